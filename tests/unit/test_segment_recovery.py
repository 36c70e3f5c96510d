"""SegmentRecovery's protocol: what it sends after which answers, one rule per test.
Safety over whole histories is in test_recovery_planner.py (property) and
tests/scenarios/test_recovery_cases.py (RECOVERY-CASES.md)."""

from __future__ import annotations

import pytest

from streamengine.client.core.segment_recovery import (
    Action,
    Deposed,
    Done,
    MasterSealed,
    ReadAnswered,
    RecoveryFenced,
    SealAnswered,
    SealAtMaster,
    SegmentRecovery,
    SendAcked,
    SendRead,
    SendSeal,
    SendWrite,
    StoreLost,
    WriteAnswered,
)
from streamengine.protocol.policy import ReplicationPolicy
from tests.recovery_notation import entries, notation
from tests.recovery_world import Leader, World, this

N3W2 = ReplicationPolicy(3, 2)
N3W3 = ReplicationPolicy(3, 3)
N5W3 = ReplicationPolicy(5, 3)


def sealed(store: str, acked: int = 0, matched: int = 0, last: int = 0, fence: int = 3):
    return SealAnswered(store, fence, acked, matched, last)


def held(write: SendWrite) -> WriteAnswered:
    """The store's answer when it now holds exactly what was sent."""
    first, last = write.entries[0].index, write.entries[-1].index
    return WriteAnswered(write.store, first, last, tuple(e.epoch for e in write.entries), 0)


def writes(actions: list[Action]) -> list[SendWrite]:
    return [a for a in actions if isinstance(a, SendWrite)]


def test_seals_every_store_and_reads_once_r_stores_answered() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    assert op.start() == [SendSeal("A", 3), SendSeal("B", 3), SendSeal("C", 3)]
    assert op.step(sealed("B", 1, 2, 2)) == []
    assert op.step(sealed("A", 0, 0, 0)) == [SendRead("B", 1, 0), SendRead("A", 1, 0)]
    assert op.step(sealed("A", 0, 0, 0)) == []  # a duplicate
    assert op.step(sealed("C")) == []  # sealed late: bridged once decided, not read


def test_decides_from_the_first_r_answers_and_bridges_the_late_ones() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start()
    op.step(sealed("A"))
    op.step(sealed("B", 1, 1, 1))
    op.step(sealed("C", 0, 1, 1))
    op.step(ReadAnswered("A", 1, 0, (), 3))
    out = op.step(ReadAnswered("B", 1, 0, entries("e1@1"), 3))
    assert op.plan is not None and op.final_index == 2
    assert [(w.store, notation(w.entries)) for w in writes(out)] == [
        ("A", "e1@1 BR@3"),
        ("B", ". BR@3"),
        ("C", "e1@1 BR@3"),  # its own e1 is not trusted: its acked index is 0
    ]


def test_raises_acked_only_after_w_stores_hold_and_only_on_those() -> None:
    op = SegmentRecovery(N5W3, 1, 2, ["A", "B", "C", "D", "E"])
    op.start()
    for s in "ABCDE":
        op.step(sealed(s, fence=2))
    out = []
    for s in "ABC":
        out += op.step(ReadAnswered(s, 1, 0, (), 2))
    by_store = {w.store: w for w in writes(out)}
    assert sorted(by_store) == ["A", "B", "C", "D", "E"]
    assert op.step(held(by_store["A"])) == []
    assert op.step(held(by_store["D"])) == []
    assert op.step(held(by_store["B"])) == [SendAcked("A", 1), SendAcked("B", 1), SendAcked("D", 1)]
    assert op.step(held(by_store["E"])) == [SendAcked("E", 1)]
    # SealAtMaster only once W stores answered with their acked index at the bridge.
    assert op.step(WriteAnswered("A", 0, 0, (), 1)) == []
    assert op.step(WriteAnswered("A", 0, 0, (), 1)) == []  # a duplicate counts once
    assert op.step(WriteAnswered("D", 0, 0, (), 1)) == []
    assert op.step(WriteAnswered("E", 0, 0, (), 1)) == [SealAtMaster(1)]
    assert op.step(WriteAnswered("B", 0, 0, (), 1)) == []
    assert op.step(MasterSealed(7)) == []  # not ours
    assert op.step(MasterSealed(1)) == [Done(1)]
    assert op.done
    assert op.step(held(by_store["C"])) == [SendAcked("C", 1)]  # late stores still raised


def test_a_write_is_held_only_when_its_answer_says_so() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start()
    op.step(sealed("A"))
    op.step(sealed("B"))
    op.step(ReadAnswered("A", 1, 0, (), 3))
    out = op.step(ReadAnswered("B", 1, 0, (), 3))
    a, _ = writes(out)
    # An answer without held epochs, or holding an older copy, confirms nothing.
    assert op.step(WriteAnswered("A", 1, 1, (), 1)) == [a]
    assert op.step(WriteAnswered("A", 1, 1, (1,), 1)) == [a]
    assert op.step(WriteAnswered("B", 1, 1, (3,), 0)) == []
    assert op.holding() == ("B",)
    # A higher epoch held is the same content (a later recovery of an earlier leader).
    assert op.step(WriteAnswered("A", 1, 1, (3,), 0)) == [SendAcked("A", 1), SendAcked("B", 1)]


def test_a_fence_above_the_leader_deposes_it() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start()
    assert op.step(RecoveryFenced("A", 3)) == []  # its own epoch
    assert op.step(sealed("A", fence=4)) == [Deposed(4)]
    assert op.deposed
    assert op.step(sealed("B")) == []
    assert op.outstanding() == []


def test_a_read_showing_a_later_epoch_deposes_the_leader() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start()
    op.step(sealed("A"))
    op.step(sealed("B"))
    assert op.step(ReadAnswered("A", 1, 0, entries("BR@4"), 4)) == [Deposed(4)]


def test_a_lost_store_is_replaced_among_those_decided_from() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start()
    op.step(sealed("A", 2, 2, 2))
    op.step(sealed("B", 2, 2, 2))
    op.step(sealed("C", 0, 0, 0))
    assert op.step(StoreLost("B")) == [SendRead("A", 1, 0), SendRead("C", 1, 0)]
    op.step(ReadAnswered("A", 2, 0, entries(". e2@1"), 3))  # the older read: not enough
    assert op.plan is None
    op.step(ReadAnswered("C", 1, 0, (), 3))
    op.step(ReadAnswered("A", 1, 0, entries("e1@1 e2@1"), 3))
    assert op.plan is not None
    assert (op.plan.acked_index, op.plan.acked_store, op.final_index) == (2, "A", 3)
    assert [r.store for r in op.plan.ranges] == ["A", "C"]


def test_a_late_store_below_the_read_range_gets_final_copies_read_first() -> None:
    op = SegmentRecovery(N3W3, 1, 2, ["A", "B", "C"])
    op.start()
    assert op.step(sealed("A", 2, 3, 3, fence=2)) == [SendRead("A", 2, 0)]
    out = op.step(ReadAnswered("A", 2, 0, entries(". e2@1 e3@1"), 2))
    assert [notation(w.entries) for w in writes(out)] == [". . e3@2 BR@2"]
    assert op.step(sealed("B", 0, 0, 0, fence=2)) == [SendRead("A", 1, 1)]
    assert op.outstanding()[-2:] == [SendRead("A", 1, 1), writes(out)[0]]
    out = op.step(ReadAnswered("A", 1, 1, entries("e1@1"), 2))
    assert [(w.store, notation(w.entries)) for w in writes(out)] == [("B", "e1@1 e2@1 e3@2 BR@2")]


def test_outstanding_is_what_still_awaits_an_answer_lost_stores_included() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start()
    op.step(sealed("A"))
    op.step(StoreLost("C"))
    # C is asked again: only its answer can bring it back (a recovery may need it).
    assert op.outstanding() == [SendSeal("B", 3), SendSeal("C", 3)]
    op.step(sealed("B"))
    assert op.outstanding() == [SendSeal("C", 3), SendRead("A", 1, 0), SendRead("B", 1, 0)]


def test_duplicated_and_reordered_delivery_ends_the_same() -> None:
    def run(newest_first: bool, twice: bool) -> tuple[dict[str, str], list[Action]]:
        w = World(N3W2)
        w.leader_writes("A", 1, "e1@1 . . e4@1")
        w.leader_writes("B", 1, ". . e3@1")
        leader = Leader(w, 2, batch_entries_max=1)
        while leader.inflight:
            target = leader.inflight[-1 if newest_first else 0]
            if twice:
                leader.deliver(this(target), keep=True)
            leader.deliver(this(target))
        assert len([a for a in leader.emitted if isinstance(a, SealAtMaster)]) == 1
        return {n: w.show(n) for n in w.names}, leader.finished

    assert run(False, False) == run(False, True)
    assert run(False, False) == (
        {n: "e1@2 H@2 e3@2 e4@2 BR@2 acked=5" for n in "ABC"},
        [Done(5)],
    )
    # Newest first, C and B are sealed first and decide: e1 and e4, on A alone, were
    # never acked and become holes.
    assert run(True, False) == run(True, True)
    assert run(True, False) == ({n: "H@2 H@2 e3@2 BR@2 acked=4" for n in "ABC"}, [Done(4)])


def test_refuses_a_copy_set_that_does_not_fit_the_policy() -> None:
    with pytest.raises(ValueError):
        SegmentRecovery(N3W2, 1, 2, ["A", "B"])
    with pytest.raises(ValueError):
        SegmentRecovery(N3W2, 1, 2, ["A", "A", "B"])
    with pytest.raises(ValueError):
        SegmentRecovery(N3W2, 2, 2, ["A", "B", "C"])
    op = SegmentRecovery(N3W2, 1, 2, ["A", "B", "C"])
    with pytest.raises(ValueError):
        op.step(sealed("Z"))


def test_a_window_of_batches_in_flight_per_store() -> None:
    op = SegmentRecovery(N3W3, 1, 2, ["A", "B", "C"], batch_entries_max=1)
    op.start()
    op.step(sealed("A", 0, 6, 6, fence=2))
    out = writes(op.step(ReadAnswered("A", 1, 0, entries("e1@1 e2@1 e3@1 e4@1 e5@1 e6@1"), 2)))
    assert [w.entries[0].index for w in out] == [1, 2, 3, 4]  # of 1..7
    assert [w.entries[0].index for w in writes(op.step(held(out[2])))] == [5]
    assert writes(op.step(held(out[2]))) == []  # a duplicate answer frees nothing
    assert [w.entries[0].index for w in writes(op.outstanding())] == [1, 2, 4, 5]


def test_a_store_given_up_on_comes_back_by_answering() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start()
    op.step(sealed("A"))
    op.step(sealed("B", 0, 1, 1))
    assert op.step(StoreLost("B")) == []  # no other sealed store to decide from
    op.step(ReadAnswered("A", 1, 0, (), 3))
    assert op.plan is None
    out = op.step(ReadAnswered("B", 1, 0, entries("e1@1"), 3))  # B answers after all
    assert op.plan is not None and op.final_index == 2
    assert [w.store for w in writes(out)] == ["A", "B"]
