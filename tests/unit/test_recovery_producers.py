"""A recovery that keeps producer positions (`SegmentRecovery(producers=...)`): it reads
the final copies below the run it decides from, folds the segment's marks into the
positions of the segment before, seals with them, and hands the runs to the leader."""

from __future__ import annotations

from collections import deque

from streamengine.client.core.recovery import (
    TIMING,
    Action,
    Done,
    MasterSealed,
    ProducerSeal,
    ReadAnswered,
    SealAnswered,
    SealAtMaster,
    SegmentRecovery,
    SendAcked,
    SendRead,
    SendRewrite,
    WriteAnswered,
)
from streamengine.client.core.replicator import Tick
from streamengine.protocol.entry import EntryKind, ProducerMark, StoredEntry
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.producers import ProducerPosition, Run
from streamengine.protocol.sequence import pack_sequence

P = "orders-ingest-7"
BEFORE = (ProducerPosition("other", 5, pack_sequence(1, 3)),)


def mark(index: int, first: int, count: int) -> StoredEntry:
    return StoredEntry.make(index, EntryKind.PRODUCER, 2, ProducerMark(P, first, count).encode())


def event(index: int) -> StoredEntry:
    return StoredEntry.make(index, EntryKind.EVENT, 2, b"e%d" % index)


# Segment 2: P's 0..1 behind the mark at 1, then P's 2..3 behind the mark at 4, of which
# only 2 reached a store before its writer died.
SEGMENT = (mark(1, 0, 2), event(2), event(3), mark(4, 2, 2), event(5))
# How far each store holds it.
LAST_HELD = {"A": 5, "B": 4, "C": 3}


def answer(action: Action, final_index: int) -> object:
    """What a store that does as asked answers."""
    if isinstance(action, SendRead):
        last = LAST_HELD[action.store]
        held = [e for e in SEGMENT if action.from_index <= e.index <= last]
        if action.to_index:
            held = [e for e in held if e.index <= action.to_index]
        return ReadAnswered(action.store, action.from_index, action.to_index, tuple(held), 3)
    if isinstance(action, SendRewrite):
        first, last = action.entries[0].index, action.entries[-1].index
        epochs = tuple(e.epoch for e in action.entries)
        return WriteAnswered(action.store, first, last, epochs, 0)
    assert isinstance(action, SendAcked)
    return WriteAnswered(action.store, 0, 0, (), final_index)


def test_a_recovery_keeping_producers_folds_the_whole_segment_before_it_seals() -> None:
    op = SegmentRecovery(
        ReplicationPolicy(3, 2), 2, 3, ["A", "B", "C"], producers=ProducerSeal(BEFORE, False)
    )
    actions = deque(op.start(0))
    actions.extend(op.step(0, SealAnswered("A", 3, 3, 5, 5)))
    actions.extend(op.step(0, SealAnswered("B", 3, 2, 4, 4)))
    actions.extend(op.step(0, SealAnswered("C", 3, 2, 3, 3)))
    seal: SealAtMaster | None = None
    held_back: list[SendRead] = []
    while actions:
        action = actions.popleft()
        if isinstance(action, SealAtMaster):
            seal = action
            continue
        if isinstance(action, SendRead) and action.to_index:
            held_back.append(action)  # the final copies below the decided run
            continue
        if not isinstance(action, SendRead | SendRewrite | SendAcked):
            continue  # the seals, answered above
        actions.extend(op.step(0, answer(action, op.final_index)))  # type: ignore[arg-type]
        if not actions and held_back:
            # Every store holds the bridge, yet the seal waits for the content below.
            assert seal is None
            actions.extend(op.step(0, answer(held_back.pop(), op.final_index)))  # type: ignore[arg-type]
    assert held_back == [] and seal is not None and op.final_index == 6
    # By producer id: P's last event is 2, at index 5; "other" stands where it stood.
    assert seal.producers == (ProducerPosition(P, 2, pack_sequence(2, 5)), BEFORE[0])
    assert op.step(0, MasterSealed(6)) == [
        Done(6, ((P, Run(0, 2, pack_sequence(2, 2))), (P, Run(2, 1, pack_sequence(2, 5)))))
    ]


def test_a_drained_segment_seals_with_the_positions_its_writer_knew() -> None:
    known = (ProducerPosition(P, 9, pack_sequence(2, 11)),)
    op = SegmentRecovery(
        ReplicationPolicy(3, 2), 2, 3, ["A", "B", "C"], producers=ProducerSeal(known, True)
    )
    op.start(0)
    out = [*op.step(0, SealAnswered("A", 3, 0, 0, 0)), *op.step(0, SealAnswered("B", 3, 0, 0, 0))]
    seals: list[SealAtMaster] = []
    pending = deque(out)
    while pending:
        action = pending.popleft()
        if isinstance(action, SealAtMaster):
            seals.append(action)
        elif isinstance(action, SendRead | SendRewrite | SendAcked):
            if isinstance(action, SendRead):
                reply = ReadAnswered(action.store, action.from_index, action.to_index, (), 3)
                pending.extend(op.step(0, reply))
            else:
                pending.extend(op.step(0, answer(action, op.final_index)))  # type: ignore[arg-type]
    [seal] = seals
    assert seal.producers == known


def test_final_copies_are_read_from_another_store_once_the_one_asked_is_lost() -> None:
    """Runtime seed 303: the read of the final copies below the decided run went to the
    store the acked index came from, which was then wiped and answered that read never
    again; nothing asked another store, and the seal at the master (which waits for the
    positions those copies give) never went out: the new leader's gate stayed shut.
    Once that store is lost, a store whose own acked index covers them is read."""
    op = SegmentRecovery(
        ReplicationPolicy(3, 2), 2, 3, ["A", "B", "C"], producers=ProducerSeal(BEFORE, False)
    )
    op.start(0)
    op.step(0, SealAnswered("A", 3, 3, 5, 5))
    pending = deque(op.step(0, SealAnswered("B", 3, 3, 4, 4)))
    pending.extend(op.step(0, SealAnswered("C", 3, 2, 3, 3)))
    sent: list[Action] = []
    now = 0
    while now <= 4 * TIMING.store_lost_ms:
        while pending:
            action = pending.popleft()
            sent.append(action)
            if not isinstance(action, SendRead | SendRewrite | SendAcked):
                continue
            if action.store == "A" and op.plan is not None:
                continue  # wiped once the run is decided: it answers nothing more
            pending.extend(op.step(now, answer(action, op.final_index)))  # type: ignore[arg-type]
        deadline = op.deadline_ms()
        if deadline is None or any(isinstance(a, SealAtMaster) for a in sent):
            break
        now = deadline
        pending.extend(op.step(now, Tick()))
    final_reads = [a for a in sent if isinstance(a, SendRead) and a.to_index]
    assert [(r.store, r.from_index, r.to_index) for r in final_reads][-1] == ("B", 1, 2)
    [seal] = [a for a in sent if isinstance(a, SealAtMaster)]
    assert seal.producers == (ProducerPosition(P, 2, pack_sequence(2, 5)), BEFORE[0])
