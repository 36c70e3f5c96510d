"""Stream Engine SDK: the client, what it answers with, and its errors.

These names are the SDK's public edge, exactly as README.md ("## SDK") lists them
(tests/unit/test_public_api.py holds both to it); the package root `streamengine`
exports the same ones.
"""

from streamengine.client.core.subscription import StreamEvent
from streamengine.client.errors import (
    AlreadyExists,
    AppendFailed,
    AppendInDoubt,
    AppendTimedOut,
    DataLossError,
    EventTooLarge,
    Fenced,
    InvalidArgument,
    LeadershipLost,
    NotFound,
    PermissionDenied,
    StreamDeleted,
    StreamEngineError,
    Trimmed,
    Unavailable,
)
from streamengine.client.stream_client import StreamClient
from streamengine.client.types import Replica, SegmentInfo, SegmentState, StreamInfo
from streamengine.client.writer import Writer, WriterStatistics

__all__ = [
    "AlreadyExists",
    "AppendFailed",
    "AppendInDoubt",
    "AppendTimedOut",
    "DataLossError",
    "EventTooLarge",
    "Fenced",
    "InvalidArgument",
    "LeadershipLost",
    "NotFound",
    "PermissionDenied",
    "Replica",
    "SegmentInfo",
    "SegmentState",
    "StreamClient",
    "StreamDeleted",
    "StreamEngineError",
    "StreamEvent",
    "StreamInfo",
    "Trimmed",
    "Unavailable",
    "Writer",
    "WriterStatistics",
]
