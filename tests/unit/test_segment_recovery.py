"""SegmentRecovery's protocol: what it sends after which answers, one rule per test.
Safety over whole histories is in test_recovery_planner.py (property) and
tests/scenarios/test_recovery_cases.py (RECOVERY-CASES.md)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from streamengine.client.core.recovery import (
    RECOVERY_BATCH_BYTES_MAX,
    TIMING,
    Action,
    Deposed,
    Done,
    Event,
    MasterSealed,
    ReadAnswered,
    RecoveryFenced,
    RecoveryTiming,
    SealAnswered,
    SealAtMaster,
    SegmentRecovery,
    SendAcked,
    SendRead,
    SendRewrite,
    SendSeal,
    StoreBusy,
    WriteAnswered,
    split_batches,
)
from streamengine.client.core.replicator import Tick
from streamengine.protocol.certificate import ContentDigest, certificate_of
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.policy import ReplicationPolicy
from tests.recovery_notation import entries, notation
from tests.recovery_world import CopySetWorld, RecoveringLeader, this

# The certificate of a segment that holds its bridge alone.
BRIDGE_ONLY = certificate_of([(1, int(EntryKind.BRIDGE), b"")])

N3W2 = ReplicationPolicy(3, 2)
N3W3 = ReplicationPolicy(3, 3)
N5W3 = ReplicationPolicy(5, 3)
RETRANSMIT = TIMING.retransmit_ms
LOST = TIMING.store_lost_ms
BUSY = TIMING.busy_pause_ms
LATE = TIMING.late_stores_ms


def sealed(store: str, acked: int = 0, matched: int = 0, last: int = 0, fence: int = 3):
    return SealAnswered(store, fence, acked, matched, last)


def held(write: SendRewrite) -> WriteAnswered:
    """The store's answer when it now holds exactly what was sent."""
    first, last = write.entries[0].index, write.entries[-1].index
    return WriteAnswered(write.store, first, last, tuple(e.epoch for e in write.entries), 0)


def writes(actions: Sequence[Action]) -> list[SendRewrite]:
    return [a for a in actions if isinstance(a, SendRewrite)]


def test_seals_every_store_and_reads_once_r_stores_answered() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    assert op.start(0) == [SendSeal("A", 3), SendSeal("B", 3), SendSeal("C", 3)]
    assert op.step(0, sealed("B", 1, 2, 2)) == []
    assert op.step(0, sealed("A", 0, 0, 0)) == [SendRead("B", 1, 0), SendRead("A", 1, 0)]
    assert op.step(0, sealed("A", 0, 0, 0)) == []  # a duplicate
    assert op.step(0, sealed("C")) == []  # sealed late: bridged once decided, not read


def test_decides_from_the_first_r_answers_and_bridges_the_late_ones() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A"))
    op.step(0, sealed("B", 1, 1, 1))
    op.step(0, sealed("C", 0, 1, 1))
    op.step(0, ReadAnswered("A", 1, 0, (), 3))
    out = op.step(0, ReadAnswered("B", 1, 0, entries("e1@1"), 3))
    assert op.plan is not None and op.final_index == 2
    assert [(w.store, notation(w.entries)) for w in writes(out)] == [
        ("A", "e1@1 BR@3"),
        ("B", ". BR@3"),
        ("C", "e1@1 BR@3"),  # its own e1 is not trusted: its acked index is 0
    ]


def test_raises_acked_only_after_w_stores_hold_and_only_on_those() -> None:
    op = SegmentRecovery(N5W3, 1, 2, ["A", "B", "C", "D", "E"])
    op.start(0)
    for s in "ABCDE":
        op.step(0, sealed(s, fence=2))
    out = []
    for s in "ABC":
        out += op.step(0, ReadAnswered(s, 1, 0, (), 2))
    by_store = {w.store: w for w in writes(out)}
    assert sorted(by_store) == ["A", "B", "C", "D", "E"]
    assert op.step(0, held(by_store["A"])) == []
    assert op.step(0, held(by_store["D"])) == []
    assert op.step(0, held(by_store["B"])) == [
        SendAcked("A", 1),
        SendAcked("B", 1),
        SendAcked("D", 1),
    ]
    assert op.step(0, held(by_store["E"])) == [SendAcked("E", 1)]
    # SealAtMaster only once W stores answered with their acked index at the bridge.
    assert op.step(0, WriteAnswered("A", 0, 0, (), 1)) == []
    assert op.step(0, WriteAnswered("A", 0, 0, (), 1)) == []  # a duplicate counts once
    assert op.step(0, WriteAnswered("D", 0, 0, (), 1)) == []
    # Nothing was acked anywhere: the plan holds the whole content, the bridge alone.
    assert op.step(0, WriteAnswered("E", 0, 0, (), 1)) == [SealAtMaster(1, BRIDGE_ONLY)]
    assert op.step(0, WriteAnswered("B", 0, 0, (), 1)) == []
    assert op.step(0, MasterSealed(7)) == []  # not ours
    assert op.step(0, MasterSealed(1)) == [Done(1)]
    assert op.done
    assert op.step(0, held(by_store["C"])) == [SendAcked("C", 1)]  # late stores still raised


def test_a_write_is_held_only_when_its_answer_says_so() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A"))
    op.step(0, sealed("B"))
    op.step(0, ReadAnswered("A", 1, 0, (), 3))
    out = op.step(0, ReadAnswered("B", 1, 0, (), 3))
    a, _ = writes(out)
    # An answer without held epochs, or holding an older copy, confirms nothing.
    assert op.step(0, WriteAnswered("A", 1, 1, (), 1)) == [a]
    assert op.step(0, WriteAnswered("A", 1, 1, (1,), 1)) == [a]
    assert op.step(0, WriteAnswered("B", 1, 1, (3,), 0)) == []
    assert op.holding() == ("B",)
    # A higher epoch held is the same content (a later recovery of an earlier leader).
    assert op.step(0, WriteAnswered("A", 1, 1, (3,), 0)) == [SendAcked("A", 1), SendAcked("B", 1)]


def test_a_store_acking_less_than_it_held_is_rewritten_from_its_acked_index() -> None:
    """Simulator seeds 12301 and 13120 (stores with fsync never): a store that held its
    whole rewrite restarted without part of it and answered every raise of its acked
    index with less; asking again only repeated that, and the recovery never ended.
    It is rewritten from what it acks now, then raised again."""
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A", 0, 1, 1))
    op.step(0, sealed("B", 0, 4, 4))
    op.step(0, ReadAnswered("A", 1, 0, entries("e1@1"), 3))
    a, b = writes(op.step(0, ReadAnswered("B", 1, 0, entries("e1@1 e2@1 e3@1 e4@1"), 3)))
    op.step(0, held(a))
    assert op.step(0, held(b)) == [SendAcked("A", 5), SendAcked("B", 5)]
    assert op.step(0, WriteAnswered("B", 0, 0, (), 5)) == []
    # A keeps 1..3 of its rewrite: past the last index it had when sealed (soak 14112).
    [again] = writes(op.step(0, WriteAnswered("A", 0, 0, (), 3)))
    assert (again.store, again.acked_index) == ("A", 3)
    assert [e.index for e in again.entries] == [4, 5]
    assert op.step(0, held(again)) == [SendAcked("A", 5)]
    [sealing] = op.step(0, WriteAnswered("A", 0, 0, (), 5))
    assert isinstance(sealing, SealAtMaster) and sealing.final_index == 5


def test_a_fence_above_the_leader_deposes_it() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    assert op.step(0, RecoveryFenced("A", 3)) == []  # its own epoch
    assert op.step(0, sealed("A", fence=4)) == [Deposed(4)]
    assert op.deposed
    assert op.step(0, sealed("B")) == []
    assert op.outstanding() == []


def test_a_read_showing_a_later_epoch_deposes_the_leader() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A"))
    op.step(0, sealed("B"))
    assert op.step(0, ReadAnswered("A", 1, 0, entries("BR@4"), 4)) == [Deposed(4)]


def test_a_lost_store_is_replaced_among_those_decided_from() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A", 2, 2, 2))
    op.step(0, sealed("B", 2, 2, 2))
    op.step(0, sealed("C", 0, 0, 0))
    op.step(1000, ReadAnswered("A", 3, 0, (), 3))
    # B leaves its read unanswered for STORE_LOST: decide from A and C instead (C acked
    # nothing, so both are read from 1), and probe B.
    assert op.step(LOST, Tick()) == [SendRead("A", 1, 0), SendRead("C", 1, 0), SendSeal("B", 3)]
    assert op.lost() == ("B",)
    op.step(LOST, ReadAnswered("A", 2, 0, entries(". e2@1"), 3))  # an older read: not enough
    assert op.plan is None
    op.step(LOST, ReadAnswered("C", 1, 0, (), 3))
    op.step(LOST, ReadAnswered("A", 1, 0, entries("e1@1 e2@1"), 3))
    assert op.plan is not None
    assert (op.plan.acked_index, op.plan.acked_store, op.final_index) == (2, "A", 3)
    assert [r.store for r in op.plan.ranges] == ["A", "C"]


def test_a_late_store_below_the_read_range_gets_final_copies_read_first() -> None:
    op = SegmentRecovery(N3W3, 1, 2, ["A", "B", "C"])
    op.start(0)
    assert op.step(0, sealed("A", 2, 3, 3, fence=2)) == [SendRead("A", 2, 0)]
    out = op.step(0, ReadAnswered("A", 2, 0, entries(". e2@1 e3@1"), 2))
    assert [notation(w.entries) for w in writes(out)] == [". . e3@2 BR@2"]
    assert op.step(0, sealed("B", 0, 0, 0, fence=2)) == [SendRead("A", 1, 1)]
    assert op.outstanding()[-2:] == [SendRead("A", 1, 1), writes(out)[0]]
    out = op.step(0, ReadAnswered("A", 1, 1, entries("e1@1"), 2))
    assert [(w.store, notation(w.entries)) for w in writes(out)] == [("B", "e1@1 e2@1 e3@2 BR@2")]


def test_final_copies_the_acked_store_lost_leave_the_late_store_waiting() -> None:
    """Simulator seed 12672 (fsync never): the store the decision took its acked index
    from restarted without the copies a late store needs and answered the read without
    them. A peer's answer: the recovery goes on without bridging the late store (asking
    again would get the same answer) instead of raising out of `step` and ending the
    writer."""
    op = SegmentRecovery(N3W3, 1, 2, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A", 3, 4, 4, fence=2))
    op.step(0, ReadAnswered("A", 3, 0, entries(". . e3@1 e4@1"), 2))
    assert op.step(0, sealed("B", 0, 0, 0, fence=2)) == [SendRead("A", 1, 2)]
    assert op.step(0, ReadAnswered("A", 1, 2, entries("e1@1"), 2)) == []  # no e2
    assert not [r for r in op.outstanding() if isinstance(r, SendRead)]
    assert [w.store for w in writes(op.outstanding())] == ["A"]  # nothing for B


def test_a_decider_whose_read_shows_its_seal_lost_is_sealed_again() -> None:
    """Simulator seed 11951 (fsync never): A answered the seal with acked 2, restarted
    without syncing and answered the read with no fence and nothing held. Deciding on its
    old seal answer would ask the read for copies it no longer has (`InconsistentAnswers`
    raised out of `step`, ending the writer); its seal is asked again and the decision
    waits for R answers that still hold."""
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A", 2, 2, 2))
    assert op.step(0, sealed("B", 0, 0, 0)) == [SendRead("A", 1, 0), SendRead("B", 1, 0)]
    op.step(0, ReadAnswered("B", 1, 0, (), 3))
    assert op.step(0, ReadAnswered("A", 1, 0, (), 0)) == [SendSeal("A", 3)]
    assert op.plan is None
    op.step(0, sealed("C", 1, 1, 1))
    assert op.step(0, ReadAnswered("C", 1, 0, entries("e1@1"), 3))
    assert op.plan is not None
    assert (op.plan.acked_index, op.plan.acked_store) == (1, "C")
    # Sealed again, A is bridged as any late store.
    assert [w.store for w in writes(op.step(0, sealed("A", 0, 0, 0)))] == ["A"]


def test_outstanding_is_what_still_awaits_an_answer_lost_stores_included() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A"))
    op.step(LOST, Tick())
    assert op.lost() == ("B", "C")
    # They are asked again: only an answer can bring a store back (recovery may need it).
    assert op.outstanding() == [SendSeal("B", 3), SendSeal("C", 3)]
    op.step(LOST, sealed("B"))
    assert op.outstanding() == [SendSeal("C", 3), SendRead("A", 1, 0), SendRead("B", 1, 0)]


def test_duplicated_and_reordered_delivery_ends_the_same() -> None:
    def run(newest_first: bool, twice: bool) -> tuple[dict[str, str], list[Action]]:
        w = CopySetWorld(N3W2)
        w.leader_writes("A", 1, "e1@1 . . e4@1")
        w.leader_writes("B", 1, ". . e3@1")
        leader = RecoveringLeader(w, 2, batch_entries_max=1)
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
        SegmentRecovery(N3W2, 1, 2, [])
    with pytest.raises(ValueError):
        SegmentRecovery(N3W2, 1, 2, ["A", "B", "C", "D"])
    with pytest.raises(ValueError):
        SegmentRecovery(N3W2, 1, 2, ["A", "A", "B"])
    with pytest.raises(ValueError):
        SegmentRecovery(N3W2, 2, 2, ["A", "B", "C"])
    op = SegmentRecovery(N3W2, 1, 2, ["A", "B", "C"])
    op.start(0)
    with pytest.raises(ValueError):
        op.step(0, sealed("Z"))


def test_a_copy_set_a_rebuild_left_short_decides_from_r_and_bridges_w_of_its_members() -> None:
    """A rebuilt master's copy set of two for N=3 (the third member reported nothing in
    time): the absent member never answers, the two decide (R = 2) and hold the bridge
    (W = 2)."""
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B"])
    assert op.start(0) == [SendSeal("A", 3), SendSeal("B", 3)]
    op.step(0, sealed("A", 1, 2, 2))
    op.step(0, sealed("B", 2, 2, 2))
    op.step(0, ReadAnswered("A", 1, 0, entries("e1@1 e2@1"), 3))
    out = op.step(0, ReadAnswered("B", 1, 0, entries("e1@1 e2@1"), 3))
    assert op.plan is not None and op.final_index == 3
    assert sorted(w.store for w in writes(out)) == ["A", "B"]
    raises = [a for write in writes(out) for a in op.step(10, held(write))]
    assert raises == [SendAcked("A", 3), SendAcked("B", 3)]
    assert op.step(20, WriteAnswered("A", 0, 0, (), 3)) == []
    seal = op.step(20, WriteAnswered("B", 0, 0, (), 3))
    assert [a.final_index for a in seal if isinstance(a, SealAtMaster)] == [3]
    assert op.step(30, MasterSealed(3)) == [Done(3)]


def test_a_copy_set_shorter_than_r_never_decides_without_accepting_loss() -> None:
    """One member of N=3 W=2 (R = 2) left by a rebuild: what the absent two held may
    be acked past what it holds, so it decides nothing, however long it waits."""
    op = SegmentRecovery(N3W2, 1, 3, ["A"])
    out = op.start(0)
    out += op.step(10, sealed("A", 2, 2, 2))
    out += op.step(20, ReadAnswered("A", 1, 0, entries("e1@1 e2@1"), 3))
    now = 0
    while now < 3 * LOST:
        now = op.deadline_ms() or now + RETRANSMIT
        out += op.step(now, Tick())
    assert op.plan is None and not writes(out)


def test_a_window_of_batches_in_flight_per_store() -> None:
    op = SegmentRecovery(N3W3, 1, 2, ["A", "B", "C"], batch_entries_max=1)
    op.start(0)
    op.step(0, sealed("A", 0, 6, 6, fence=2))
    out = writes(op.step(0, ReadAnswered("A", 1, 0, entries("e1@1 e2@1 e3@1 e4@1 e5@1 e6@1"), 2)))
    assert [w.entries[0].index for w in out] == [1, 2, 3, 4]  # of 1..7
    assert [w.entries[0].index for w in writes(op.step(0, held(out[2])))] == [5]
    assert writes(op.step(0, held(out[2]))) == []  # a duplicate answer frees nothing
    assert [w.entries[0].index for w in writes(op.outstanding())] == [1, 2, 4, 5]


def test_a_lost_store_is_probed_and_revived_by_its_answer() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A"))
    op.step(0, sealed("B", 0, 1, 1))
    op.step(100, ReadAnswered("A", 1, 0, (), 3))
    # B (its read) and C (its seal) are silent: lost, with no other sealed store to
    # decide from. Each is probed with its seal, every RETRANSMIT, and nothing else.
    assert op.step(LOST, Tick()) == [SendSeal("B", 3), SendSeal("C", 3)]
    assert op.lost() == ("B", "C") and op.plan is None
    assert op.deadline_ms() == LOST + RETRANSMIT
    assert op.step(LOST + RETRANSMIT - 1, Tick()) == []
    assert op.step(LOST + RETRANSMIT, Tick()) == [SendSeal("B", 3), SendSeal("C", 3)]
    # B answers the probe: back among those decided from, its read goes out again at once.
    assert op.step(LOST + RETRANSMIT + 100, sealed("B", 0, 1, 1)) == [SendRead("B", 1, 0)]
    assert op.lost() == ("C",)
    out = op.step(LOST + RETRANSMIT + 200, ReadAnswered("B", 1, 0, entries("e1@1"), 3))
    assert op.plan is not None and op.final_index == 2
    assert [w.store for w in writes(out)] == ["A", "B"]


# ---- time: retransmits, lost stores, busy stores, late stores (RecoveryTiming) ----


def test_an_unanswered_request_goes_out_again_after_the_interval_and_not_before() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    table: list[tuple[int, Event, list[Action], int | None]] = [
        # (now, event, actions, deadline after)
        (RETRANSMIT - 1, Tick(), [], RETRANSMIT),
        (RETRANSMIT, Tick(), [SendSeal("A", 3), SendSeal("B", 3), SendSeal("C", 3)], 1000),
        (700, sealed("A"), [], 1000),  # answered: not sent again
        (999, Tick(), [], 1000),
        (1000, Tick(), [SendSeal("B", 3), SendSeal("C", 3)], 1500),
        (1200, sealed("B"), [SendRead("A", 1, 0), SendRead("B", 1, 0)], 1500),
        (1500, Tick(), [SendSeal("C", 3)], 1700),
        (1700, ReadAnswered("A", 1, 0, (), 3), [SendRead("B", 1, 0)], 2000),
    ]
    for now, event, actions, deadline in table:
        assert (now, op.step(now, event), op.deadline_ms()) == (now, actions, deadline)


def test_the_deadline_is_the_earliest_pending_decision() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    table: list[tuple[int, Event, int | None, str]] = [
        # (now, event, deadline after, the decision it is for)
        (0, Tick(), RETRANSMIT, "the seals go out again"),
        (LOST - 100, Tick(), LOST, "the stores are lost, before the seals' next retransmit"),
        (LOST, Tick(), LOST - 100 + RETRANSMIT, "lost: their seals probe them"),
        (LOST + 10, sealed("A"), LOST - 100 + RETRANSMIT, "B and C are probed"),
        (LOST + 20, sealed("B"), LOST - 100 + RETRANSMIT, "C is probed (A, B read)"),
        (LOST - 100 + RETRANSMIT, Tick(), LOST + 20 + RETRANSMIT, "A and B's reads again"),
    ]
    for now, event, deadline, why in table:
        op.step(now, event)
        assert (why, op.deadline_ms()) == (why, deadline)


def test_a_silent_store_becomes_lost_and_the_recovery_decides_from_the_others() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(10, sealed("A"))
    op.step(10, sealed("B", 0, 1, 1))  # read, with A
    op.step(20, sealed("C"))  # late: not read
    op.step(30, ReadAnswered("A", 1, 0, (), 3))
    # B has left its read (sent at 10) unanswered; every 500 ms it goes out again.
    for now in range(510, LOST + 10, RETRANSMIT):
        assert op.step(now, Tick()) == [SendRead("B", 1, 0)] and not op.lost()
    # Lost at 10 + STORE_LOST: C replaces it among those decided from; B is probed.
    assert op.step(LOST + 9, Tick()) == []
    assert op.step(LOST + 10, Tick()) == [SendRead("C", 1, 0), SendSeal("B", 3)]
    out = op.step(LOST + 20, ReadAnswered("C", 1, 0, (), 3))
    assert op.plan is not None and op.final_index == 1  # B's e1 was never seen: unacked
    assert [w.store for w in writes(out)] == ["A", "B", "C"]  # B too, should it answer
    # Its batches are not retransmitted while it is lost; it is only probed.
    assert op.step(LOST + 10 + RETRANSMIT, Tick()) == [SendSeal("B", 3)]


def test_a_store_answering_is_not_lost_while_another_request_to_it_waits() -> None:
    op = SegmentRecovery(N3W3, 1, 2, ["A", "B", "C"], batch_entries_max=1)
    op.start(0)
    op.step(0, sealed("A", 0, 3, 3, fence=2))
    out = writes(op.step(0, ReadAnswered("A", 1, 0, entries("e1@1 e2@1 e3@1"), 2)))
    assert [w.entries[0].index for w in out] == [1, 2, 3, 4]
    # A answers one batch every 1500 ms (slower than a retransmit, faster than lost).
    for i, w in enumerate(out[:3], start=1):
        assert out[3] in op.step(i * 1500, held(w))  # the last batch: sent again
        assert "A" not in op.lost()  # (B and C, which never answered, are)


def test_a_batch_refused_busy_goes_out_again_after_the_busy_pause() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A"))
    op.step(0, sealed("B"))
    op.step(0, ReadAnswered("A", 1, 0, (), 3))
    a, _ = writes(op.step(0, ReadAnswered("B", 1, 0, (), 3)))
    assert op.step(100, StoreBusy("A", 1)) == []
    assert op.deadline_ms() == 100 + BUSY
    assert op.step(100 + BUSY - 1, Tick()) == []
    assert op.step(100 + BUSY, Tick()) == [a]
    assert op.deadline_ms() == RETRANSMIT  # C's seal, B's batch: the next decisions
    # Busy, A answered: it is not lost meanwhile, however long it stays busy.
    for now in range(200, 3 * LOST, 200):
        op.step(now, StoreBusy("A", 1))
    assert "A" not in op.lost()
    assert writes(op.step(3 * LOST, held(a))) == []


def test_late_stores_are_bridged_for_a_while_after_done_then_it_finishes() -> None:
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"])
    op.start(0)
    op.step(0, sealed("A"))
    op.step(0, sealed("B"))
    op.step(0, ReadAnswered("A", 1, 0, (), 3))
    a, b = writes(op.step(0, ReadAnswered("B", 1, 0, (), 3)))
    op.step(0, held(a))
    op.step(0, held(b))
    op.step(0, WriteAnswered("A", 0, 0, (), 1))
    assert op.step(0, WriteAnswered("B", 0, 0, (), 1)) == [SealAtMaster(1, BRIDGE_ONLY)]
    assert op.step(100, MasterSealed(1)) == [Done(1)]
    # C has not answered its seal: it is still asked, then probed, until the window ends.
    assert op.step(3000, Tick()) == [SendSeal("C", 3)]
    assert op.lost() == ("C",)
    out = op.step(3100, sealed("C"))  # it answers late: bridged
    assert [(w.store, notation(w.entries)) for w in writes(out)] == [("C", "BR@3")]
    assert op.step(100 + LATE - 1, Tick()) == writes(out)
    assert op.deadline_ms() == 100 + LATE  # before the write's next retransmit
    assert op.step(100 + LATE, Tick()) == []
    assert op.finished and op.deadline_ms() is None and op.outstanding() == []
    assert op.step(100 + LATE, held(writes(out)[0])) == []


def test_it_finishes_once_done_with_nothing_left_to_send() -> None:
    w = CopySetWorld(N3W2)
    leader = RecoveringLeader(w, 2)
    leader.run()
    assert leader.finished == [Done(1)]
    assert leader.op.finished and leader.op.deadline_ms() is None


def test_timing_relations_are_checked() -> None:
    RecoveryTiming(retransmit_ms=1, store_lost_ms=2, busy_pause_ms=1, late_stores_ms=1)
    for bad in (
        {"retransmit_ms": 2_000},  # never lost before a retransmit
        {"busy_pause_ms": 0},
        {"busy_pause_ms": 600},
        {"late_stores_ms": 0},
    ):
        with pytest.raises(ValueError):
            RecoveryTiming(**bad)


# ---- the certificate sent with the seal ----


def _seal_at_master(op: SegmentRecovery, reads: dict[str, tuple[int, tuple[StoredEntry, ...]]]):
    """Seal A and B (A acked 3, B acked 2 of events 1..3), answer their reads and
    writes; the SealAtMaster the recovery sends."""
    op.start(0)
    op.step(0, sealed("A", 3, 3, 3, fence=2))
    out = op.step(0, sealed("B", 2, 3, 3, fence=2))
    for store, (first, held_entries) in reads.items():
        out += op.step(0, ReadAnswered(store, first, 0, held_entries, 2))
    for write in writes(out):
        out += op.step(0, held(write))
    for acked in [a for a in out if isinstance(a, SendAcked)]:
        out += op.step(0, WriteAnswered(acked.store, 0, 0, (), acked.acked_index))
    [seal] = [a for a in out if isinstance(a, SealAtMaster)]
    return seal


EVENTS = tuple(StoredEntry.make(i, EntryKind.EVENT, 1, b"event %d" % i) for i in (1, 2, 3))


def test_a_drained_segment_is_sealed_with_the_certificate_of_what_its_writer_appended() -> None:
    known = ContentDigest()
    known.add_events(1, [e.payload for e in EVENTS])
    op = SegmentRecovery(N3W2, 1, 2, ["A", "B", "C"], known=known)
    seal = _seal_at_master(op, {"A": (3, EVENTS[2:]), "B": (3, EVENTS[2:])})
    rows = [(e.index, int(e.kind), e.payload) for e in EVENTS]
    assert seal == SealAtMaster(4, certificate_of([*rows, (4, int(EntryKind.BRIDGE), b"")]))
    assert known.through_index == 3, "the writer's digest is never changed"


def test_a_takeover_that_never_read_below_the_acked_indexes_seals_without_one() -> None:
    op = SegmentRecovery(N3W2, 1, 2, ["A", "B", "C"])
    seal = _seal_at_master(op, {"A": (3, EVENTS[2:]), "B": (3, EVENTS[2:])})
    assert seal == SealAtMaster(4, None)  # W replicas certify it at the master


def test_a_writer_digest_that_does_not_fit_the_plan_is_not_sent() -> None:
    known = ContentDigest()
    known.add_events(1, [e.payload for e in EVENTS[:2]])  # says 2 events; stores hold 3
    op = SegmentRecovery(N3W2, 1, 2, ["A", "B", "C"], known=known)
    seal = _seal_at_master(op, {"A": (3, EVENTS[2:]), "B": (3, EVENTS[2:])})
    assert seal == SealAtMaster(4, None)


# ---- accepting loss (an operator's `seal --accept-loss`) ----


def _lone_survivor(
    accept_loss: bool, held_entries: tuple[StoredEntry, ...] = EVENTS, acked: int = 2
) -> tuple[SegmentRecovery, list[Action]]:
    """A answers the seal (acked `acked`, holding `held_entries`, events 1..3 unless
    told); B and C never do (wiped). The recovery runs at epoch 3."""
    op = SegmentRecovery(N3W2, 1, 3, ["A", "B", "C"], accept_loss=accept_loss)
    last = held_entries[-1].index if held_entries else 0
    out = op.start(0)
    out += op.step(10, sealed("A", acked, max(acked, last if last else 0), last, fence=3))
    out += op.step(20, ReadAnswered("A", 1, 0, held_entries, 3))
    now = 0
    while now < 3 * LOST:
        now = op.deadline_ms() or now + RETRANSMIT
        out += op.step(now, Tick())
    return op, out


def test_without_accepting_loss_fewer_than_r_stores_never_decide() -> None:
    op, out = _lone_survivor(accept_loss=False)
    assert op.plan is None and not writes(out)
    assert set(op.lost()) == {"B", "C"}


def _bridge_lone_survivor(
    op: SegmentRecovery, out: list[Action], now: int
) -> tuple[list[Action], SealAtMaster | None]:
    """Answer A's rewrites (and any raise) until the recovery seals at the master."""
    for rewrite in set(writes(out)):
        out = out + op.step(now, held(rewrite))
    for raise_ in [a for a in out if isinstance(a, SendAcked)]:
        out += op.step(now, WriteAnswered(raise_.store, 0, 0, (), raise_.acked_index))
    seals = [a for a in out if isinstance(a, SealAtMaster)]
    return out, seals[-1] if seals else None


# Accepting loss from a lone survivor A of N = 3, W = 2 (R = 2): what A holds (the
# traces' notation) and its acked index; the plan's content, and the SealAtMaster's
# declared loss (0: nothing lost). Loss runs from `a + 1` unless the acked index
# reached a bridge the plan found; to the segment's end either way.
ACCEPTING_LOSS = [
    # Event 3 was held but not known acked: what the old leader acked past 2 may be gone.
    ("e1@1 e2@1 e3@1", 2, "e1@1 e2@1 e3@3 BR@3", 3),
    # Issue 35, defect 2: a bridge above the acked index, left by an interrupted
    # recovery, proves nothing: acked e2 may have been where the HOLE goes.
    ("e1@1 . e3@2 BR@2", 1, "e1@1 H@3 e3@3 BR@3", 2),
    # Every index held is acked: what lay past 3 on the lost replicas may have been.
    ("e1@1 e2@1 e3@1", 3, "e1@1 e2@1 e3@1 BR@3", 4),
    # The acked index reached the bridge: a recovery sealed it, nothing was acked past.
    ("e1@1 e2@1 BR@2", 3, "e1@1 e2@1 BR@2", 0),
    # Nothing held at all: everything the segment had may be lost.
    ("-", 0, "BR@3", 1),
]


@pytest.mark.parametrize(("held_by_a", "acked", "chosen", "lost_from"), ACCEPTING_LOSS)
def test_accepting_loss_declares_lost_from_the_first_index_past_what_was_known_acked(
    held_by_a: str, acked: int, chosen: str, lost_from: int
) -> None:
    held_entries = entries(held_by_a)
    op, out = _lone_survivor(True, held_entries, acked)
    plan = op.plan
    assert plan is not None
    # Below `copies_from`, the final copies stay as A holds them (never rewritten).
    final_copies = [e for e in held_entries if e.index < plan.copies_from]
    assert notation([*final_copies, *plan.copies]) == chosen
    out, seal = _bridge_lone_survivor(op, out, 3 * LOST)
    assert seal is not None and seal.final_index == op.final_index
    assert seal.lost_from_index == lost_from
    assert op.lost_from_index() == lost_from and op.declares_loss() == bool(lost_from)


def test_accepting_loss_records_the_loss_at_the_master_before_any_acked_index_rises() -> None:
    """Face 2 of the hole: a recovery that raised the survivors' acked index to the
    bridge, then died before the master recorded the loss, left stores that tell every
    later reader and recovery "nothing lost up to the bridge". Raised after the seal, a
    survivor's acked index stops below the loss: a reader tailing it before it learns
    of the seal would be handed the lost range and hop its bridge (simulator seed 78)."""
    op, out = _lone_survivor(accept_loss=True)
    [rewrite] = set(writes(out))
    assert rewrite.store == "A" and [e.index for e in rewrite.entries] == [3, 4]
    out = op.step(3 * LOST, held(rewrite))
    assert not [a for a in out if isinstance(a, SendAcked)], "raised before the master knew"
    [seal] = [a for a in out if isinstance(a, SealAtMaster)]
    assert seal.final_index == 4 and seal.lost_from_index == 3
    # A retransmit of the seal declares the same loss.
    resent = op.step(3 * LOST + RETRANSMIT, Tick())
    assert seal in resent and not [a for a in resent if isinstance(a, SendAcked)]
    out = op.step(3 * LOST + RETRANSMIT + 1, MasterSealed(4))
    # Raised to what was known acked, never into the loss (nor to the bridge).
    assert out == [Done(4), SendAcked("A", 2)]
    op.step(3 * LOST + RETRANSMIT + 2, WriteAnswered("A", 0, 0, (), 2))
    assert op.outstanding() == [SendSeal("B", 3), SendSeal("C", 3)]  # the lost, probed


def test_a_store_answering_after_the_lossy_decision_is_bridged_and_raised_below_the_loss() -> None:
    """B, counted lost, answers once the seal declaring the loss went out: the seal goes
    on unchanged (no second decision), and B is bridged; with two answering, the raise
    (below the loss) waits for both to hold, as W = 2 asks."""
    op, out = _lone_survivor(accept_loss=True)
    [rewrite] = set(writes(out))
    now = 3 * LOST
    [seal] = [a for a in op.step(now, held(rewrite)) if isinstance(a, SealAtMaster)]
    late = op.step(now + 1, sealed("B", 1, 3, 3, fence=3))
    [late_rewrite] = writes(late)
    assert late_rewrite.store == "B" and [e.index for e in late_rewrite.entries] == [2, 3, 4]
    assert seal in op.step(now + RETRANSMIT + 1, Tick())  # resent as it was
    assert op.step(now + RETRANSMIT + 2, MasterSealed(4)) == [Done(4)]
    raised = op.step(now + RETRANSMIT + 3, held(late_rewrite))
    assert raised == [SendAcked("A", 2), SendAcked("B", 2)]


def test_accepting_loss_declares_it_once_the_late_survivors_hold_too() -> None:
    """The master records the loss once every survivor that answered holds the bridge
    (W of them at most); a survivor bridged after the master's answer is raised then."""
    op = SegmentRecovery(N5W3, 1, 3, ["A", "B", "C", "D", "E"], accept_loss=True)
    out = op.start(0)
    out += op.step(10, sealed("A", 2, 3, 3, fence=3))
    out += op.step(10, sealed("B", 1, 3, 3, fence=3))
    out += op.step(20, ReadAnswered("A", 1, 0, EVENTS, 3))
    out += op.step(20, ReadAnswered("B", 1, 0, EVENTS, 3))
    now = 0
    while op.plan is None:
        now = op.deadline_ms() or now + RETRANSMIT
        out += op.step(now, Tick())
    by_store = {w.store: w for w in writes(out)}
    out = op.step(now, held(by_store["A"]))
    assert not [a for a in out if isinstance(a, SealAtMaster)], "B does not hold the bridge yet"
    out = op.step(now, held(by_store["B"]))
    [seal] = [a for a in out if isinstance(a, SealAtMaster)]
    assert seal.lost_from_index == 3 and not [a for a in out if isinstance(a, SendAcked)]
    out = op.step(now + 1, MasterSealed(4))
    assert out == [Done(4), SendAcked("A", 2), SendAcked("B", 2)]
    assert op.certificate() is None, "no replica reaches the bridge to be checked"


def test_accepting_loss_with_r_answers_is_the_ordinary_recovery() -> None:
    op = SegmentRecovery(N3W2, 1, 2, ["A", "B", "C"], accept_loss=True)
    assert _seal_at_master(op, {"A": (1, EVENTS), "B": (1, EVENTS)}).lost_from_index == 0


def test_accepting_loss_waits_for_every_store_to_answer_or_be_lost() -> None:
    op = SegmentRecovery(N3W2, 1, 2, ["A", "B", "C"], accept_loss=True)
    op.start(0)
    op.step(10, sealed("A", 2, 3, 3, fence=2))
    op.step(20, ReadAnswered("A", 1, 0, EVENTS, 2))
    assert op.plan is None, "B and C may still answer: no decision before they are lost"


def test_rewrites_are_cut_to_a_replys_size_for_the_shared_connection() -> None:
    """A recovery's rewrites ride the client's connection to the store beside reads
    and tails: none holds more than `RECOVERY_BATCH_BYTES_MAX` of values (but a lone
    entry larger than that), and none more entries than a store takes at once."""
    size = RECOVERY_BATCH_BYTES_MAX // 3
    large = [StoredEntry.make(i, EntryKind.EVENT, 1, bytes(size)) for i in range(1, 8)]
    batches = split_batches("s1", large, acked=7)
    assert [[e.index for e in b.entries] for b in batches] == [[1, 2], [3, 4], [5, 6], [7]]
    assert all(b.store == "s1" and b.acked_index == 7 for b in batches)
    huge = [StoredEntry.make(1, EntryKind.EVENT, 1, bytes(RECOVERY_BATCH_BYTES_MAX + 1))]
    assert len(split_batches("s1", huge, acked=1)) == 1
    small = [StoredEntry.make(i, EntryKind.EVENT, 1, b"e") for i in range(1, 6)]
    assert [len(b.entries) for b in split_batches("s1", small, 5, entries_max=2)] == [2, 2, 1]
