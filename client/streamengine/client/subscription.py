"""Followers: `subscribe` (forever) and `read` (a range), as events or as Arrow record
batches (`subscribe_batches`, `read_batches`).

A thin asyncio shell around `client.core.subscription.Cursor`: it fetches the master's
segment list, reads one replica at a time (what it acked, in packed `Read` replies:
`_PackedRead`; then a live tail with `Subscribe`: `_LiveTail`; both on the client's
one connection to the store's data port), feeds the cursor what arrives (and what
fails), and hands out what the cursor releases. Reconnection is transparent: the
cursor's position is the resume point, so no sequence is yielded twice and none is
skipped but holes.

Why one long module: `Follower`'s loop, its read-ahead and the reply streams it opens
share one replica connection's lifecycle (open, read, tail, fail over); the decisions
are in the core, and what is left here is that lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import grpc
import pyarrow as pa

from streamengine.client.channels import ChannelPool
from streamengine.client.core.replicas import FollowerTiming
from streamengine.client.core.subscription import (
    SUBSCRIBE_BATCH_ENTRIES,
    Asked,
    Cursor,
    DataLoss,
    Finished,
    ListRun,
    ReadFrom,
    Released,
    SegmentView,
    StreamEvent,
    Unreachable,
    Wait,
    acked_end,
)
from streamengine.client.errors import (
    DataLossError,
    StreamEngineError,
    Trimmed,
    Unavailable,
    from_rpc_error,
)
from streamengine.client.packed import Packed, released_batch, released_events
from streamengine.client.retrying import retry_unary
from streamengine.protocol import codec, framed_read, framing
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.entry import first_corrupt
from streamengine.protocol.framed import CallError, ClientCall
from streamengine.protocol.retention import position_trimmed
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

log = logging.getLogger(__name__)

# A sequence; "end": what is appended from now on; "earliest": the first event retained.
Start = int | Literal["end", "earliest"]

# A refresh lists the segments from the cursor's on, this many of them, each sealed one
# with its certificate's chunks (kilobytes per segment): a reader far behind hops
# segments faster than it refreshes anyway. Counted in segments, not epochs: epochs may
# be far apart (a grant without a segment; a rebuilt master starts 2^20 past what the
# stores knew, and a reader listing 16 epochs ahead never saw its segments).
LISTED_AHEAD_SEGMENTS = 16
REPORT_TIMEOUT_S = 2.0
# Events made into objects at a time, out of a packed reply of up to tens of thousands:
# made all at once, they outlived the collector's youngest generation and every reply
# paid for full collections of the client's heap (catch-up per event 25-35 % slower).
EVENTS_PER_LIST = 256
# How long a replica may take to tell its acked index (the replicas are asked at once):
# a store that answers at all answers this at once.
SEGMENT_STATE_TIMEOUT_S = 2.0


def segment_views(reply: master_pb2.ListSegmentsReply) -> list[SegmentView]:
    return [segment_view(segment) for segment in reply.segments]


def segment_view(segment: entry_pb2.Segment) -> SegmentView:
    """A listed segment as the cursor sees it; its certificate when listed with chunks
    (a malformed one counts as none: crc32c still guards every entry)."""
    certificate = None
    if segment.certificate.chunks:
        with contextlib.suppress(MalformedCertificate):
            certificate = codec.certificate_from_pb(segment.certificate)
    bad = set(segment.bad_stores)
    return SegmentView(
        epoch=segment.id.epoch,
        replicas=tuple(replica.address for replica in segment.copy_set),
        sealed=segment.state == entry_pb2.SEALED,
        final_index=segment.final_index,
        certificate=certificate,
        bad=tuple(r.address for r in segment.copy_set if r.store_id in bad),
        lost_from_index=segment.lost_from_index,
        acked_index=segment.acked_index,
    )


@dataclass
class _StreamRef:
    name: str
    stream_id: int


class _Replies(Protocol):
    """What `_follow` reads replies from: a packed read, or a live tail."""

    def read(self) -> Awaitable[Any]: ...

    def cancel(self) -> bool: ...


class _PackedRead:
    """A packed Read on the replica's data port (`framed_read`), on the client's
    connection to that store (the one its tails ride), read by a task of its own: its
    replies wait in a small queue (the store is held back by credit beyond it) until
    `_follow` takes them. Started when the cursor asks for the read, or before
    (`Cursor.upcoming`: a read-ahead), until `_read` takes it as the read the cursor
    asked for, or cancels it (which cancels the request at the store)."""

    REPLIES_HELD = 2

    def __init__(
        self, read: ReadFrom, replies: AsyncGenerator[segment_store_pb2.ReadReply, None]
    ) -> None:
        self.wanted = read
        self._replies: asyncio.Queue[object] = asyncio.Queue(self.REPLIES_HELD)
        self._pump = asyncio.ensure_future(self._receive(replies))

    async def _receive(self, replies: AsyncGenerator[segment_store_pb2.ReadReply, None]) -> None:
        try:
            # Closed however the pump ends: a read left early cancels its request.
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    await self._replies.put(reply)
            await self._replies.put(grpc.aio.EOF)
        except (CallError, StreamEngineError) as error:  # StreamEngineError: client closed
            await self._replies.put(error)

    async def read(self) -> object:
        """The next reply, or grpc.aio.EOF after the last (what a gRPC call answers)."""
        reply = await self._replies.get()
        if isinstance(reply, (CallError, StreamEngineError)):
            raise reply
        return reply

    def cancel(self) -> bool:
        return self._pump.cancel()


class _LiveTail:
    """A Subscribe call on the store's data port, read as `_follow` reads a gRPC call
    (replies, then `grpc.aio.EOF` at the store's End), opened at the first read (so
    that a store it cannot reach fails as the call would), with a keepalive every
    interval. Each reply taken grants its bytes back to the store (`framed`): a
    follower that stops reading holds the store to its credit."""

    def __init__(
        self,
        channels: ChannelPool,
        data_address: str,
        start: segment_store_pb2.SubscribeRequest,
        keepalive_interval_ms: int,
    ) -> None:
        self._channels = channels
        self._data_address = data_address
        self._start = start
        self._keepalive_interval_ms = keepalive_interval_ms
        self._call: ClientCall | None = None
        self._keepalives: asyncio.Task[None] | None = None

    async def read(self) -> object:
        if self._call is None:
            # Kept at once (no await between): `cancel` ends the request from here on.
            self._call = await self._channels.data_call(self._data_address, framing.SUBSCRIBE)
            await self._call.send(self._start)
            self._keepalives = asyncio.ensure_future(self._keep_alive(self._call))
        reply = await self._call.receive()
        return grpc.aio.EOF if reply is None else reply

    async def _keep_alive(self, call: ClientCall) -> None:
        with contextlib.suppress(CallError):  # the call's end reaches `read`
            while True:
                await asyncio.sleep(self._keepalive_interval_ms / 1000)
                keepalive = segment_store_pb2.Keepalive(sent_at_ms=wall_ms())
                await call.send(segment_store_pb2.SubscribeRequest(keepalive=keepalive))

    def cancel(self) -> bool:
        if self._keepalives is not None:
            self._keepalives.cancel()
        if self._call is not None:
            self._call.cancel()
        return True


def _status_of(error: grpc.aio.AioRpcError | CallError) -> tuple[str, str]:
    """A call's end, gRPC's or the data plane's: its status code's name, its details."""
    if isinstance(error, CallError):
        return error.code.name, error.details
    return error.code().name, error.details() or ""


@dataclass
class _Outcome:
    """A call to a replica (`packed`: a packed Read, else a Subscribe), and how it
    ended: `clean` when the replica ended it itself."""

    packed: bool
    clean: bool = False


@dataclass
class _Expected:
    """The index a packed Read's next value must be of; `first` before any reply."""

    index: int
    first: bool


class Follower:
    """Reads one stream from `start` (inclusive) to `end` (exclusive; None: forever)."""

    def __init__(
        self,
        master: master_pb2_grpc.MasterAsyncStub,
        channels: ChannelPool,
        stream: str,
        start: Start,
        end: int | None,
        until_acked_end: bool,
        timing: FollowerTiming | None = None,
    ) -> None:
        self._master = master
        self._channels = channels
        self._stream = stream
        self._start = start
        self._end = end
        self._until_acked_end = until_acked_end
        self._ref: _StreamRef | None = None
        self._timing = timing or FollowerTiming()
        # What the master's latest list said was trimmed (`protocol.retention`).
        self._trimmed_through_epoch = 0
        self._first_retained = 0
        self._ahead: _PackedRead | None = None
        # Each store's data port, by its gRPC address, from the master's latest lists:
        # where its packed reads and tails go (`data_address`).
        self._data_addresses: dict[str, str] = {}

    async def released(self) -> AsyncIterator[list[Released]]:
        """What the cursor hands out, in sequence order: one list per reply a replica
        sent (its verified parts; EVENT rows and the HOLEs between them)."""
        cursor = await self.open_cursor()
        while True:
            decision = cursor.next(monotonic_ms())
            if isinstance(decision, Finished):
                return
            if isinstance(decision, DataLoss):
                raise DataLossError(
                    self._stream,
                    decision.epoch,
                    decision.first_index,
                    decision.last_index,
                    decision.accepted,
                )
            if isinstance(decision, Unreachable):
                raise Unavailable(decision.describe(self._stream))
            if isinstance(decision, Wait):
                delay_ms = decision.until_ms - monotonic_ms()
                if delay_ms > 0:
                    await asyncio.sleep(delay_ms / 1000)
                await self.refresh(cursor)
                continue
            try:
                async for parts in self._read(cursor, decision):
                    yield parts
            finally:
                if self._ahead is not None and cursor.epoch > self._ahead.wanted.epoch:
                    self._ahead.cancel()  # passed by (a later segment listed first)
                    self._ahead = None

    @property
    def stream(self) -> str:
        return self._stream

    async def open_cursor(self) -> Cursor:
        """A cursor at the start, given the master's list of the segments from there on
        (with certificates). The first list is retried like any control call: a read or
        subscription that starts while the masters change over waits for the new one."""
        segments = await self._list_segments(retry=True)
        end = self._end
        if self._until_acked_end and end is None:
            end = await self._acked_end(segments)
        if self._start == "end":
            start = await self._acked_end(segments)
        elif self._start == "earliest":
            start = self._first_retained
        else:
            start = self._start
        cursor = Cursor(start, end, self._timing)
        self._check_trimmed(cursor)
        cursor.on_segments(segments, monotonic_ms())
        await self.refresh(cursor)  # the segments from the start on, with certificates
        return cursor

    def segment_id(self, epoch: int) -> entry_pb2.SegmentId:
        """Segment `epoch` of the stream (once a list named its id)."""
        assert self._ref is not None
        return entry_pb2.SegmentId(stream_id=self._ref.stream_id, epoch=epoch, stream=self._stream)

    def data_address(self, replica: str) -> str:
        """The data port of the store at `replica` (its gRPC address), as a list named
        it; empty when none did (dialling it then fails as an unreachable store)."""
        return self._data_addresses.get(replica, "")

    def close(self) -> None:
        """Stop a read-ahead still running (the follower is done with)."""
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead = None

    async def batches(self) -> AsyncIterator[pa.RecordBatch]:
        """Record batches (`packed.EVENT_SCHEMA`) of the events in sequence order, one
        per part of a reply the cursor released (a reply, or the part of it a verified
        chunk ends in: not joined, which would copy every row once more); none empty."""
        try:
            async for parts in self.released():
                for batch in map(released_batch, parts):
                    if batch.num_rows:
                        yield batch
        finally:
            self.close()

    async def events(self) -> AsyncIterator[list[StreamEvent]]:
        """Lists of at most `EVENTS_PER_LIST` events, in sequence order."""
        try:
            async for parts in self.released():
                for part in parts:
                    for piece in part.pieces(EVENTS_PER_LIST):
                        events = released_events(piece)
                        if events:
                            yield events
        finally:
            self.close()

    async def _read(self, cursor: Cursor, read: ReadFrom) -> AsyncIterator[list[Released]]:
        """Read one replica until the cursor moves elsewhere, the replica fails, or the
        range is done: what it acked now in packed `Read` replies (a catch-up, no message
        per entry), then, still wanted, a live tail of what it acks from there on."""
        assert self._ref is not None
        segment = self.segment_id(read.epoch)
        ahead = self._ahead
        if ahead is not None and ahead.wanted.epoch <= read.epoch:
            self._ahead = None
            if ahead.wanted != read:
                ahead.cancel()  # the cursor chose another read
                ahead = None
        else:
            ahead = None
        if ahead is None:
            cursor.on_call_started(read.epoch)
        call: _Replies = ahead if ahead is not None else self._packed_read(read)
        if self._ahead is None:
            self._read_ahead(cursor)
        caught_up = _Outcome(packed=True)
        async for parts in self._follow(cursor, read, call, caught_up):
            yield parts
        if not caught_up.clean or not Cursor.continues(cursor.next(monotonic_ms()), read):
            return
        start = segment_store_pb2.SubscribeRequest(
            start=segment_store_pb2.SubscribeStart(
                segment=segment,
                from_index=cursor.read_from_index,
                max_batch_entries=SUBSCRIBE_BATCH_ENTRIES,
                keepalive_interval_ms=cursor.timing.keepalive_interval_ms,
            )
        )
        call = _LiveTail(
            self._channels,
            self.data_address(read.replica),
            start,
            cursor.timing.keepalive_interval_ms,
        )
        async for parts in self._follow(cursor, read, call, _Outcome(packed=False)):
            yield parts

    def _packed_read(self, read: ReadFrom) -> _PackedRead:
        request = segment_store_pb2.ReadRequest(
            segment=self.segment_id(read.epoch),
            from_index=read.from_index,
            acked_only=True,
            packed=True,
            reader_verifies=read.checked,
        )
        # A replica no list named a data port for is unreachable: its read fails at once.
        data_address = self.data_address(read.replica)
        return _PackedRead(read, framed_read.read(data_address, self._channels.data_call, request))

    def _read_ahead(self, cursor: Cursor) -> None:
        """Start the read of the next segment now (usually on another store), so that
        it is read while this sealed one is: a catch-up keeps two stores busy, not one."""
        upcoming = cursor.upcoming()
        if upcoming is None:
            return
        self._ahead = self._packed_read(upcoming)

    async def _follow(
        self,
        cursor: Cursor,
        read: ReadFrom,
        call: _Replies,
        outcome: _Outcome,
    ) -> AsyncIterator[list[Released]]:
        """Feed the cursor the replies of `call` (a packed Read or a Subscribe) while it
        goes on with `read`; `outcome.clean` when the replica ended the call itself."""
        start_position = cursor.position
        expected = _Expected(read.from_index, first=True)
        # One read stays pending across wake-ups: cancelling a read would cancel the RPC.
        pending: asyncio.Future[object] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(call.read())
                timeout_s = max(cursor.wake_at_ms() - monotonic_ms(), 0) / 1000
                done, _ = await asyncio.wait({pending}, timeout=timeout_s)
                if done:
                    reply, pending = pending.result(), None
                    if reply is grpc.aio.EOF:
                        outcome.clean = True
                        return
                    if isinstance(reply, segment_store_pb2.ReadReply):
                        parts = self._on_packed(cursor, read, reply, expected)
                    else:
                        assert isinstance(reply, segment_store_pb2.SubscribeReply)
                        parts = self._on_reply(cursor, read, reply)
                    if parts:
                        yield parts
                        cursor.on_delivered(monotonic_ms())
                if cursor.refresh_due(monotonic_ms()):
                    await self.refresh(cursor)
                await self.report(cursor)
                decision = cursor.next(monotonic_ms())
                if not Cursor.continues(decision, read):
                    log.info("%s: leaving replica %s: %s", self._stream, read.replica, decision)
                    return
        except asyncio.CancelledError:
            # gRPC cancels the calls of a channel that closes: unless this task itself is
            # being cancelled, the client closed under the reader.
            current = asyncio.current_task()
            if current is not None and not current.cancelling():
                self._channels.check_open()
            raise
        except (grpc.aio.AioRpcError, CallError) as error:
            # The data plane ends the calls of a client that closes with CANCELLED.
            self._channels.check_open()
            code, details = _status_of(error)
            if code == "DATA_LOSS":
                # The store found what it holds damaged: an answer, not a failure.
                log.warning("%s: replica %s: DATA_LOSS: %s", self._stream, read.replica, details)
                cursor.on_replica_damaged(read.epoch, read.replica, f"DATA_LOSS: {details}")
                await self.report(cursor)
                return
            if code == "NOT_FOUND" and outcome.packed:
                # A Read's answer that the replica holds nothing of the segment. Of an
                # open segment that is nothing yet: the read goes on to tail it (the
                # cursor says so; of a sealed one it leaves the replica). Asking again at
                # once instead spun on the replica until the first write reached it.
                cursor.on_position(read.epoch, read.replica, 0, monotonic_ms())
                outcome.clean = True
                return
            if cursor.position != start_position:
                # Disconnected after serving (a consumer too slow for the store's buffer,
                # or a restart): resume from the position, on the same replica.
                log.info("%s: disconnected by %s (%s), resuming", self._stream, read.replica, code)
                return
            log.info("%s: replica %s failed: %s, retrying later", self._stream, read.replica, code)
            cursor.on_replica_failed(read.epoch, read.replica, monotonic_ms())
        finally:
            if pending is not None:
                pending.cancel()
            call.cancel()

    def _on_packed(
        self,
        cursor: Cursor,
        read: ReadFrom,
        reply: segment_store_pb2.ReadReply,
        expected: _Expected,
    ) -> list[Released]:
        """A packed Read reply: what the replica acked when the read began (its answer,
        once), then values of consecutive indexes, each verified by the store."""
        now = monotonic_ms()
        if expected.first:
            expected.first = False
            cursor.on_position(read.epoch, read.replica, reply.acked_index, now, reply.bridge_index)
        packed = Packed.of(reply)
        if packed is None:
            cursor.on_keepalive(read.epoch, read.replica, now)
            return []
        if packed.first_index != expected.index:
            log.warning(
                "%s: replica %s sent index %d, expected %d",
                self._stream,
                read.replica,
                packed.first_index,
                expected.index,
            )
            cursor.on_replica_failed(read.epoch, read.replica, now)
            return []
        expected.index = packed.last_index + 1
        return cursor.on_run(read.epoch, packed, now)

    def _on_reply(
        self, cursor: Cursor, read: ReadFrom, reply: segment_store_pb2.SubscribeReply
    ) -> list[Released]:
        now = monotonic_ms()
        if reply.HasField("batch"):
            return self.batch_released(cursor, read, reply.batch)
        if reply.HasField("position"):
            position = reply.position
            cursor.on_position(
                read.epoch, read.replica, position.acked_index, now, position.bridge_index
            )
        else:
            cursor.on_keepalive(read.epoch, read.replica, now)
        return []

    def batch_released(
        self, cursor: Cursor, read: ReadFrom, batch: segment_store_pb2.EntryBatch
    ) -> list[Released]:
        """A Subscribe batch of `read`, each entry's crc32c checked: what the cursor
        releases of it (a corrupt entry is damage, a gap a failure of the replica)."""
        entries = batch.entries
        if not entries:
            return []
        # Columns, each field read once: the hot path of every follower.
        indexes = [e.index for e in entries]
        kinds = [e.kind for e in entries]
        payloads = [e.payload for e in entries]
        corrupt = first_corrupt(
            indexes, kinds, [e.epoch for e in entries], payloads, [e.crc32c for e in entries]
        )
        if corrupt is not None:
            # What the store holds there fails its crc32c: it is damaged, not away.
            problem = f"index {indexes[corrupt]} fails its crc32c"
            log.warning("%s: replica %s: %s", self._stream, read.replica, problem)
            cursor.on_replica_damaged(read.epoch, read.replica, problem)
            return []
        if indexes[-1] - indexes[0] != len(indexes) - 1:
            log.warning(
                "%s: replica %s sent a non-consecutive batch at index %d",
                self._stream,
                read.replica,
                indexes[0],
            )
            cursor.on_replica_failed(read.epoch, read.replica, monotonic_ms())
            return []
        run = ListRun(indexes[0], bytes(kinds), payloads)
        return cursor.on_run(read.epoch, run, monotonic_ms())

    async def report(self, cursor: Cursor) -> None:
        """Tell the master of replicas found serving what they must not (its store then
        checks them first); a master that does not answer misses a hint, nothing more."""
        for report in cursor.take_reports():
            log.warning("%s: replica %s reported: %s", self._stream, report.replica, report.problem)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._master.ReportReplica(
                    master_pb2.ReportReplicaRequest(
                        stream=self._stream,
                        segment_epoch=report.epoch,
                        store_address=report.replica,
                        problem=report.problem,
                    ),
                    timeout=REPORT_TIMEOUT_S,
                )

    async def refresh(self, cursor: Cursor) -> None:
        """Give the cursor the master's list; a master that does not answer now is
        asked again later (an unknown stream still ends the subscription)."""
        epoch = cursor.epoch
        try:
            segments = await self._list_segments(epoch, segments_max=LISTED_AHEAD_SEGMENTS)
        except Unavailable as error:
            log.info("%s: master did not list the segments (%s), retrying", self._stream, error)
            cursor.on_list_failed(monotonic_ms())
            return
        self._check_trimmed(cursor)
        cursor.on_segments(segments, monotonic_ms())

    def _check_trimmed(self, cursor: Cursor) -> None:
        """A position a trim took away ends the read: what it would read next is gone
        (the list no longer names its segment, which the cursor would skip)."""
        if position_trimmed(cursor.position, self._trimmed_through_epoch):
            raise Trimmed(self._stream, cursor.position, self._first_retained)

    async def _list_segments(
        self, from_epoch: int = 0, segments_max: int = 0, retry: bool = False
    ) -> list[SegmentView]:
        """The master's list from `from_epoch` on, its first `segments_max` segments (0:
        all), sealed ones with their certificates when bounded; `retry` like a control
        call."""

        async def ask() -> master_pb2.ListSegmentsReply:
            return await self._master.ListSegments(
                master_pb2.ListSegmentsRequest(
                    stream=self._stream,
                    from_epoch=from_epoch,
                    segments_max=segments_max,
                    certificates=bool(segments_max),
                ),
                timeout=self._timing.list_timeout_ms / 1000,
            )

        try:
            reply = await (retry_unary(ask) if retry else ask())
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from error
        self._ref = _StreamRef(self._stream, reply.stream_id)
        self._trimmed_through_epoch = reply.trimmed_through_epoch
        self._first_retained = reply.first_retained_sequence
        for segment in reply.segments:
            for replica in segment.copy_set:
                if replica.data_address:
                    self._data_addresses[replica.address] = replica.data_address
        return segment_views(reply)

    async def _acked_end(self, segments: list[SegmentView]) -> int:
        """The sequence just past the last acked event now (`core.subscription.acked_end`),
        asking the open segment's replicas at once, again while none answers."""
        first_ms = monotonic_ms()
        while True:
            if not segments:
                return self._first_retained
            last = segments[-1]
            answers: list[int | None] = []
            if not last.sealed:
                asks = (self._replica_acked(replica, last.epoch) for replica in last.replicas)
                answers = list(await asyncio.gather(*asks))
            end = acked_end(last, Asked(answers, first_ms, monotonic_ms()), self._timing)
            if isinstance(end, Unreachable):
                raise Unavailable(end.describe(self._stream))
            if isinstance(end, int):
                return end
            await asyncio.sleep(max(end.until_ms - monotonic_ms(), 0) / 1000)
            segments = await self._list_segments(retry=True)

    async def _replica_acked(self, replica: str, epoch: int) -> int | None:
        """What `replica` says it acked of segment `epoch` (0: it holds none of it), or
        None when it does not answer."""
        assert self._ref is not None
        stub = store_grpc.SegmentStoreStub(self._channels.get(replica))
        segment = entry_pb2.SegmentId(stream_id=self._ref.stream_id, epoch=epoch)
        try:
            state = await stub.GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(segment=segment),
                timeout=SEGMENT_STATE_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            code = error.code().name
            log.info("%s: replica %s did not tell its acked index: %s", self._stream, replica, code)
            return None
        return int(state.acked_index)


def _follower(
    master: master_pb2_grpc.MasterAsyncStub,
    channels: ChannelPool,
    stream: str,
    start: Start,
    end: int | None,
    forever: bool,
    timing: FollowerTiming | None = None,
) -> Follower | None:
    """A follower of `[start, end)` (`forever`: from `start` on, for ever; else `end=None`
    stops at the acked end at call time); None when the range is empty."""
    if forever:
        return Follower(master, channels, stream, start, None, until_acked_end=False)
    if end is not None and isinstance(start, int) and end <= start:
        return None
    return Follower(master, channels, stream, start, end, end is None, timing)


def bounded_read_timing(give_up_after_s: float | None) -> FollowerTiming:
    """A bounded read's waits: the defaults, or its own give-up time (ValueError below
    what a replica's silence takes to notice)."""
    timing = FollowerTiming()
    if give_up_after_s is None:
        return timing
    return timing.giving_up_after(round(give_up_after_s * 1000))


async def subscribe(
    master: master_pb2_grpc.MasterAsyncStub, channels: ChannelPool, stream: str, start: Start
) -> AsyncIterator[StreamEvent]:
    """Every acked event from `start` on, forever."""
    follower = _follower(master, channels, stream, start, None, forever=True)
    assert follower is not None
    async for events in follower.events():
        for event in events:
            yield event


async def read(
    master: master_pb2_grpc.MasterAsyncStub,
    channels: ChannelPool,
    stream: str,
    start: int | Literal["earliest"] = 0,
    end: int | None = None,
    timing: FollowerTiming | None = None,
) -> AsyncIterator[StreamEvent]:
    """Acked events in `[start, end)`; `end=None` stops at the acked end at call time."""
    follower = _follower(master, channels, stream, start, end, False, timing)
    if follower is None:
        return
    async for events in follower.events():
        for event in events:
            yield event


async def subscribe_batches(
    master: master_pb2_grpc.MasterAsyncStub, channels: ChannelPool, stream: str, start: Start
) -> AsyncIterator[pa.RecordBatch]:
    """`subscribe`, as record batches (`packed.EVENT_SCHEMA`)."""
    follower = _follower(master, channels, stream, start, None, forever=True)
    assert follower is not None
    async for batch in follower.batches():
        yield batch


async def read_batches(
    master: master_pb2_grpc.MasterAsyncStub,
    channels: ChannelPool,
    stream: str,
    start: int | Literal["earliest"] = 0,
    end: int | None = None,
    timing: FollowerTiming | None = None,
) -> AsyncIterator[pa.RecordBatch]:
    """`read`, as record batches (`packed.EVENT_SCHEMA`)."""
    follower = _follower(master, channels, stream, start, end, False, timing)
    if follower is None:
        return
    async for batch in follower.batches():
        yield batch
