"""Stream Engine SDK."""

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
    "StreamInfo",
    "Trimmed",
    "Unavailable",
]
