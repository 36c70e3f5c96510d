"""A closing writer's acked index reaches the stores it could not tell, through the
master (`master.core.leader_acked`): the writer hands it over with its lease only when
some store never said it knows it, the master keeps it with the segment's record and
passes it on in heartbeat replies to each store that reports less, and a store keeps
it as a leader's Write's (clamped to what it holds, never lowered, never in a segment
fenced past its epoch). The runtime world's seed 227 found the gap: a Spark write task
whose rows stayed unread after its stores came back."""

from __future__ import annotations

import pytest

from streamengine.client.core.replicator import Append, SendWrite, Tick, WriteReplied
from streamengine.client.core.writer import Leader, Release, ReleaseLease
from streamengine.master.catalog import decode_segment, encode_segment
from streamengine.master.core.leader_acked import LeaderAckedOwed
from streamengine.master.core.model import Held, SegmentRecord, SegmentState
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.segment_store.core.commands import (
    AckedRaised,
    RaiseAckedCommand,
    SealCommand,
    SegmentKey,
)
from streamengine.segment_store.core.errors import BadRequest
from streamengine.segment_store.kv import MemoryKV
from tests.store_commands import CommandedCore
from tests.unit.test_leader import leading, of_type, signed, step

# ---- the writer: what its release hands over ----


def _appended_and_answered(acked_by: dict[str, int]) -> Leader:
    """A leader of epoch 5 whose append of one event W stores hold, each store then
    saying it knows acked index `acked_by[store]` (absent: it never answers)."""
    leader = leading()
    actions = step(leader, 10, Append((b"a",)))
    for send in of_type(actions, SendWrite):
        step(leader, 11, WriteReplied(send.store, send.request_id, False, 1, 0, 1, 1))
    assert leader.replicator is not None and leader.replicator.acked_index == 1
    broadcast = step(leader, 20, Tick())
    for send in of_type(broadcast, SendWrite):
        if send.store in acked_by:
            reply = WriteReplied(send.store, send.request_id, False, 1, acked_by[send.store])
            step(leader, 21, reply)
    return leader


@pytest.mark.parametrize(
    ("acked_by", "handed_over"),
    [
        ({"s1": 1, "s2": 1, "s3": 1}, 0),  # every store knows it: nothing to pass on
        ({"s1": 1, "s2": 1}, 1),  # s3 never said so
        ({"s1": 1, "s2": 1, "s3": 0}, 1),  # s3 answered without it
        ({}, 1),  # nobody heard the broadcast
    ],
)
def test_a_release_hands_over_the_acked_index_some_store_never_confirmed(
    acked_by: dict[str, int], handed_over: int
) -> None:
    leader = _appended_and_answered(acked_by)
    released = of_type(step(leader, 30, Release()), ReleaseLease)
    assert released == [ReleaseLease(5, signed(5), acked_index=handed_over)]


# ---- the master: what it owes each store ----

SEGMENT = (4, 2)
COPY_SET = ("a", "b", "c")


def held(acked: int, last: int = 10, fence: int = 0) -> Held:
    return Held(fence, acked, last, 100)


@pytest.mark.parametrize(
    ("reported", "told", "still_owed"),
    [
        (held(3), [(SEGMENT, 7)], True),  # reports less: told
        (held(7), [], False),  # knows it
        (held(9), [], False),  # knows more
        (held(3, last=3), [], False),  # holds no more than it acked: nothing to raise
        (held(3, last=5), [(SEGMENT, 7)], True),  # min(7, its last) is still above
        (held(3, fence=3), [], False),  # fenced past epoch 2: a recovery's business
        (None, [], False),  # holds nothing of it
    ],
)
def test_the_master_tells_a_store_what_it_is_owed_until_it_knows(
    reported: Held | None, told: list[tuple[tuple[int, int], int]], still_owed: bool
) -> None:
    owed = LeaderAckedOwed()
    owed.released(SEGMENT, COPY_SET, 7)
    report = {} if reported is None else {SEGMENT: reported}
    assert owed.to_tell("a", report) == told
    assert owed.to_tell("a", report) == told  # asked again, the same answer
    assert len(owed) == 1  # b and c are still owed it
    for store in ("b", "c"):
        assert owed.to_tell(store, {SEGMENT: held(7)}) == []
    assert len(owed) == (1 if still_owed else 0)


def test_a_store_outside_the_copy_set_is_told_nothing() -> None:
    owed = LeaderAckedOwed()
    owed.released(SEGMENT, COPY_SET, 7)
    assert owed.to_tell("z", {SEGMENT: held(0)}) == []
    assert len(owed) == 1


def test_a_later_release_of_the_same_segment_keeps_the_higher_index() -> None:
    owed = LeaderAckedOwed()
    owed.released(SEGMENT, COPY_SET, 7)
    owed.released(SEGMENT, COPY_SET, 5)
    assert owed.to_tell("a", {SEGMENT: held(0)}) == [(SEGMENT, 7)]


def test_nothing_is_owed_for_acked_index_zero_and_the_oldest_release_goes_first() -> None:
    owed = LeaderAckedOwed(segments_max=2)
    owed.released(SEGMENT, COPY_SET, 0)
    assert len(owed) == 0
    for stream_id in (1, 2, 3):
        owed.released((stream_id, 1), COPY_SET, 4)
    reports = {(stream_id, 1): held(0) for stream_id in (1, 2, 3)}
    assert owed.to_tell("a", reports) == [((2, 1), 4), ((3, 1), 4)]


def test_the_owed_index_is_kept_with_the_segment_record_and_only_then() -> None:
    record = SegmentRecord(4, "t/s", 2, COPY_SET, SegmentState.OPEN, 0, 1, 0, 1)
    assert b"released_acked_index" not in encode_segment(record)
    owing = SegmentRecord(
        4, "t/s", 2, COPY_SET, SegmentState.OPEN, 0, 1, 0, 1, released_acked_index=7
    )
    assert decode_segment(encode_segment(owing)) == owing
    assert decode_segment(encode_segment(record)) == record


# ---- the store: what it keeps ----

SEG = SegmentKey(7, 3)


def _core_holding(last: int, acked: int = 0) -> CommandedCore:
    core = CommandedCore(MemoryKV())
    entries = [StoredEntry.make(i, EntryKind.EVENT, 3, b"e%d" % i) for i in range(1, last + 1)]
    core.write(SEG, 3, acked, entries)
    return core


@pytest.mark.parametrize(
    ("holds", "acked_before", "raised_to", "acked_after"),
    [
        (5, 0, 4, 4),
        (5, 0, 9, 5),  # clamped to what it holds
        (5, 3, 2, 3),  # never lowered
        (5, 5, 5, 5),
    ],
)
def test_a_store_keeps_the_masters_acked_index_as_a_leaders_write(
    holds: int, acked_before: int, raised_to: int, acked_after: int
) -> None:
    core = _core_holding(holds, acked_before)
    outcome = core.execute(RaiseAckedCommand(((SEG, raised_to),)))
    assert outcome == AckedRaised((SEG,) if acked_after > acked_before else ())
    assert core.catalog.metas()[SEG].acked_index == acked_after


def test_a_store_raises_nothing_it_does_not_hold_nor_past_a_fence() -> None:
    core = _core_holding(5)
    core.execute(SealCommand(SEG, 4))  # a recovery of epoch 4 fenced it
    other = SegmentKey(8, 1)
    assert core.execute(RaiseAckedCommand(((SEG, 5), (other, 3)))) == AckedRaised(())
    assert core.catalog.metas()[SEG].acked_index == 0
    assert other not in core.catalog.metas()


def test_a_bad_segment_id_raises_nothing_at_all() -> None:
    core = _core_holding(5)
    with pytest.raises(BadRequest):
        core.execute(RaiseAckedCommand(((SEG, 5), (SegmentKey(0, 1), 3))))
    assert core.catalog.metas()[SEG].acked_index == 0
