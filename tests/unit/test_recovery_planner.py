"""The recovery planner, one named table row per rule and per case of docs/design.md
"Writing" step 2. Stores are written in RECOVERY-CASES.md's notation."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from streamengine.client.core.recovery_plan import (
    InconsistentAnswers,
    RecoveryPlan,
    SealAnswer,
    StoreAnswer,
    TooFewAnswers,
    plan_recovery,
    read_from_index,
)
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.segment_store.core.errors import BelowFence as StoreRefused
from tests.recovery_notation import entries, notation
from tests.recovery_world import CopySetWorld, RecoveringLeader

N3W2 = ReplicationPolicy(3, 2)
N3W3 = ReplicationPolicy(3, 3)
N5W3 = ReplicationPolicy(5, 3)


def answer(store: str, acked: int, held: str, fence: int = 1) -> StoreAnswer:
    copies = entries(held)
    indexes = {e.index for e in copies}
    matched = 0
    while matched + 1 in indexes:
        matched += 1
    last = max(indexes, default=0)
    return StoreAnswer(SealAnswer(store, fence, acked, matched, last), copies)


def ranges(plan: RecoveryPlan) -> str:
    return " ".join(
        f"{r.store}:none" if r.empty else f"{r.store}:{r.first_index}..{r.last_index}"
        for r in plan.ranges
    )


@dataclass(frozen=True)
class Case:
    name: str
    policy: ReplicationPolicy
    epoch: int
    stores: tuple[tuple[str, int, str], ...]  # store, acked index, held
    a: tuple[int, str]
    copies: str  # the plan's copies, indexes below copies_from shown as "."
    final_index: int
    existing_bridge: bool
    holes: tuple[int, ...]
    ranges: str
    # A stream with producers: the run ends before the first index no answer holds.
    end_at_first_gap: bool = False


CASES = [
    Case(
        "empty segment: a lone bridge at 1 on every store",
        N3W2,
        2,
        (("A", 0, "-"), ("B", 0, "-")),
        a=(0, "A"),
        copies="BR@2",
        final_index=1,
        existing_bridge=False,
        holes=(),
        ranges="A:1..1 B:1..1",
    ),
    Case(
        "a is the largest acked index, and the store that reported it",
        N3W2,
        3,
        (("A", 1, "e1@1 e2@1"), ("B", 2, "e1@1 e2@1")),
        a=(2, "B"),
        copies=". e2@1 BR@3",
        final_index=3,
        existing_bridge=False,
        holes=(),
        ranges="A:2..3 B:3..3",
    ),
    Case(
        "copies at or below a keep their original epoch; above a take the leader's",
        N3W2,
        5,
        (("A", 2, "e1@1 H@3 e3@1"), ("B", 0, "e1@1")),
        a=(2, "A"),
        copies="e1@1 H@3 e3@5 BR@5",
        final_index=4,
        existing_bridge=False,
        holes=(),
        ranges="A:3..4 B:1..4",
    ),
    Case(
        "copies at or below a come from the store that reported a, never another",
        N3W2,
        3,
        (("A", 0, "e1@1"), ("B", 1, "H@2")),
        a=(1, "B"),
        copies="H@2 BR@3",
        final_index=2,
        existing_bridge=False,
        holes=(),
        ranges="A:1..2 B:2..2",
    ),
    Case(
        "above a the copy with the highest epoch wins (an interrupted recovery's hole)",
        N3W2,
        3,
        (("A", 0, "e1@1 e2@1"), ("B", 0, "e1@2 H@2")),
        a=(0, "A"),
        copies="e1@3 H@3 BR@3",
        final_index=3,
        existing_bridge=False,
        holes=(),
        ranges="A:1..3 B:1..3",
    ),
    Case(
        "conflicting epochs: the higher epoch wins whichever store holds it",
        N5W3,
        4,
        (("A", 0, "e1@1 e2@1 e3@1"), ("B", 0, "e1@1 H@3"), ("C", 0, "e1@2 e2@2")),
        a=(0, "A"),
        copies="e1@4 H@4 e3@4 BR@4",
        final_index=4,
        existing_bridge=False,
        holes=(),
        ranges="A:1..4 B:1..4 C:1..4",
    ),
    Case(
        "an index no answer holds becomes a HOLE (holes in the middle)",
        N3W2,
        2,
        (("A", 0, "e1@1 . . e4@1"), ("B", 0, "e1@1 . e3@1")),
        a=(0, "A"),
        copies="e1@2 H@2 e3@2 e4@2 BR@2",
        final_index=5,
        existing_bridge=False,
        holes=(2,),
        ranges="A:1..5 B:1..5",
    ),
    Case(
        "several holes, above a only",
        N3W2,
        4,
        (("A", 1, "e1@1 . . . e5@1"), ("B", 0, ". e2@3")),
        a=(1, "A"),
        copies="e1@1 e2@4 H@4 H@4 e5@4 BR@4",
        final_index=6,
        existing_bridge=False,
        holes=(3, 4),
        ranges="A:2..6 B:1..6",
    ),
    Case(
        "already bridged at a: add nothing, stale copies past the bridge stay unread",
        N3W2,
        4,
        (("A", 2, "e1@1 BR@2 e3@1"), ("B", 0, "e1@1 . e3@1")),
        a=(2, "A"),
        copies="e1@1 BR@2",
        final_index=2,
        existing_bridge=True,
        holes=(),
        ranges="A:none B:1..2",
    ),
    Case(
        "already bridged at a on every store answering: nothing to write anywhere",
        N3W2,
        4,
        (("A", 2, "e1@1 BR@2"), ("B", 2, "e1@1 BR@2 e3@1")),
        a=(2, "A"),
        copies=". BR@2",
        final_index=2,
        existing_bridge=True,
        holes=(),
        ranges="A:none B:none",
    ),
    Case(
        "a bridge above a from an interrupted recovery ends the run there",
        N3W2,
        4,
        (("A", 0, "e1@1 e2@1 e3@1"), ("B", 0, "e1@2 BR@2")),
        a=(0, "A"),
        copies="e1@4 BR@4",
        final_index=2,
        existing_bridge=True,
        holes=(),
        ranges="A:1..2 B:1..2",
    ),
    Case(
        "the FIRST chosen bridge ends the run, not the largest index (B2)",
        N3W2,
        3,
        (("B", 1, "BR@2"), ("C", 0, ". e2@1")),
        a=(1, "B"),
        copies="BR@2",
        final_index=1,
        existing_bridge=True,
        holes=(),
        ranges="B:none C:1..1",
    ),
    Case(
        "a chosen bridge after a hole: the hole stays a hole",
        N3W2,
        5,
        (("A", 1, "e1@1 . BR@3"), ("B", 0, "e1@1")),
        a=(1, "A"),
        copies="e1@1 H@5 BR@5",
        final_index=3,
        existing_bridge=True,
        holes=(2,),
        ranges="A:2..3 B:1..3",
    ),
    Case(
        "stale copy below another store's acked index is rewritten, never trusted (naive)",
        N3W2,
        3,
        (("A", 0, "e1@1"), ("B", 1, "BR@2")),
        a=(1, "B"),
        copies="BR@2",
        final_index=1,
        existing_bridge=True,
        holes=(),
        ranges="A:1..1 B:none",
    ),
    Case(
        "stale copy below acked: a matched index past a is not a reason to skip",
        N3W2,
        4,
        (("A", 0, "e1@1 e2@1 e3@1"), ("B", 3, "H@2 e2@2 e3@2")),
        a=(3, "B"),
        copies="H@2 e2@2 e3@2 BR@4",
        final_index=4,
        existing_bridge=False,
        holes=(),
        ranges="A:1..4 B:4..4",
    ),
    Case(
        "N = W = 3: R = 1, one sealed store decides",
        N3W3,
        2,
        (("C", 1, "e1@1 e2@1"),),
        a=(1, "C"),
        copies="e1@1 e2@2 BR@2",
        final_index=3,
        existing_bridge=False,
        holes=(),
        ranges="C:2..3",
    ),
    Case(
        "the first of equal acked indexes is the one reported",
        N3W2,
        3,
        (("B", 1, "e1@1"), ("A", 1, "e1@1")),
        a=(1, "B"),
        copies="e1@1 BR@3",
        final_index=2,
        existing_bridge=False,
        holes=(),
        ranges="B:2..2 A:2..2",
    ),
    Case(
        "with producers, the run ends before the first index no answer holds",
        N3W2,
        2,
        (("A", 0, "e1@1 . . e4@1"), ("B", 0, "e1@1 . e3@1")),
        a=(0, "A"),
        copies="e1@2 BR@2",
        final_index=2,
        existing_bridge=False,
        holes=(),
        ranges="A:1..2 B:1..2",
        end_at_first_gap=True,
    ),
    Case(
        "with producers, a gap above a ends the run, copies below it are chosen",
        N3W2,
        4,
        (("A", 1, "e1@1 . . . e5@1"), ("B", 0, ". e2@3")),
        a=(1, "A"),
        copies="e1@1 e2@4 BR@4",
        final_index=3,
        existing_bridge=False,
        holes=(),
        ranges="A:2..3 B:1..3",
        end_at_first_gap=True,
    ),
    Case(
        "with producers and no gap, as without",
        N3W2,
        2,
        (("A", 0, "e1@1 e2@1"), ("B", 0, "e1@1")),
        a=(0, "A"),
        copies="e1@2 e2@2 BR@2",
        final_index=3,
        existing_bridge=False,
        holes=(),
        ranges="A:1..3 B:1..3",
        end_at_first_gap=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recovery_rule(case: Case) -> None:
    answers = [answer(s, acked, held) for s, acked, held in case.stores]
    plan = plan_recovery(case.policy, case.epoch, answers, end_at_first_gap=case.end_at_first_gap)
    assert (plan.acked_index, plan.acked_store) == case.a
    assert notation(plan.copies) == case.copies
    assert plan.final_index == case.final_index
    assert plan.copy_at(plan.final_index).kind == EntryKind.BRIDGE
    assert plan.existing_bridge == case.existing_bridge
    assert plan.holes == case.holes
    assert ranges(plan) == case.ranges
    for r in plan.ranges:
        written = plan.entries_for(r)
        assert [e.index for e in written] == list(range(r.first_index, r.last_index + 1))
    for e in plan.copies:
        e.verify()


def test_reads_start_low_enough_for_every_store_and_at_a() -> None:
    seals = [SealAnswer("A", 3, 4, 6, 6), SealAnswer("B", 3, 2, 2, 5)]
    assert read_from_index(seals) == 3
    assert read_from_index([SealAnswer("A", 3, 4, 4, 4), SealAnswer("B", 3, 4, 5, 5)]) == 4
    assert read_from_index([SealAnswer("A", 3, 0, 0, 0)]) == 1


def test_a_store_sealed_later_gets_its_own_range_and_the_final_copies_below() -> None:
    plan = plan_recovery(N3W3, 4, [answer("A", 2, "e1@1 e2@1 e3@1")])
    assert plan.copies_from == 2 and plan.final_index == 4
    late = plan.range_for("B", 0)
    assert (late.first_index, late.last_index) == (1, 4)
    assert plan.needs_final_copies(0) == (1, 1)
    assert plan.needs_final_copies(1) is None
    with pytest.raises(IndexError):
        plan.entries_for(late)
    wider = plan.with_final_copies(entries("e1@1 e2@1"))
    assert wider.copies_from == 1
    assert notation(wider.entries_for(late)) == "e1@1 e2@1 e3@4 BR@4"
    with pytest.raises(InconsistentAnswers):
        plan_recovery(N3W3, 4, [answer("A", 3, "e1@1 e2@1 e3@1")]).with_final_copies(
            entries("e1@1")
        )


def test_a_late_store_acked_past_the_bridge_needs_nothing() -> None:
    plan = plan_recovery(N3W2, 3, [answer("A", 0, "e1@1"), answer("B", 0, "")])
    assert plan.range_for("C", 2).empty


@pytest.mark.parametrize(
    ("name", "stores", "error"),
    [
        ("fewer than R answers", (("A", 0, "e1@1"),), TooFewAnswers),
        (
            "two copies of one epoch differ",
            (("A", 0, "e1@1"), ("B", 0, "x@1")),
            InconsistentAnswers,
        ),
        (
            "the acked store lacks a copy below its acked index",
            (("A", 2, "e1@1 e2@1"), ("B", 0, "-")),
            None,
        ),
        ("a copy above the leader's epoch", (("A", 0, "e1@7"), ("B", 0, "-")), InconsistentAnswers),
    ],
)
def test_answers_that_cannot_be_planned_from(
    name: str, stores: tuple[tuple[str, int, str], ...], error: type[Exception] | None
) -> None:
    answers = [answer(s, acked, held) for s, acked, held in stores]
    if error is None:
        # The store reported acked 2 but the read returned only index 1.
        broken = StoreAnswer(answers[0].seal, answers[0].entries[:1])
        with pytest.raises(InconsistentAnswers):
            plan_recovery(N3W2, 3, [broken, answers[1]])
        return
    with pytest.raises(error):
        plan_recovery(N3W2, 3, answers)


def test_answers_validate_themselves() -> None:
    with pytest.raises(InconsistentAnswers):
        SealAnswer("A", 1, 3, 2, 2)
    with pytest.raises(InconsistentAnswers):
        StoreAnswer(SealAnswer("A", 1, 0, 0, 1), entries(". e2@1"))
    e = StoredEntry.make(1, EntryKind.EVENT, 1, b"x")
    with pytest.raises(InconsistentAnswers):
        StoreAnswer(SealAnswer("A", 1, 0, 1, 1), (e, e))


# ---- property: over histories a real cluster can produce, recovery keeps what counts

POLICIES = [
    (N3W2, "ABC"),
    (N3W3, "ABC"),
    (ReplicationPolicy(4, 2), "ABCD"),
    (N5W3, "ABCDE"),
]
INDEX_TOP = 5


class History:
    """Leader 1 writing the segment (each event to any stores, its acked index the W-th
    largest matched index it was told), recovering leaders interrupted at any point,
    and what was held by W stores at any moment."""

    def __init__(self, world: CopySetWorld):
        self.world = world
        self.l1_matched: dict[str, int] = {}
        # index -> (epoch, kind, payload) of a copy W stores held at one moment
        self.chosen: dict[int, tuple[EntryKind, bytes]] = {}

    def leader1_write(self, store: str, index: int | None) -> None:
        w = self.world
        acked_index = w.policy.acked_index(self.l1_matched.values())
        batch = (
            [] if index is None else [StoredEntry.make(index, EntryKind.EVENT, 1, b"e%d" % index)]
        )
        try:
            r = w.stores[store].write(w.segment, 1, acked_index, batch)
        except StoreRefused:
            w.log.append(f"leader 1 write of {index} to {store} refused")
            return  # fenced by a recovering leader
        w.log.append(f"leader 1 writes {index} acked={acked_index} to {store}: {r}")
        self.l1_matched[store] = r.matched_index
        w.check()

    def note_quorums(self) -> None:
        counts: dict[tuple[int, int, EntryKind, bytes], int] = {}
        for name in self.world.names:
            for e in self.world.held(name):
                key = (e.index, e.epoch, e.kind, e.payload)
                counts[key] = counts.get(key, 0) + 1
        for (index, _, kind, payload), n in counts.items():
            if n >= self.world.policy.write_quorum:
                known = self.chosen.setdefault(index, (kind, payload))
                assert known == (kind, payload), f"index {index}: two values on W stores"


class Choices(Protocol):
    def integer(self, lo: int, hi: int) -> int: ...


class Drawn:
    """Choices drawn by hypothesis (so a failing history shrinks)."""

    def __init__(self, data: st.DataObject):
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


def _step_a_leader(choose: Choices, leaders: list[RecoveringLeader], final: bool) -> None:
    busy = [x for x in leaders if x.inflight]
    leader = busy[choose.integer(0, len(busy) - 1)]
    target = leader.inflight[choose.integer(0, len(leader.inflight) - 1)]
    mode = ("deliver", "deliver", "deliver", "lose", "repeat", "silence")[choose.integer(0, 5)]
    if mode == "silence":  # stores with a request in flight are lost; answers revive them
        leader.wait_until_lost()
        return
    if final and leader is leaders[-1] and mode == "lose":
        mode = "deliver"  # the liveness phase loses nothing of the last leader's
    if mode == "lose":
        leader.world.log.append(f"leader {leader.epoch}: lost {target}")
        leader.lose(lambda a: a is target)
    else:
        leader.deliver(lambda a: a is target, keep=mode == "repeat")


# The liveness phase draws once per delivered message, so even the smallest history is
# a few hundred draws.
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[
        HealthCheck.large_base_example,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_recovery_never_loses_what_w_stores_held_nor_changes_what_was_acked(
    data: st.DataObject,
) -> None:
    choose = Drawn(data)
    policy, names = POLICIES[choose.integer(0, len(POLICIES) - 1)]
    world = CopySetWorld(policy, tuple(names))
    try:
        check_history(choose, world)
    except BaseException:
        for line in world.log:
            note(line)
        raise


class Seeded:
    """Choices from a seeded generator: many more histories per second than hypothesis
    draws, reproducible by seed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


SEEDED_HISTORIES = 300


def test_seeded_histories_keep_what_w_stores_held_and_what_was_acked() -> None:
    for seed in range(SEEDED_HISTORIES):
        choose = Seeded(seed)
        policy, names = POLICIES[choose.integer(0, len(POLICIES) - 1)]
        world = CopySetWorld(policy, tuple(names))
        try:
            check_history(choose, world)
        except BaseException as error:
            log = "\n".join(world.log)
            raise AssertionError(f"seed {seed} ({policy}): {error!r}\n{log}") from error


def check_history(choose: Choices, world: CopySetWorld) -> None:
    """Play one random history on `world`, then check what the last leader sealed."""
    policy, names = world.policy, world.names
    history = History(world)
    leaders: list[RecoveringLeader] = []
    interrupted = choose.integer(0, 2)
    batch = (1, 2, 4096)[choose.integer(0, 2)]
    # Safety phase: leader 1 writes, recovering leaders start and stall, messages are
    # delivered, lost, repeated and reordered.
    for _ in range(choose.integer(0, 40)):
        move = choose.integer(0, 9)
        if move <= 3:
            index = choose.integer(0, INDEX_TOP) or None  # None: only the acked index
            history.leader1_write(names[choose.integer(0, len(names) - 1)], index)
        elif move == 4 and len(leaders) < interrupted:
            leaders.append(RecoveringLeader(world, 2 + len(leaders), batch))
        elif any(x.inflight for x in leaders):
            _step_a_leader(choose, leaders, final=False)
        history.note_quorums()
    # Liveness phase: the latest leader runs to its end while stale leaders' messages
    # and leader 1's writes still arrive.
    last = RecoveringLeader(world, 2 + len(leaders), batch)
    leaders.append(last)
    for _ in range(5000):
        if not last.inflight:
            break
        if choose.integer(0, 9) == 0:
            store = names[choose.integer(0, len(names) - 1)]
            history.leader1_write(store, choose.integer(1, INDEX_TOP))
        else:
            _step_a_leader(choose, leaders, final=True)
        history.note_quorums()
    assert last.op.done, "the last leader did not finish"
    final_index = last.op.final_index
    assert world.master_final == final_index

    sealed = [n for n in names if world.acked(n) >= final_index]
    assert len(sealed) >= policy.write_quorum
    replicas = [
        [(e.index, e.kind, e.payload) for e in world.held(n) if e.index <= final_index]
        for n in sealed
    ]
    assert all(r == replicas[0] for r in replicas), "sealed replicas differ"
    content = {index: (kind, payload) for index, kind, payload in replicas[0]}
    assert sorted(content) == list(range(1, final_index + 1))
    bridges = [i for i, (kind, _) in content.items() if kind == EntryKind.BRIDGE]
    assert bridges == [final_index]
    for index, value in history.chosen.items():
        if value[0] == EntryKind.BRIDGE:
            assert index == final_index, f"a bridge W stores held at {index} was moved"
        else:
            assert content.get(index) == value, f"index {index} held by W stores was lost"
    for index, (_, kind, payload) in world.served.items():
        assert content.get(index) == (kind, payload), f"acked index {index} changed"
