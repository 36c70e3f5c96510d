"""Many recoveries' seals as one batch (`Integrity.seal_segments`): each decided as a
lone `SealSegment` would be, one after the other, the seals committed together in as
few transactions as the metadata's bound makes."""

from __future__ import annotations

import functools

from streamengine.master.core.errors import (
    InvalidArgument,
    MasterError,
    NotFound,
    NotLeader,
    SealConflict,
    StreamDeleted,
)
from streamengine.master.core.model import SegmentRecord, SegmentState
from streamengine.master.integrity import Seal
from streamengine.master.leadership import Roll
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX
from streamengine.master.state import MasterState
from tests.batch_answers import assert_answered_as_alone
from tests.unit.lease_helpers import writer
from tests.unit.test_roll_batches import NOW, STREAMS, leading_master


def rolled_master() -> tuple[MasterState, list[int]]:
    """`leading_master` with every stream rolled to epoch 2: segment 1 of each is
    SEALING, for its leader to seal."""
    state, made = leading_master()
    rolls: list[Roll | MasterError] = [Roll(f"t/s{n}", writer("w1"), 1) for n in range(STREAMS)]
    state.leadership.roll_segments(rolls, NOW)
    made.clear()
    return state, made


def test_a_batch_of_seals_commits_in_the_few_transactions_its_bound_makes() -> None:
    state, made = rolled_master()
    seals: list[Seal | MasterError] = [Seal(f"t/s{n}", 1, 2, 5 + n) for n in range(STREAMS)]
    answers = state.integrity.seal_segments(seals, NOW)
    assert all(isinstance(a, SegmentRecord) and a.state == SegmentState.SEALED for a in answers)
    assert len(made) == -(-STREAMS // OPS_PER_TRANSACTION_MAX)
    assert all(ops <= OPS_PER_TRANSACTION_MAX for ops in made)
    for n in range(STREAMS):
        record = state.streams[f"t/s{n}"]
        assert state.segments[(record.stream_id, 1)].final_index == 5 + n


def test_a_refused_seal_changes_nothing_and_leaves_the_others() -> None:
    state, made = rolled_master()
    before = {key: segment for key, segment in state.segments.items()}
    seals: list[Seal | MasterError] = [
        Seal("t/s0", 1, 2, 5),
        Seal("t/s1", 1, 1, 5),  # its own epoch: not a later leader
        Seal("t/s2", 7, 2, 5),  # no such segment
        Seal("t/s3", 1, 2, 0),  # index 0
        Seal("t/s4", 1, 9, 5),  # an epoch never granted
        Seal("t/gone", 1, 2, 5),
        InvalidArgument("refused before the batch (a denial, a grant that does not hold)"),
        Seal("t/s5", 1, 2, 5),
    ]
    answers = state.integrity.seal_segments(seals, NOW)
    assert [type(a).__name__ for a in answers] == [
        "SegmentRecord",
        "NotLeader",
        "NotFound",
        "InvalidArgument",
        "NotLeader",
        "StreamDeleted",
        "InvalidArgument",
        "SegmentRecord",
    ]
    assert answers[6] is seals[6]
    for n in (1, 3, 4):
        key = (state.streams[f"t/s{n}"].stream_id, 1)
        assert state.segments[key] is before[key]
    assert len(made) == 1, "the two seals in one commit"


def test_each_answer_is_what_lone_seals_one_after_the_other_would_answer() -> None:
    """A second seal of a stream goes in the next round: a repeat is answered the
    segment as sealed, a contradiction SealConflict."""
    batched, _ = rolled_master()
    alone, _ = rolled_master()
    seals: list[Seal | MasterError] = [Seal(f"t/s{n}", 1, 2, 3) for n in range(6)]
    seals += [
        Seal("t/s0", 1, 2, 3),  # the same seal again: answered as sealed
        Seal("t/s1", 1, 2, 4),  # another final index: a contradiction
        Seal("t/s2", 1, 2, 3),
        Seal("t/s2", 1, 2, 9),
        Seal("t/gone", 1, 2, 3),
        Seal("t/none", 1, 2, 3),
    ]
    answers = batched.integrity.seal_segments(seals, NOW)
    for seal, answer in zip(seals, answers, strict=True):
        assert isinstance(seal, Seal)
        lone = functools.partial(
            alone.integrity.seal_segment,
            seal.stream,
            seal.segment_epoch,
            seal.writer_epoch,
            seal.final_index,
            NOW,
        )
        assert_answered_as_alone(answer, lone)
    assert isinstance(answers[6], SegmentRecord) and answers[6] == answers[0]
    assert isinstance(answers[7], SealConflict) and isinstance(answers[9], SealConflict)
    assert isinstance(answers[10], StreamDeleted) and isinstance(answers[11], NotFound)
    assert batched.segments == alone.segments and batched.streams == alone.streams


def test_a_lone_seal_is_the_batch_of_one() -> None:
    state, made = rolled_master()
    sealed = state.integrity.seal_segment("t/s0", 1, 2, 5, NOW)
    assert sealed.state == SegmentState.SEALED and len(made) == 1
    assert state.integrity.seal_segment("t/s0", 1, 2, 5, NOW) == sealed
    try:
        state.integrity.seal_segment("t/s1", 1, 1, 5, NOW)
    except NotLeader:
        pass
    else:
        raise AssertionError("a seal under the segment's own epoch is refused")
    assert len(made) == 1
