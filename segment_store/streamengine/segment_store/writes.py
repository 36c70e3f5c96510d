"""The writer's calls: Write (a stream of batches, answered in order) and Seal. The shell
of `core.writes`: it admits each request (its grant, the quota, the committer's room)
and hands the command to the group committer. Seal is a gRPC call; Write is served on
the data plane (`data_plane.py`), and its behaviour here knows no transport: requests
come in as an async iterator, replies go out through a `send`, and what ends the
stream with a status is raised as `RequestEnds`.

A Write stream carries the batches of many segments (every writer of one client on
this store), and one message may carry many of them (`WriteRequest.parts`): each part
is admitted as a request alone, all of a message's admitted parts reach the group
committer before it wakes (one commit and sync for the message when they fit one
group), and the message is answered with one reply holding every part's. A part
refused (its grant, its fence, its input, its stream deleted) is answered with its
status in its reply (`WriteReply.error`, `refusals.refusal_of`) and the stream goes
on; only what `core.authority.ends_write_stream` names ends it, or a message of parts
malformed or over its bounds (`core.writes.check_write_message`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from streamengine.protocol.auth import Principal
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.entry import CorruptEntry, PackedEntries
from streamengine.protocol.grants import Grant
from streamengine.protocol.limits import WRITE_BATCH_ENTRIES_MAX
from streamengine.protocol.logs import segment_fields
from streamengine.segment_store import metrics
from streamengine.segment_store.core.authority import WriteStreamGrants, ends_write_stream
from streamengine.segment_store.core.commands import (
    Outcome,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
    check_epoch,
)
from streamengine.segment_store.core.errors import BadRequest, StoreError
from streamengine.segment_store.core.writes import check_write_message
from streamengine.segment_store.refusals import RequestEnds, abort, refusal_of
from streamengine.segment_store.store_context import StoreContext, segment_key
from streamengine.v1 import entry_pb2, segment_store_pb2

# Messages a Write stream may have in flight: past it the store stops reading that
# stream, and the data plane's credit holds the client back. A stream carries every
# segment a client writes on this store (each at most a writer's window of requests,
# `client.core.store_session`), so it is wide enough for the group committer to take
# many segments' batches in one commit. What waits is a ticket per request (a refused
# batch is freed at once) plus the committer's queue, bounded in bytes on its own.
WRITE_STREAM_INFLIGHT_MAX = 1024

log = logging.getLogger("streamengine.store")


def batch_of(request: segment_store_pb2.WriteRequest) -> PackedEntries:
    """The entries of a Write; values whose lengths do not add up are bad input. The
    count is checked before any value is cut out: an oversized batch costs nothing."""
    if len(request.value_lengths) > WRITE_BATCH_ENTRIES_MAX:
        raise BadRequest(
            f"batch of {len(request.value_lengths)} entries is over {WRITE_BATCH_ENTRIES_MAX}"
        )
    try:
        return PackedEntries.from_wire(
            request.first_index, request.packed_values, request.value_lengths
        )
    except CorruptEntry as error:
        raise BadRequest(str(error)) from None


def parts_of(request: segment_store_pb2.WriteRequest) -> Sequence[segment_store_pb2.WriteRequest]:
    """The segments' requests a Write message carries: itself, or its parts once the
    message is checked whole (its shape and its bounds), before any part is admitted."""
    parts = request.parts
    if not parts:
        return (request,)
    check_write_message(
        len(parts),
        sum(len(part.value_lengths) for part in parts),
        sum(len(part.packed_values) for part in parts),
    )
    if len(request.ListFields()) > 1:
        raise BadRequest("a request with parts sets no other field")
    if any(part.parts for part in parts):
        raise BadRequest("a part of a request has parts of its own")
    return parts


class WriteCalls:
    """Write and Seal."""

    def __init__(self, store: StoreContext) -> None:
        self.store = store

    def methods(self) -> dict[str, Callable[..., Any]]:
        """The gRPC calls (Write is the data plane's)."""
        return {"Seal": self.seal}

    async def write(
        self,
        request_iterator: AsyncIterator[segment_store_pb2.WriteRequest],
        send: Callable[[segment_store_pb2.WriteReply], Awaitable[None]],
        caller: Principal,
    ) -> None:
        """Serves one Write stream of `caller` until the client ends it or it is idle;
        raises RequestEnds for what ends it with a status."""
        grants = WriteStreamGrants(self.store.authority, caller)
        inflight = asyncio.Semaphore(WRITE_STREAM_INFLIGHT_MAX)
        # Tickets, not requests, wait for their replies: a refused batch's entries are
        # freed at once, so memory is the committer's queue plus one message per stream.
        # A malformed message waits as its error, answered in turn by the stream's end.
        answers: asyncio.Queue[_Message | StoreError | None] = asyncio.Queue()

        idle_s = self.store.config.write_stream_idle_ms / 1000
        unanswered = 0  # messages read whose reply is not written yet
        last_activity = time.monotonic()

        async def read_requests() -> None:
            nonlocal unanswered, last_activity
            try:
                # No timer per request: `close_when_idle` watches the clock apart.
                async for request in request_iterator:
                    last_activity = time.monotonic()
                    await inflight.acquire()
                    unanswered += 1
                    try:
                        parts = parts_of(request)
                    except StoreError as error:
                        answers.put_nowait(error)
                        return
                    metrics.WRITE_MESSAGES.inc()
                    metrics.WRITE_PARTS.inc(len(parts))
                    # No await between the parts: the committer takes them in one group.
                    admitted = [(_Ticket.of(part), self._admit(part, grants)) for part in parts]
                    answers.put_nowait(_Message(bool(request.parts), admitted))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read_requests())

        async def close_when_idle() -> None:
            """Ends the stream once nothing is unanswered and nothing arrived (nor was
            answered) for `idle_s`."""
            while True:
                quiet_s = time.monotonic() - last_activity
                if not unanswered and quiet_s >= idle_s:
                    metrics.WRITE_STREAMS_IDLE_CLOSED.inc()
                    reader.cancel()
                    return
                await asyncio.sleep(idle_s - quiet_s if quiet_s < idle_s else idle_s)

        watchdog = asyncio.create_task(close_when_idle())
        try:
            while (message := await answers.get()) is not None:
                if isinstance(message, StoreError):
                    raise RequestEnds(message)
                replies = [
                    await self._answer(ticket, admitted) for ticket, admitted in message.parts
                ]
                await send(
                    segment_store_pb2.WriteReply(parts=replies) if message.many else replies[0]
                )
                unanswered -= 1
                last_activity = time.monotonic()
                inflight.release()
            # The reader ended: the client closed its side, or the watchdog the stream.
            await asyncio.wait({reader})
            if not reader.cancelled():
                reader.result()
        finally:
            watchdog.cancel()
            reader.cancel()
            for task in (watchdog, reader):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _answer(self, ticket: _Ticket, admitted: _Admitted) -> segment_store_pb2.WriteReply:
        """The reply to one segment's request, once its write is done."""
        if isinstance(admitted, tuple):  # refused for now: busy, or over the quota
            status, held = admitted
            return ticket.reply(segment_store_pb2.WriteStatus.ValueType(status), held)
        outcome = admitted if isinstance(admitted, Exception) else await admitted
        if isinstance(outcome, Exception):
            return self._refused(ticket, outcome)
        assert isinstance(outcome, WriteResult)
        return ticket.reply(segment_store_pb2.ACCEPTED, outcome)

    @staticmethod
    def _refused(ticket: _Ticket, error: Exception) -> segment_store_pb2.WriteReply:
        """The reply to one refused request; or, for what ends the stream (or is no
        refusal of the store's: a bug), the stream's end."""
        if not isinstance(error, StoreError) or ends_write_stream(error):
            raise RequestEnds(error, ticket.segment)
        refusal = refusal_of(error, ticket.segment)
        return ticket.refused(
            segment_store_pb2.WriteError(
                code=refusal.code.value[0],
                details=refusal.details,
                metadata=dict(refusal.metadata),
            )
        )

    def _admit(
        self, request: segment_store_pb2.WriteRequest, grants: WriteStreamGrants
    ) -> _Admitted:
        """The write under way; or, for a batch refused for now (the store too busy, the
        tenant over its quota: nothing written), its status and what the segment holds
        (the batch itself is dropped at once: memory is the committer's queue, not every
        refused batch waiting for its reply); or why it was refused (an Exception,
        answered on this request alone unless it ends the stream)."""
        try:
            segment = segment_key(request.segment)
            # Malformed before unauthorized: a bad request says what is wrong with it.
            check_epoch(request.writer_epoch, "writer epoch")
            batch = batch_of(request)
            grant = grants.admit(request.grant, segment, request.writer_epoch, wall_ms())
            self.store.authority.check_not_deleted(segment.stream_id, request.writer_epoch)
            self.store.core.check_takes_part(segment)
            command = WriteCommand(
                segment,
                request.writer_epoch,
                request.acked_index,
                batch,
                grant.tenant,
                self._placing(grant, segment),
                grant.stream_name,
                grant.write_quorum,
            )
        except StoreError as error:
            return error
        if not len(batch):
            return self.store.committer.submit(command)
        payload_bytes = batch.payload_bytes()
        if not self.store.quota.admit(grant.tenant, payload_bytes, monotonic_ms()):
            metrics.REFUSED_QUOTA.inc()
            return self._held_back(segment_store_pb2.REFUSED_QUOTA, command)
        shares, caller = self.store.shares, grants.principal
        if not shares.take_queue_bytes(caller, payload_bytes):
            metrics.REFUSED_BUSY.inc()
            return self._held_back(segment_store_pb2.REFUSED_BUSY, command)
        future = self.store.committer.try_submit(command)
        if future is None:
            shares.give_queue_bytes(caller, payload_bytes)
            metrics.REFUSED_BUSY.inc()
            return self._held_back(segment_store_pb2.REFUSED_BUSY, command)
        if shares.counts(caller):  # else nothing to give back: schedule nothing
            future.add_done_callback(lambda _: shares.give_queue_bytes(caller, payload_bytes))
        return future

    def _placing(self, grant: Grant, segment: SegmentKey) -> tuple[str, ...]:
        """The copy set `grant` lists for `segment` while this store does not hold it
        yet (the command that first brings it here keeps it); else none to keep."""
        if self.store.core.catalog.meta(segment) is not None:
            return ()
        listed = grant.segment(segment.epoch)
        return () if listed is None else listed.copy_set

    def _held_back(self, status: int, command: WriteCommand) -> _Admitted:
        """A batch refused for now: its status and what the segment holds, or, below the
        fence, that error (as for any write)."""
        held = self.store.core.refused_busy(command)
        return held if isinstance(held, Exception) else (status, held)

    async def seal(
        self,
        request: segment_store_pb2.SealRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.SealRequest, segment_store_pb2.SealReply
        ],
    ) -> segment_store_pb2.SealReply:
        try:
            principal = self.store.caller(context)
            segment = segment_key(request.segment)
            check_epoch(request.new_epoch, "seal epoch")
            grant = self.store.authority.grant_for(
                principal, "SegmentStore/Seal", request.grant, segment, request.new_epoch, wall_ms()
            )
            self.store.core.check_takes_part(segment)
            command = SealCommand(
                segment,
                request.new_epoch,
                grant.tenant,
                self._placing(grant, segment),
                grant.stream_name,
                grant.write_quorum,
            )
        except StoreError as error:
            await abort(context, error, request.segment)
        outcome = await self.store.committer.submit(command)
        if isinstance(outcome, Exception):
            await abort(context, outcome, request.segment)
        assert isinstance(outcome, SealResult)
        log.info(
            "segment sealed",
            extra=segment_fields(
                request.segment.stream,
                request.segment.epoch,
                fence=outcome.fence,
                index=outcome.acked_index,
            ),
        )
        return segment_store_pb2.SealReply(
            fence=outcome.fence,
            acked_index=outcome.acked_index,
            matched_index=outcome.matched_index,
            last_index=outcome.last_index,
        )


# What `_admit` makes of a Write request: the write under way; a batch refused for now
# with its status (REFUSED_BUSY, REFUSED_QUOTA) and what the segment holds; or why it
# is refused.
_Admitted = asyncio.Future[Outcome] | tuple[int, WriteResult] | Exception


@dataclass(frozen=True, slots=True)
class _Message:
    """What a Write message's reply waits for: each part's ticket and write, and whether
    it came with `parts` (answered with `WriteReply.parts`) or as its own single part."""

    many: bool
    parts: list[tuple[_Ticket, _Admitted]]


@dataclass(frozen=True, slots=True)
class _Ticket:
    """What a Write reply needs of its request."""

    segment: entry_pb2.SegmentId
    key: SegmentKey
    request_id: int
    first_index: int
    last_index: int
    report_held: bool

    @classmethod
    def of(cls, request: segment_store_pb2.WriteRequest) -> _Ticket:
        segment = entry_pb2.SegmentId()
        segment.CopyFrom(request.segment)
        return cls(
            segment,
            SegmentKey(segment.stream_id, segment.epoch),
            request.request_id,
            request.first_index if request.value_lengths else 0,
            request.first_index + len(request.value_lengths) - 1 if request.value_lengths else 0,
            request.report_held,
        )

    def reply(
        self, status: segment_store_pb2.WriteStatus.ValueType, result: WriteResult
    ) -> segment_store_pb2.WriteReply:
        return segment_store_pb2.WriteReply(
            segment=self.segment,
            request_id=self.request_id,
            status=status,
            matched_index=result.matched_index,
            acked_index=result.acked_index,
            fence=result.fence,
            first_index=self.first_index,
            last_index=self.last_index,
            held_epochs=result.held_epochs if self.report_held else (),
        )

    def refused(self, error: segment_store_pb2.WriteError) -> segment_store_pb2.WriteReply:
        return segment_store_pb2.WriteReply(
            segment=self.segment,
            request_id=self.request_id,
            status=segment_store_pb2.REFUSED,
            first_index=self.first_index,
            last_index=self.last_index,
            error=error,
        )
