"""Stream Engine SDK: the client, what it answers with, and its errors.

These names are the SDK's public edge, exactly as README.md ("## SDK") lists them
(tests/unit/test_public_api.py holds both to it); the package root `streamengine`
exports the same ones.

Each name is loaded on first use from its module (`_HOMES`): the servers and the CLI
import `streamengine.client.errors` and friends, and a server process that loaded the
whole SDK (pyarrow, the writer, the subscription) at start took about a second longer
to start, in every test that starts one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_ERRORS = "streamengine.client.errors"
_TYPES = "streamengine.client.types"
_WRITER = "streamengine.client.writer"
_HOMES = {
    **{name: _ERRORS for name in (
        "AlreadyExists", "AppendFailed", "AppendInDoubt", "AppendTimedOut",
        "DataLossError", "EventTooLarge", "Fenced", "InvalidArgument", "LeadershipLost",
        "NotFound", "PermissionDenied", "StreamDeleted", "StreamEngineError", "Trimmed",
        "Unavailable")},
    **{name: _TYPES for name in ("Replica", "SegmentInfo", "SegmentState", "StreamInfo")},
    "StreamClient": "streamengine.client.stream_client",
    "StreamEvent": "streamengine.client.core.subscription",
    "Writer": _WRITER,
    "WriterStatistics": _WRITER,
}
assert sorted(_HOMES) == sorted(__all__), "every public name has one home"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'streamengine.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
