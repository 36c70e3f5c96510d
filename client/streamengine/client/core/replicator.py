"""Pipelined quorum replication of one open segment to its copy set.

Theory of operation. Appends get consecutive indexes from 1 and are held in one buffer.
Every store of the copy set has its own cursor into that buffer (`next_index`) and a
window of in-flight Write requests, each a batch of consecutive entries carrying the
leader's acked index. A store answers each request, in order, with its matched index
(the longest prefix it holds). The acked index is the W-th largest matched index
(`client.core.quorum`); it is told to users (`Acked`) and broadcast to stores on the
next write, or by an empty request on a `Tick` once it is `idle_ack_ms` old and the
store has heard nothing for as long. Never alone in the step of an answer or an
append: an append acked is usually followed by the next at once (the shell runs the
appends an ack wakes before its clock's next tick), whose batch then carries it, and a
store answers one request rather than two.

A store that answers with a matched index below the batch it was sent has a gap (it
dropped or lost something); one that answers REFUSED_BUSY wrote nothing; one that
reconnects may have missed anything in flight. In every case its cursor goes back to
`matched + 1` and the entries are sent again. Replies to requests sent before that
reset say nothing new about the gap and cause no second reset.

Batching: a store with nothing in flight gets what is waiting at once (light load, low
latency); a store with requests in flight gets a batch when it is full or at least
`small_batch_bytes`, or a smaller one once its oldest entry has waited `linger_ms`
while fewer than `partial_in_flight_max` requests are out (otherwise the next reply
lets it go), so batches grow with load and the round trip.

Memory: entries above the acked index ("unacked bytes") are bounded by
`unacked_bytes_max`: the shell asks `room_for` and makes appends wait. Entries at or
below the acked index are kept only for stores still behind; when all kept bytes pass
`retained_bytes_max` the slowest store below the acked index is detached: it gets no
more writes in this segment (`StoreDetached`; the leader rolls to a new copy set).

Acking can be held back (`acking=False` until every earlier segment is sealed) and is
stopped for good by `Stop` (lease lost): then nothing more is acked or sent.

Grants: a store takes writes only under the master's signed grant of the writer's epoch,
shown once per Write stream. The first request sent to a store after it (re)connects
carries the grant (`SendWrite.grant`); the later ones on that stream do not. A grant
expires: when the master renews it (`renew_grant`), the next request to each store
carries the renewed one.

The content digest: every append also feeds the segment's certificate
(`streamengine.protocol.certificate`), computed from the events as the user gave them, before any
store holds them. Once everything assigned is acked (a drained segment about to roll),
`content_digest` hands it to the segment's recovery, which adds the bridge and sends
the certificate with the seal.

Why one long module: one state machine (the buffer, each store's cursor and window,
the acked index) with its events, actions and statistics; every transition names the
messages it takes and gives, so they are read together.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from streamengine.client.core.quorum import QuorumTracker
from streamengine.protocol.certificate import ContentDigest
from streamengine.protocol.entry import (
    EntryKind,
    PackedEntries,
    StoredEntry,
    event_crcs,
    producer_crc,
)
from streamengine.protocol.limits import (
    EVENT_BYTES_MAX,
    INDEX_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
)
from streamengine.protocol.policy import ReplicationPolicy

# Bytes an entry costs beyond its payload on the wire (index, kind, epoch, crc,
# framing): batches are cut by payload plus this, so small events count for something.
ENTRY_OVERHEAD_BYTES = 32
# Bytes an entry kept in this process costs beyond its payload: the bytes object's
# header, its crc object, its slots in the kept lists (`tests/unit/test_replicator.py`
# measures it with tracemalloc; docs/performance.md has the figure). The memory bounds
# (`unacked_bytes_max`, `retained_bytes_max`) count payload plus this.
ENTRY_MEMORY_BYTES = 136
_KEPT_EXTRA_BYTES = ENTRY_MEMORY_BYTES - ENTRY_OVERHEAD_BYTES

# A batch big enough to amortise the CPU each end spends per gRPC message (thousands of
# small events; docs/performance.md, "Writes"), small enough that a store writes it in a few
# milliseconds. Batches this large form only under load: what waits while the window
# is full goes out together.
BATCH_BYTES_MAX = 1 << 20
BATCH_ENTRIES_MAX = WRITE_BATCH_ENTRIES_MAX

# How long an entry may wait for a fuller batch while its store is busy anyway.
LINGER_MS = 2

# In-flight Write requests per store: enough to keep the pipe full at a few ms of
# round trip, few enough that a reset after a gap wastes little, and that appends
# arriving meanwhile wait to go out as one larger batch (under 8 appends in flight, 4
# requests of about 2000 events carry more than 8 of 1000; docs/performance.md,
# "Writes").
WINDOW_BATCHES = 4

# In-flight requests per store beyond which a small batch (under `SMALL_BATCH_BYTES`,
# not cut by a bound) waits for a reply rather than the linger: under moderate load
# batches then grow with the round trip (as in Nagle's algorithm) instead of filling
# the window with tiny ones, which would cost a store its per-message overhead many
# times over. Larger batches use the whole window.
PARTIAL_IN_FLIGHT_MAX = 2
SMALL_BATCH_BYTES = 32 << 10

# Appended but not yet acked: what the writer may owe its users at once. Appends
# wait beyond it.
UNACKED_BYTES_MAX = 16 << 20

# Everything kept for resending, acked or not: a store that is down or slow can be
# caught up from its matched index while this holds; beyond it the slowest store is
# detached rather than memory grown.
RETAINED_BYTES_MAX = 64 << 20

# How long an acked index waits for a write to carry it (and a store's silence) before
# the store is sent it alone, so its readers see the tail even when no new event comes.
# Short, because a reader starting at the end takes the store's acked index as the end;
# long enough that a writer appending again after each ack sends one request per store
# and event, not two: under load every write carries it and no extra request goes out.
IDLE_ACK_MS = 5

# Pause before resending to a store that refused a batch as busy.
BUSY_BACKOFF_MS = 10


@dataclass(frozen=True, slots=True)
class ReplicatorLimits:
    batch_bytes_max: int = BATCH_BYTES_MAX
    batch_entries_max: int = BATCH_ENTRIES_MAX
    linger_ms: int = LINGER_MS
    window_batches: int = WINDOW_BATCHES
    partial_in_flight_max: int = PARTIAL_IN_FLIGHT_MAX
    small_batch_bytes: int = SMALL_BATCH_BYTES
    unacked_bytes_max: int = UNACKED_BYTES_MAX
    retained_bytes_max: int = RETAINED_BYTES_MAX
    idle_ack_ms: int = IDLE_ACK_MS
    busy_backoff_ms: int = BUSY_BACKOFF_MS

    def __post_init__(self) -> None:
        if not 0 < self.batch_bytes_max <= WRITE_BATCH_BYTES_MAX - EVENT_BYTES_MAX:
            # A batch is cut before it passes batch_bytes_max, plus at most one event.
            raise ValueError(f"batch_bytes_max {self.batch_bytes_max} out of range")
        if not 0 < self.batch_entries_max <= WRITE_BATCH_ENTRIES_MAX:
            raise ValueError(f"batch_entries_max {self.batch_entries_max} out of range")
        if self.window_batches < 1 or self.linger_ms < 0 or self.idle_ack_ms < 1:
            raise ValueError("window, linger and idle tick must be positive")
        if self.partial_in_flight_max < 1:
            raise ValueError("partial_in_flight_max must be positive")
        if self.unacked_bytes_max < EVENT_BYTES_MAX + ENTRY_MEMORY_BYTES:
            raise ValueError("unacked_bytes_max must hold the largest event")
        if self.retained_bytes_max < self.unacked_bytes_max:
            raise ValueError("retained_bytes_max must hold every unacked byte")


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """Which segment: the master's `SegmentId`."""

    stream_id: int
    epoch: int
    stream: str


# ---- events ----


@dataclass(frozen=True, slots=True)
class Append:
    """User events, in order; the shell checked `room_for` and the event size.
    `marked`: the first payload is a PRODUCER mark naming the producer sequences of the
    events after it (`streamengine.protocol.entry.ProducerMark`)."""

    payloads: tuple[bytes, ...]
    marked: bool = False
    # When its caller's append timeout runs out, if the shell held it before giving it
    # (a producer's batch waits for its turn): its timeout counts from the call.
    due_ms: int | None = None


@dataclass(frozen=True, slots=True)
class WriteReplied:
    """A store's `WriteReply`."""

    store: str
    request_id: int
    busy: bool  # REFUSED_BUSY: nothing of the batch was written
    matched_index: int
    acked_index: int
    first_index: int = 0
    last_index: int = 0


@dataclass(frozen=True, slots=True)
class WritesReplied:
    """Several `WriteReplied` that came together (one store's message answers many
    requests), in the order they came: one step takes them all, then decides once
    what to ack and send, where a step per answer would decide after each."""

    replies: tuple[WriteReplied, ...]

    def __post_init__(self) -> None:
        assert self.replies, "a batch of answers holds at least one"


@dataclass(frozen=True, slots=True)
class StoreConnected:
    store: str


@dataclass(frozen=True, slots=True)
class StoreDisconnected:
    """The Write stream to `store` ended; whatever was in flight may be lost."""

    store: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: linger, busy back-off and the idle acked broadcast."""


@dataclass(frozen=True, slots=True)
class AllowAcking:
    """Every earlier segment is sealed: the acked index may be told from now on."""


@dataclass(frozen=True, slots=True)
class Flush:
    """Tell every connected store the acked index now (the writer is closing)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Leadership is lost: ack nothing more, send nothing more."""


ReplicatorEvent = (
    Append
    | WriteReplied
    | WritesReplied
    | StoreConnected
    | StoreDisconnected
    | Tick
    | AllowAcking
    | Flush
    | Stop
)

# ---- actions ----


@dataclass(frozen=True, slots=True)
class Assigned:
    """The events of one `Append` got indexes `first_index..last_index` of the segment
    of `segment_epoch` (their sequences are packed with it, whatever rolls later)."""

    first_index: int
    last_index: int
    segment_epoch: int


@dataclass(frozen=True, slots=True)
class SendWrite:
    """Send a `WriteRequest` on the store's Write stream."""

    store: str
    segment: SegmentRef
    writer_epoch: int
    request_id: int
    acked_index: int
    # EVENTs of copy epoch `writer_epoch` from `first_index` on: their payloads and
    # crc32cs, packed by the shell once for every store it sends them to (`batch`).
    first_index: int
    payloads: Sequence[bytes]
    crcs: Sequence[int]
    # The signed grant of `writer_epoch`: on the first request of a Write stream only.
    grant: bytes = b""
    # The indexes among them that are PRODUCER marks, not EVENTs.
    marks: tuple[int, ...] = ()

    @property
    def last_index(self) -> int:
        return self.first_index + len(self.payloads) - 1 if self.payloads else 0

    def batch(self) -> PackedEntries:
        """The entries as the stored values a Write carries (`codec.write_request`)."""
        return PackedEntries.events(
            self.writer_epoch, self.first_index, self.payloads, self.crcs, self.marks
        )

    @property
    def entries(self) -> tuple[StoredEntry, ...]:
        """The entries as objects (tests)."""
        pairs = zip(self.payloads, self.crcs, strict=True)
        marks = self.marks
        return tuple(
            StoredEntry(
                index,
                EntryKind.PRODUCER if index in marks else EntryKind.EVENT,
                self.writer_epoch,
                payload,
                crc,
            )
            for index, (payload, crc) in enumerate(pairs, self.first_index)
        )


@dataclass(frozen=True, slots=True)
class Acked:
    """Every index up to `acked_index` is held by W stores: resolve those appends."""

    segment_epoch: int
    acked_index: int


@dataclass(frozen=True, slots=True)
class StoreDetached:
    """`store` fell too far behind (or lost data): no more writes to it in this segment."""

    store: str
    matched_index: int
    reason: str


ReplicatorAction = Assigned | SendWrite | Acked | StoreDetached


class InconsistentReply(Exception):
    """A store answered what no correct store can hold (the peer broke the protocol,
    not this writer): e.g. more of the segment than was ever sent to anyone."""


class SegmentFull(Exception):
    """The segment's indexes are used up; roll to a new segment."""


@dataclass(slots=True)
class _InFlight:
    request_id: int
    first_index: int
    last_index: int


@dataclass(slots=True)
class _Store:
    connected: bool = False
    # Its stream failed or was refused at least once: a flush no longer waits for it.
    lost: bool = False
    detached: bool = False
    matched: int = 0
    store_acked: int = 0  # what the store last said its acked index is
    next_index: int = 1
    in_flight: deque[_InFlight] = field(default_factory=deque)
    # Replies to requests below this id predate the last reset: no new gap news.
    reset_request_id: int = 0
    busy_until_ms: int = 0
    sent_acked: int = 0
    last_send_ms: int = 0
    # Whether the current Write stream has been sent the grant.
    grant_sent: bool = False


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    connected: bool
    detached: bool
    matched_index: int
    acked_index: int
    in_flight_requests: int


@dataclass(frozen=True, slots=True)
class ReplicatorStatistics:
    segment_epoch: int
    last_index: int
    acked_index: int
    quorum_index: int
    unacked_bytes: int
    retained_bytes: int
    sent_through: int
    stores: dict[str, StoreStatistics]


def events_bytes(payloads: Sequence[bytes]) -> int:
    """What events cost the memory bounds (`room_for`)."""
    return sum(map(len, payloads)) + len(payloads) * ENTRY_MEMORY_BYTES


class Replicator:
    """One open segment's replication state; see the module docstring."""

    def __init__(
        self,
        segment: SegmentRef,
        writer_epoch: int,
        policy: ReplicationPolicy,
        copy_set: Iterable[str],
        limits: ReplicatorLimits | None = None,
        acking: bool = True,
        grant: bytes = b"",
    ) -> None:
        """`grant`: the master's signed grant of `writer_epoch` (see the module doc)."""
        self.segment = segment
        self.writer_epoch = writer_epoch
        self.grant = grant
        self.limits = limits or ReplicatorLimits()
        self._quorum = QuorumTracker(policy, copy_set)
        self._stores: dict[str, _Store] = {store: _Store() for store in self._quorum.copy_set}
        # Kept entries base..last as parallel lists from `_head` on (a list with a moving
        # head slices in C; a deque does not).
        self._payloads: list[bytes] = []
        self._crcs: list[int] = []
        self._cum_bytes: list[int] = []  # bytes of indexes 1..i, for each kept i
        self._appended_ms: list[int] = []
        # The kept indexes that are PRODUCER marks, ascending (one per producer batch).
        self._marks: list[int] = []
        self._head = 0
        self._base = 1  # index of self._payloads[self._head]
        self._last = 0
        self._total_bytes = 0  # bytes of 1..last
        self._payload_bytes = 0
        self._base_cum = 0  # bytes of 1..base-1
        self._acked = 0
        self._acked_cum = 0
        self._acked_ms = 0  # when the acked index last rose
        self._acking = acking
        self._stopped = False
        self._next_request_id = 1
        self._sent_through = 0
        self._content = ContentDigest()

    # ---- queries ----

    @property
    def copy_set(self) -> tuple[str, ...]:
        return self._quorum.copy_set

    @property
    def last_index(self) -> int:
        return self._last

    @property
    def acked_index(self) -> int:
        return self._acked

    @property
    def quorum_index(self) -> int:
        return self._quorum.acked_index

    @property
    def sent_through(self) -> int:
        """Every index any store may hold is at most this (indexes go out in order)."""
        return self._sent_through

    @property
    def unacked_bytes(self) -> int:
        """Memory of the entries above the acked index (`ENTRY_MEMORY_BYTES` each)."""
        return self._total_bytes - self._acked_cum + (self._last - self._acked) * _KEPT_EXTRA_BYTES

    @property
    def retained_bytes(self) -> int:
        """Memory of every entry kept (`ENTRY_MEMORY_BYTES` each)."""
        kept = self._last - self._base + 1
        return self._total_bytes - self._base_cum + kept * _KEPT_EXTRA_BYTES

    @property
    def payload_bytes(self) -> int:
        return self._payload_bytes

    @property
    def stopped(self) -> bool:
        return self._stopped

    def content_digest(self) -> ContentDigest | None:
        """A snapshot of the digest of indexes 1..last, once every one is acked (the
        segment's whole content, bar the bridge its recovery adds); None before."""
        if self._acked != self._last:
            return None
        assert self._content.through_index == self._last
        return self._content.copy()

    def room_for(self, nbytes: int) -> bool:
        """May events of `nbytes` (as `events_bytes` counts them) be appended now? An
        empty buffer always takes one append, however large, so nothing waits forever."""
        unacked = self.unacked_bytes
        return unacked == 0 or unacked + nbytes <= self.limits.unacked_bytes_max

    def flushed(self) -> bool:
        """Does every store hold everything and know the acked index, but those whose
        stream was lost? One still opening its first stream counts: a writer closing
        right after its first appends, while a busy store accepts its connection, would
        otherwise leave that store without the segment until a repair."""
        return all(
            store.matched >= self._last and store.store_acked >= self._acked
            for store in self._stores.values()
            if not store.detached and (store.connected or not store.lost)
        )

    def acked_known_everywhere(self) -> bool:
        """Did every store of the copy set say it knows the acked index?"""
        return all(store.store_acked >= self._acked for store in self._stores.values())

    def deadline_ms(self, now_ms: int) -> int | None:
        """When a `Tick` would next do something, if ever."""
        if self._stopped:
            return None
        deadline: int | None = None
        window = self.limits.window_batches
        for store in self._stores.values():
            if not store.connected or store.detached or len(store.in_flight) >= window:
                continue  # a full window moves on a reply, not on time
            candidates = []
            # (With `partial_in_flight_max` requests out, only a reply moves a partial
            # batch; a full one went out when it filled.)
            partial_may_go = len(store.in_flight) < self.limits.partial_in_flight_max
            if store.next_index <= self._last and partial_may_go:
                when = store.busy_until_ms
                if store.in_flight:
                    appended = self._appended_ms[self._head + store.next_index - self._base]
                    when = max(when, appended + self.limits.linger_ms)
                candidates.append(when)
            if store.sent_acked < self._acked and store.next_index > self._last:
                candidates.append(max(store.busy_until_ms, self._idle_ack_at(store)))
            for candidate in candidates:
                deadline = candidate if deadline is None else min(deadline, candidate)
        return deadline

    def statistics(self) -> ReplicatorStatistics:
        return ReplicatorStatistics(
            segment_epoch=self.segment.epoch,
            last_index=self._last,
            acked_index=self._acked,
            quorum_index=self.quorum_index,
            unacked_bytes=self.unacked_bytes,
            retained_bytes=self.retained_bytes,
            sent_through=self._sent_through,
            stores={
                name: StoreStatistics(
                    store.connected,
                    store.detached,
                    store.matched,
                    store.store_acked,
                    len(store.in_flight),
                )
                for name, store in self._stores.items()
            },
        )

    # ---- the step function ----

    def renew_grant(self, grant: bytes) -> None:
        """The master renewed the grant of `writer_epoch`: every store is shown the
        renewed one with its next request, before the one it holds expires."""
        assert grant
        if grant != self.grant:
            self.grant = grant
            for store in self._stores.values():
                store.grant_sent = False

    def step(self, now_ms: int, event: ReplicatorEvent) -> list[ReplicatorAction]:
        actions: list[ReplicatorAction] = []
        if isinstance(event, Append):
            actions.append(self._append(now_ms, event.payloads, event.marked))
        elif isinstance(event, WriteReplied):
            self._on_reply(now_ms, event)
        elif isinstance(event, WritesReplied):
            for reply in event.replies:
                self._on_reply(now_ms, reply)
        elif isinstance(event, StoreConnected):
            store = self._stores[event.store]
            store.connected = True
            store.next_index = store.matched + 1
            store.reset_request_id = self._next_request_id
            store.busy_until_ms = 0
            # A new stream knows nothing of what was broadcast on the old one, nor of
            # the grant.
            store.sent_acked = 0
            store.grant_sent = False
        elif isinstance(event, StoreDisconnected):
            store = self._stores[event.store]
            store.connected = False
            store.lost = True
            store.in_flight.clear()
        elif isinstance(event, AllowAcking):
            self._acking = True
        elif isinstance(event, Stop):
            self._stopped = True
            return actions
        elif not isinstance(event, Tick | Flush):
            raise TypeError(f"unknown event {event!r}")
        if self._stopped:
            return actions
        if not isinstance(event, Append):  # an append changes no matched or acked index
            self._advance_acked(now_ms, actions)
            self._trim(actions)
        # The acked index goes alone at once on a Flush, when idle on a Tick.
        ack_alone = isinstance(event, Flush | Tick)
        force_ack = isinstance(event, Flush)
        for name, store in self._stores.items():
            self._pump(now_ms, name, store, actions, ack_alone, force_ack)
        return actions

    # ---- internals ----

    def _append(self, now_ms: int, payloads: tuple[bytes, ...], marked: bool = False) -> Assigned:
        if self._stopped:
            raise RuntimeError("append to a stopped replicator")
        if not payloads:
            raise ValueError("an append needs at least one event")
        if self._last + len(payloads) > INDEX_MAX:
            raise SegmentFull(f"segment {self.segment.epoch} is out of indexes")
        first = self._last + 1
        total = self._total_bytes
        self._payload_bytes += sum(map(len, payloads))
        self._payloads += payloads
        self._crcs += event_crcs(self.writer_epoch, first, payloads)
        if marked:
            self._crcs[-len(payloads)] = producer_crc(self.writer_epoch, first, payloads[0])
            self._marks.append(first)
        cum_bytes = self._cum_bytes
        for payload in payloads:
            total += len(payload) + ENTRY_OVERHEAD_BYTES
            cum_bytes.append(total)
        self._appended_ms.extend([now_ms] * len(payloads))
        if marked:
            kinds = bytes((EntryKind.PRODUCER,)) + bytes((EntryKind.EVENT,)) * (len(payloads) - 1)
            self._content.add_run(first, kinds, payloads)
        else:
            self._content.add_events(first, payloads)
        self._total_bytes = total
        self._last = first + len(payloads) - 1
        return Assigned(first, self._last, self.segment.epoch)

    def _on_reply(self, now_ms: int, reply: WriteReplied) -> None:
        store = self._stores[reply.store]
        if not store.connected:
            return  # an answer from a stream already given up on
        if reply.matched_index > self._sent_through:
            raise InconsistentReply(
                f"{reply.store} says it holds {reply.matched_index} of segment "
                f"{self.segment.epoch}; only {self._sent_through} was ever sent"
            )
        while store.in_flight and store.in_flight[0].request_id <= reply.request_id:
            store.in_flight.popleft()
        store.store_acked = max(store.store_acked, reply.acked_index)
        lost_data = reply.matched_index < store.matched
        store.matched = reply.matched_index
        self._quorum.update(reply.store, reply.matched_index)
        assert store.matched <= self._sent_through, (
            f"{reply.store} holds {store.matched} of a segment sent only to {self._sent_through}"
        )
        fresh = reply.request_id >= store.reset_request_id
        gap = reply.last_index > 0 and reply.matched_index < reply.last_index
        if lost_data or (fresh and (reply.busy or gap)):
            store.next_index = reply.matched_index + 1
            store.reset_request_id = self._next_request_id
            if reply.busy:
                store.busy_until_ms = now_ms + self.limits.busy_backoff_ms
        store.next_index = max(store.next_index, reply.matched_index + 1)

    def _advance_acked(self, now_ms: int, actions: list[ReplicatorAction]) -> None:
        if not self._acking:
            return
        quorum = min(self._quorum.acked_index, self._last)
        if quorum <= self._acked:
            return
        assert self._acked < quorum <= self._sent_through <= self._last
        self._acked_cum = self._cum_bytes[self._head + quorum - self._base]
        self._acked = quorum
        self._acked_ms = now_ms
        actions.append(Acked(self.segment.epoch, quorum))

    def _attached(self) -> list[_Store]:
        return [store for store in self._stores.values() if not store.detached]

    def _trim(self, actions: list[ReplicatorAction]) -> None:
        while self.retained_bytes > self.limits.retained_bytes_max:
            behind = [
                (store.matched, name)
                for name, store in self._stores.items()
                if not store.detached and store.matched < self._acked
            ]
            if not behind:
                break
            _, name = min(behind)
            self._detach(name, "too far behind: resend buffer full", actions)
        self._drop_through(min([self._acked, *(s.matched for s in self._attached())]))
        for name, store in self._stores.items():
            if not store.detached and store.next_index < self._base:
                self._detach(name, "lost entries no longer kept", actions)

    def _detach(self, name: str, reason: str, actions: list[ReplicatorAction]) -> None:
        store = self._stores[name]
        store.detached = True
        store.in_flight.clear()
        actions.append(StoreDetached(name, store.matched, reason))
        self._drop_through(min([self._acked, *(s.matched for s in self._attached())]))

    def _drop_through(self, index: int) -> None:
        if index < self._base:
            return
        drop = index - self._base + 1
        self._base_cum = self._cum_bytes[self._head + drop - 1]
        self._head += drop
        self._base = index + 1
        if self._marks and self._marks[0] < self._base:
            del self._marks[: bisect.bisect_left(self._marks, self._base)]
        if self._head > 4096 and self._head * 2 > len(self._payloads):
            del self._payloads[: self._head]
            del self._crcs[: self._head]
            del self._cum_bytes[: self._head]
            del self._appended_ms[: self._head]
            self._head = 0

    def _pump(
        self,
        now_ms: int,
        name: str,
        store: _Store,
        actions: list[ReplicatorAction],
        ack_alone: bool,
        force_ack: bool,
    ) -> None:
        if not store.connected or store.detached or now_ms < store.busy_until_ms:
            return
        limits = self.limits
        while len(store.in_flight) < limits.window_batches and store.next_index <= self._last:
            first = store.next_index
            start = self._head + first - self._base
            end_all = self._head + self._last - self._base + 1
            # Cut the batch where its bytes would pass the bound (at least one entry).
            budget = self._cum_bytes[start] - self._entry_size(start) + limits.batch_bytes_max
            end = bisect.bisect_right(self._cum_bytes, budget, start + 1, end_all)
            end = min(end, start + limits.batch_entries_max)
            batch_bytes = (
                self._cum_bytes[end - 1] - self._cum_bytes[start] + self._entry_size(start)
            )
            small = (
                end == end_all
                and end - start < limits.batch_entries_max
                and batch_bytes < limits.small_batch_bytes
            )
            if small and store.in_flight:  # wait for company?
                waited_ms = now_ms - self._appended_ms[start]
                in_flight = len(store.in_flight)
                if in_flight >= limits.partial_in_flight_max or waited_ms < limits.linger_ms:
                    break
            self._send(
                now_ms,
                name,
                store,
                first,
                self._payloads[start:end],
                self._crcs[start:end],
                actions,
            )
        if (
            len(store.in_flight) < limits.window_batches
            and store.sent_acked < self._acked
            and ack_alone
            and (force_ack or self._idle(store, now_ms))
        ):
            self._send(now_ms, name, store, 0, (), (), actions)

    def _idle(self, store: _Store, now_ms: int) -> bool:
        """Is the acked index due to go alone to `store`? Not while a batch waits to go
        (it carries it, within `linger_ms` or at the next reply)."""
        return store.next_index > self._last and now_ms >= self._idle_ack_at(store)

    def _idle_ack_at(self, store: _Store) -> int:
        """When `store` is sent the acked index alone if no write carries it first."""
        return max(store.last_send_ms, self._acked_ms) + self.limits.idle_ack_ms

    def _entry_size(self, position: int) -> int:
        before = self._base_cum if position == self._head else self._cum_bytes[position - 1]
        return self._cum_bytes[position] - before

    def _send(
        self,
        now_ms: int,
        name: str,
        store: _Store,
        first_index: int,
        payloads: Sequence[bytes],
        crcs: Sequence[int],
        actions: list[ReplicatorAction],
    ) -> None:
        assert not self._stopped, "a stopped replicator sends nothing"
        assert store.next_index <= self._last + 1 and self._acked <= self._last
        request_id = self._next_request_id
        self._next_request_id += 1
        grant = b"" if store.grant_sent else self.grant
        store.grant_sent = True
        marks: tuple[int, ...] = ()
        if self._marks and payloads:
            low = bisect.bisect_left(self._marks, first_index)
            high = bisect.bisect_left(self._marks, first_index + len(payloads))
            marks = tuple(self._marks[low:high])
        action = SendWrite(
            name,
            self.segment,
            self.writer_epoch,
            request_id,
            self._acked,
            first_index,
            payloads,
            crcs,
            grant,
            marks,
        )
        if payloads:
            store.next_index = action.last_index + 1
            self._sent_through = max(self._sent_through, action.last_index)
        store.in_flight.append(_InFlight(request_id, action.first_index, action.last_index))
        store.sent_acked = self._acked
        store.last_send_ms = now_ms
        actions.append(action)
