"""Stream Engine SDK."""

from client.errors import (
    AlreadyExists,
    AppendFailed,
    AppendInDoubt,
    DataLossError,
    EventTooLarge,
    Fenced,
    InvalidArgument,
    LeadershipLost,
    NotFound,
    StreamEngineError,
    Unavailable,
)
from client.stream_client import StreamClient

__all__ = [
    "AlreadyExists",
    "AppendFailed",
    "AppendInDoubt",
    "DataLossError",
    "EventTooLarge",
    "Fenced",
    "InvalidArgument",
    "LeadershipLost",
    "NotFound",
    "StreamClient",
    "StreamEngineError",
    "Unavailable",
]
