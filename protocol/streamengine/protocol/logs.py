"""Structured logs for servers and tools: one logfmt line per record.

    ts=2026-11-21T08:20:00.123Z level=info logger=streamengine.store
        msg="segment sealed" stream=acme/orders epoch=3 fence=4      (one line)

Fields come from `extra=`; `segment_fields(...)` builds the ones every line that
concerns a segment carries, so they are named the same everywhere.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

# Fields printed after the message, in this order, when a record carries them.
FIELDS = (
    "stream",
    "epoch",
    "index",
    "final_index",
    "fence",
    "writer_epoch",
    "client",
    "store",
    "source",
    "target",
    "reason",
    "error",
)


def segment_fields(stream: str, epoch: int, **more: Any) -> dict[str, Any]:
    """The `extra=` of a line about segment `epoch` of `stream`."""
    return {"stream": stream or "?", "epoch": epoch, **more}


def _quote(value: object) -> str:
    text = str(value)
    if text and all(c.isalnum() or c in "-_./:@" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [
            f"ts={stamp}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        parts += [f"{key}={_quote(getattr(record, key))}" for key in FIELDS if hasattr(record, key)]
        if record.exc_info:
            parts.append(f"exception={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


# grpc.aio's logger for what fails in its core around a servicer's call.
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


class PeerGoneAtStatus(logging.Filter):
    """grpc.aio logs, at error level with a traceback, a call whose final status its
    core could not send (`ExecuteBatchError` of a `SendStatusFromServerOperation`,
    grpc/grpc#32551): the servicer returned, and the peer had already gone (a client
    killed, a connection reset). Nothing was left unhandled: it becomes one info line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (
            error is not None
            and type(error).__name__ == "ExecuteBatchError"
            and "SendStatusFromServerOperation" in str(error)
        ):
            record.msg = "%s: the final status was not sent, the peer is gone"
            record.args = (record.getMessage(),)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def configure(level: str | int = logging.INFO) -> None:
    """Log to stderr in logfmt (replacing any earlier configuration)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    grpc_core = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, PeerGoneAtStatus) for f in grpc_core.filters):
        grpc_core.addFilter(PeerGoneAtStatus())
