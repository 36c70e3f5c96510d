"""The producer table: which producer sequences a stream holds, and what a retry writes.

Shared by both sides: the leader (`streamengine.client.core.writer`) keeps the table and
decides by it; the master keeps each producer's position with the seal of a segment
(`ProducerPosition`) and hands it to the next leader.

Theory of operation. A writer made with a producer id appends batches that carry
producer sequences (`append_batch(payloads, producer_sequence=K)`: K, K + 1, ...). Each
such batch goes into the stream as one PRODUCER mark followed by its events
(`streamengine.protocol.entry.ProducerMark`), at consecutive indexes of one segment, so
its events sit at consecutive stream sequences: one `Run`.

The leader keeps, per producer id, the runs it knows in stream order. Every producer's
sequences are consecutive from 0 with no gap and no repeat, so the runs of one producer
follow each other: the table's high-water mark is the last sequence of its last run.
`decide` answers a batch against it:

- every event at or below the mark is already in the stream: it is not written again,
  and its stream sequence is answered (`Dedup.known`; 0 where the table no longer tells
  it, below);
- the events above the mark are written (`Dedup.write_from`);
- a batch that starts above the mark + 1 leaves a gap: refused (`SequenceGap`), nothing
  written. A producer the table does not know starts at 0.

Jumps (`decide(..., jumps=True)`, the producer's opt-in). A producer whose sequences
are not consecutive but only increase (a streaming job numbers rows by batch id and
position: each batch starts far above the last) may start a batch anywhere above the
mark; its runs then leave holes. Deduplication is as before: nothing at or below the
mark is written again, and a sequence that falls in a hole is answered 0 like one whose
position is no longer kept (it was never written, and never will be). The table itself
takes runs with holes from any writer (`add_run`): the gap rule is a check on a batch,
not on what the stream holds.

Queued batches. A leader's shell may hold a producer's batches back (no room in the
window yet) after deciding them, each to be written whole: the table takes them only
when they are assigned. A batch behind such queued batches is decided by
`decide_behind`, against the last queued sequence rather than the table's mark: all new
sequences right after them (or above them, with jumps) are written; one that overlaps
them waits until they are assigned, then `decide` answers it. A queued batch that is
not written (timed out, cancelled, or decided against a table changed since: `changes`)
fails every queued batch behind it, which the shell checks: no gap is ever written.

What counts. A producer may have several batches in flight. The table takes a run
when the leader assigns its indexes, before W stores hold it: a
retry of an event in flight is answered with the sequence it has, once it is acked
(the shell waits for that). A writer that stops leading leaves its in-flight runs
in doubt; the next leader knows only what recovery kept. That is why a new leader
decides nothing before every earlier segment is sealed and recovered (the gate): it
rebuilds the table from what recovery chose (`fold_segment`, each recovered segment in
epoch order, on top of the table recorded with the master's seal of the segment before
them), and only then takes a batch with a producer. A recovery of a stream with
producers ends at the first index it finds on no store (`plan_recovery`'s
`end_at_first_gap`), so a batch kept there always follows every earlier batch of its
producer: no sequence below the mark is missing from the stream.

Bounds. The table keeps at most `RUNS_PER_PRODUCER_MAX` runs per producer (the latest)
and at most `PRODUCERS_MAX` producers; a seal records only each producer's last event
(`ProducerPosition`). An event older than what the table keeps is still never written
again (the mark is kept), but its stream sequence is answered 0: durable, position no
longer known.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streamengine.protocol.entry import (
    EntryKind,
    ProducerMark,
    StoredEntry,
    check_producer_id,
)
from streamengine.protocol.sequence import pack_sequence

# Runs kept per producer: a retry of this many batches back is answered with the stream
# sequence of each event; older ones with 0. 1,024 runs of 40 bytes are 40 KiB.
RUNS_PER_PRODUCER_MAX = 1024
# Producers one stream's table keeps: their last events go with every seal to the
# master (`ProducerPosition`, about 150 bytes each), whose record of a segment is
# bounded (`protocol.segment_records.RECORD_BYTES_MAX`, 64 KiB).
PRODUCERS_MAX = 256
assert PRODUCERS_MAX * 200 < 64 << 10, "the positions fit a segment record"


class SequenceGap(ValueError):
    """A batch whose first producer sequence leaves a gap after the high-water mark."""

    def __init__(self, producer_id: str, first_sequence: int, expected: int) -> None:
        super().__init__(
            f"producer {producer_id!r}: sequence {first_sequence} leaves a gap; the stream "
            f"holds its events through {expected - 1} (the next batch starts at {expected})"
            if expected
            else f"producer {producer_id!r}: sequence {first_sequence} leaves a gap; the "
            "stream holds none of its events (its first batch starts at 0)"
        )
        self.producer_id = producer_id
        self.first_sequence = first_sequence
        self.expected = expected


class TooManyProducers(ValueError):
    """A new producer past `PRODUCERS_MAX`."""


@dataclass(frozen=True, slots=True)
class Run:
    """Producer sequences `first_sequence` .. + `count` - 1, in the stream at the
    consecutive stream sequences from `first_stream_sequence`."""

    first_sequence: int
    count: int
    first_stream_sequence: int

    def __post_init__(self) -> None:
        assert self.first_sequence >= 0 and self.count >= 1, self
        assert self.first_stream_sequence > 0, self

    @property
    def last_sequence(self) -> int:
        return self.first_sequence + self.count - 1

    @property
    def last_stream_sequence(self) -> int:
        return self.first_stream_sequence + self.count - 1


@dataclass(frozen=True, slots=True)
class ProducerPosition:
    """A producer's last event in the stream: what a seal records of it."""

    producer_id: str
    last_sequence: int
    last_stream_sequence: int

    def __post_init__(self) -> None:
        check_producer_id(self.producer_id)
        if self.last_sequence < 0 or self.last_stream_sequence <= 0:
            raise ValueError(f"a producer position out of range: {self}")


@dataclass(frozen=True, slots=True)
class Dedup:
    """The answer to a batch: its first `len(known)` events are already in the stream
    at these stream sequences (0: durable, position no longer kept); the events from
    position `write_from` on (`len(known)`) are to be written, their producer sequences
    from `first_sequence`."""

    known: tuple[int, ...]
    first_sequence: int
    count: int

    @property
    def write_from(self) -> int:
        return len(self.known)

    @property
    def to_write(self) -> int:
        return self.count - len(self.known)


class ProducerTable:
    """See the module docstring."""

    def __init__(self, positions: Iterable[ProducerPosition] = ()) -> None:
        self._runs: dict[str, list[Run]] = {}
        # How often runs were taken away (`forget_from`): a batch decided before such a
        # change must be decided again (module doc, "Queued batches").
        self.changes = 0
        for position in positions:
            run = Run(position.last_sequence, 1, position.last_stream_sequence)
            self._runs[position.producer_id] = [run]

    # ---- queries ----

    def last_sequence(
        self, producer_id: str, before_stream_sequence: int | None = None
    ) -> int | None:
        """The producer's high-water mark (None: none of its events), counting only runs
        that start before `before_stream_sequence` when given."""
        run = self._last_run(producer_id, before_stream_sequence)
        return None if run is None else run.last_sequence

    def durable_sequence(self, producer_id: str, durable_through: int) -> int | None:
        """The producer's highest sequence at or below stream sequence `durable_through`
        (everything up to which is acked): a run may be acked in part."""
        run = self._last_run(producer_id, durable_through + 1)
        if run is None:
            return None
        return min(
            run.last_sequence, run.first_sequence + durable_through - run.first_stream_sequence
        )

    def last_stream_sequence(self, producer_id: str) -> int | None:
        run = self._last_run(producer_id, None)
        return None if run is None else run.last_stream_sequence

    def positions(self, before_stream_sequence: int | None = None) -> tuple[ProducerPosition, ...]:
        """Each producer's last event (before `before_stream_sequence` when given), by
        producer id: what the seal of the segment ending there records."""
        found = []
        for producer_id in sorted(self._runs):
            run = self._last_run(producer_id, before_stream_sequence)
            if run is not None:
                found.append(
                    ProducerPosition(producer_id, run.last_sequence, run.last_stream_sequence)
                )
        return tuple(found)

    def decide(
        self, producer_id: str, first_sequence: int, count: int, jumps: bool = False
    ) -> Dedup:
        """What to do with a batch of `count` events from `first_sequence`; raises
        SequenceGap (nothing is to be written) unless the producer's sequences may
        `jumps` ahead of the mark."""
        check_producer_id(producer_id)
        assert count >= 1 and first_sequence >= 0
        runs = self._runs.get(producer_id, [])
        expected = runs[-1].last_sequence + 1 if runs else 0
        if first_sequence > expected and not jumps:
            raise SequenceGap(producer_id, first_sequence, expected)
        if producer_id not in self._runs and len(self._runs) >= PRODUCERS_MAX:
            raise TooManyProducers(
                f"the stream's table already keeps {PRODUCERS_MAX} producers; "
                f"{producer_id!r} would be one more"
            )
        duplicates = max(0, min(count, expected - first_sequence))
        firsts = [run.first_sequence for run in runs]
        known = tuple(
            _stream_sequence(runs, firsts, sequence)
            for sequence in range(first_sequence, first_sequence + duplicates)
        )
        return Dedup(known, first_sequence + duplicates, count)

    def decide_behind(
        self,
        producer_id: str,
        queued_through: int,
        first_sequence: int,
        count: int,
        jumps: bool = False,
    ) -> Dedup | None:
        """As `decide`, for a batch behind this producer's queued batches, the last of
        which ends at producer sequence `queued_through` (module doc, "Queued batches"):
        None when the batch overlaps them; raises SequenceGap past them."""
        assert count >= 1 and first_sequence >= 0
        expected = queued_through + 1
        if first_sequence > expected and not jumps:
            raise SequenceGap(producer_id, first_sequence, expected)
        if first_sequence < expected:
            return None
        return Dedup((), first_sequence, count)

    # ---- changes ----

    def add_run(self, producer_id: str, run: Run) -> None:
        """A run assigned (or found by recovery), after the producer's last (right after
        it, unless the producer's sequences jump)."""
        runs = self._runs.setdefault(producer_id, [])
        expected = runs[-1].last_sequence + 1 if runs else 0
        assert run.first_sequence >= expected, (producer_id, run, expected)
        assert not runs or run.first_stream_sequence > runs[-1].last_stream_sequence, run
        runs.append(run)
        if len(runs) > RUNS_PER_PRODUCER_MAX:
            # The oldest runs go; the last event among them stays as a run of one, so
            # the producer's position is never lost (`forget_from`).
            drop = len(runs) - RUNS_PER_PRODUCER_MAX + 1
            last = runs[drop - 1]
            runs[:drop] = [Run(last.last_sequence, 1, last.last_stream_sequence)]

    def forget_from(self, stream_sequence: int) -> None:
        """Drop every run from `stream_sequence` on: appends whose fate recovery decides
        (a roll that could not drain), folded back in once it has."""
        self.changes += 1
        for producer_id in sorted(self._runs):
            runs = self._runs[producer_id]
            keep = bisect.bisect_left([run.first_stream_sequence for run in runs], stream_sequence)
            del runs[keep:]
            if not runs:
                del self._runs[producer_id]

    def fold_segment(
        self, epoch: int, entries: Sequence[StoredEntry]
    ) -> tuple[tuple[str, Run], ...]:
        """Add the runs of a recovered segment, its entries from index 1 to the bridge as
        recovery chose them; returns them. A mark followed by fewer events than it
        counts (the tail of a batch in doubt that recovery did not keep) is a shorter
        run."""
        runs = segment_runs(epoch, entries)
        for producer_id, run in runs:
            self.add_run(producer_id, run)
        return runs

    # ---- internals ----

    def _last_run(self, producer_id: str, before_stream_sequence: int | None) -> Run | None:
        runs = self._runs.get(producer_id)
        if not runs:
            return None
        if before_stream_sequence is None:
            return runs[-1]
        keys = [run.first_stream_sequence for run in runs]
        at = bisect.bisect_left(keys, before_stream_sequence)
        return runs[at - 1] if at else None


def segment_runs(epoch: int, entries: Sequence[StoredEntry]) -> tuple[tuple[str, Run], ...]:
    """The producer runs of segment `epoch`'s entries (consecutive, from its first mark
    on), by producer id, in index order."""
    runs = []
    for position, entry in enumerate(entries):
        if entry.kind != EntryKind.PRODUCER:
            continue
        mark = ProducerMark.decode(entry.payload)
        held = 0
        while (
            held < mark.count
            and position + 1 + held < len(entries)
            and entries[position + 1 + held].kind == EntryKind.EVENT
        ):
            held += 1
        if held:
            first = pack_sequence(epoch, entry.index + 1)
            runs.append((mark.producer_id, Run(mark.first_sequence, held, first)))
    return tuple(runs)


def _stream_sequence(runs: list[Run], firsts: list[int], sequence: int) -> int:
    """The stream sequence of `sequence` among `runs` (their first sequences `firsts`),
    0 when it is older than the runs kept."""
    at = bisect.bisect_right(firsts, sequence) - 1
    if at < 0 or sequence > runs[at].last_sequence:
        return 0
    run = runs[at]
    return run.first_stream_sequence + sequence - run.first_sequence
