"""Every error the SDK raises, by who is at fault, under one base.

- the caller: `InvalidArgument`, `EventTooLarge`, `NotFound`, `AlreadyExists`,
  `PermissionDenied`;
- the cluster, retryable later: `Unavailable`, and `AppendTimedOut` for an append not
  acknowledged in time while its writer goes on leading;
- leadership: `LeadershipLost` (the writer is finished; open a new one), and for an
  append whose fate the writer cannot know, `AppendInDoubt`;
- data: `DataLossError`, naming the segment and index range no replica can serve;
  `Trimmed`, a position the stream's retention (or a trim) took away, naming the first
  sequence still retained;
- `StreamDeleted`: the stream is deleted and refused until it is undeleted or removed.

`from_rpc_error` is the one table mapping gRPC statuses back to these.
"""

from __future__ import annotations

import grpc

from streamengine.client.core.subscription import resume_past_loss
from streamengine.protocol.status import (
    DELETED_UNTIL_METADATA_KEY,
    FENCE_METADATA_KEY,
    TOO_LARGE_METADATA_KEY,
)


class StreamEngineError(Exception):
    """Base of every error the SDK raises."""


class InvalidArgument(StreamEngineError):
    """The request is malformed or impossible (a bad name, an impossible policy)."""


class EventTooLarge(InvalidArgument):
    """An event over `EVENT_BYTES_MAX`."""


class NotFound(StreamEngineError):
    """Unknown stream, tenant, segment or store."""


class AlreadyExists(StreamEngineError):
    """Creating what exists with different settings."""


class PermissionDenied(StreamEngineError):
    """The caller may not do this: its certificate or token does not allow it, or its
    token is invalid, expired or revoked. Nothing changed."""


class Unavailable(StreamEngineError):
    """The cluster cannot serve now (server down, not enough live stores); retry later."""


class AppendTimedOut(Unavailable):
    """The append was not acknowledged within the writer's append timeout: too few stores
    of the copy set answer, and no master answers to roll away from them. The writer
    still leads. `in_doubt`: the append is in the segment and is written if its stores
    come back (then it appears at one sequence, so a retry may duplicate it); otherwise
    it was held back for room and never sent, and definitely failed."""

    def __init__(self, message: str, in_doubt: bool):
        self.in_doubt = in_doubt
        super().__init__(message)


class LeadershipLost(StreamEngineError):
    """This writer no longer leads its stream; every later append fails. Open a new
    writer to compete for leadership again."""


class AppendFailed(LeadershipLost):
    """The append definitely failed: it never reached a write quorum under this
    leader, and no later recovery can make it appear."""


class AppendInDoubt(LeadershipLost):
    """The append may be durable: it reached some stores before leadership was lost.
    If it is, it appears after the next leader's recovery, at one sequence."""


class DataLossError(StreamEngineError):
    """A range of a stream that no replica can serve: `first_index..last_index` of
    segment `segment_epoch`; `accepted`: an operator sealed it accepting the loss
    (`streamengine seal NAME --accept-loss`), and what was acknowledged from
    `first_index` to the segment's end (past its bridge `last_index` too) may be gone
    for good. A reader goes on past it from `resume_sequence`."""

    def __init__(
        self,
        stream: str,
        segment_epoch: int,
        first_index: int,
        last_index: int,
        accepted: bool = False,
    ):
        self.stream = stream
        self.segment_epoch = segment_epoch
        self.first_index = first_index
        self.last_index = last_index
        self.accepted = accepted
        # Past the range: the position after it, or after the whole segment.
        self.resume_sequence = resume_past_loss(segment_epoch, last_index, accepted)
        if accepted:
            # The lost replicas may have held acked events past the bridge too.
            what = (
                f"indexes {first_index}.. to its end (bridge at {last_index}) were lost: "
                "the segment was sealed accepting the loss"
            )
        else:
            what = f"indexes {first_index}..{last_index} are unreadable on every replica"
        super().__init__(
            f"{stream}: segment {segment_epoch} {what} "
            f"(resume from sequence {self.resume_sequence})"
        )


class Trimmed(StreamEngineError):
    """A reader's position was trimmed away (by retention or by hand): whole sealed
    segments before `first_retained_sequence` are gone. Start again there (or with
    `start="earliest"`)."""

    def __init__(self, stream: str, position: int, first_retained_sequence: int):
        self.stream = stream
        self.position = position
        self.first_retained_sequence = first_retained_sequence
        super().__init__(
            f"{stream}: sequence {position} was trimmed; the first retained sequence is "
            f"{first_retained_sequence}"
        )


class StreamDeleted(StreamEngineError):
    """The stream is deleted: appends and reads are refused. Its data goes at
    `deleted_until_ms` (wall-clock ms) unless it is undeleted before."""

    def __init__(self, message: str, deleted_until_ms: int):
        self.deleted_until_ms = deleted_until_ms
        super().__init__(message)


class Fenced(LeadershipLost):
    """A store refused a write or seal: its fence is above this writer's epoch."""

    def __init__(self, message: str, fence: int):
        self.fence = fence
        super().__init__(message)



_STATUS_TO_ERROR: dict[grpc.StatusCode, type[StreamEngineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Unavailable,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.ABORTED: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: LeadershipLost,
    grpc.StatusCode.DATA_LOSS: StreamEngineError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
}


def fence_of(error: grpc.aio.AioRpcError | grpc.RpcError) -> int | None:
    """The fence a store reported in a FAILED_PRECONDITION, if any."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():  # type: ignore[misc]  # pairs at run time
        if key == FENCE_METADATA_KEY:
            return int(value)
    return None


def deleted_until_of(error: grpc.aio.AioRpcError | grpc.RpcError) -> int | None:
    """When a deleted stream's data goes, from the master's FAILED_PRECONDITION."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():  # type: ignore[misc]  # pairs at run time
        if key == DELETED_UNTIL_METADATA_KEY:
            return int(value)
    return None


def from_rpc_error(error: grpc.RpcError) -> StreamEngineError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        deleted_until = deleted_until_of(error)
        if deleted_until is not None:
            return StreamDeleted(details or "stream deleted", deleted_until)
        fence = fence_of(error)
        if fence is not None:
            return Fenced(details or "fenced", fence)
        return LeadershipLost(details or "failed precondition")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        # Pairs at run time, sync or aio: (key, value).
        if any(pair[0] == TOO_LARGE_METADATA_KEY for pair in trailing or ()):  # type: ignore[index]
            return EventTooLarge(details or "too large")
    error_type = _STATUS_TO_ERROR.get(code, StreamEngineError)
    return error_type(details or code.name)
