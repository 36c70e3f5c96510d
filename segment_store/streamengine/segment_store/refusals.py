"""How the SegmentStore service refuses a call: the one table from the store's domain
errors to gRPC statuses (`STATUS`), the statuses a dropped subscriber ends with, and
`refusal_of`, the status of an error with the structured facts beside it (the fence,
the bound exceeded, when a deleted stream goes) and one log line: `abort` ends a call
with it, a Write stream answers one refused request with it (`writes`). A refused
request changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from streamengine.protocol.entry import CorruptEntry
from streamengine.protocol.logs import segment_fields
from streamengine.protocol.status import (
    DELETED_UNTIL_METADATA_KEY,
    FENCE_METADATA_KEY,
    TOO_LARGE_METADATA_KEY,
)
from streamengine.segment_store import metrics
from streamengine.segment_store.copy import CopySourceUnavailable
from streamengine.segment_store.core.authority import (
    CallerRefused,
    CallerUnproven,
    GrantRefused,
    NoSigningKeyYet,
    OverCallerLimit,
    StreamDeleted,
)
from streamengine.segment_store.core.errors import (
    BadRequest,
    BelowFence,
    ConflictingCopy,
    CopyMismatch,
    CopyRefused,
    NotJoined,
    ReplicaLost,
    SegmentNotFound,
    StoredCopyCorrupt,
    StoreUnavailable,
    TooLarge,
)
from streamengine.v1 import entry_pb2

log = logging.getLogger("streamengine.store")


class Refused(Exception):
    """A request refused with a status (the service's own, beyond the core's errors)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(details)


STATUS: dict[type[Exception], grpc.StatusCode] = {
    BelowFence: grpc.StatusCode.FAILED_PRECONDITION,
    # The index is held at that epoch already, with other bytes: nothing to retry.
    ConflictingCopy: grpc.StatusCode.ALREADY_EXISTS,
    CopyRefused: grpc.StatusCode.FAILED_PRECONDITION,
    CopyMismatch: grpc.StatusCode.DATA_LOSS,
    CopySourceUnavailable: grpc.StatusCode.UNAVAILABLE,
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SegmentNotFound: grpc.StatusCode.NOT_FOUND,
    StoreUnavailable: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CorruptEntry: grpc.StatusCode.DATA_LOSS,
    StoredCopyCorrupt: grpc.StatusCode.DATA_LOSS,
    GrantRefused: grpc.StatusCode.PERMISSION_DENIED,
    CallerRefused: grpc.StatusCode.PERMISSION_DENIED,
    CallerUnproven: grpc.StatusCode.UNAUTHENTICATED,
    NoSigningKeyYet: grpc.StatusCode.UNAVAILABLE,
    OverCallerLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StreamDeleted: grpc.StatusCode.FAILED_PRECONDITION,
    # No answer about the segment, as from a store that is down: a recovery decides
    # from the others, a writer goes on with them.
    NotJoined: grpc.StatusCode.UNAVAILABLE,
    ReplicaLost: grpc.StatusCode.UNAVAILABLE,
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a refused request is answered with: a status, its details, and the
    structured facts beside it (a call's trailing metadata)."""

    code: grpc.StatusCode
    details: str
    metadata: tuple[tuple[str, str], ...] = ()


def refusal_of(error: Exception, segment: entry_pb2.SegmentId | None = None) -> Refusal:
    """The status of `error`, with its facts, counted and logged once (a call's abort,
    or one refused request of a Write stream)."""
    if isinstance(error, Refused):
        return Refusal(error.code, error.details)
    code = next((c for t, c in STATUS.items() if isinstance(error, t)), grpc.StatusCode.INTERNAL)
    trailing: tuple[tuple[str, str], ...] = ()
    fields = segment_fields(segment.stream, segment.epoch) if segment is not None else {}
    if isinstance(error, StreamDeleted):
        trailing = ((DELETED_UNTIL_METADATA_KEY, str(error.deleted_until_ms)),)
        log.info("refused: %s", error, extra=fields)
    elif isinstance(error, BelowFence):
        trailing = ((FENCE_METADATA_KEY, str(error.fence)),)
        log.info("refused below the fence: %s", error, extra=fields | {"fence": error.fence})
    elif isinstance(error, ConflictingCopy):
        metrics.CONFLICTING_COPIES.inc()
        log.warning(
            "refused a copy that differs from the one held at its epoch: %s",
            error,
            extra=fields | {"index": error.index, "epoch_held": error.epoch},
        )
    elif isinstance(error, BadRequest):
        if isinstance(error, TooLarge):
            trailing = ((TOO_LARGE_METADATA_KEY, str(error.bytes_max)),)
        metrics.BAD_REQUESTS.inc()
        log.info("bad request: %s", error, extra=fields)
    elif isinstance(error, GrantRefused | CallerRefused):
        metrics.DENIED.inc()
        log.info("denied: %s", error, extra=fields)
    elif isinstance(error, CallerUnproven | OverCallerLimit):
        # No log line: anyone reaching the port could flood the log with these.
        reason = "unproven" if isinstance(error, CallerUnproven) else "over_limit"
        metrics.REFUSED_CALLERS.labels(reason).inc()
    elif code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL):
        log.error("%s: %s", code.name, error, extra=fields)
    return Refusal(code, str(error), trailing)


async def abort(
    context: grpc.aio.ServicerContext[Any, Any],
    error: Exception,
    segment: entry_pb2.SegmentId | None = None,
) -> NoReturn:
    refusal = refusal_of(error, segment)
    await context.abort(refusal.code, refusal.details, trailing_metadata=refusal.metadata)


# Why the live tail dropped a subscriber (`core.tail.Drop.reason`) -> its status.
TAIL_DROP_STATUS = {
    "silent": grpc.StatusCode.UNAVAILABLE,
    "slow": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class RequestEnds(Exception):
    """What ends a data-port request (a Write stream, a Subscribe) with a status: the
    error, and the segment it is of."""

    def __init__(self, error: Exception, segment: entry_pb2.SegmentId | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.segment = segment

    def refusal(self) -> Refusal:
        return refusal_of(self.error, self.segment)
