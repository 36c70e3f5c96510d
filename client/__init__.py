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
    "StreamEngineError",
    "Unavailable",
]
