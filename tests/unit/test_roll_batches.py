"""A client's rolls as one batch (`Leadership.roll_segments`): each decided as a lone
`RollSegment` would be, one after the other, their epochs committed together in as few
transactions as the metadata's bound makes (docs/design.md, "Rolling")."""

from __future__ import annotations

import functools

from streamengine.master.catalog import Catalog
from streamengine.master.core.errors import (
    MasterError,
    NotEnoughStores,
    NotFound,
    NotLeader,
    StreamDeleted,
    TooManyUnsealed,
)
from streamengine.master.core.model import SegmentState
from streamengine.master.leadership import Beat, Roll, WriterView
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX, MemoryMetadata
from streamengine.master.state import MasterState
from tests.batch_answers import assert_answered_as_alone
from tests.unit.lease_helpers import fixed_secrets, writer

LEASE = 1000
TIMEOUT = 3000
STREAMS = 100  # more rolls than one metadata transaction holds
START_MS = 1_000_000


def leading_master() -> tuple[MasterState, list[int]]:
    """A master on in-memory metadata with four stores and STREAMS streams, each led by
    w1 at epoch 1, and the operations of each commit it makes from then on."""
    state = fixed_secrets(MasterState(Catalog(MemoryMetadata()), START_MS, LEASE, TIMEOUT))
    now = START_MS
    for store in ("a", "b", "c", "d"):
        state.registry.register_store(store, f"127.0.0.1:{1000 + ord(store)}", "", 0, now)
        state.registry.store_heartbeat(store, 0, 0, {}, now)
    for n in range(STREAMS):
        state.tenancy.create_stream(f"t/s{n}", 3, 2, 0, 0, True, now)
    state.tenancy.create_stream("t/gone", 3, 2, 0, 0, True, now)
    now += LEASE  # past the start-up window
    beats = [Beat(f"t/s{n}", writer("w1"), 0) for n in range(STREAMS)]
    beats.append(Beat("t/gone", writer("w1"), 0))
    state.leadership.writer_heartbeats(beats, now)
    state.tenancy.delete_stream("t/gone", now)
    made: list[int] = []
    commit = state.catalog.commit

    def counted(batch):
        made.append(batch.ops())
        return commit(batch)

    state.catalog.commit = counted  # type: ignore[method-assign]
    return state, made


NOW = START_MS + LEASE + 10


def test_a_batch_of_rolls_commits_in_the_few_transactions_its_bound_makes() -> None:
    state, made = leading_master()
    rolls: list[Roll | MasterError] = [Roll(f"t/s{n}", writer("w1"), 1) for n in range(STREAMS)]
    answers = state.leadership.roll_segments(rolls, NOW)
    assert all(isinstance(a, WriterView) and a.leads and a.lease.epoch == 2 for a in answers)
    # A roll writes its stream, the open segment turned SEALING and the new one.
    assert len(made) == -(-3 * STREAMS // OPS_PER_TRANSACTION_MAX)
    assert all(ops <= OPS_PER_TRANSACTION_MAX for ops in made)
    for n in range(STREAMS):
        record = state.streams[f"t/s{n}"]
        assert record.epoch == 2 and state.leases[f"t/s{n}"].epoch == 2
        assert state.segments[(record.stream_id, 1)].state == SegmentState.SEALING
        assert state.segments[(record.stream_id, 2)].state == SegmentState.OPEN


def test_a_refused_roll_changes_nothing_and_leaves_the_others() -> None:
    state, made = leading_master()
    before = {name: (state.streams[name], state.leases[name]) for name in ("t/s1", "t/s2")}
    rolls: list[Roll | MasterError] = [
        Roll("t/s0", writer("w1"), 1),
        Roll("t/s1", writer("w1"), 7),  # not its epoch
        Roll("t/s2", writer("w9"), 1),  # not its lease
        Roll("t/none", writer("w1"), 1),
        Roll("t/gone", writer("w1"), 1),
        NotFound("refused before the batch (a denial, a grant that does not hold)"),
        Roll("t/s3", writer("w1"), 1, exclude=("a", "b")),  # 2 stores for 3 replicas
        Roll("t/s4", writer("w1"), 1),
    ]
    answers = state.leadership.roll_segments(rolls, NOW)
    assert [type(a).__name__ for a in answers] == [
        "WriterView",
        "NotLeader",
        "NotLeader",
        "NotFound",
        "StreamDeleted",
        "NotFound",
        "NotEnoughStores",
        "WriterView",
    ]
    assert answers[5] is rolls[5]
    for name, (record, lease) in before.items():
        assert state.streams[name] is record and state.leases[name] is lease
    assert state.streams["t/s3"].epoch == 1
    assert state.streams["t/s0"].epoch == 2 and state.streams["t/s4"].epoch == 2
    assert len(made) == 1, "the two rolls in one commit"


def test_each_answer_is_what_lone_rolls_one_after_the_other_would_answer() -> None:
    """A second roll of a stream goes in the next round: decided once the first is
    applied, as if it came after it alone."""
    batched, _ = leading_master()
    alone, _ = leading_master()
    rolls: list[Roll | MasterError] = [Roll(f"t/s{n}", writer("w1"), 1) for n in range(8)]
    rolls += [
        Roll("t/s0", writer("w1"), 1),  # again: stale once the first is applied
        Roll("t/s1", writer("w1"), 2),  # the next roll of t/s1: two unsealed then
        Roll("t/s2", writer("w1"), 1, exclude=("a",)),
        Roll("t/gone", writer("w1"), 1),
    ]
    answers = batched.leadership.roll_segments(rolls, NOW)
    for roll, answer in zip(rolls, answers, strict=True):
        assert isinstance(roll, Roll)
        lone = functools.partial(
            alone.leadership.roll_segment, roll.stream, roll.claim, roll.epoch, roll.exclude, NOW
        )
        assert_answered_as_alone(answer, lone)
    assert isinstance(answers[8], NotLeader)
    assert isinstance(answers[9], TooManyUnsealed)
    assert isinstance(answers[11], StreamDeleted)
    assert batched.streams == alone.streams and batched.segments == alone.segments
    assert batched.leases == alone.leases


def test_a_lone_roll_is_the_batch_of_one() -> None:
    state, made = leading_master()
    view = state.leadership.roll_segment("t/s0", writer("w1"), 1, (), NOW)
    assert view.leads and view.lease.epoch == 2 and len(made) == 1
    try:
        state.leadership.roll_segment("t/s0", writer("w1"), 1, (), NOW)
    except NotLeader:
        pass
    else:
        raise AssertionError("a stale roll is refused")
    try:
        state.leadership.roll_segment("t/s1", writer("w1"), 1, ("a", "b"), NOW)
    except NotEnoughStores:
        pass
    else:
        raise AssertionError("too few stores left")
    assert len(made) == 1
