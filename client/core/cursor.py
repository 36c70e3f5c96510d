"""A reader's cursor along a stream: position, segment hops, replica choice.

Theory of operation. A stream is a list of segments ordered by epoch (the master's
list). The cursor holds a position `(epoch, next index)` and reads one segment at a
time from one replica of its copy set. Stores serve only acked entries, so what a
replica sends is final: the cursor yields EVENTs, skips HOLEs, and on a BRIDGE hops to
the next segment of the list. A sealed segment is complete on a replica whose acked
index reached the bridge (the master's final index); a replica that stops short of it
(it missed the bridge, or died) is left for another replica, resuming at the position.

Failures and data loss (the rules live in `client/core/replicas.py`): a replica that
cannot be asked (unreachable, silent, disconnected) is retried with a doubling backoff
and says nothing about what it holds; a replica's *answer* (its acked index, NOT_FOUND as
acked 0) does. `DataLoss` is reported for a sealed segment only when the master lists no
replica for it, or every listed replica answered that it serves less than the position
and a list fetched after those answers still names only them. Until then the cursor
answers `Wait(until_ms)`: re-read the master's list at `until_ms` and ask again.

Time is an input. While tailing, the cursor also decides when the tailed replica is
silent (`FollowerTiming.silent_replica_ms` without entries, a position or a keepalive:
a failure) and when to re-read the master's list (`refresh_due`); `wake_at_ms` says
when to ask it again if nothing arrives. Every wait is a field of `FollowerTiming`, so
the SDK and the simulator (`FollowerTiming.fast()`) run the same decisions.

The shell (`client/subscription.py`; `tests/sim/follower_node.py` in the simulator)
feeds it the master's segment list, what replicas answer, and failures, with the time;
the cursor answers what to read next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamengine.client.core.replicas import (
    Ask,
    FollowerTiming,
    Lost,
    Relist,
    ReplicaSet,
    WaitUntil,
)
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.limits import INDEX_MAX
from streamengine.protocol.sequence import pack_sequence, unpack_sequence

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


@dataclass(slots=True)
class StreamEvent:
    """An acked event handed to the user (not a core input event). Not frozen: one is
    made per event read, and a frozen dataclass costs three times as much to build."""

    sequence: int
    epoch: int
    index: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReadFrom:
    """Tail `epoch` on `replica` from `from_index` on."""

    epoch: int
    replica: str
    from_index: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to read now: re-read the master's list at `until_ms` (a later segment may
    be listed, a copy set may have changed, a failed replica's backoff ends) and ask
    again. `until_ms` may be in the past: refresh at once."""

    until_ms: int


@dataclass(frozen=True, slots=True)
class Finished:
    """The requested range is read."""


@dataclass(frozen=True, slots=True)
class DataLoss:
    """No replica can serve `first_index..last_index` of segment `epoch`."""

    epoch: int
    first_index: int
    last_index: int


Next = ReadFrom | Wait | Finished | DataLoss


def _find(kinds: Sequence[int], kind: int, start: int, stop: int) -> int | None:
    try:
        return kinds.index(kind, start, stop)
    except ValueError:
        return None


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
        self._last_heard_ms = 0
        self._last_listed_ms = 0
        # The master did not answer the list `_list_failures` times in a row: the next
        # try waits until `_list_retry_at_ms` (the replicas' backoff rule).
        self._list_failures = 0
        self._list_retry_at_ms = 0
        self._last_yielded: int | None = None

    # ---- inputs ----

    def on_segments(self, segments: Sequence[SegmentView], now_ms: int) -> None:
        """The master's list, oldest first (a refresh replaces the previous one)."""
        self._last_listed_ms = max(self._last_listed_ms, now_ms)
        self._list_failures = 0
        self._list_retry_at_ms = 0
        self._segments = sorted(segments, key=lambda s: s.epoch)
        for segment in self._segments:
            replicas = self._replicas.get(segment.epoch)
            if replicas is not None:
                replicas.list_refreshed()
                if segment.sealed:
                    replicas.segment_sealed()
        current = self._current_segment()
        if current is None:
            later = [s for s in self._segments if s.epoch > self._epoch]
            if later:
                self._enter(later[0].epoch)
        elif current.sealed and self._next_index > current.final_index:
            self._hop()

    def on_position(self, epoch: int, replica: str, acked_index: int, now_ms: int) -> None:
        """`replica` answered that it serves `epoch` up to `acked_index` (a Subscribe
        POSITION; a NOT_FOUND for the segment is `acked_index=0`)."""
        if epoch != self._epoch:
            return
        self._replicas_of(epoch).answered(replica, acked_index)
        self._last_progress_ms = max(self._last_progress_ms, now_ms)
        if replica == self._replica:
            self._last_heard_ms = max(self._last_heard_ms, now_ms)

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
        """A batch the current replica served for `epoch`: consecutive indexes from
        `first_index`, as columns. Returns the events to yield; entries at or below the
        position (a resend) are ignored, a HOLE is skipped, a BRIDGE hops to the next
        segment."""
        if epoch != self._epoch or not kinds:
            return []
        self._last_progress_ms = max(self._last_progress_ms, now_ms)
        self._last_heard_ms = max(self._last_heard_ms, now_ms)
        if self._replica is not None:
            self._replicas_of(epoch).served(self._replica, first_index + len(kinds) - 1)
        skip = self._next_index - first_index
        if skip < 0:
            raise ValueError(
                f"segment {epoch}: replica skipped from {self._next_index} to {first_index}"
            )
        stop = len(kinds)
        if self._end is not None:
            end_epoch, end_index = unpack_sequence(self._end)
            if epoch == end_epoch:
                stop = min(stop, max(skip, end_index - first_index))
            elif epoch > end_epoch:
                stop = skip
        bridge_at = _find(kinds, EntryKind.BRIDGE, skip, stop)
        if bridge_at is not None:
            stop = bridge_at
        base = pack_sequence(epoch, 0)
        events = [
            StreamEvent(base + first_index + i, epoch, first_index + i, payloads[i])
            for i in range(skip, stop)
            if kinds[i] == EntryKind.EVENT
        ]
        if stop > skip:
            self._next_index = first_index + stop
        if events:
            self._last_yielded = events[-1].sequence
        if bridge_at is not None:
            self._hop()
        return events

    def on_replica_failed(self, epoch: int, replica: str, now_ms: int) -> None:
        """The replica could not be asked (unreachable, silent, disconnected, a corrupt
        batch): it is retried after a backoff; this says nothing of what it holds."""
        if epoch == self._epoch:
            self._replicas_of(epoch).failed(replica, now_ms)
            if self._replica == replica:
                self._replica = None

    # ---- decisions ----

    @property
    def position(self) -> int:
        """The next sequence the cursor will yield at the earliest."""
        return pack_sequence(self._epoch, min(self._next_index, INDEX_MAX))

    @property
    def next_index(self) -> int:
        return self._next_index

    @property
    def last_yielded(self) -> int | None:
        return self._last_yielded

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
        if self._end is not None and self.position >= self._end:
            return Finished()
        segment = self._current_segment()
        if segment is None:
            return self._wait(now_ms + self.timing.idle_refresh_ms)
        replicas = self._replicas_of(segment.epoch)
        if self._replica is not None and self._silent(now_ms):
            replicas.failed(self._replica, now_ms)
            self._replica = None
        if self._replica is not None and segment.sealed:
            if self._stalled_on_sealed(segment, now_ms):
                replicas.failed(self._replica, now_ms)
                self._replica = None
            elif replicas.below(self._replica, self._next_index):
                self._replica = None  # it said it holds less: another replica may not
        if self._replica is None:
            choice = replicas.choose(segment.replicas, segment.sealed, self._next_index, now_ms)
            if isinstance(choice, Lost):
                return DataLoss(segment.epoch, self._next_index, segment.final_index)
            if isinstance(choice, WaitUntil):
                return self._wait(choice.until_ms)
            if isinstance(choice, Relist):
                return self._wait(now_ms)
            assert isinstance(choice, Ask)
            self._replica = choice.replica
            self._last_progress_ms = self._last_heard_ms = now_ms
        return ReadFrom(segment.epoch, self._replica, self._next_index)

    # ---- internals ----

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
        self._replica = None

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

    def _stalled_on_sealed(self, segment: SegmentView, now_ms: int) -> bool:
        if self._next_index > segment.final_index:
            return False
        return now_ms - self._last_progress_ms >= self.timing.sealed_replica_stall_ms
