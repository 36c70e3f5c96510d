"""The recovery planner: what a new leader writes to close an earlier segment.

Theory of operation. Recovery is Paxos per index with the epoch as the ballot. A new
leader has sealed at least R = N - W + 1 stores of the segment's copy set (so it meets
every write quorum) and read what they hold. From those answers alone it decides:

- `a`, the largest acked index among the answers, and the store that reported it.
  That store's copies at `<= a` are final (acked), and are taken as they are, with
  their original epoch.
- above `a`, at each index the chosen copy is the one with the highest epoch among the
  answers; an index no answer holds becomes a HOLE.
- the run ends at the FIRST chosen BRIDGE, wherever it is. At or below `a` it means the
  segment was bridged before: add nothing. Copies a store holds past a chosen bridge
  are stale and are never rewritten. With no bridge, the run ends at the largest index
  any answer holds and a new BRIDGE goes at `end + 1`.
- on a stream with producers (`end_at_first_gap`), the run ends before the first index
  above `a` no answer holds, instead of going on past a HOLE there. Nothing past it
  was acked (an acked index covers every index below it), and a producer's batch kept
  past a lost one would leave its sequences out of order in the stream: a producer
  keeps several batches in flight, and the next leader's table must never count a
  sequence as written that a hole below its mark took (the simulator's seed 158).
- every store X it bridges holds final copies only up to its own acked index `a_X`, so
  it receives the chosen copies of `a_X + 1 .. final_index` (the bridge included),
  rewritten with the leader's epoch above `a`. A store's matched index is never used:
  a store can hold a stale copy below another store's acked index (an event a failed
  leader wrote to it alone, that an earlier recovery replaced by a HOLE elsewhere), and
  trusting it would resurrect that copy.

`plan_recovery` is a pure function of the answers; `SegmentRecovery`
(`streamengine.client.core.recovery`) drives the seals, reads and writes around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.policy import ReplicationPolicy


class RecoveryError(ValueError):
    """The answers cannot be planned from."""


class TooFewAnswers(RecoveryError):
    """Fewer than R sealed stores: the decision would miss a write quorum."""


class InconsistentAnswers(RecoveryError):
    """A store answered something no correct store can hold (the peer is at fault)."""


@dataclass(frozen=True, slots=True)
class SealAnswer:
    """What a store answered to this leader's Seal."""

    store: str
    fence: int
    acked_index: int
    matched_index: int
    last_index: int

    def __post_init__(self) -> None:
        if not 0 <= self.acked_index <= self.matched_index <= self.last_index:
            raise InconsistentAnswers(
                f"store {self.store}: need acked <= matched <= last, got "
                f"{self.acked_index}, {self.matched_index}, {self.last_index}"
            )


@dataclass(frozen=True, slots=True)
class StoreAnswer:
    """A sealed store's answer and the entries read from it (index order; an index it
    does not hold is absent)."""

    seal: SealAnswer
    entries: tuple[StoredEntry, ...]

    @property
    def store(self) -> str:
        return self.seal.store

    def __post_init__(self) -> None:
        previous = 0
        for entry in self.entries:
            if entry.index <= previous:
                raise InconsistentAnswers(f"store {self.store}: entries out of order")
            previous = entry.index
        if previous > self.seal.last_index:
            raise InconsistentAnswers(
                f"store {self.store}: holds index {previous} past its last index "
                f"{self.seal.last_index}"
            )


@dataclass(frozen=True, slots=True)
class RewriteRange:
    """Indexes `first_index..last_index` a store must receive (empty when first > last:
    its acked index already covers the bridge)."""

    store: str
    first_index: int
    last_index: int

    @property
    def empty(self) -> bool:
        return self.first_index > self.last_index


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """The decision for one segment. `copies[i - copies_from]` is the copy every bridged
    store must hold at index i, for `copies_from <= i <= final_index`."""

    leader_epoch: int
    acked_index: int
    acked_store: str
    final_index: int
    existing_bridge: bool
    copies_from: int
    copies: tuple[StoredEntry, ...]
    holes: tuple[int, ...]
    ranges: tuple[RewriteRange, ...]

    @property
    def end_index(self) -> int:
        """The last index before the bridge."""
        return self.final_index - 1

    def copy_at(self, index: int) -> StoredEntry:
        if not self.copies_from <= index <= self.final_index:
            raise IndexError(f"index {index} outside {self.copies_from}..{self.final_index}")
        return self.copies[index - self.copies_from]

    def range_for(self, store: str, acked_index: int) -> RewriteRange:
        """What `store`, whose own acked index is `acked_index`, must receive. Stores
        sealed after the decision are bridged too (needed whenever R < W)."""
        return RewriteRange(store, acked_index + 1, self.final_index)

    def needs_final_copies(self, acked_index: int) -> tuple[int, int] | None:
        """The range of final copies (at or below `a`) to read from `acked_store` before
        a store with this acked index can be bridged; None if the plan holds them."""
        first = acked_index + 1
        if first >= self.copies_from:
            return None
        return first, self.copies_from - 1

    def with_final_copies(
        self, entries: Sequence[StoredEntry], source: str | None = None
    ) -> RecoveryPlan:
        """The plan extended downwards with final copies read later from `source` (by
        default `acked_store`; any store whose acked index covers them), for a store
        sealed after the decision whose acked index is lower, or the producer positions."""
        by_index = {e.index: e for e in entries if e.index < self.copies_from}
        if not by_index:
            return self
        first = min(by_index)
        missing = [i for i in range(first, self.copies_from) if i not in by_index]
        if missing:
            raise InconsistentAnswers(
                f"store {source or self.acked_store} reported its final copies but lacks "
                f"index {missing[0]}"
            )
        lower = tuple(by_index[i] for i in range(first, self.copies_from))
        return RecoveryPlan(
            self.leader_epoch,
            self.acked_index,
            self.acked_store,
            self.final_index,
            self.existing_bridge,
            first,
            lower + self.copies,
            self.holes,
            self.ranges,
        )

    def entries_for(self, rewrite: RewriteRange) -> tuple[StoredEntry, ...]:
        if rewrite.empty:
            return ()
        if rewrite.first_index < self.copies_from:
            raise IndexError(
                f"final copies from {rewrite.first_index} not read yet "
                f"(plan holds {self.copies_from}..)"
            )
        start = rewrite.first_index - self.copies_from
        return self.copies[start : rewrite.last_index - self.copies_from + 1]


def read_from_index(answers: Sequence[SealAnswer]) -> int:
    """The first index to read from the stores decided from: the final copies every one
    of them lacks start at min(a_X) + 1, and index `a` itself shows whether the segment
    was already bridged (an acked index never passes a bridge, so a bridge at or below
    `a` sits at `a`)."""
    if not answers:
        raise TooFewAnswers("no answers")
    a = max(s.acked_index for s in answers)
    lowest = min(s.acked_index for s in answers) + 1
    return max(1, min(lowest, a))


def plan_recovery(
    policy: ReplicationPolicy,
    leader_epoch: int,
    answers: Sequence[StoreAnswer],
    accept_loss: bool = False,
    end_at_first_gap: bool = False,
) -> RecoveryPlan:
    """Decide the recovery of one segment from the stores this leader sealed.

    Every answer must have been read from `read_from_index` (or lower) to its end. Fewer
    than R answers (at least one) only when `accept_loss`: an operator's choice, and
    what was acked past the answers' acked index may then be lost."""
    stores = [x.store for x in answers]
    if len(set(stores)) != len(stores):
        raise ValueError(f"a store answers twice: {stores}")
    if not answers or (len(answers) < policy.read_quorum and not accept_loss):
        raise TooFewAnswers(f"{len(answers)} sealed stores, need R = {policy.read_quorum}")
    for x in answers:
        if x.seal.fence > leader_epoch or any(e.epoch > leader_epoch for e in x.entries):
            raise InconsistentAnswers(f"store {x.store} is past epoch {leader_epoch}")

    acked = max(answers, key=lambda x: x.seal.acked_index)  # the first on ties
    a = acked.seal.acked_index
    lo = read_from_index([x.seal for x in answers])
    final = _final_copies(acked, lo, a)

    bridge_at = next((i for i, e in enumerate(final) if e.kind == EntryKind.BRIDGE), None)
    if bridge_at is not None:
        copies = tuple(final[: bridge_at + 1])
        holes: tuple[int, ...] = ()
        existing = True
    else:
        above, holes, existing = _choose_above(leader_epoch, answers, a, end_at_first_gap)
        copies = tuple(final) + above
    final_index = lo + len(copies) - 1
    ranges = tuple(RewriteRange(x.store, x.seal.acked_index + 1, final_index) for x in answers)
    return RecoveryPlan(
        leader_epoch, a, acked.store, final_index, existing, lo, copies, holes, ranges
    )


def _final_copies(acked: StoreAnswer, lo: int, a: int) -> list[StoredEntry]:
    by_index = {e.index: e for e in acked.entries if lo <= e.index <= a}
    missing = [i for i in range(lo, a + 1) if i not in by_index]
    if missing:
        raise InconsistentAnswers(
            f"store {acked.store} reported acked {a} but its read lacks index {missing[0]}"
        )
    return [by_index[i] for i in range(lo, a + 1)]


def _choose_above(
    leader_epoch: int, answers: Sequence[StoreAnswer], a: int, end_at_first_gap: bool
) -> tuple[tuple[StoredEntry, ...], tuple[int, ...], bool]:
    """Chosen copies of `a+1 .. final index` with the leader's epoch, the holes (none
    when `end_at_first_gap`), and whether the bridge was already chosen."""
    best: dict[int, StoredEntry] = {}
    for x in answers:
        for e in x.entries:
            if e.index <= a:
                continue
            held = best.get(e.index)
            if held is None or e.epoch > held.epoch:
                best[e.index] = e
            elif e.epoch == held.epoch and not e.same_content(held):
                raise InconsistentAnswers(
                    f"index {e.index}: two copies of epoch {e.epoch} differ "
                    f"(store {x.store} among them)"
                )
    last = max(best, default=a)
    if end_at_first_gap:
        last = next((i - 1 for i in range(a + 1, last + 1) if i not in best), last)
    chosen: list[StoredEntry] = []
    holes: list[int] = []
    for i in range(a + 1, last + 1):
        copy = best.get(i)
        if copy is None:
            holes.append(i)
            chosen.append(StoredEntry.make(i, EntryKind.HOLE, leader_epoch))
            continue
        chosen.append(copy.with_epoch(leader_epoch))
        if copy.kind == EntryKind.BRIDGE:
            return tuple(chosen), tuple(holes), True
    chosen.append(StoredEntry.make(last + 1, EntryKind.BRIDGE, leader_epoch))
    return tuple(chosen), tuple(holes), False
