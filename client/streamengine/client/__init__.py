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
    "StreamClient",
    "StreamDeleted",
    "StreamEngineError",
    "Trimmed",
    "Unavailable",
]
