"""The recovery planner, one named table row per rule and per case of DESIGN.md
"Writing" step 2. Stores are written in RECOVERY-CASES.md's notation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from client.core.entry import EntryKind, StoredEntry
from client.core.policy import ReplicationPolicy
from client.core.recovery import (
    InconsistentAnswers,
    RecoveryPlan,
    SealAnswer,
    StoreAnswer,
    TooFewAnswers,
    plan_recovery,
    read_from_index,
)
from tests.recovery_notation import entries, notation

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


CASES = [
    Case(
        "empty segment: a lone bridge at 1 on every store",
        N3W2, 2, (("A", 0, "-"), ("B", 0, "-")),
        a=(0, "A"), copies="BR@2", final_index=1, existing_bridge=False, holes=(),
        ranges="A:1..1 B:1..1",
    ),
    Case(
        "a is the largest acked index, and the store that reported it",
        N3W2, 3, (("A", 1, "e1@1 e2@1"), ("B", 2, "e1@1 e2@1")),
        a=(2, "B"), copies=". e2@1 BR@3", final_index=3, existing_bridge=False,
        holes=(), ranges="A:2..3 B:3..3",
    ),
    Case(
        "copies at or below a keep their original epoch; above a take the leader's",
        N3W2, 5, (("A", 2, "e1@1 H@3 e3@1"), ("B", 0, "e1@1")),
        a=(2, "A"), copies="e1@1 H@3 e3@5 BR@5", final_index=4, existing_bridge=False,
        holes=(), ranges="A:3..4 B:1..4",
    ),
    Case(
        "copies at or below a come from the store that reported a, never another",
        N3W2, 3, (("A", 0, "e1@1"), ("B", 1, "H@2")),
        a=(1, "B"), copies="H@2 BR@3", final_index=2, existing_bridge=False, holes=(),
        ranges="A:1..2 B:2..2",
    ),
    Case(
        "above a the copy with the highest epoch wins (an interrupted recovery's hole)",
        N3W2, 3, (("A", 0, "e1@1 e2@1"), ("B", 0, "e1@2 H@2")),
        a=(0, "A"), copies="e1@3 H@3 BR@3", final_index=3, existing_bridge=False,
        holes=(), ranges="A:1..3 B:1..3",
    ),
    Case(
        "conflicting epochs: the higher epoch wins whichever store holds it",
        N5W3, 4, (("A", 0, "e1@1 e2@1 e3@1"), ("B", 0, "e1@1 H@3"), ("C", 0, "e1@2 e2@2")),
        a=(0, "A"), copies="e1@4 H@4 e3@4 BR@4", final_index=4, existing_bridge=False,
        holes=(), ranges="A:1..4 B:1..4 C:1..4",
    ),
    Case(
        "an index no answer holds becomes a HOLE (holes in the middle)",
        N3W2, 2, (("A", 0, "e1@1 . . e4@1"), ("B", 0, "e1@1 . e3@1")),
        a=(0, "A"), copies="e1@2 H@2 e3@2 e4@2 BR@2", final_index=5, existing_bridge=False,
        holes=(2,), ranges="A:1..5 B:1..5",
    ),
    Case(
        "several holes, above a only",
        N3W2, 4, (("A", 1, "e1@1 . . . e5@1"), ("B", 0, ". e2@3")),
        a=(1, "A"), copies="e1@1 e2@4 H@4 H@4 e5@4 BR@4", final_index=6,
        existing_bridge=False, holes=(3, 4), ranges="A:2..6 B:1..6",
    ),
    Case(
        "already bridged at a: add nothing, stale copies past the bridge stay unread",
        N3W2, 4, (("A", 2, "e1@1 BR@2 e3@1"), ("B", 0, "e1@1 . e3@1")),
        a=(2, "A"), copies="e1@1 BR@2", final_index=2, existing_bridge=True, holes=(),
        ranges="A:none B:1..2",
    ),
    Case(
        "already bridged at a on every store answering: nothing to write anywhere",
        N3W2, 4, (("A", 2, "e1@1 BR@2"), ("B", 2, "e1@1 BR@2 e3@1")),
        a=(2, "A"), copies=". BR@2", final_index=2, existing_bridge=True, holes=(),
        ranges="A:none B:none",
    ),
    Case(
        "a bridge above a from an interrupted recovery ends the run there",
        N3W2, 4, (("A", 0, "e1@1 e2@1 e3@1"), ("B", 0, "e1@2 BR@2")),
        a=(0, "A"), copies="e1@4 BR@4", final_index=2, existing_bridge=True, holes=(),
        ranges="A:1..2 B:1..2",
    ),
    Case(
        "the FIRST chosen bridge ends the run, not the largest index (B2)",
        N3W2, 3, (("B", 1, "BR@2"), ("C", 0, ". e2@1")),
        a=(1, "B"), copies="BR@2", final_index=1, existing_bridge=True, holes=(),
        ranges="B:none C:1..1",
    ),
    Case(
        "a chosen bridge after a hole: the hole stays a hole",
        N3W2, 5, (("A", 1, "e1@1 . BR@3"), ("B", 0, "e1@1")),
        a=(1, "A"), copies="e1@1 H@5 BR@5", final_index=3, existing_bridge=True,
        holes=(2,), ranges="A:2..3 B:1..3",
    ),
    Case(
        "stale copy below another store's acked index is rewritten, never trusted (naive)",
        N3W2, 3, (("A", 0, "e1@1"), ("B", 1, "BR@2")),
        a=(1, "B"), copies="BR@2", final_index=1, existing_bridge=True, holes=(),
        ranges="A:1..1 B:none",
    ),
    Case(
        "stale copy below acked: a matched index past a is not a reason to skip",
        N3W2, 4, (("A", 0, "e1@1 e2@1 e3@1"), ("B", 3, "H@2 e2@2 e3@2")),
        a=(3, "B"), copies="H@2 e2@2 e3@2 BR@4", final_index=4, existing_bridge=False,
        holes=(), ranges="A:1..4 B:4..4",
    ),
    Case(
        "N = W = 3: R = 1, one sealed store decides",
        N3W3, 2, (("C", 1, "e1@1 e2@1"),),
        a=(1, "C"), copies="e1@1 e2@2 BR@2", final_index=3, existing_bridge=False,
        holes=(), ranges="C:2..3",
    ),
    Case(
        "the first of equal acked indexes is the one reported",
        N3W2, 3, (("B", 1, "e1@1"), ("A", 1, "e1@1")),
        a=(1, "B"), copies="e1@1 BR@3", final_index=2, existing_bridge=False, holes=(),
        ranges="B:2..2 A:2..2",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recovery_rule(case: Case) -> None:
    plan = plan_recovery(
        case.policy, case.epoch, [answer(s, acked, held) for s, acked, held in case.stores]
    )
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
        ("two copies of one epoch differ", (("A", 0, "e1@1"), ("B", 0, "x@1")),
         InconsistentAnswers),
        ("the acked store lacks a copy below its acked index",
         (("A", 2, "e1@1 e2@1"), ("B", 0, "-")), None),
        ("a copy above the leader's epoch", (("A", 0, "e1@7"), ("B", 0, "-")),
         InconsistentAnswers),
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
