"""A reader's cursor along a stream: position, segment hops, replica choice.

Theory of operation. A stream is a list of segments ordered by epoch (the master's
list). The cursor holds a position `(epoch, next index)` and reads one segment at a
time from one replica of its copy set. Stores serve only acked entries, so what a
replica sends is final: the cursor yields EVENTs, skips HOLEs, and on a BRIDGE hops to
the next segment of the list. A sealed segment is complete on a replica whose acked
index reached the bridge (the master's final index); a replica that stops short of it
(it missed the bridge, or died) is left for another replica, resuming at the position.
When no replica of a segment can serve what the cursor needs, the cursor reports data
loss naming the segment and the missing range instead of waiting forever.

The shell (`client/subscription.py`) feeds it the master's segment list, what replicas
answer, and failures, with the time; the cursor answers what to read next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.limits import INDEX_MAX
from streamengine.protocol.sequence import pack_sequence, unpack_sequence

# A replica that serves nothing new for this long while the master says its segment is
# sealed beyond what it served has missed the bridge: try another one.
SEALED_REPLICA_STALL_MS = 2000


@dataclass(frozen=True, slots=True)
class SegmentView:
    """A segment as the master lists it."""

    epoch: int
    replicas: tuple[str, ...]
    sealed: bool
    final_index: int  # the BRIDGE once sealed, else 0


@dataclass(slots=True)
class Event:
    """An acked event handed to the user. Not frozen: one is made per event read, and a
    frozen dataclass costs three times as much to build."""

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
class WaitForSegments:
    """Nothing to read until the master lists a later segment (or the current one's
    replicas come back): refresh the list after a pause."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The requested range is read."""


@dataclass(frozen=True, slots=True)
class DataLoss:
    """No replica can serve `first_index..last_index` of segment `epoch`."""

    epoch: int
    first_index: int
    last_index: int


Next = ReadFrom | WaitForSegments | Finished | DataLoss


def _find(kinds: Sequence[int], kind: int, start: int, stop: int) -> int | None:
    try:
        return kinds.index(kind, start, stop)
    except ValueError:
        return None


@dataclass
class _SegmentProgress:
    failed_replicas: set[str] = field(default_factory=set)
    # Per replica, the acked index it last reported (what it can serve).
    replica_acked: dict[str, int] = field(default_factory=dict)


class Cursor:
    """Position of one reader; `start` inclusive, `end` exclusive (None: forever)."""

    def __init__(self, start_sequence: int, end_sequence: int | None = None) -> None:
        epoch, index = unpack_sequence(start_sequence)
        self._epoch = epoch
        self._next_index = max(index, 1)
        self._end = end_sequence
        self._segments: list[SegmentView] = []
        self._progress: dict[int, _SegmentProgress] = {}
        self._replica: str | None = None
        self._last_progress_ms = 0
        self._last_yielded: int | None = None

    # ---- inputs ----

    def on_segments(self, segments: Sequence[SegmentView]) -> None:
        """The master's list, oldest first (a refresh replaces the previous one)."""
        self._segments = sorted(segments, key=lambda s: s.epoch)
        current = self._current_segment()
        if current is None:
            later = [s for s in self._segments if s.epoch > self._epoch]
            if later:
                self._enter(later[0].epoch)
        elif current.sealed and self._next_index > current.final_index:
            self._hop()

    def on_position(self, epoch: int, replica: str, acked_index: int, now_ms: int) -> None:
        if epoch != self._epoch:
            return
        self._progress_of(epoch).replica_acked[replica] = acked_index
        self._last_progress_ms = max(self._last_progress_ms, now_ms)

    def on_entries(self, epoch: int, entries: Sequence[StoredEntry], now_ms: int) -> list[Event]:
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
    ) -> list[Event]:
        """A batch a replica served for `epoch`: consecutive indexes from `first_index`,
        as columns. Returns the events to yield; entries at or below the position (a
        resend) are ignored, a HOLE is skipped, a BRIDGE hops to the next segment."""
        if epoch != self._epoch or not kinds:
            return []
        self._last_progress_ms = max(self._last_progress_ms, now_ms)
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
            Event(base + first_index + i, epoch, first_index + i, payloads[i])
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

    def on_replica_failed(self, epoch: int, replica: str) -> None:
        """The replica could not serve (unreachable, NOT_FOUND, disconnected)."""
        if epoch == self._epoch:
            self._progress_of(epoch).failed_replicas.add(replica)
            if self._replica == replica:
                self._replica = None

    def forget_failures(self) -> None:
        """After a pause, failed replicas may be back: consider them again."""
        for progress in self._progress.values():
            progress.failed_replicas.clear()

    # ---- decisions ----

    @property
    def position(self) -> int:
        """The next sequence the cursor will yield at the earliest."""
        return pack_sequence(self._epoch, min(self._next_index, INDEX_MAX))

    @property
    def last_yielded(self) -> int | None:
        return self._last_yielded

    def next(self, now_ms: int) -> Next:
        if self._end is not None and self.position >= self._end:
            return Finished()
        segment = self._current_segment()
        if segment is None:
            return WaitForSegments()
        progress = self._progress_of(segment.epoch)
        if self._replica is not None and self._stalled_on_sealed(segment, now_ms):
            progress.failed_replicas.add(self._replica)
            self._replica = None
        if self._replica is None:
            choice = self._choose_replica(segment, progress)
            if choice is None:
                if segment.sealed:
                    return DataLoss(segment.epoch, self._next_index, segment.final_index)
                return WaitForSegments()
            self._replica = choice
            self._last_progress_ms = now_ms
        return ReadFrom(segment.epoch, self._replica, self._next_index)

    # ---- internals ----

    def _current_segment(self) -> SegmentView | None:
        for segment in self._segments:
            if segment.epoch == self._epoch:
                return segment
        return None

    def _progress_of(self, epoch: int) -> _SegmentProgress:
        return self._progress.setdefault(epoch, _SegmentProgress())

    def _enter(self, epoch: int) -> None:
        self._epoch = epoch
        self._next_index = 1
        self._replica = None

    def _hop(self) -> None:
        later = [s for s in self._segments if s.epoch > self._epoch]
        self._progress.pop(self._epoch, None)
        if later:
            self._enter(later[0].epoch)
        else:
            # The next segment is not listed yet: wait at its first possible position.
            self._enter(self._epoch + 1)

    def _stalled_on_sealed(self, segment: SegmentView, now_ms: int) -> bool:
        if not segment.sealed or self._next_index > segment.final_index:
            return False
        return now_ms - self._last_progress_ms >= SEALED_REPLICA_STALL_MS

    def _choose_replica(self, segment: SegmentView, progress: _SegmentProgress) -> str | None:
        candidates = [r for r in segment.replicas if r not in progress.failed_replicas]
        if not candidates:
            return None

        # Prefer a replica known to serve the position; else keep the master's order,
        # which spreads readers as copy sets are spread.
        def serves(replica: str) -> bool:
            return progress.replica_acked.get(replica, 0) >= self._next_index

        serving = [r for r in candidates if serves(r)]
        return (serving or candidates)[0]
