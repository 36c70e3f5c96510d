"""Stream Engine: a durable, quorum-replicated, append-only event log.

    from streamengine import StreamClient, AppendInDoubt

The same names as `streamengine.client` (README.md, "## SDK", lists them), loaded on
first use, so that the servers (`streamengine.master`, `streamengine.segment_store`),
which share this namespace and the protocol package (`streamengine.protocol`,
`streamengine.v1`), never import the SDK.

Each part of the package lives in the repository's top-level folder of its name
(`master/streamengine/master/...`); in a checkout with those folders on `sys.path` this
package's `__path__` spans them all, as one folder does in an installed wheel.
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path
from typing import TYPE_CHECKING, Any

__path__ = extend_path(__path__, __name__)

if TYPE_CHECKING:
    from streamengine.client import (
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
        Replica,
        SegmentInfo,
        SegmentState,
        StreamClient,
        StreamDeleted,
        StreamEngineError,
        StreamEvent,
        StreamInfo,
        Trimmed,
        Unavailable,
        Writer,
        WriterStatistics,
    )

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


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("streamengine.client"), name)
    raise AttributeError(f"module 'streamengine' has no attribute {name!r}")
