"""A reader's cursor along a stream: position, segment hops, replica choice.

Theory of operation. A stream is a list of segments ordered by epoch (the master's
list). The cursor holds a position `(epoch, next index)` and reads one segment at a
time from one replica of its copy set. Stores serve only acked entries, so what a
replica sends is final: the cursor yields EVENTs, skips HOLEs, and on a BRIDGE hops to
the next segment of the list. A sealed segment is complete on a replica whose acked
index reached the bridge (the master's final index); a replica that stops short of it
(it missed the bridge, or died) is left for another replica, resuming at the position.

Failures and data loss (the rules live in `streamengine.client.core.replicas`): a replica that
cannot be asked (unreachable, silent, disconnected) is retried with a doubling backoff
and says nothing about what it holds; a replica's *answer* (its acked index, NOT_FOUND as
acked 0) does. `DataLoss` is reported for a sealed segment only when the master lists no
replica for it, or every listed replica answered that it serves less than the position
and a list fetched after those answers still names only them. Until then the cursor
answers `Wait(until_ms)`: re-read the master's list at `until_ms` and ask again. An
answer counts only on a read begun once the list said sealed: one begun before may carry
what the replica held while the segment was open, however late it arrives.

A bounded read (an `end`) promises every acked event of its range, or an error, never a
short answer: when its position has not moved for `FollowerTiming.unreachable_read_ms`
and every replica that may serve it failed since its latest answer, the cursor answers
`Unreachable`, naming them (the shell raises Unavailable); a subscription waits on. The
end of a read "to the acked end" is decided here too (`acked_end`): from what the open
segment's replicas answer, never from the master's figure alone; while none answers,
they are asked again, for as long as a read waits for its replicas.

Certificates. A segment the master lists sealed with a certificate
(`streamengine.protocol.certificate`) is read chunk by chunk: a read starts at the first index of
the chunk holding the position (`read_from_index`), what arrives is held back until its
chunk is complete and matches the certificate (`ChunkCheck`), and only then handed out
(entries before the position are dropped). Every entry's crc32c is checked as it arrives
(by the shell), so a flipped bit stops a replica at once; the chunk digest catches what
a valid crc cannot (a stale copy, an index missing or extra, a crc collision) before any
of that chunk leaves the cursor. A replica whose chunk differs is damaged for this
reader (`ReplicaSet.damaged`): another replica is read from that chunk's first index,
and the replica is reported to the master (`take_reports`), which has its store check
it. A live tail of a segment still open has no certificate yet: crc32c alone guards
it, as the acked entries it serves come straight from the leader's quorum. A replica
that answers with its bridge in a segment the list held shows open says the list is
older than the seal: nothing more of it is handed out until the list is read again
(`on_position`, `Wait.relist`), as its copies are at rest, where only the
certificate tells a forged one.

Time is an input. While tailing, the cursor also decides when the tailed replica is
silent (`FollowerTiming.silent_replica_ms` without entries, a position or a keepalive:
a failure) and when to re-read the master's list (`refresh_due`); `wake_at_ms` says
when to ask it again if nothing arrives. Every wait is a field of `FollowerTiming`, so
the SDK and tests that want short waits (`FollowerTiming.fast()`) run the same decisions.

The shell (`streamengine.client.subscription`, which the simulator runs too) feeds it
the master's segment list, what replicas answer, and failures, with the time; the
cursor answers what to read next.

Why one long module: the cursor, its decisions (`ReadFrom`, `Wait`, `Finished`,
`DataLoss`, `Unreachable`) and the runs it takes are one state machine, read together;
the replica rules it shares with Spark are apart, in `client.core.replicas`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from streamengine.client.core.replicas import (
    Ask,
    FollowerTiming,
    Lost,
    Relist,
    ReplicaSet,
    WaitUntil,
)
from streamengine.protocol.certificate import Certificate, CertificateMismatch, ChunkCheck
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.limits import EPOCH_MAX, INDEX_MAX
from streamengine.protocol.sequence import SEQUENCE_MAX, pack_sequence, unpack_sequence

# Entries a subscriber asks per pushed batch: large batches are the follower's hot path
# (one message, one crc pass, one list of events per batch).
SUBSCRIBE_BATCH_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class SegmentView:
    """A segment as the master lists it."""

    epoch: int
    replicas: tuple[str, ...]
    sealed: bool
    final_index: int  # the BRIDGE once sealed, else 0
    # Sealed: what it must contain (None while none is known, or not listed with chunks).
    certificate: Certificate | None = None
    # Replicas the master knows to differ from the certificate.
    bad: tuple[str, ...] = ()
    # Sealed accepting loss: from this index to the segment's end, acked events may be
    # lost (0: none); past the bridge too, since the lost replicas may have held acked
    # events there. Nothing of that range is handed out; a reader reaching it gets
    # `DataLoss(accepted=True)`.
    lost_from_index: int = 0
    # The largest acked index the master knows for the segment: its leader's latest
    # report, or the highest its stores gave in their heartbeats (status: it trails).
    acked_index: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """Tell the master that `replica` served segment `epoch` wrong (`problem`)."""

    epoch: int
    replica: str
    problem: str


@dataclass(slots=True)
class StreamEvent:
    """An acked event handed to the user (not a core input event). Not frozen: one is
    made per event read, and a frozen dataclass costs three times as much to build.
    `stream` names its stream when one subscription follows many
    (`StreamClient.subscribe_many`), else it is ""."""

    sequence: int
    epoch: int
    index: int
    payload: bytes
    stream: str = ""


@dataclass(frozen=True, slots=True)
class ReadFrom:
    """Tail `epoch` on `replica` from `from_index` on. `attempt` numbers the reads the
    cursor started: a shell goes on with its read while `Cursor.continues` says so."""

    epoch: int
    replica: str
    from_index: int
    attempt: int = field(default=0, compare=False)
    # The cursor checks what this read brings against the segment's certificate, so
    # the store need not check each copy's crc32c first (`ReadRequest.reader_verifies`).
    checked: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to read now: re-read the master's list at `until_ms` (a later segment may
    be listed, a copy set may have changed, a failed replica's backoff ends) and ask
    again. `until_ms` may be in the past: refresh at once. `relist`: a replica's bridge
    showed the list held stale, and only a list read now answers (a summary found
    unchanged does not)."""

    until_ms: int
    relist: bool = False


@dataclass(frozen=True, slots=True)
class Finished:
    """The requested range is read."""


@dataclass(frozen=True, slots=True)
class DataLoss:
    """No replica can serve `first_index..last_index` of segment `epoch`; `accepted`:
    an operator sealed the segment accepting that loss (`SegmentView.lost_from_index`),
    and the loss runs from `first_index` to the segment's end, past its bridge
    (`last_index`) too: what the lost replicas held there is gone as well."""

    epoch: int
    first_index: int
    last_index: int
    accepted: bool = False

    def covers(self, epoch: int, index: int) -> bool:
        """Whether an event at `index` of segment `epoch` falls in the lost range."""
        if epoch != self.epoch or index < self.first_index:
            return False
        return self.accepted or index <= self.last_index

    @property
    def resume_sequence(self) -> int:
        return resume_past_loss(self.epoch, self.last_index, self.accepted)


def resume_past_loss(epoch: int, last_index: int, accepted: bool) -> int:
    """Where a reader goes on past a data loss: after its range, or, for an accepted
    loss (which runs to the segment's end), at the first position of any later segment."""
    if accepted:
        return pack_sequence(epoch + 1, 0) if epoch < EPOCH_MAX else SEQUENCE_MAX
    return pack_sequence(epoch, last_index + 1)


@dataclass(frozen=True, slots=True)
class Unreachable:
    """A bounded read cannot go on: no replica of segment `epoch` it tried (`stores`)
    could be read, or told its acked index (`acked_end`), for `waited_ms`."""

    epoch: int
    stores: tuple[str, ...]
    waited_ms: int
    # The replicas said the segment is sealed, and the master, whose list has its
    # certificate, did not answer.
    master_silent: bool = False

    def describe(self, stream: str) -> str:
        if self.master_silent:
            return (
                f"{stream}: segment {self.epoch} is sealed on its replicas and the master "
                f"did not list its certificate for {self.waited_ms / 1000:.0f} s"
            )
        stores = ", ".join(self.stores) or "none listed"
        return (
            f"{stream}: no replica of segment {self.epoch} answered for "
            f"{self.waited_ms / 1000:.0f} s ({stores})"
        )


Next = ReadFrom | Wait | Finished | DataLoss | Unreachable


@dataclass(frozen=True, slots=True)
class Asked:
    """What the replicas of an open segment answered for its acked index (in copy-set
    order; None: no answer), at `now_ms`, asked first at `first_ms`."""

    answers: Sequence[int | None]
    first_ms: int
    now_ms: int


def acked_end(last: SegmentView, asked: Asked, timing: FollowerTiming) -> int | Wait | Unreachable:
    """The sequence just past the last acked event of a stream whose latest listed
    segment is `last` (`open_acked_index`; none asked once it is sealed)."""
    if last.sealed:
        return pack_sequence(last.epoch + 1, 0)
    acked = open_acked_index(last.epoch, last.replicas, last.acked_index, asked, timing)
    return acked if not isinstance(acked, int) else pack_sequence(last.epoch, acked + 1)


def open_acked_index(
    epoch: int,
    replicas: tuple[str, ...],
    master_acked: int,
    asked: Asked,
    timing: FollowerTiming,
) -> int | Wait | Unreachable:
    """The acked index of open segment `epoch`: the largest of its replicas' answers
    and the master's figure. With no answer at all it is unknown (the master's figure
    trails the leader's, so a read ending there could end short without a word): ask
    again at `Wait.until_ms` (the stores may be restarting) until a read gives up on
    its replicas (`FollowerTiming.unreachable_read_ms`), then `Unreachable`."""
    assert len(asked.answers) == len(replicas)
    known = [acked for acked in asked.answers if acked is not None]
    if known:
        return max(master_acked, *known)
    waited_ms = asked.now_ms - asked.first_ms
    if waited_ms >= timing.unreachable_read_ms:
        return Unreachable(epoch, replicas, waited_ms)
    return Wait(asked.now_ms + timing.segment_refresh_ms)


class Run(Protocol):
    """Consecutive entries from `first_index` as a replica served them, each entry's
    crc32c verified (by the shell, or by the store for packed reads): a pushed batch's
    columns (`ListRun`) or a packed reply (`streamengine.client.packed`), never an object per
    entry."""

    @property
    def first_index(self) -> int: ...

    @property
    def kinds(self) -> bytes:
        """One byte per entry: its `EntryKind`."""
        ...

    def feed(self, check: ChunkCheck) -> int:
        """Feed the certificate check the whole run; its `verified_through`."""
        ...


@dataclass(frozen=True, slots=True)
class ListRun:
    """A run as columns of Python values (a pushed batch, or the simulator's)."""

    first_index: int
    kinds: bytes
    payloads: Sequence[bytes]

    def feed(self, check: ChunkCheck) -> int:
        return check.feed(self.first_index, self.kinds, self.payloads)


@dataclass(frozen=True, slots=True)
class Released:
    """Entries `start..stop-1` (positions in `run`) of segment `epoch` are verified and
    at the position: its EVENTs go to the reader, its HOLEs are skipped (`kinds`)."""

    epoch: int
    run: Run
    start: int
    stop: int

    @property
    def first_index(self) -> int:
        return self.run.first_index + self.start

    def pieces(self, most: int) -> Iterator[Released]:
        """This release as consecutive releases of at most `most` entries each."""
        for start in range(self.start, self.stop, most):
            yield Released(self.epoch, self.run, start, min(start + most, self.stop))

    @property
    def all_events(self) -> bool:
        return self.run.kinds.count(_EVENT, self.start, self.stop) == self.stop - self.start

    def events(self, payloads: Sequence[bytes], stream: str = "") -> list[StreamEvent]:
        """The events, given the run's payloads `start..stop-1` (as Python bytes), each
        tagged with `stream` (`StreamEvent.stream`)."""
        epoch, first = self.epoch, self.first_index
        base = pack_sequence(epoch, first)
        if self.all_events:
            return [
                StreamEvent(base + i, epoch, first + i, payload, stream)
                for i, payload in enumerate(payloads)
            ]
        kinds = self.run.kinds[self.start : self.stop]
        return [
            StreamEvent(base + i, epoch, first + i, payloads[i], stream)
            for i in range(len(kinds))
            if kinds[i] == EntryKind.EVENT
        ]


_EVENT = bytes([EntryKind.EVENT])
_BRIDGE = bytes([EntryKind.BRIDGE])


class Cursor:
    """Position of one reader; `start` inclusive, `end` exclusive (None: forever)."""

    def __init__(
        self,
        start_sequence: int,
        end_sequence: int | None = None,
        timing: FollowerTiming | None = None,
    ) -> None:
        epoch, index = unpack_sequence(start_sequence)
        self.timing = timing or FollowerTiming()
        self._epoch = epoch
        self._next_index = max(index, 1)
        self._end = end_sequence
        self._segments: list[SegmentView] = []
        self._replicas: dict[int, ReplicaSet] = {}
        self._replica: str | None = None
        self._last_progress_ms = 0
        # When the current replica last served entries (a position is not an advance).
        self._last_served_ms = 0
        self._last_heard_ms = 0
        self._last_listed_ms = 0
        # The master did not answer the list `_list_failures` times in a row: the next
        # try waits until `_list_retry_at_ms` (the replicas' backoff rule).
        self._list_failures = 0
        self._list_retry_at_ms = 0
        self._last_yielded: int | None = None
        # The certificate check of what the current replica sends (sealed, certified
        # segments), and the runs that arrived but are not verified yet: what of them
        # is at or after `_held_first`.
        self._check: ChunkCheck | None = None
        self._held_first = 0
        self._held: list[Run] = []
        self._reports: list[ReplicaReport] = []
        self._attempts = 0  # reads started (`ReadFrom.attempt`)
        # Whether the current read began once the master listed its segment sealed:
        # only then is what it answers about the replica's end (`on_position`).
        self._read_began_sealed = False
        # When the position last moved (or the first `next`): a bounded read gives up
        # `timing.unreachable_read_ms` after it while no replica can be read.
        self._advanced_ms: int | None = None
        # A replica said it holds the bridge of this segment, which the list held shows
        # open: the list is older than the seal, and what the replica holds is at rest,
        # which only the certificate guards. Nothing is read of it until a list read
        # since says (`_relisted_for_seal`).
        self._relist_for_seal = 0
        # Segments a list read after a replica's bridge still showed open (a seal the
        # master has not recorded yet, with no certificate to check): read under crc32c.
        self._open_though_bridged: set[int] = set()

    # ---- inputs ----

    def on_segments(self, segments: Sequence[SegmentView], now_ms: int) -> None:
        """The master's list, oldest first (a refresh replaces the previous one)."""
        self._last_listed_ms = max(self._last_listed_ms, now_ms)
        self._list_failures = 0
        self._list_retry_at_ms = 0
        self._segments = sorted(segments, key=lambda s: s.epoch)
        self._relisted_for_seal()
        for segment in self._segments:
            replicas = self._replicas.get(segment.epoch)
            if replicas is not None:
                replicas.list_refreshed()
                if segment.sealed:
                    replicas.segment_sealed()
        current = self._current_segment()
        if (
            current is not None
            and self._check is not None
            and self._check.certificate != current.certificate
        ):
            self._leave_replica()  # another certificate: read the chunk again under it
        if current is None:
            later = [s for s in self._segments if s.epoch > self._epoch]
            if later:
                self._enter(later[0].epoch)
        elif current.sealed and self._next_index > current.final_index:
            if 0 < current.lost_from_index <= self._next_index:
                # Read past the bridge on a replica since lost: what it held there may
                # have been acked and is lost too, which `next` tells (`DataLoss`).
                return
            self._hop()
            self._advanced_ms = now_ms

    def on_position(
        self, epoch: int, replica: str, acked_index: int, now_ms: int, bridge_index: int = 0
    ) -> None:
        """`replica` answered that it serves `epoch` up to `acked_index` (a Subscribe
        POSITION, a Read's first reply; a NOT_FOUND for the segment is
        `acked_index=0`), holding an acked bridge at `bridge_index` (0: none)."""
        if epoch != self._epoch:
            return
        if self._bridge_unlisted(bridge_index):
            self._relist_for_seal = epoch
            self._leave_replica()
            return
        replicas = self._replicas_of(epoch)
        current = self._current_segment()
        sealed = current is not None and current.sealed
        if replica == self._replica and sealed and not self._read_began_sealed:
            # The store may have made this answer before the segment was sealed (a slow
            # stream delivers it late), when it held less than it does now: a lower
            # bound, as served entries are. Taking it for an answer once made a reader
            # declare data loss on the only replica, whose bridge followed on the same
            # stream (simulator seeds 10268, 10473).
            replicas.served(replica, acked_index)
        else:
            replicas.answered(replica, acked_index)
        if acked_index >= self._next_index:
            # Only an answer that holds what the reader needs next is progress: a
            # replica lost with a wiped store answers NOT_FOUND (0) at once and for
            # good, and counted as progress it held a follower of a sealed segment
            # on it, asking again and again (simulator seed 49).
            self._last_progress_ms = max(self._last_progress_ms, now_ms)
        if replica == self._replica:
            self._last_heard_ms = max(self._last_heard_ms, now_ms)

    def on_call_started(self, epoch: int) -> None:
        """The shell asked the current replica of `epoch` anew (a new call of the same
        read, not one started ahead): what it answers now is made after what the list
        says, so a segment listed sealed makes its answer one about the replica's end
        (`on_position`): a replica that holds nothing of it is left at once."""
        current = self._current_segment()
        if epoch == self._epoch and current is not None and self._replica is not None:
            self._read_began_sealed = current.sealed

    def on_list_unchanged(self, now_ms: int) -> None:
        """The master's summary of the stream (its segments added, sealed, trimmed) is
        what it was when the list held was read: the timed refresh (`refresh_due`) waits
        on. Not a list: data loss still waits for a list read after the replicas'
        answers (`ReplicaSet.list_refreshed`), which this is not."""
        self._last_listed_ms = max(self._last_listed_ms, now_ms)

    def on_list_failed(self, now_ms: int) -> None:
        """The master did not answer the list (restarting, unreachable): keep reading
        with the list held, and ask again after a backoff. Data loss is never decided
        on a list older than the replicas' answers, so this delays it, never causes it."""
        self._list_failures += 1
        self._list_retry_at_ms = now_ms + self.timing.retry_delay_ms(self._list_failures)

    def on_delivered(self, now_ms: int) -> None:
        """The consumer took the events handed to it only now. Nothing was read from the
        replica meanwhile, so that time is the consumer's, not the replica's silence (a
        stalled consumer is dropped by the store and resumes on the same replica)."""
        self._last_heard_ms = max(self._last_heard_ms, now_ms)
        self._last_served_ms = max(self._last_served_ms, now_ms)

    def on_keepalive(self, epoch: int, replica: str, now_ms: int) -> None:
        """The tailed replica is alive, with nothing new to send."""
        if epoch == self._epoch and replica == self._replica:
            self._last_heard_ms = max(self._last_heard_ms, now_ms)

    def on_entries(
        self, epoch: int, entries: Sequence[StoredEntry], now_ms: int
    ) -> list[StreamEvent]:
        """Entries a replica served for `epoch`, consecutive and in index order."""
        if not entries:
            return []
        return self.on_batch(
            epoch,
            entries[0].index,
            [int(e.kind) for e in entries],
            [e.payload for e in entries],
            now_ms,
        )

    def on_batch(
        self,
        epoch: int,
        first_index: int,
        kinds: Sequence[int],
        payloads: Sequence[bytes],
        now_ms: int,
    ) -> list[StreamEvent]:
        """`on_run` over columns of Python values, as events."""
        run = ListRun(first_index, bytes(kinds), payloads)
        events: list[StreamEvent] = []
        for released in self.on_run(epoch, run, now_ms):
            held = released.run
            assert isinstance(held, ListRun)
            events.extend(released.events(held.payloads[released.start : released.stop]))
        return events

    def on_run(self, epoch: int, run: Run, now_ms: int) -> list[Released]:
        """A run the current replica served for `epoch`: consecutive indexes, each
        entry's crc32c checked. Returns what to hand out, in order; entries at or below
        the position (a resend) are ignored, a HOLE is skipped, a BRIDGE hops to the next
        segment. Under a certificate, entries are held back until their chunk verified
        (module docstring)."""
        count = len(run.kinds)
        if epoch != self._epoch or not count or epoch == self._relist_for_seal:
            return []
        self._last_progress_ms = max(self._last_progress_ms, now_ms)
        self._last_served_ms = max(self._last_served_ms, now_ms)
        self._last_heard_ms = max(self._last_heard_ms, now_ms)
        if self._replica is not None:
            self._replicas_of(epoch).served(self._replica, run.first_index + count - 1)
        position = self.position
        if self._check is not None:
            ready = self._checked(epoch, run)
        else:
            released = self._release(epoch, run, 0, count)
            ready = [released] if released is not None else []
        if self.position != position:
            self._advanced_ms = now_ms
        return ready

    def _checked(self, epoch: int, run: Run) -> list[Released]:
        """Feed the certificate check; hand on what it verified."""
        check = self._check
        assert check is not None
        mismatch: CertificateMismatch | None = None
        try:
            verified = run.feed(check)
        except CertificateMismatch as error:
            # The chunks before the one that differs verified: they leave (else a run
            # spanning both would be read again from the same replica, for ever).
            verified, mismatch = check.verified_through, error
        self._held.append(run)
        ready = self._verified(epoch, check, verified) if verified >= self._held_first else []
        if mismatch is not None and self._check is check:
            self._damaged(mismatch.first_index, f"segment {epoch}: {mismatch}")
        return ready

    def _verified(self, epoch: int, check: ChunkCheck, verified: int) -> list[Released]:
        """Release the held runs through index `verified`."""
        ready: list[Released] = []
        keep: list[Run] = []
        for held in self._held:
            last = held.first_index + len(held.kinds) - 1
            start = max(self._held_first, held.first_index) - held.first_index
            stop = min(verified, last) - held.first_index + 1
            if start < stop and self._epoch == epoch:  # not hopped past yet
                released = self._release(epoch, held, start, stop)
                if released is not None:
                    ready.append(released)
            if last > verified:
                keep.append(held)
        if self._check is check:  # still reading this replica's segment (no hop)
            self._held = keep
            self._held_first = verified + 1
            if check.done:
                self._check = None
                self._held = []
        return ready

    def _release(self, epoch: int, run: Run, start: int, stop: int) -> Released | None:
        """Positions `start..stop-1` of `run` are known good: what of them to hand out."""
        first_index = run.first_index
        skip = self._next_index - first_index
        if skip < start:
            raise ValueError(
                f"segment {epoch}: replica skipped from {self._next_index} to {first_index + start}"
            )
        lost_from = self._lost_from_index(epoch)
        if lost_from:
            stop = min(stop, max(skip, lost_from - first_index))
        if self._end is not None:
            end_epoch, end_index = unpack_sequence(self._end)
            if epoch == end_epoch:
                stop = min(stop, max(skip, end_index - first_index))
            elif epoch > end_epoch:
                stop = skip
        if skip >= stop:
            return None
        bridge_at = run.kinds.find(_BRIDGE, skip, stop)
        if bridge_at >= 0:
            stop = bridge_at
        released = None
        if stop > skip:
            self._next_index = first_index + stop
            released = Released(epoch, run, skip, stop)
            last_event = run.kinds.rfind(_EVENT, skip, stop)
            if last_event >= 0:
                self._last_yielded = pack_sequence(epoch, first_index + last_event)
        if bridge_at >= 0:
            self._hop()
        return released

    def on_replica_failed(self, epoch: int, replica: str, now_ms: int) -> None:
        """The replica could not be asked (unreachable, silent, disconnected): it is
        retried after a backoff; this says nothing of what it holds."""
        if epoch == self._epoch:
            self._replicas_of(epoch).failed(replica, now_ms)
            if self._replica == replica:
                self._leave_replica()

    def on_replica_damaged(self, epoch: int, replica: str, problem: str) -> None:
        """The replica cannot serve the range being read: it failed the read with
        DATA_LOSS, or sent an entry whose crc32c does not verify. Damage is an answer
        (`ReplicaSet.damaged`), and the master hears of it."""
        if epoch == self._epoch and replica == self._replica:
            self._damaged(self.read_from_index, f"segment {epoch}: {problem}")

    @property
    def reports_pending(self) -> bool:
        return bool(self._reports)

    def take_reports(self) -> list[ReplicaReport]:
        """Replicas to report to the master, once each."""
        reports, self._reports = self._reports, []
        return reports

    # ---- decisions ----

    @property
    def position(self) -> int:
        """The next sequence the cursor will yield at the earliest."""
        return pack_sequence(self._epoch, min(self._next_index, INDEX_MAX))

    @property
    def next_index(self) -> int:
        return self._next_index

    @property
    def epoch(self) -> int:
        """The segment the position is in."""
        return self._epoch

    @property
    def segment_listed(self) -> bool:
        """Whether the master's list held names the segment of the position."""
        return self._current_segment() is not None

    @property
    def read_from_index(self) -> int:
        """Where the current read starts: the position, or under a certificate the first
        index of its chunk."""
        if self._check is not None:
            return self._held_first
        return self._next_index

    @property
    def last_yielded(self) -> int | None:
        return self._last_yielded

    def upcoming(self) -> ReadFrom | None:
        """The read the cursor will most likely ask for after the current segment, when
        that one is sealed and the next is listed: its first replica the master does not
        list as bad, from its first index. A shell may start it early (a read-ahead of
        what that replica acked); the cursor still decides, and takes nothing it did not
        ask for."""
        current = self._current_segment()
        if current is None or not current.sealed:
            return None
        later = [s for s in self._segments if s.epoch > self._epoch]
        if not later:
            return None
        if self._end is not None and pack_sequence(later[0].epoch, 1) >= self._end:
            return None
        replicas = [r for r in later[0].replicas if r not in later[0].bad]
        if not replicas:
            return None
        checked = self._certificate_of(later[0], 1) is not None
        return ReadFrom(later[0].epoch, replicas[0], 1, checked=checked)

    def refresh_due(self, now_ms: int) -> bool:
        """While tailing: time to re-read the master's list."""
        due = now_ms - self._last_listed_ms >= self.timing.segment_refresh_ms
        return due and now_ms >= self._list_retry_at_ms

    def wake_at_ms(self, listing: bool = False) -> int:
        """While tailing, when to call `next` (and `refresh_due`) even if nothing
        arrives: the list refresh (unless one is `listing` already: its answer wakes the
        shell), or when the replica counts as silent."""
        silent_at = self._last_heard_ms + self.timing.silent_replica_ms
        if listing:
            return silent_at
        refresh_at = max(
            self._last_listed_ms + self.timing.segment_refresh_ms, self._list_retry_at_ms
        )
        return min(refresh_at, silent_at)

    def next(self, now_ms: int) -> Next:
        self._advanced(now_ms)  # the first call starts the count
        if self._end is not None and self.position >= self._end:
            return Finished()
        segment = self._current_segment()
        if segment is None:
            return self._wait(now_ms + self.timing.idle_refresh_ms)
        if segment.sealed and 0 < segment.lost_from_index <= self._next_index:
            return DataLoss(segment.epoch, segment.lost_from_index, segment.final_index, True)
        if self._relist_for_seal == segment.epoch:
            waited_ms = now_ms - self._advanced(now_ms)
            if self._end is not None and waited_ms >= self.timing.unreachable_read_ms:
                return Unreachable(segment.epoch, segment.replicas, waited_ms, master_silent=True)
            return Wait(max(now_ms, self._list_retry_at_ms), relist=True)
        replicas = self._replicas_of(segment.epoch)
        for bad in segment.bad:  # the master knows them to differ from the certificate
            replicas.damaged(bad, 1)
        if self._replica is not None and self._silent(now_ms):
            replicas.failed(self._replica, now_ms)
            self._leave_replica()
        if self._replica is not None and segment.sealed:
            if self._stalled_on_sealed(segment, now_ms):
                replicas.failed(self._replica, now_ms)
                self._leave_replica()
            elif replicas.below(self._replica, self._next_index):
                self._leave_replica()  # it said it holds less: another replica may not
        if self._replica is not None and not segment.sealed and self._stalled_on_open(now_ms):
            # A replica the leader stopped writing (detached as too far behind, the roll
            # refused) lives on, answering with the same position, while the segment
            # grows on the others: after a while with nothing served, read the next
            # replica. On an idle stream this only rotates among them.
            replicas.passed_over(self._replica, now_ms)
            self._leave_replica()
        if self._replica is None:
            give_up_at = self._give_up_at_ms(segment, replicas, now_ms)
            if give_up_at is not None and now_ms >= give_up_at:
                return Unreachable(segment.epoch, segment.replicas, now_ms - self._advanced(now_ms))
            choice = replicas.choose(segment.replicas, segment.sealed, self._next_index, now_ms)
            if isinstance(choice, Lost):
                return DataLoss(segment.epoch, self._next_index, segment.final_index)
            if isinstance(choice, WaitUntil):
                until_ms = choice.until_ms
                return self._wait(until_ms if give_up_at is None else min(until_ms, give_up_at))
            if isinstance(choice, Relist):
                return self._wait(now_ms)
            assert isinstance(choice, Ask)
            self._replica = choice.replica
            self._last_progress_ms = self._last_heard_ms = self._last_served_ms = now_ms
            self._attempts += 1
            self._read_began_sealed = segment.sealed
            self._start_check(segment)
        return ReadFrom(
            segment.epoch,
            self._replica,
            self.read_from_index,
            self._attempts,
            checked=self._check is not None,
        )

    @staticmethod
    def continues(decision: Next, read: ReadFrom) -> bool:
        """Whether `decision` (the latest `next`) is to go on with the read `read`
        started: the same replica of the same segment, not a read started since."""
        if not isinstance(decision, ReadFrom):
            return False
        return (decision.epoch, decision.replica, decision.attempt) == (
            read.epoch,
            read.replica,
            read.attempt,
        )

    # ---- internals ----

    def _advanced(self, now_ms: int) -> int:
        """When the position last moved; the first call starts the count."""
        if self._advanced_ms is None:
            self._advanced_ms = now_ms
        return self._advanced_ms

    def _give_up_at_ms(self, segment: SegmentView, replicas: ReplicaSet, now_ms: int) -> int | None:
        """A bounded read whose every hopeful replica is failing gives up at this time
        (module docstring); None while one may serve, and for a subscription."""
        advanced = self._advanced(now_ms)
        if self._end is None:
            return None
        if not replicas.unreachable(segment.replicas, segment.sealed, self._next_index):
            return None
        return advanced + self.timing.unreachable_read_ms

    def _lost_from_index(self, epoch: int) -> int:
        segment = self._current_segment()
        if segment is None or segment.epoch != epoch or not segment.sealed:
            return 0
        return segment.lost_from_index

    def _bridge_unlisted(self, bridge_index: int) -> bool:
        """Whether a replica's bridge at `bridge_index` shows the list held stale: the
        current segment listed open, events left to read before the bridge, and no list
        read since a replica said so before."""
        current = self._current_segment()
        return (
            bridge_index > self._next_index
            and current is not None
            and not current.sealed
            and current.epoch not in self._open_though_bridged
        )

    def _relisted_for_seal(self) -> None:
        """The master answered after a replica's bridge: if it still lists the segment
        open it has not recorded the seal, and holds no certificate to read it under."""
        epoch, self._relist_for_seal = self._relist_for_seal, 0
        current = self._current_segment()
        if epoch and current is not None and current.epoch == epoch and not current.sealed:
            self._open_though_bridged.add(epoch)

    def _current_segment(self) -> SegmentView | None:
        for segment in self._segments:
            if segment.epoch == self._epoch:
                return segment
        return None

    def _replicas_of(self, epoch: int) -> ReplicaSet:
        replicas = self._replicas.get(epoch)
        if replicas is None:
            replicas = self._replicas[epoch] = ReplicaSet(self.timing)
            segment = self._current_segment()
            if segment is not None and segment.epoch == epoch and segment.sealed:
                replicas.segment_sealed()
        return replicas

    def _enter(self, epoch: int) -> None:
        self._epoch = epoch
        self._next_index = 1
        self._leave_replica()

    def _leave_replica(self) -> None:
        """Stop reading the current replica; what it sent unverified is dropped."""
        self._replica = None
        self._check = None
        self._held = []

    def _start_check(self, segment: SegmentView) -> None:
        """A new read of a sealed, certified segment starts at its position's chunk."""
        certificate = self._certificate_of(segment, self._next_index)
        if certificate is not None:
            self._check = ChunkCheck(certificate, self._next_index)
            self._held_first = self._check.next_index

    @staticmethod
    def _certificate_of(segment: SegmentView, index: int) -> Certificate | None:
        """The certificate a read of `segment` from `index` is checked against, if any."""
        certificate = segment.certificate
        if not segment.sealed or certificate is None:
            return None
        if not 1 <= index <= certificate.final_index:
            return None
        if certificate.final_index != segment.final_index:
            return None  # not this seal's certificate: nothing to check against
        return certificate

    def _damaged(self, index: int, problem: str) -> None:
        replica = self._replica
        assert replica is not None
        self._replicas_of(self._epoch).damaged(replica, index)
        self._reports.append(ReplicaReport(self._epoch, replica, problem))
        self._leave_replica()

    def _hop(self) -> None:
        later = [s for s in self._segments if s.epoch > self._epoch]
        self._replicas.pop(self._epoch, None)
        if later:
            self._enter(later[0].epoch)
        else:
            # The next segment is not listed yet: wait at its first possible position.
            self._enter(self._epoch + 1)

    def _wait(self, until_ms: int) -> Wait:
        return Wait(max(until_ms, self._list_retry_at_ms))

    def _silent(self, now_ms: int) -> bool:
        return now_ms - self._last_heard_ms >= self.timing.silent_replica_ms

    def _stalled_on_open(self, now_ms: int) -> bool:
        return now_ms - self._last_served_ms >= self.timing.open_replica_stall_ms

    def _stalled_on_sealed(self, segment: SegmentView, now_ms: int) -> bool:
        if self._next_index > segment.final_index:
            return False
        return now_ms - self._last_progress_ms >= self.timing.sealed_replica_stall_ms
