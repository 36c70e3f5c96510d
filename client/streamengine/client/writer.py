"""The writer: leadership of one stream and pipelined appends, as an async context.

A thin asyncio shell around `client.core.writer.Leader`: every input (a heartbeat
answer, a store's reply, a broken stream, the clock) becomes one `step`, which drains
the core's outbox in one loop and carries the actions out (send this, resolve those
appends); appends waiting for room are given to the core in that same loop, after the
actions already queued, never by a step inside a step. All steps happen on the event
loop thread without an `await` in between, so the core needs no lock.

An append is answered whatever happens: it waits (no room, or a roll drains the
segment), is submitted to the core, and is pending from the moment the core assigns
its indexes; a step-down fails the waiting and submitted ones (never sent) and tells
each pending one whether it is in doubt or definitely failed.

Every background loop (heartbeats, recoveries) is a task of a TaskGroup owned by the
`async with` block: a failure in one reaches the user. The clock is the client's one
timer for all its writers (`client.timers`): after each step the writer tells it the
core's next deadline, and it steps `Tick` then. Writes go through
the client's store sessions (`client.store_session`): one Write stream per store shared
by every writer of the client, to which the writer attaches its open segment; a store's
answer comes back as one step (`store_event`), and a failure of the core on it reaches
the user as a background loop's would.
Heartbeats, rolls and releases go through the client's lease session (`client.leases`),
which batches them with every other writer's and holds the leases at the master while the
process lives; a writer's close hands its release over and does not wait for it.

Earlier segments. Each `RecoverSegment` gets one `client.recovery.SegmentSealer` task;
its `Done` becomes `SegmentSealed` (the core then acks the new segment, or rolls out of
an epoch granted without a segment), its `Deposed` a `FencedByStore` (the core steps
down), any other failure `RecoveryFailed` (the core starts it again later).

Rolling. The core drains the open segment and emits `AskRoll`; the shell hands the
roll to the lease session, which sends it with the other writers' rolls of the moment
(`RollSegments`), and feeds its own answer back (`RollAnswered`, or `RollFailed`). Appends
wait while the core does not accept them (`accepting_appends`) and go on in the new
segment, whose Write streams replace the old ones. A roll that could not drain (too few
stores of the copy set left to ack) ends the old segment's unacked appends
(`AppendsLeftUnacked`): in doubt if some store may hold them, failed if none does.

```python
async with client.writer("acme/orders") as w:    # waits for leadership
    seq = await w.append(b"...")                  # resolves once W stores hold it
```

Producers (exactly once). A writer made with a producer id waits, once it leads, until
every earlier segment is recovered: its producer table (`Leader.producers`) is then
rebuilt and `last_producer_sequence` known. `append_batch(payloads, producer_sequence=K)`
decides by the table (`streamengine.protocol.producers`): the events at or below the
high-water mark are not written again, their stream sequences are answered once they
are durable; the others go as one batch behind a PRODUCER mark. A decided batch is
given to the core at once or held back for room in turn with every other append, as a
plain one is; the next batch of the producer decides behind it (`decide_behind`), and
one held back is written only if the table it was decided by is unchanged, and never
while a segment is being recovered; one not written fails every one held behind it
(`streamengine.protocol.producers`, "Queued batches").

Why one long module: `Writer` carries out every action of the core's one state machine
(calls to the master, writes through the store sessions, recoveries) and feeds
back their answers; the store sessions are apart (`client.store_session`), as is a
recovery's calls (`client.recovery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from streamengine.client.channels import ChannelPool
from streamengine.client.core.replicator import (
    Acked,
    Append,
    Assigned,
    Flush,
    ReplicatorLimits,
    SegmentRef,
    SendWrite,
    StoreDetached,
    Tick,
    events_bytes,
)
from streamengine.client.core.writer import (
    APPEND_TIMEOUT_MS,
    STREAM_DELETED,
    AppendHeld,
    AppendsLeftUnacked,
    AppendsTimedOut,
    AskRoll,
    BecameLeader,
    Closing,
    FencedByStore,
    HeartbeatFailed,
    HeldAppendLeft,
    HeldAppendsTimedOut,
    Leader,
    LeaderAction,
    LeaderEvent,
    RecoverSegment,
    RecoveryFailed,
    Release,
    ReleaseLease,
    Role,
    RollAnswered,
    RollFailed,
    SegmentSealed,
    SendHeartbeat,
    SessionAttention,
    SessionUnbound,
    StepDownReason,
    SteppedDown,
)
from streamengine.client.errors import (
    AppendFailed,
    AppendInDoubt,
    AppendTimedOut,
    EventTooLarge,
    Fenced,
    InvalidArgument,
    LeadershipLost,
    StreamDeleted,
    StreamEngineError,
    Unavailable,
    from_rpc_error,
)
from streamengine.client.leases import LeaseSession
from streamengine.client.recovery import SegmentSealer
from streamengine.client.store_session import StoreSession, StoreSessions
from streamengine.client.timers import WriterTimers
from streamengine.client.wire import BatchCache, LeaseSecret, heartbeat_answer
from streamengine.protocol.clock import monotonic_ms
from streamengine.protocol.entry import (
    PRODUCER_SEQUENCE_MAX,
    InvalidProducer,
    ProducerMark,
    check_producer_id,
)
from streamengine.protocol.limits import EVENT_BYTES_MAX
from streamengine.protocol.producers import Dedup, ProducerTable, SequenceGap, TooManyProducers
from streamengine.protocol.sequence import pack_sequence
from streamengine.v1 import master_pb2, master_pb2_grpc

log = logging.getLogger(__name__)

# How long leaving the block waits for stores to confirm the final acked index (so
# readers see the tail without waiting for the next leader).
FLUSH_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class WriterStatistics:
    """A snapshot; changes nothing."""

    stream: str
    role: str
    epoch: int
    last_index: int
    acked_index: int
    in_flight_bytes: int  # appended, not yet acked
    retained_bytes: int  # kept for resending to stores behind
    matched_index: dict[str, int]  # per store id
    connected: dict[str, bool]
    detached: tuple[str, ...]
    pending_appends: int
    waiting_appends: int  # held back by back pressure
    # Seconds since a master last answered this writer (None: never). A leader no master
    # answers goes on appending to its open segment; it cannot roll meanwhile.
    master_silent_s: float | None
    # Earlier segments this writer is still sealing and recovering: its own segment
    # acks nothing until they are done.
    unsealed_epochs: tuple[int, ...] = ()


@dataclass(slots=True)
class _Append:
    """One `append`/`append_batch` call: its future resolves to the first and last
    sequence once acked, or fails. It waits (not yet given to the core), is submitted
    (stepped, its `Assigned` not yet seen), then is pending (assigned, maybe sent)."""

    payloads: tuple[bytes, ...]
    nbytes: int
    future: asyncio.Future[tuple[int, int]]
    marked: bool = False  # the first payload is a PRODUCER mark
    # A marked batch: the last producer sequence it writes, and the table it was decided
    # by with that table's `changes` then (it is written only if they still hold).
    producer_through: int = -1
    decided_by: ProducerTable | None = None
    table_changes: int = 0
    first_index: int = 0
    last_index: int = 0
    segment_epoch: int = 0


async def _raise(error: Exception) -> None:
    raise error


def _answer_taken(answer: asyncio.Future[tuple[int, int]]) -> None:
    if not answer.cancelled():
        answer.exception()


def _as_bytes(payload: bytes | bytearray | memoryview) -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    raise InvalidArgument(f"an event is bytes, not {type(payload).__name__}")


class Writer:
    """Leadership of one stream; see the module docstring. Made by `StreamClient.writer`."""

    def __init__(
        self,
        master: master_pb2_grpc.MasterAsyncStub,
        channels: ChannelPool,
        stream: str,
        leases: LeaseSession,
        sessions: StoreSessions,
        timers: WriterTimers,
        *,
        limits: ReplicatorLimits | None = None,
        leadership_timeout_s: float | None = None,
        client_id: str | None = None,
        rolling: bool = True,
        append_timeout_s: float = APPEND_TIMEOUT_MS / 1000,
        accept_loss: bool = False,
        producer_id: str | None = None,
        sequence_jumps: bool = False,
    ) -> None:
        """`rolling=False` keeps one segment for as long as this writer leads.
        `sequence_jumps`: the producer's sequences only increase, a batch may start
        anywhere above the last (`streamengine.protocol.producers`, "Jumps").
        `accept_loss` (`StreamClient.seal`'s, an operator's choice only): recoveries of
        earlier segments decide from the stores that answer when fewer than R can, and
        declare the range they cannot know lost."""
        self.stream = stream
        self._accept_loss = accept_loss
        if producer_id is not None:
            try:
                check_producer_id(producer_id)
            except InvalidProducer as error:
                raise InvalidArgument(str(error)) from None
        self.producer_id = producer_id
        self._sequence_jumps = sequence_jumps
        # Producer batches decide in the order of their calls (module docstring).
        self._producer_turn = asyncio.Lock()
        self.client_id = client_id or f"writer-{uuid.uuid4().hex}"
        self._master = master
        # The client's lease session carries this writer's heartbeats and releases,
        # and holds its lease at the master while the process lives.
        self._leases = leases
        self._channels = channels
        # The client's Write streams, one per store: this writer's open segment is
        # attached to those of its copy set.
        self._sessions = sessions
        self._attached: dict[str, StoreSession] = {}
        # The client's one timer: it steps `Tick` when the core's deadline comes.
        self._timers = timers
        self._segment: SegmentRef | None = None  # the one attached
        self._leadership_timeout_s = leadership_timeout_s
        self._core = Leader(
            monotonic_ms(),
            limits,
            recovery_supported=True,
            rolling_supported=rolling,
            append_timeout_ms=max(1, round(append_timeout_s * 1000)),
            producer=producer_id is not None,
            session=leases.lease,
        )
        # The session incarnation this writer last told the lease session it is bound
        # under (empty: not bound).
        self._told_bound = b""
        self._append_timeout_s = append_timeout_s
        self._group: asyncio.TaskGroup | None = None
        # Heartbeats in flight: cancelled on close (their answers no longer matter).
        self._heartbeats: set[asyncio.Task[None]] = set()
        # Sealing earlier segments: cancelled when this writer stops leading.
        self._recoveries: set[asyncio.Task[None]] = set()
        self._sealed_changed = asyncio.Event()
        self._waiting: deque[_Append] = deque()  # held back: no room, or a roll drains
        self._submitted: deque[_Append] = deque()  # stepped, `Assigned` not yet seen
        self._pending: deque[_Append] = deque()  # assigned: resolved when acked
        self._room_freed = False
        self._stepping = False
        self._decided = asyncio.Event()  # leading, or finished before leading
        self._flushed = asyncio.Event()
        self._stepped = asyncio.Event()
        self._closing = False
        self._error: StreamEngineError | None = None
        # The last heartbeat error, told to the user if the core ends the writer on it.
        self._heartbeat_error: StreamEngineError | None = None
        self._lease_secret = LeaseSecret()
        self.batch_cache = BatchCache()

    # ---- the context ----

    async def __aenter__(self) -> Writer:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        try:
            self.step(Tick())  # the first heartbeat goes now; the timers do the rest
            try:
                async with asyncio.timeout(self._leadership_timeout_s):
                    await self._decided.wait()
            except TimeoutError:
                leader = self._core.statistics().leader_id or "nobody (the master is silent)"
                raise Unavailable(
                    f"{self.stream}: no leadership within {self._leadership_timeout_s} s; "
                    f"leading: {leader}"
                ) from None
            if self._error is not None:
                raise self._error
            if self.producer_id is not None:
                # The producer table is known once every earlier segment is recovered.
                await self._wait_recovered(self._leadership_timeout_s)
        except BaseException as error:
            await self._close(type(error), error, error.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._close(exc_type, exc, tb)

    async def _close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._group is not None
        if self.leading and exc_type is None:
            await self._finish_recoveries()
            await self._flush()
        self._closing = True
        # No heartbeat may reach the master after the release: the lease would then be
        # free and granted again, to this writer, opening an epoch nobody uses (and
        # leaving the segment just written unsealed until the next leader).
        heartbeats = list(self._heartbeats)
        for task in heartbeats:
            task.cancel()
        await asyncio.gather(*heartbeats, return_exceptions=True)
        # Its ReleaseLease goes to the lease session at once (as does that of a grant
        # answered later, even after the close: `_step_finished` gives it back).
        self.step(Release())
        self._detach()
        for task in [*self._heartbeats, *self._recoveries]:
            task.cancel()
        if exc_type is not None and not issubclass(exc_type, asyncio.CancelledError):
            # The caller's own error goes on as it is; a TaskGroup would wrap it in an
            # ExceptionGroup. Only a background loop's failure (which cancels the
            # caller, so it arrives here as CancelledError) comes back as a group.
            await self._group.__aexit__(None, None, None)
        else:
            await self._group.__aexit__(exc_type, exc, tb)
        return None

    def client_closed(self) -> None:
        """Its `StreamClient` closes the channels under it: stop leading now, as a close
        does (appends in flight fail, in doubt where they may be durable; the lease goes
        back, or runs out), instead of appending on into closed channels until the
        append timeout."""
        if self._group is not None and not self._closing:
            self.step(Release())
        self._decided.set()

    async def _finish_recoveries(self) -> None:
        """Closing: the recoveries this writer started finish before it lets go (the
        core says when, `Leader.ready_to_release`)."""
        self.step(Closing())
        while not self._core.ready_to_release(monotonic_ms()):
            self._stepped.clear()
            await self._stepped.wait()

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every appended event is acked and every connected store holds it
        and knows the acked index, so a reader starting at the end now starts after
        it. False if that did not happen within `timeout_s` (a store is slow or down)."""
        self._check_leading()
        await self._flush(timeout_s)
        return self._is_flushed()

    async def _flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        self._flushed.clear()
        self.step(Flush())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.leading and not self._is_flushed():
                    self._flushed.clear()
                    await self._flushed.wait()

    def _is_flushed(self) -> bool:
        replicator = self._core.replicator
        return replicator is None or (
            replicator.acked_index == replicator.last_index and replicator.flushed()
        )

    # ---- appending ----

    @property
    def leading(self) -> bool:
        return self._core.role is Role.LEADING

    @property
    def epoch(self) -> int:
        return self._core.epoch

    async def append(self, payload: bytes | bytearray | memoryview) -> int:
        """Append one event; returns its sequence once W stores hold it."""
        first, _ = await self._append((_as_bytes(payload),))
        return first

    async def append_batch(
        self,
        payloads: Sequence[bytes | bytearray | memoryview],
        producer_sequence: int | None = None,
    ) -> list[int]:
        """Append events in order (consecutive indexes); their sequences once acked.

        With `producer_sequence` K (a writer made with a producer id), the events are
        the producer's K, K + 1, ...: those already in the stream are not written again
        and answer the stream sequence they have there (0 for one older than the
        writer's table keeps: durable, position no longer known); a K above
        `last_producer_sequence` + 1 leaves a gap and raises InvalidArgument, writing
        nothing."""
        if producer_sequence is not None:
            return await self._append_producer(tuple(map(_as_bytes, payloads)), producer_sequence)
        if not payloads:
            return []
        first, last = await self._append(tuple(map(_as_bytes, payloads)))
        return list(range(first, last + 1))

    @property
    def last_producer_sequence(self) -> int | None:
        """The highest producer sequence of this writer's producer id durable in the
        stream (None: none of its events)."""
        if self.producer_id is None:
            raise InvalidArgument(f"{self.stream}: this writer was made without a producer id")
        return self._core.producers.durable_sequence(self.producer_id, self._durable_through())

    def _durable_through(self) -> int:
        """The stream sequence up to which every event is durable (acked)."""
        replicator = self._core.replicator
        if replicator is None:
            return pack_sequence(self.epoch, 0)  # earlier segments are all recovered
        return pack_sequence(replicator.segment.epoch, replicator.acked_index)

    async def _append_producer(self, payloads: tuple[bytes, ...], first_sequence: int) -> list[int]:
        producer_id = self.producer_id
        if producer_id is None:
            raise InvalidArgument(
                f"{self.stream}: a producer sequence needs a writer made with a producer id"
            )
        if not 0 <= first_sequence <= PRODUCER_SEQUENCE_MAX - len(payloads):
            raise InvalidArgument(f"producer sequence {first_sequence} out of range")
        if not payloads:
            return []
        largest = max(map(len, payloads))
        if largest > EVENT_BYTES_MAX:
            raise EventTooLarge(f"event of {largest} bytes > {EVENT_BYTES_MAX}")
        item: _Append | None = None
        # The append timeout counts from the call, through the wait for the turn.
        due_ms = monotonic_ms() + round(self._append_timeout_s * 1000)
        deadline = asyncio.get_running_loop().time() + self._append_timeout_s
        async with self._producer_turn:
            await self._wait_producer_turn(deadline)
            decision = self._producer_decision(producer_id, first_sequence, len(payloads))
            if decision is None:
                # A retry of batches still held back: answered once they are assigned.
                await self._wait_producer_turn(deadline, queue_drained=True)
                decision = self._producer_decision(producer_id, first_sequence, len(payloads))
                assert decision is not None, "nothing of the producer is held back"
            if decision.to_write:
                mark = ProducerMark(producer_id, decision.first_sequence, decision.to_write)
                batch = (mark.encode(), *payloads[decision.write_from :])
                # Given to the core now, or held back in turn behind what waits for room.
                item = self._enqueue(batch, due_ms=due_ms, decision=decision)
        try:
            if decision.known:
                await self._wait_durable(max(decision.known), deadline=deadline)
        except BaseException:
            if item is not None:
                # The caller hears this error; the batch's own answer, still to come,
                # is taken so that asyncio does not report it as never retrieved.
                item.future.add_done_callback(_answer_taken)
            raise
        written: list[int] = []
        if item is not None:
            first, last = await item.future
            written = list(range(first + 1, last + 1))  # the mark comes first
        return [*decision.known, *written]

    def _producer_decision(self, producer_id: str, first_sequence: int, count: int) -> Dedup | None:
        """What to write of a producer's batch (`streamengine.protocol.producers`): by
        the table, or behind this producer's batches still held back (None: it
        overlaps them)."""
        queued_through = self._queued_producer_through()
        table = self._core.producers
        try:
            if queued_through is None:
                return table.decide(producer_id, first_sequence, count, self._sequence_jumps)
            return table.decide_behind(
                producer_id, queued_through, first_sequence, count, self._sequence_jumps
            )
        except (SequenceGap, TooManyProducers) as error:
            raise InvalidArgument(f"{self.stream}: {error}") from None

    def _queued_producer_through(self) -> int | None:
        """The last producer sequence of the marked batches held back, if any is."""
        for item in reversed(self._waiting):
            if item.marked and not item.future.done():
                return item.producer_through
        return None

    async def _wait_producer_turn(self, deadline: float, queue_drained: bool = False) -> None:
        """Until a producer's batch may be decided: leading, every earlier segment
        recovered (the table rebuilt), and with `queue_drained` none of its batches held
        back; at most until `deadline` (the loop's time)."""
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    self._check_leading()
                    if not self._core.recovering and not (
                        queue_drained and self._queued_producer_through() is not None
                    ):
                        return
                    self._stepped.clear()
                    await self._stepped.wait()
        except TimeoutError:
            raise AppendTimedOut(
                f"{self.stream}: the producer's table was not ready within "
                f"{self._append_timeout_s} s",
                in_doubt=False,
            ) from None

    async def _wait_recovered(self, timeout_s: float | None) -> None:
        """Until every earlier segment is sealed and recovered (the gate)."""
        async with asyncio.timeout(timeout_s):
            while self._core.recovering:
                self._check_leading()
                self._stepped.clear()
                await self._stepped.wait()
        self._check_leading()

    async def _wait_durable(
        self, stream_sequence: int, in_doubt: bool = True, deadline: float | None = None
    ) -> None:
        """Until the event at `stream_sequence` (an earlier batch's) is acked, at most
        until `deadline` (the loop's time; by default an append timeout from now): a
        retry answers only what is durable (`in_doubt=False`: nothing of this call was
        written yet). Its own append answers if it fails."""
        try:
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self._append_timeout_s
            async with asyncio.timeout_at(deadline):
                while self._durable_through() < stream_sequence:
                    self._check_leading()
                    self._stepped.clear()
                    await self._stepped.wait()
        except TimeoutError:
            raise AppendTimedOut(
                f"{self.stream}: an earlier batch of this producer is not acked "
                f"within {self._append_timeout_s} s",
                in_doubt=in_doubt,
            ) from None

    async def _append(self, payloads: tuple[bytes, ...]) -> tuple[int, int]:
        return await self._enqueue(payloads).future

    def _enqueue(
        self, payloads: tuple[bytes, ...], due_ms: int | None = None, decision: Dedup | None = None
    ) -> _Append:
        """Give an append to the core, or hold it back for room; its future resolves
        once acked."""
        largest = max(map(len, payloads))
        if largest > EVENT_BYTES_MAX:
            raise EventTooLarge(f"event of {largest} bytes > {EVENT_BYTES_MAX}")
        nbytes = events_bytes(payloads)
        self._check_leading()
        unacked_max = self._core.limits.unacked_bytes_max
        if len(payloads) > 1 and nbytes > unacked_max:
            raise InvalidArgument(
                f"a batch of {nbytes} bytes is more than the writer may have unacked "
                f"({unacked_max}): split it"
            )
        item = _Append(payloads, nbytes, asyncio.get_running_loop().create_future())
        marked = decision is not None
        if decision is not None:
            item.marked = True
            item.producer_through = decision.first_sequence + decision.to_write - 1
            item.decided_by = self._core.producers
            item.table_changes = item.decided_by.changes
        # No segment yet (an epoch granted without one): it waits for the roll.
        replicator = self._core.replicator
        if (
            not self._waiting
            and self._core.accepting_appends
            and replicator is not None
            and replicator.room_for(nbytes)
        ):
            self._submitted.append(item)
            self.step(Append(payloads, marked, due_ms))
        else:
            # The core answers it if it waits too long (`HeldAppendsTimedOut`).
            self._waiting.append(item)
            self.step(AppendHeld(due_ms))
        return item

    def _check_leading(self) -> None:
        if self._error is not None:
            raise self._error
        if not self.leading:
            raise LeadershipLost(f"{self.stream}: this writer does not lead")

    def _admit_next(self, now: int) -> bool:
        """Give the first waiting append to the core if it may go now (inside the drain
        loop of `step`, so its writes queue after the actions just carried out)."""
        if not self._room_freed:
            return False
        replicator = self._core.replicator
        while self._waiting and (self._waiting[0].future.done() or self._stale(self._waiting[0])):
            item = self._waiting.popleft()  # cancelled by its caller, or decided by a stale table
            if not item.future.done():
                item.future.set_exception(
                    AppendFailed(
                        f"{self.stream}: a roll gave up while the producer's batch waited for "
                        "room, and recovery decides its earlier batches: it was never sent"
                    )
                )
            if item.marked:
                self._fail_held_producer_batches()
            self._core.step(now, HeldAppendLeft(taken=False))
        if (
            not self._waiting
            or replicator is None
            or not self._core.accepting_appends
            or not replicator.room_for(self._waiting[0].nbytes)
            # A producer's batch goes only once the table is whole again: after a roll,
            # when the segment rolled away from is recovered (`step` then looks again).
            or (self._waiting[0].marked and self._core.recovering)
        ):
            self._room_freed = False
            return False
        item = self._waiting.popleft()
        self._core.step(now, HeldAppendLeft(taken=True))
        self._submitted.append(item)
        self._core.step(now, Append(item.payloads, item.marked))
        return True

    def _stale(self, item: _Append) -> bool:
        """A producer's batch decided by a table that changed since (module doc)."""
        table = self._core.producers
        return item.marked and (item.decided_by is not table or item.table_changes != table.changes)

    def _fail_held_producer_batches(self) -> None:
        """A producer's batch held back was not written: neither is any behind it, or
        they would leave a gap in the producer's sequences."""
        for item in self._waiting:
            if item.marked and not item.future.done():
                item.future.set_exception(
                    AppendFailed(
                        f"{self.stream}: an earlier batch of this producer was not written, "
                        "so this one was not either (retry from the earlier batch)"
                    )
                )

    # ---- the core ----

    def step(self, event: LeaderEvent) -> None:
        """Feed one event to the core and carry out everything that follows, in one
        loop: the actions it queued, then waiting appends the room freed lets go (each
        one more step, drained in turn). Nothing here steps from inside a step."""
        assert not self._stepping, f"a step inside a step: {event!r}"
        self._stepping = True
        try:
            now = monotonic_ms()
            accepting = self._core.accepting_appends
            recovering = self._core.recovering
            self._core.step(now, event)
            while True:
                actions = self._core.take_actions()
                if actions:
                    self._apply(actions)
                    continue
                if not accepting and self._core.accepting_appends:
                    accepting = True
                    self._room_freed = True  # a roll's drain ended (rolled or given up)
                if recovering and not self._core.recovering:
                    recovering = False
                    self._room_freed = True  # held producer batches may go
                if not (self._waiting and self._admit_next(now)):
                    break
        finally:
            self._stepping = False
        # Every submitted append was assigned, or failed with the step-down.
        assert not self._submitted, self._submitted
        if self._core.role is Role.LEADING:
            # Leading, with a segment or not yet (an epoch granted without one: its
            # recoveries run, appends wait for the roll that gives it one).
            self._decided.set()
        self._stepped.set()
        incarnation = self._core.session_incarnation
        if incarnation != self._told_bound:
            self._told_bound = incarnation
            self._leases.bind(self.stream, self, incarnation)
        self._timers.schedule(self, self._core.deadline_ms(monotonic_ms()))

    def _apply(self, actions: Iterable[LeaderAction]) -> None:
        for action in actions:
            if isinstance(action, SendWrite):
                session = self._attached.get(action.store)
                if session is not None:
                    session.send(action, self.batch_cache)
            elif isinstance(action, Assigned):
                self._assigned(action)
            elif isinstance(action, Acked):
                self._acked(action.acked_index)
            elif isinstance(action, SendHeartbeat):
                if self._closing:
                    continue  # see `_close`
                task = self._spawn(self._heartbeat(action))
                self._heartbeats.add(task)
                task.add_done_callback(self._heartbeats.discard)
            elif isinstance(action, BecameLeader):
                self._became_leader(action)
            elif isinstance(action, SteppedDown):
                self._stepped_down(action)
            elif isinstance(action, AppendsTimedOut):
                self._timed_out(action)
            elif isinstance(action, HeldAppendsTimedOut):
                self._held_timed_out(action.count)
            elif isinstance(action, AppendsLeftUnacked):
                self._left_unacked(action)
            elif isinstance(action, ReleaseLease):
                self._release(action)
            elif isinstance(action, StoreDetached):
                log.warning(
                    "%s: store %s detached at matched %d: %s",
                    self.stream,
                    action.store,
                    action.matched_index,
                    action.reason,
                )
            elif isinstance(action, RecoverSegment):
                self._start_recovery(action)
            elif isinstance(action, AskRoll):
                self._spawn(self._roll(action))
        if self._core.replicator is not None and self._is_flushed():
            self._flushed.set()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._group is not None
        return self._group.create_task(coroutine)

    def _became_leader(self, action: BecameLeader) -> None:
        assert self._group is not None
        # After a roll: the old segment leaves the store sessions (all of it is acked,
        # or its unacked appends were ended; its recovery uses its own requests), and
        # appends held back by the drain may go on.
        self._detach()
        self._room_freed = True
        self._segment = action.segment.segment
        for replica in action.segment.copy_set:
            session = self._sessions.get(replica)
            session.attach(self, self._segment)
            self._attached[replica.store_id] = session
        log.info("%s: leading epoch %d on %s", self.stream, action.epoch, action.segment.copy_set)
        self._decided.set()

    def _detach(self) -> None:
        """The open segment leaves the store sessions: its replies go nowhere now."""
        for session in self._attached.values():
            assert self._segment is not None
            session.detach(self, self._segment)
        self._attached.clear()

    def store_event(self, event: LeaderEvent) -> None:
        """A store session's event for this writer's segment (never inside a step).
        The core may refuse the store's answer (`InconsistentReply`): that ends this
        writer, as a failed background loop does, and no other."""
        self._step_from_outside(event)

    def on_time(self) -> None:
        """The client's timers: the core's deadline came (never inside a step)."""
        if not self._closing:
            self._step_from_outside(Tick())

    def session_unbound(self) -> None:
        """The lease session no longer renews this writer's lease (never inside a
        step: the session's renewals are answered in a task of their own)."""
        if not self._closing:
            self._step_from_outside(SessionUnbound())

    def session_attention(self) -> None:
        """The master has something to tell this writer: it heartbeats now."""
        if not self._closing:
            self._step_from_outside(SessionAttention())

    def _step_from_outside(self, event: LeaderEvent) -> None:
        """A step called by the client's shared parts, not by this writer's own tasks:
        a failure of the core ends this writer, reaching its owner, and no other."""
        try:
            self.step(event)
        except Exception as error:  # handed to the writer's owner
            if self._group is None or self._closing:
                log.warning("%s: %r after close: %r", self.stream, event, error)
                return
            self._detach()
            self._spawn(_raise(error))

    def _assigned(self, assigned: Assigned) -> None:
        # Pending from this moment: a step-down from here on must answer it.
        item = self._submitted.popleft()
        item.first_index = assigned.first_index
        item.last_index = assigned.last_index
        item.segment_epoch = assigned.segment_epoch
        self._pending.append(item)

    def _acked(self, acked_index: int) -> None:
        pending = self._pending
        while pending and pending[0].last_index <= acked_index:
            item = pending.popleft()
            if not item.future.done():
                epoch = item.segment_epoch
                item.future.set_result(
                    (pack_sequence(epoch, item.first_index), pack_sequence(epoch, item.last_index))
                )
        self._room_freed = True

    def _timed_out(self, late: AppendsTimedOut) -> None:
        waited = f"{self.stream}: not acknowledged within the append timeout"
        for item in self._pending:
            if item.segment_epoch != late.segment_epoch or item.last_index > late.last_index:
                break
            if not item.future.done():
                item.future.set_exception(
                    AppendTimedOut(
                        f"{waited}; the append may still be written (in doubt): too few "
                        "stores of the copy set answer and no master answers to roll away "
                        "from them",
                        in_doubt=True,
                    )
                )
        for waiting in self._waiting:
            if not waiting.future.done():
                waiting.future.set_exception(
                    AppendTimedOut(
                        f"{waited}; the append waited for room and was never sent",
                        in_doubt=False,
                    )
                )
        self._waiting.clear()

    def _held_timed_out(self, count: int) -> None:
        """The `count` oldest appends held back waited the append timeout."""
        assert count <= len(self._waiting), (count, len(self._waiting))
        for _ in range(count):
            item = self._waiting.popleft()
            if item.marked:
                self._fail_held_producer_batches()
            if not item.future.done():
                item.future.set_exception(
                    AppendTimedOut(
                        f"{self.stream}: not acknowledged within the append timeout; the "
                        "append waited (for room, or for a segment the master did not give) "
                        "and was never sent",
                        in_doubt=False,
                    )
                )

    def _left_unacked(self, left: AppendsLeftUnacked) -> None:
        message = (
            f"{self.stream}: segment {left.segment_epoch} was rolled away from before the "
            "append was acknowledged (too few stores of its copy set could ack)"
        )
        pending = self._pending
        while pending and pending[0].segment_epoch == left.segment_epoch:
            item = pending.popleft()
            if item.future.done():
                continue  # answered already (timed out, or cancelled by its caller)
            if item.first_index > left.sent_through:
                item.future.set_exception(AppendFailed(f"{message}; it reached no store"))
            else:
                item.future.set_exception(
                    AppendInDoubt(f"{message}; it may be durable and then appears after recovery")
                )

    def _stepped_down(self, down: SteppedDown) -> None:
        message = f"{self.stream}: epoch {down.epoch}: {down.reason.value}: {down.message}"
        if down.reason is StepDownReason.REFUSED and self._heartbeat_error is not None:
            self._error = self._heartbeat_error
        elif down.reason is StepDownReason.FENCED:
            self._error = Fenced(message, down.epoch + 1)
        else:
            self._error = LeadershipLost(message)
        if down.reason is not StepDownReason.RELEASED:
            log.warning("%s", message)
        for item in self._pending:
            if item.future.done():
                continue
            if item.first_index > down.sent_through:
                item.future.set_exception(AppendFailed(f"{message}; the append reached no store"))
            else:
                item.future.set_exception(
                    AppendInDoubt(
                        f"{message}; the append may be durable and then appears after recovery"
                    )
                )
        self._pending.clear()
        for waiting in [*self._submitted, *self._waiting]:
            if not waiting.future.done():
                waiting.future.set_exception(AppendFailed(f"{message}; the append was never sent"))
        self._submitted.clear()
        self._waiting.clear()
        self._detach()
        for task in self._recoveries:
            task.cancel()
        self._sealed_changed.set()
        self._decided.set()

    # ---- background loops ----

    async def _heartbeat(self, action: SendHeartbeat) -> None:
        request = master_pb2.WriterHeartbeatRequest(
            stream=self.stream,
            client_id=self.client_id,
            epoch=action.epoch,
            acked_index=action.acked_index,
            segment_bytes=action.segment_bytes,
            lease_secret=self._lease_secret.shown(),
            producer=self._core.producer,
            seen_epoch=action.seen_epoch,
        )
        sent_at = monotonic_ms()
        try:
            reply = await self._leases.heartbeat(
                request, action.timeout_ms / 1000, lambda late: self._late_grant(sent_at, late)
            )
        except grpc.aio.AioRpcError as error:
            log.info("%s: heartbeat failed: %s", self.stream, error.code().name)
            self._heartbeat_error = from_rpc_error(error)
            failure = (
                STREAM_DELETED
                if isinstance(self._heartbeat_error, StreamDeleted)
                else error.code().name
            )
            self.step(HeartbeatFailed(sent_at, failure, error.details() or ""))
            return
        self._lease_secret.learn(reply.lease_secret)
        leader = reply.role == master_pb2.LEADER
        if self._lease_secret.answered_without_it(request.lease_secret, leader):
            self.step(HeartbeatFailed(sent_at, "", "answered before the lease secret came"))
            return
        self.step(heartbeat_answer(sent_at, reply))

    def _late_grant(self, sent_at: int, reply: master_pb2.WriterHeartbeatReply) -> None:
        """A grant answered after its heartbeat was given up on: it carries the only
        copy of the lease secret, so the core hears it all the same (it leads, or, once
        finished, gives the lease back), rather than the lease being granted again
        and again to a writer that never learns it."""
        if self._stepping:
            return  # never a step inside a step (the lease then runs out)
        self._lease_secret.learn(reply.lease_secret)
        self.step(heartbeat_answer(sent_at, reply))

    # ---- sealing earlier segments ----

    async def _roll(self, action: AskRoll) -> None:
        log.info(
            "%s: rolling epoch %d (%s), excluding %s",
            self.stream,
            action.epoch,
            action.reason,
            list(action.exclude_stores),
        )
        request = master_pb2.RollSegmentRequest(
            stream=self.stream,
            client_id=self.client_id,
            epoch=action.epoch,
            exclude_stores=action.exclude_stores,
            grant=action.grant,
            lease_secret=self._lease_secret.shown(),
        )
        sent_at = monotonic_ms()
        try:
            reply = await self._leases.roll(request, action.timeout_ms / 1000)
        except grpc.aio.AioRpcError as error:
            log.info("%s: roll refused: %s %s", self.stream, error.code().name, error.details())
            self.step(RollFailed(f"{error.code().name}: {error.details()}"))
            return
        self._lease_secret.learn(reply.lease_secret)
        self.step(RollAnswered(heartbeat_answer(sent_at, reply)))

    def _start_recovery(self, action: RecoverSegment) -> None:
        task = self._spawn(self._recover(action))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _recover(self, action: RecoverSegment) -> None:
        """Seal and recover one earlier segment for the core's gate."""
        epoch = action.segment.epoch
        log.info("%s: sealing segment %d under epoch %d", self.stream, epoch, action.new_epoch)
        sealer = SegmentSealer(
            self._leases.seal, self._channels, self.client_id, action, self._accept_loss
        )
        try:
            await sealer.run()
        except Fenced as error:
            await sealer.close()
            self.step(FencedByStore(f"recovery of segment {epoch}", error.fence))
            return
        except Exception as error:  # any other failure: the core tries again
            await sealer.close()
            log.warning("%s: recovery of segment %d failed: %r", self.stream, epoch, error)
            self.step(RecoveryFailed(epoch, repr(error)))
            return
        except BaseException:
            await sealer.close()
            raise
        self.step(SegmentSealed(epoch, sealer.runs))
        self._sealed_changed.set()
        await sealer.finish()

    async def wait_sealed(self, timeout_s: float) -> None:
        """Wait until every segment before this writer's own is sealed and recovered
        (until then nothing of its own segment is acked)."""
        self._check_leading()
        async with asyncio.timeout(timeout_s):
            while self._core.statistics().unsealed_epochs:
                self._sealed_changed.clear()
                await self._sealed_changed.wait()
                self._check_leading()

    async def wait_bridged(self, timeout_s: float) -> None:
        """After `wait_sealed`: wait, at most `timeout_s`, for the recoveries to bridge
        every live replica they still owe it (`SegmentSealer.finish`, bounded by
        `RecoveryTiming.late_stores_ms`). The seal needs W of them; an operator's seal
        waits for the rest, so that a `verify` after it finds each at its bridge."""
        recoveries = list(self._recoveries)
        if recoveries:
            await asyncio.wait(recoveries, timeout=timeout_s)

    def _release(self, action: ReleaseLease) -> None:
        """Give the lease of `action.epoch` back, through the session: closing many
        writers one after the other waits for none of their releases."""
        self._leases.release(
            master_pb2.ReleaseLeaseRequest(
                stream=self.stream,
                client_id=self.client_id,
                epoch=action.epoch,
                grant=action.grant,
                lease_secret=self._lease_secret.shown(),
                acked_index=action.acked_index,
            )
        )

    # ---- statistics ----

    def statistics(self) -> WriterStatistics:
        core = self._core.statistics()
        replication = core.replication
        stores = replication.stores if replication else {}
        return WriterStatistics(
            stream=self.stream,
            role=core.role.value,
            epoch=core.epoch,
            last_index=replication.last_index if replication else 0,
            acked_index=replication.acked_index if replication else 0,
            in_flight_bytes=replication.unacked_bytes if replication else 0,
            retained_bytes=replication.retained_bytes if replication else 0,
            matched_index={name: s.matched_index for name, s in stores.items()},
            connected={name: s.connected for name, s in stores.items()},
            detached=tuple(name for name, s in stores.items() if s.detached),
            pending_appends=len(self._pending),
            waiting_appends=len(self._waiting),
            master_silent_s=(
                (monotonic_ms() - core.master_answered_ms) / 1000
                if core.master_answered_ms
                else None
            ),
            unsealed_epochs=core.unsealed_epochs,
        )
