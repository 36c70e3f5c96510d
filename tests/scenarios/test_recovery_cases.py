"""RECOVERY-CASES.md replayed against `SegmentRecovery` and the real store core.

Each trace is replayed step by step: the stores are real `SegmentStoreCore`s over
memory, the recovering leaders are real `SegmentRecovery` operations, and the test
chooses which request is delivered next. A "fixed" variant must end in exactly the
store contents the trace shows, with no violation. For each "wrong variant" the test
stops at the step that breaks the wrong rule and shows our operation does not take it;
where it is cheap, it then takes the wrong step by hand and shows the checker catches
the violation the trace names (so these tests can fail).

Below the traces: docs/design.md's recovery rules as tables in the style of a recovery test
(pre-fill every store, run one recovery to the end, assert every store).

The traces show a store's fence from leader 1's first write; a real store has fence 0
until it is sealed, so fences are asserted from the first seal on.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from streamengine.client.core.recovery import Done, SendAcked, SendRewrite
from streamengine.protocol.policy import ReplicationPolicy
from tests.recovery_notation import entries, notation
from tests.recovery_world import (
    CopySetWorld,
    RecoveringLeader,
    Violation,
    acked,
    at_master,
    read,
    seal,
    write,
)

N3W2 = ReplicationPolicy(3, 2)
N3W3 = ReplicationPolicy(3, 3)


def decided(leader: RecoveringLeader) -> str:
    """The decision as the traces print it."""
    plan = leader.op.plan
    assert plan is not None, "not decided yet"
    ranges = " ".join(
        f"{r.store}:none" if r.empty else f"{r.store}:{r.first_index}..{r.last_index}"
        for r in plan.ranges
    )
    return (
        f"a={plan.acked_index} (store {plan.acked_store}), chosen {notation(plan.copies)}, "
        f"bridge at {plan.final_index}; rewrite ranges {ranges}"
    )


def states(world: CopySetWorld) -> dict[str, str]:
    return {n: world.show(n) for n in world.names}


def fences(world: CopySetWorld) -> dict[str, int]:
    return {n: world.fence(n) for n in world.names}


# ---- B1: a store's acked index is raised before W stores hold the recovery's copies


def b1_until_leader2_crashes() -> tuple[CopySetWorld, RecoveringLeader]:
    w = CopySetWorld(N3W2)
    w.leader_writes("A", 1, "e1@1")  # 1-2
    l2 = RecoveringLeader(w, 2)  # 4
    l2.deliver(seal("A"))  # 5
    l2.deliver(seal("B"))  # 6
    assert w.show("A") == "e1@1 acked=0" and w.show("B") == "- acked=0"
    l2.deliver(read("A"))  # 7
    l2.deliver(read("B"))  # 8
    assert decided(l2) == (  # 9
        "a=0 (store A), chosen e1@2 BR@2, bridge at 2; rewrite ranges A:1..2 B:1..2"
    )
    l2.deliver(write("A", 1))  # 10
    assert w.show("A") == "e1@2 acked=0"
    l2.deliver(write("A", 2))  # 11
    assert w.show("A") == "e1@2 BR@2 acked=0"
    return w, l2


def test_b1_fixed_ends_safe() -> None:
    w, _l2 = b1_until_leader2_crashes()
    # 12. leader 2 crashes (with writes to B still in flight)
    l3 = RecoveringLeader(w, 3)  # 13
    l3.deliver(seal("B"))  # 14
    l3.deliver(seal("C"))  # 15
    assert w.show("B") == "- acked=0" and w.show("C") == "- acked=0"
    assert (w.fence("B"), w.fence("C")) == (3, 3)
    l3.deliver(read("B"))  # 16
    l3.deliver(read("C"))  # 17
    assert decided(l3) == (  # 18
        "a=0 (store B), chosen BR@3, bridge at 1; rewrite ranges B:1..1 C:1..1"
    )
    l3.deliver(write("B", 1))  # 19
    assert w.show("B") == "BR@3 acked=0"
    l3.deliver(write("C", 1))  # 20
    assert w.show("C") == "BR@3 acked=0"
    l3.deliver(acked("B"))  # 21-22
    assert w.show("B") == "BR@3 acked=1"
    l3.deliver(acked("C"))  # 23-24
    l3.deliver(at_master())  # 25
    assert states(w) == {"A": "e1@2 BR@2 acked=0", "B": "BR@3 acked=1", "C": "BR@3 acked=1"}
    assert fences(w) == {"A": 2, "B": 3, "C": 3}
    assert w.master_final == 1 and l3.finished == [Done(1)]


def test_b1_design_strict_raise_before_w_stores_hold_is_not_taken() -> None:
    w, l2 = b1_until_leader2_crashes()
    # 12. design-strict raises A's acked index to 2 now: only A holds the run.
    assert l2.op.holding() == ("A",)
    assert not l2.ever_sent(acked("A"))
    assert all(not isinstance(a, SendAcked) for a in l2.op.outstanding())
    # Taking the wrong step by hand leads to the violation the trace names.
    w.stores["A"].write(w.segment, 2, 2, [])
    w.check()
    l3 = RecoveringLeader(w, 3)
    for step in (seal("B"), seal("C"), read("B"), read("C"), write("B", 1), write("C", 1)):
        l3.deliver(step)
    with pytest.raises(Violation, match="store B serves BRIDGE at index 1; store A served e1"):
        l3.deliver(acked("B"))


# ---- B1-eager: the raise overtakes the rewrite of a stale copy


def b1_eager_until_a_sealed_late() -> tuple[CopySetWorld, RecoveringLeader]:
    w = CopySetWorld(N3W2)
    w.leader_writes("A", 1, "e1@1")  # 1-2
    l2 = RecoveringLeader(w, 2)  # 4
    for step in (seal("B"), seal("C"), read("B"), read("C")):  # 5-8
        l2.deliver(step)
    assert decided(l2) == (  # 9
        "a=0 (store B), chosen BR@2, bridge at 1; rewrite ranges B:1..1 C:1..1"
    )
    l2.deliver(seal("A"))  # 10
    assert w.show("A") == "e1@1 acked=0" and w.fence("A") == 2
    assert l2.in_flight(write("A", 1))  # 11: A is bridged too
    return w, l2


def test_b1_eager_fixed_ends_safe() -> None:
    w, l2 = b1_eager_until_a_sealed_late()
    l2.deliver(write("A", 1))  # 12
    assert states(w) == {"A": "BR@2 acked=0", "B": "- acked=0", "C": "- acked=0"}
    assert fences(w) == {"A": 2, "B": 2, "C": 2}
    # Beyond the trace: the recovery runs to its end, every store bridged and acked.
    l2.run()
    assert states(w) == {"A": "BR@2 acked=1", "B": "BR@2 acked=1", "C": "BR@2 acked=1"}
    assert w.master_final == 1


def test_b1_eager_raise_never_overtakes_the_rewrite() -> None:
    _w, l2 = b1_eager_until_a_sealed_late()
    # B and C complete first: they are raised, A (its write unanswered) is not.
    l2.deliver(write("B", 1))
    l2.deliver(write("C", 1))
    assert l2.in_flight(acked("B")) and l2.in_flight(acked("C"))
    assert not l2.ever_sent(acked("A"))
    l2.deliver(write("A", 1))
    assert l2.in_flight(acked("A"))  # only once A answered for its range
    # The wrong order by hand: the raise reaching A before its rewrite serves e1.
    w2, _ = b1_eager_until_a_sealed_late()
    with pytest.raises(Violation, match="store A serves BRIDGE at index 1; store A served e1"):
        w2.stores["A"].write(w2.segment, 2, 1, [])
        w2.check()
        w2.stores["A"].write(w2.segment, 2, 0, entries("BR@2"))
        w2.check()


# ---- B2: the run goes on past a BRIDGE below the largest index


def b2_until_leader3_decides() -> tuple[CopySetWorld, RecoveringLeader]:
    w = CopySetWorld(N3W2)
    w.leader_writes("C", 1, ". e2@1")  # 1-3
    assert w.show("C") == ". e2@1 acked=0"
    l2 = RecoveringLeader(w, 2)  # 5
    for step in (seal("A"), seal("B"), read("A"), read("B")):  # 6-9
        l2.deliver(step)
    assert decided(l2) == (  # 10
        "a=0 (store A), chosen BR@2, bridge at 1; rewrite ranges A:1..1 B:1..1"
    )
    l2.deliver(write("A", 1))  # 11
    l2.deliver(write("B", 1))  # 12
    l2.deliver(acked("A"))  # 13-14
    l2.deliver(acked("B"))  # 15-16
    assert w.show("A") == "BR@2 acked=1" and w.show("B") == "BR@2 acked=1"
    # 17. leader 2 crashes before the master hears of it
    l3 = RecoveringLeader(w, 3)  # 18
    l3.deliver(seal("B"))  # 19
    l3.deliver(seal("C"))  # 20
    assert w.show("B") == "BR@2 acked=1" and w.show("C") == ". e2@1 acked=0"
    l3.deliver(read("B"))  # 21
    l3.deliver(read("C"))  # 22
    return w, l3


def test_b2_fixed_ends_safe() -> None:
    w, l3 = b2_until_leader3_decides()
    assert decided(l3) == (  # 23
        "a=1 (store B), chosen BR@2, bridge at 1; rewrite ranges B:none C:1..1"
    )
    l3.deliver(write("C", 1))  # 24
    assert states(w) == {"A": "BR@2 acked=1", "B": "BR@2 acked=1", "C": "BR@2 e2@1 acked=0"}
    assert fences(w) == {"A": 2, "B": 3, "C": 3}
    # 25. W stores hold the bridge; C is raised to it, and its stale e2 past the bridge
    # goes in the same batch.
    l3.deliver(acked("C"))
    l3.deliver(at_master())
    assert w.show("C") == "BR@2 acked=1"
    assert w.master_final == 1 and l3.finished == [Done(1)]


def test_b2_fix1_only_run_past_a_bridge_is_not_taken() -> None:
    w, l3 = b2_until_leader3_decides()
    plan = l3.op.plan
    assert plan is not None and plan.final_index == 1 and plan.existing_bridge
    l3.run()
    # Nothing past the first chosen bridge was ever written.
    writes = [a for a in l3.emitted if isinstance(a, SendRewrite)]
    assert [(a.store, notation(a.entries)) for a in writes] == [("C", "BR@2")]
    assert w.master_final == 1


# ---- quorum-any: after W stores hold the run, the acked index is raised on a store
# that has not answered for its own range


def quorum_any_until_b_raised() -> tuple[CopySetWorld, RecoveringLeader]:
    w = CopySetWorld(N3W2)
    w.leader_writes("A", 1, "e1@1")  # 1-2
    l2 = RecoveringLeader(w, 2)  # 4
    for step in (seal("B"), seal("C"), read("B"), read("C")):  # 5-8
        l2.deliver(step)
    assert decided(l2) == (  # 9
        "a=0 (store B), chosen BR@2, bridge at 1; rewrite ranges B:1..1 C:1..1"
    )
    l2.deliver(seal("A"))  # 10-11
    l2.deliver(write("B", 1))  # 12
    l2.deliver(write("C", 1))  # 13
    l2.deliver(acked("B"))  # 14-15
    return w, l2


def test_quorum_any_fixed_ends_safe() -> None:
    w, _l2 = quorum_any_until_b_raised()
    assert states(w) == {"A": "e1@1 acked=0", "B": "BR@2 acked=1", "C": "BR@2 acked=0"}
    assert fences(w) == {"A": 2, "B": 2, "C": 2}


def test_quorum_any_raise_on_a_store_that_has_not_answered_is_not_taken() -> None:
    w, l2 = quorum_any_until_b_raised()
    # 16. quorum-any raises A now; A's rewrite is still in flight.
    assert l2.in_flight(write("A", 1))
    assert not l2.ever_sent(acked("A"))
    assert not any(isinstance(a, SendAcked) and a.store == "A" for a in l2.op.outstanding())
    with pytest.raises(Violation, match="store A serves e1 at index 1"):
        w.stores["A"].write(w.segment, 2, 1, [])
        w.check()


# ---- naive: trusting a store's matched index below a resurrects a stale copy


def naive_until_leader3_decides() -> tuple[CopySetWorld, RecoveringLeader]:
    w = CopySetWorld(N3W2)
    w.leader_writes("A", 1, "e1@1")  # 1-2
    l2 = RecoveringLeader(w, 2)  # 4
    for step in (seal("B"), seal("C"), read("B"), read("C")):  # 5-8
        l2.deliver(step)
    assert decided(l2) == (  # 9
        "a=0 (store B), chosen BR@2, bridge at 1; rewrite ranges B:1..1 C:1..1"
    )
    for step in (write("B", 1), write("C", 1), acked("B"), acked("C")):  # 10-15
        l2.deliver(step)
    assert w.show("B") == "BR@2 acked=1" and w.show("C") == "BR@2 acked=1"
    # 16. leader 2 crashes
    l3 = RecoveringLeader(w, 3)  # 17
    l3.deliver(seal("A"))  # 18
    l3.deliver(seal("B"))  # 19
    l3.deliver(read("A"))  # 20
    l3.deliver(read("B"))  # 21
    return w, l3


def test_naive_fixed_ends_safe() -> None:
    w, l3 = naive_until_leader3_decides()
    assert decided(l3) == (  # 22
        "a=1 (store B), chosen BR@2, bridge at 1; rewrite ranges A:1..1 B:none"
    )
    assert states(w) == {"A": "e1@1 acked=0", "B": "BR@2 acked=1", "C": "BR@2 acked=1"}
    assert fences(w) == {"A": 3, "B": 3, "C": 2}
    # Beyond the trace: A is rewritten, then raised.
    l3.run()
    assert states(w) == {"A": "BR@2 acked=1", "B": "BR@2 acked=1", "C": "BR@2 acked=1"}


def test_naive_matched_index_is_not_trusted_below_a() -> None:
    w, l3 = naive_until_leader3_decides()
    meta = w.stores["A"].catalog.meta(w.segment)
    assert meta is not None and meta.matched_index == 1  # A "matches" index 1 ...
    assert l3.in_flight(write("A", 1))  # ... yet it is rewritten,
    assert not l3.ever_sent(acked("A"))  # and not raised before it answers
    with pytest.raises(Violation, match="store A serves e1 at index 1"):
        w.stores["A"].write(w.segment, 3, 1, [])
        w.check()


# ---- matched: a stale copy inflates the matched index, so a lost rewrite goes unnoticed


def matched_until_writes_lost() -> tuple[CopySetWorld, RecoveringLeader]:
    w = CopySetWorld(N3W2)
    w.leader_writes("A", 1, "e1@1")  # 1, 3
    w.leader_writes("B", 1, ". e2@1")  # 2, 4
    l2 = RecoveringLeader(w, 2)  # 6
    for step in (seal("B"), seal("C"), read("B"), read("C")):  # 7-10
        l2.deliver(step)
    assert decided(l2) == (  # 11
        "a=0 (store B), chosen H@2 e2@2 BR@2, bridge at 3; rewrite ranges B:1..3 C:1..3"
    )
    l2.deliver(seal("A"))  # 12-13
    l2.deliver(write("B", 1))  # 14
    assert w.show("B") == "H@2 e2@1 acked=0"
    l2.deliver(write("B", 3))  # 15
    for i in (1, 2, 3):  # 16-18
        l2.deliver(write("C", i))
    l2.deliver(write("A", 2))  # 19
    l2.deliver(write("A", 3))  # 20
    return w, l2


def test_matched_fixed_ends_safe() -> None:
    w, l2 = matched_until_writes_lost()
    assert states(w) == {
        "A": "e1@1 e2@2 BR@2 acked=0",
        "B": "H@2 e2@1 BR@2 acked=0",
        "C": "H@2 e2@2 BR@2 acked=0",
    }
    assert fences(w) == {"A": 2, "B": 2, "C": 2}
    # Beyond the trace: the rewrites still in flight land, and every store converges.
    l2.run()
    assert states(w) == {
        "A": "H@2 e2@2 BR@2 acked=3",
        "B": "H@2 e2@2 BR@2 acked=3",
        "C": "H@2 e2@2 BR@2 acked=3",
    }
    assert w.master_final == 3


def test_matched_index_never_confirms_a_rewrite() -> None:
    w, l2 = matched_until_writes_lost()
    for store in ("A", "B"):
        meta = w.stores[store].catalog.meta(w.segment)
        assert meta is not None and meta.matched_index == 3  # "holds" 1..3 by matched
    assert l2.op.holding() == ("C",)  # only C answered for its whole range
    assert not any(isinstance(a, SendAcked) for a in l2.emitted)
    assert l2.in_flight(write("A", 1)) and l2.in_flight(write("B", 2))
    with pytest.raises(Violation, match="store A serves e1 at index 1"):
        for store in ("C", "B", "A"):
            w.stores[store].write(w.segment, 2, 3, [])
            w.check()


# ---- docs/design.md's recovery rules: pre-fill every store, run one recovery, assert all


@dataclass(frozen=True)
class Prefill:
    name: str
    policy: ReplicationPolicy
    before: dict[str, tuple[str, int]]  # store -> (held, acked index)
    leader_epoch: int
    final_index: int
    holes: tuple[int, ...]
    after: dict[str, str]


PREFILLS = [
    Prefill(
        "empty segment: a bridge at 1 everywhere",
        N3W2,
        {"A": ("-", 0), "B": ("-", 0), "C": ("-", 0)},
        2,
        1,
        (),
        {"A": "BR@2 acked=1", "B": "BR@2 acked=1", "C": "BR@2 acked=1"},
    ),
    Prefill(
        "already bridged: nothing added, the store that missed the bridge gets it",
        N3W2,
        {"A": ("e1@1 BR@2", 2), "B": ("e1@1 BR@2", 2), "C": ("e1@1", 1)},
        3,
        2,
        (),
        {"A": "e1@1 BR@2 acked=2", "B": "e1@1 BR@2 acked=2", "C": "e1@1 BR@2 acked=2"},
    ),
    Prefill(
        "already bridged: a stale copy past the bridge is never rewritten (and goes)",
        N3W2,
        {"A": ("e1@1 BR@2", 2), "B": ("e1@1 . e3@1", 1), "C": ("-", 0)},
        3,
        2,
        (),
        # B's stale e3 past the bridge is dropped once its acked index reaches the bridge.
        {"A": "e1@1 BR@2 acked=2", "B": "e1@1 BR@2 acked=2", "C": "e1@1 BR@2 acked=2"},
    ),
    Prefill(
        "conflicting epochs: an interrupted recovery's bridge beats an older event",
        N3W2,
        {"A": ("e1@1 e2@1 e3@1", 0), "B": ("e1@2 BR@2", 0), "C": ("e1@1", 0)},
        3,
        2,
        (),
        {
            "A": "e1@3 BR@3 acked=2",  # its e3 past the bridge goes with the acked index
            "B": "e1@3 BR@3 acked=2",
            "C": "e1@3 BR@3 acked=2",
        },
    ),
    Prefill(
        "conflicting epochs: an interrupted recovery's hole beats an older event",
        N3W2,
        {"A": ("e1@1 e2@1", 0), "B": ("e1@2 H@2 e3@2", 0), "C": ("e1@1 . e3@1", 0)},
        3,
        4,
        (),
        {
            "A": "e1@3 H@3 e3@3 BR@3 acked=4",
            "B": "e1@3 H@3 e3@3 BR@3 acked=4",
            "C": "e1@3 H@3 e3@3 BR@3 acked=4",
        },
    ),
    Prefill(
        "stale copy below another store's acked index is replaced by the final copy",
        N3W2,
        {"A": ("e1@1", 0), "B": ("H@2 e2@2 BR@2", 3), "C": ("H@2 e2@2 BR@2", 0)},
        3,
        3,
        (),
        {
            "A": "H@2 e2@2 BR@2 acked=3",
            "B": "H@2 e2@2 BR@2 acked=3",
            "C": "H@2 e2@2 BR@2 acked=3",
        },
    ),
    Prefill(
        "holes in the middle",
        N3W2,
        {"A": ("e1@1 . . e4@1", 0), "B": (". . e3@1", 0), "C": ("-", 0)},
        2,
        5,
        (2,),
        {
            "A": "e1@2 H@2 e3@2 e4@2 BR@2 acked=5",
            "B": "e1@2 H@2 e3@2 e4@2 BR@2 acked=5",
            "C": "e1@2 H@2 e3@2 e4@2 BR@2 acked=5",
        },
    ),
    Prefill(
        "acked copies keep their epoch; each store is written above its own acked index",
        N3W2,
        {"A": ("e1@1 e2@1 e3@1", 2), "B": ("e1@1 e2@1", 1), "C": ("e1@1", 0)},
        4,
        4,
        (),
        {
            "A": "e1@1 e2@1 e3@4 BR@4 acked=4",
            "B": "e1@1 e2@1 e3@4 BR@4 acked=4",
            "C": "e1@1 e2@1 e3@4 BR@4 acked=4",
        },
    ),
    Prefill(
        "N = W = 3: one store decides, the stores sealed later are bridged too",
        N3W3,
        {"A": ("e1@1 e2@1", 1), "B": ("e1@1", 1), "C": ("e1@1 e2@1 e3@1", 1)},
        2,
        3,
        (),
        {
            "A": "e1@1 e2@2 BR@2 acked=3",
            "B": "e1@1 e2@2 BR@2 acked=3",
            "C": "e1@1 e2@2 BR@2 acked=3",
        },
    ),
]


@pytest.mark.parametrize("case", PREFILLS, ids=lambda c: c.name)
def test_recovery_rule_on_real_stores(case: Prefill) -> None:
    w = CopySetWorld(case.policy)
    for store, (held, acked_index) in case.before.items():
        for e in entries(held):
            w.stores[store].write(w.segment, e.epoch, 0, [e])
        if acked_index:
            top = max(e.epoch for e in entries(held))
            w.stores[store].write(w.segment, top, acked_index, [])
        assert w.show(store) == f"{held} acked={acked_index}"
    leader = RecoveringLeader(w, case.leader_epoch, batch_entries_max=2)
    leader.run()
    plan = leader.op.plan
    assert plan is not None and plan.final_index == case.final_index
    assert plan.holes == case.holes
    assert states(w) == case.after
    assert set(fences(w).values()) == {case.leader_epoch}
    assert w.master_final == case.final_index
    assert leader.finished == [Done(case.final_index)]
