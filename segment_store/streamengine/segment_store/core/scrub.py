"""The scrub: which sealed replica a store reads back next, how fast, and what a read of
one replica found. No I/O, no clock: time comes in as `now_ms`.

Theory of operation. A store re-reads every sealed replica it holds, from index 1 to its
bridge, over and over, at a bounded rate (`--scrub-mb-per-s`), so that damage at rest
(a flipped bit, a lost block) is found by the store before a reader or a repair needs
the copy. One replica is read at a time (`ReplicaScan`), in steps of at most
`SCRUB_STEP_ENTRIES` entries and `SCRUB_STEP_BYTES` bytes, so a step holds the store's
threads (and the interpreter's lock) for about a millisecond; the next step may start
only once the bytes read so far fit the rate (`ScrubSchedule.read_at_ms`).

Each step checks every copy's crc32c (and RocksDB checks its blocks' checksums on the
way: a block that fails is `KVCorruption`); the replica's certificate is computed from
what was read (`streamengine.protocol.certificate`). The outcome is either *damaged* (a copy that
fails a checksum, an index missing below the bridge) or the certificate of what the
replica holds, which the store reports to the master: the master compares it with the
segment's certificate, and a replica that differs is bad there.

Which replica next (`ScrubSchedule.next_replica`): first those the master asked for
(`scrub_first`: a reader or a repair found them suspect), oldest request first; then
replicas sealed since the store started, in the order they appeared (the master counts
a replica as good only once a read of it matched the certificate, so a fresh seal's
first check comes before re-checks); then replicas never read since the store started
(after a restart damage may be anywhere: the in-memory record of what was checked is
gone), in key order; then the replica
checked longest ago, once `recheck_ms` has passed since its last check (a small store
does not spin over the same replicas). The time a full pass takes is the store's sealed
bytes divided by the rate: that is how long damage may stay unseen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from streamengine.protocol.certificate import Certificate, ContentDigest
from streamengine.protocol.entry import VALUE_HEADER_BYTES, first_corrupt_value

# One step of a scrub: well under a millisecond of the interpreter's lock (reading, crc
# and SHA-256 of each entry: docs/performance.md, "The scrub"), so the store's event
# loop never waits long behind it.
SCRUB_STEP_ENTRIES = 256
SCRUB_STEP_BYTES = 64 << 10
# The default rate: a replica of the default segment size (256 MiB) is read in about a
# minute, a terabyte in three days, for a few percent of a core, with no effect on append
# latency that the machine's noise lets one see (docs/performance.md, "The scrub").
SCRUB_MB_PER_S_DEFAULT = 4.0
# A replica is read again at most this often, however little the store holds.
SCRUB_RECHECK_MS_DEFAULT = 10 * 60 * 1000
# Replicas the master may have queued for a check first; more are ignored until room.
SCRUB_FIRST_MAX = 256


class _Key(Protocol):
    """A replica's key: hashable, and ordered so replicas are read in a stable order
    (never by hash order, which changes per process)."""

    def __lt__(self, other: Any, /) -> bool: ...

    def __hash__(self) -> int: ...


K = TypeVar("K", bound=_Key)


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What one read of a replica found: the certificate of what it holds, or the first
    index that is damaged (or missing) with why."""

    final_index: int
    certificate: Certificate | None
    damaged_index: int
    detail: str
    bytes_read: int
    # The damage is an index the replica does not hold (below its bridge), rather
    # than a copy failing a checksum.
    missing: bool = False

    @property
    def damaged(self) -> bool:
        return self.certificate is None


class ReplicaScan:
    """One sealed replica read from index 1 to `final_index`: `next_read` says what to
    read, `feed` (or `damaged`) takes what the read gave, until `result` is set."""

    def __init__(
        self,
        final_index: int,
        step_entries: int = SCRUB_STEP_ENTRIES,
        step_bytes: int = SCRUB_STEP_BYTES,
    ) -> None:
        assert final_index >= 1 and step_entries >= 1 and step_bytes >= 0  # 0: no bound
        self.final_index = final_index
        self.step_entries = step_entries
        self.step_bytes = step_bytes
        self._digest = ContentDigest()
        self._bytes_read = 0
        self.result: ScanResult | None = None

    @property
    def next_index(self) -> int:
        return self._digest.through_index + 1

    def next_read(self) -> tuple[int, int, int, int] | None:
        """(first index, last index, most entries, most bytes) of the next step, None
        once the scan is over. A step returns consecutive values from `first`, cut
        before an index the replica lacks."""
        if self.result is not None:
            return None
        return self.next_index, self.final_index, self.step_entries, self.step_bytes

    def feed(self, values: Sequence[bytes]) -> None:
        """The stored values the step read, consecutive from `next_index`."""
        assert self.result is None, "the scan is over"
        first = self.next_index
        self._bytes_read += sum(map(len, values))
        if not values:
            detail = f"index {first} is missing below the bridge {self.final_index}"
            self.result = ScanResult(self.final_index, None, first, detail, self._bytes_read, True)
            return
        bad = first_corrupt_value(first, values)
        if bad is not None:
            self.damaged(first + bad, f"index {first + bad} fails its crc32c")
            return
        if first + len(values) - 1 > self.final_index:
            values = values[: self.final_index - first + 1]
        self._digest.add_run(
            first,
            bytes(value[0] for value in values),
            [memoryview(value)[VALUE_HEADER_BYTES:] for value in values],
        )
        if self._digest.through_index == self.final_index:
            self.result = ScanResult(
                self.final_index, self._digest.finish(), 0, "", self._bytes_read
            )

    def damaged(self, index: int, detail: str) -> None:
        """The read of `index` on failed (the engine found a block damaged)."""
        assert self.result is None, "the scan is over"
        self.result = ScanResult(self.final_index, None, index, detail, self._bytes_read)


class ScrubSchedule(Generic[K]):
    """Which replica to read next and when the rate allows the next step; replicas are
    keys of any kind (the store's `SegmentKey`)."""

    def __init__(
        self,
        bytes_per_s: float,
        now_ms: int,
        recheck_ms: int = SCRUB_RECHECK_MS_DEFAULT,
    ) -> None:
        if bytes_per_s <= 0 or recheck_ms <= 0:
            raise ValueError(f"scrub rate {bytes_per_s} and recheck {recheck_ms} must be > 0")
        self.bytes_per_ms = bytes_per_s / 1000
        self.recheck_ms = recheck_ms
        self.started_ms = now_ms
        self._checked_ms: dict[K, int] = {}
        self._first: list[K] = []
        # Replicas seen sealed so far; None until the first look (what is sealed then
        # is the start's backlog, not fresh).
        self._seen: set[K] | None = None
        # Sealed since the first look and never checked, in the order they appeared.
        self._fresh: dict[K, None] = {}
        self._read_at_ms = now_ms

    # ---- inputs ----

    def check_first(self, replica: K) -> bool:
        """The master asks for `replica` before any other; False when it is queued
        already or the queue is full."""
        if replica in self._first or len(self._first) >= SCRUB_FIRST_MAX:
            return False
        self._first.append(replica)
        return True

    def read_done(self, now_ms: int, nbytes: int) -> None:
        """A step read `nbytes`: the next one waits until they fit the rate."""
        start = max(self._read_at_ms, now_ms)
        self._read_at_ms = start + int(nbytes / self.bytes_per_ms)

    def checked(self, replica: K, now_ms: int) -> None:
        """A scan of `replica` ended (either way)."""
        self._checked_ms[replica] = now_ms
        if replica in self._first:
            self._first.remove(replica)

    # ---- decisions ----

    def read_at_ms(self) -> int:
        """When the next step may start."""
        return self._read_at_ms

    def next_replica(self, now_ms: int, sealed: Mapping[K, int]) -> K | None:
        """The replica to read now, among `sealed` (every sealed replica held, with its
        final index), or None when none is due. Replicas no longer held are forgotten."""
        self._first = [r for r in self._first if r in sealed]
        self._checked_ms = {r: t for r, t in self._checked_ms.items() if r in sealed}
        self._note_fresh(sealed)
        if self._first:
            return self._first[0]
        if self._fresh:
            return next(iter(self._fresh))
        never = [r for r in sealed if r not in self._checked_ms]
        if never:
            return min(never)
        due = sorted(r for r, t in self._checked_ms.items() if now_ms - t >= self.recheck_ms)
        if due:
            return min(due, key=lambda r: self._checked_ms[r])
        return None

    def _note_fresh(self, sealed: Mapping[K, int]) -> None:
        if self._seen is None:
            self._seen = set(sealed)
            return
        self._fresh = {r: None for r in self._fresh if r in sealed and r not in self._checked_ms}
        for replica in sealed:
            if replica not in self._seen:
                self._seen.add(replica)
                if replica not in self._checked_ms:
                    self._fresh[replica] = None
        if len(self._seen) > len(sealed):
            self._seen &= sealed.keys()

    def due_ms(self, sealed: Mapping[K, int]) -> int | None:
        """When `next_replica` would next return a replica, if nothing changes."""
        if self._first or any(r not in self._checked_ms for r in sealed):
            return self._read_at_ms
        times = [t for r, t in self._checked_ms.items() if r in sealed]
        return min(times) + self.recheck_ms if times else None

    def oldest_check_age_ms(self, now_ms: int, sealed: Mapping[K, int]) -> int:
        """How long the least recently checked replica has gone unchecked (a replica
        never checked counts from the store's start)."""
        if not sealed:
            return 0
        oldest = min(self._checked_ms.get(r, self.started_ms) for r in sealed)
        return max(0, now_ms - oldest)

    def unchecked(self, sealed: Mapping[K, int]) -> int:
        return sum(1 for r in sealed if r not in self._checked_ms)
