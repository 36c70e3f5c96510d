"""Retention, trims and deletes in two phases: the pure decisions
(`streamengine.master.core.retention`, `streamengine.protocol.retention`) as tables, then
`MasterState` applying them over a real metadata store (restarts included). Each test names
the rule it checks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streamengine.master.core import retention
from streamengine.master.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotTrimmable,
    StreamDeleted,
)
from streamengine.master.core.model import Held, SegmentState
from streamengine.master.core.retention import SegmentFacts, retention_trims, trims_before
from streamengine.protocol.retention import first_retained_sequence, position_trimmed
from streamengine.protocol.sequence import SEQUENCE_MAX, pack_sequence
from tests.unit.lease_helpers import writer
from tests.unit.test_master_state import LEASE, Master, beat

NOW = 10_000_000


def sealed(epoch: int, age_ms: int = 0, size: int = 0, final: int = 11) -> SegmentFacts:
    return SegmentFacts(epoch, True, NOW - age_ms, final, size)


def unsealed(epoch: int, size: int = 0) -> SegmentFacts:
    return SegmentFacts(epoch, False, 0, 0, size)


@pytest.mark.parametrize(
    ("rule", "segments", "age_ms", "bytes_max", "trimmed"),
    [
        ("no limit trims nothing", [sealed(1, 10**9, 10**9)], 0, 0, []),
        (
            "by age: whole sealed segments whose seal is older than the limit",
            [sealed(1, 5000), sealed(2, 3000), sealed(3, 500)],
            1000,
            0,
            [1, 2],
        ),
        ("by age: exactly the limit is kept", [sealed(1, 1000)], 1000, 0, []),
        (
            "by age: never past an unsealed segment, however old what follows",
            [sealed(1, 5000), unsealed(2), sealed(3, 5000)],
            1000,
            0,
            [1],
        ),
        ("by age: an open head segment stops everything", [unsealed(1), sealed(2, 9000)], 1, 0, []),
        (
            "by bytes: the head goes while the rest still exceeds the limit",
            [sealed(1, size=60), sealed(2, size=60), sealed(3, size=60)],
            0,
            100,
            [1],
        ),
        (
            "by bytes: the open segment counts toward what is retained",
            [sealed(1, size=60), sealed(2, size=60), unsealed(3, size=200)],
            0,
            100,
            [1, 2],
        ),
        (
            "by bytes: never trims so far that less than the limit stays",
            [sealed(1, size=50), sealed(2, size=50)],
            0,
            60,
            [],
        ),
        (
            "either limit trims",
            [sealed(1, 5000, 10), sealed(2, 10, 500), sealed(3, 10, 200)],
            1000,
            100,
            [1, 2],
        ),
    ],
)
def test_retention_trims_only_whole_sealed_segments_from_the_head(
    rule, segments, age_ms, bytes_max, trimmed
) -> None:
    assert retention_trims(segments, age_ms, bytes_max, NOW) == trimmed, rule


def test_a_long_retention_trim_is_cut_to_one_transaction() -> None:
    segments = [sealed(e, 5000) for e in range(1, retention.TRIMS_PER_COMMIT_MAX + 10)]
    assert len(retention_trims(segments, 1000, 0, NOW)) == retention.TRIMS_PER_COMMIT_MAX


@pytest.mark.parametrize(
    ("rule", "segments", "age_ms", "bytes_max", "looks"),
    [
        ("a byte limit: every pass (an open segment grows)", [sealed(1, 10)], 1000, 100, NOW),
        ("an age limit: once the head's seal is older", [sealed(1, 300), sealed(2)], 1000, 0,
         NOW + 701),
        ("an age limit over an open head: only its seal", [unsealed(1)], 1000, 0,
         retention.LOOK_NEVER_MS),
        ("an age limit and no segment: only a seal", [], 1000, 0, retention.LOOK_NEVER_MS),
    ],
)
def test_a_stream_nothing_trims_is_looked_at_again_when_something_can_be_due(
    rule, segments, age_ms, bytes_max, looks
) -> None:
    assert retention_trims(segments, age_ms, bytes_max, NOW) == []
    assert retention.next_look_ms(segments, age_ms, bytes_max, NOW) == looks, rule


@pytest.mark.parametrize(
    ("rule", "segments", "before", "trimmed"),
    [
        ("a segment of an earlier epoch is entirely before", [sealed(1), sealed(3)], (3, 1), [1]),
        ("the segment holding the sequence stays", [sealed(1), sealed(2)], (2, 5), [1]),
        ("past a segment's bridge takes it", [sealed(1, final=11), sealed(2)], (1, 12), [1]),
        ("at its bridge does not", [sealed(1, final=11)], (1, 11), []),
        ("nothing before the first segment", [sealed(2)], (1, 100), []),
        ("the open segment holding the sequence is fine", [sealed(1), unsealed(2)], (2, 9), [1]),
    ],
)
def test_trims_before_take_segments_whose_every_event_sorts_before(
    rule, segments, before, trimmed
) -> None:
    assert trims_before(segments, pack_sequence(*before)) == trimmed, rule


def test_a_trim_by_hand_over_an_unsealed_segment_is_refused_whole() -> None:
    with pytest.raises(NotTrimmable, match="segment 2"):
        trims_before([sealed(1), unsealed(2), sealed(3)], pack_sequence(4, 1))


@pytest.mark.parametrize("before", [SEQUENCE_MAX + 1, 1 << 63, (1 << 64) - 1, -1])
def test_a_trim_before_a_sequence_that_cannot_exist_is_invalid(before: int) -> None:
    with pytest.raises(InvalidArgument, match="before_sequence"):
        trims_before([sealed(1), sealed(2)], before)


@pytest.mark.parametrize(("age_ms", "bytes_max"), [(-1, 0), (0, -1), (1 << 62, 0), (0, 1 << 61)])
def test_impossible_limits_are_invalid(age_ms: int, bytes_max: int) -> None:
    with pytest.raises(InvalidArgument):
        retention.validate_retention(age_ms, bytes_max)


@pytest.mark.parametrize(
    ("rule", "position", "through", "trimmed"),
    [
        ("nothing trimmed: every position is fine", (0, 0), 0, False),
        ("the start of the stream after a trim", (0, 0), 3, True),
        ("inside a trimmed epoch", (3, 7), 3, True),
        ("the first epoch after", (4, 1), 3, False),
    ],
)
def test_position_trimmed(rule, position, through, trimmed) -> None:
    assert position_trimmed(pack_sequence(*position), through) is trimmed, rule


def test_first_retained_sequence() -> None:
    assert first_retained_sequence(0, [1, 2]) == 0
    assert first_retained_sequence(2, [5, 6]) == pack_sequence(5, 1)
    assert first_retained_sequence(6, []) == pack_sequence(7, 1)


# ---- MasterState ----

GRACE = 60_000


@pytest.fixture
def master(metadata_place) -> Master:
    m = Master(metadata_place)
    m.state.delete_grace_ms = GRACE
    m.stores("a", "b", "c", "d")
    m.state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, m.now)
    m.now += LEASE
    return m


def roll_sealed(m: Master, count: int, size: int = 100) -> list[int]:
    """`count` segments written, each rolled and sealed at index 11, `size` bytes each."""
    view = beat(m, "w1")
    assert view.segment is not None
    epochs = []
    held: dict[str, dict[tuple[int, int], Held]] = {}
    for _ in range(count):
        segment = view.segment
        assert segment is not None
        view = m.state.leadership.roll_segment("t/s", writer("w1"), view.lease.epoch, [], m.now)
        m.state.integrity.seal_segment("t/s", segment.epoch, view.lease.epoch, 11, m.now)
        for member in segment.copy_set:
            held.setdefault(member, {})[segment.key] = Held(view.lease.epoch, 11, 11, size)
            m.state.registry.store_heartbeat(member, size, 0, held[member], m.now)
        epochs.append(segment.epoch)
        m.now += 1000
    return epochs


def test_a_trim_hides_segments_at_once_and_removes_them_after_the_grace(master: Master) -> None:
    epochs = roll_sealed(master, 3)
    trimmed = master.state.retention.trim_stream("t/s", pack_sequence(epochs[2], 1), master.now)
    assert trimmed.epochs == (epochs[0], epochs[1])
    assert trimmed.entries == 20 and trimmed.bytes == 200
    assert trimmed.first_retained_sequence == pack_sequence(epochs[2], 1)
    record, listed = master.state.list_segments("t/s", 0)
    assert listed[0].epoch == epochs[2]
    assert record.trimmed_through_epoch == epochs[1]
    # Survives a restart; the data stays until the grace has passed.
    state = master.restart()
    assert state.stream("t/s").trimmed_through_epoch == epochs[1]
    key = (record.stream_id, epochs[0])
    member = state.segments[key].copy_set[0]
    held = {key: Held(3, 11, 11, 100)}
    assert state.registry.store_heartbeat(member, 100, 0, held, master.now) == []
    assert state.retention.remove_due(trimmed.removal_at_ms - 1) == ([], [])
    _, removed = state.retention.remove_due(trimmed.removal_at_ms)
    assert removed == [(record.stream_id, epochs[0]), (record.stream_id, epochs[1])]
    assert state.registry.store_heartbeat(member, 100, 0, held, master.now) == [key]
    assert key not in master.restart().segments


def test_retention_trims_by_age_and_by_bytes_only_sealed_segments(master: Master) -> None:
    epochs = roll_sealed(master, 3)  # sealed 1 s apart; the open segment follows
    master.state.tenancy.update_stream("t/s", 2500, None)
    assert [t.epochs for t in master.state.retention.apply_retention(master.now)] == [(epochs[0],)]
    master.state.tenancy.update_stream("t/s", 0, 99)
    assert [t.epochs for t in master.state.retention.apply_retention(master.now)] == [(epochs[1],)]
    master.state.tenancy.update_stream("t/s", 1, 0)
    master.now += 10
    assert [t.epochs for t in master.state.retention.apply_retention(master.now)] == [(epochs[2],)]
    _, listed = master.state.list_segments("t/s", 0)
    assert [s.state for s in listed] == [SegmentState.OPEN]
    assert master.state.retention.apply_retention(master.now + 10**9) == []


def test_a_trim_over_an_open_segment_changes_nothing(master: Master) -> None:
    roll_sealed(master, 1)
    before = (dict(master.state.streams), dict(master.state.segments))
    with pytest.raises(NotTrimmable):
        master.state.retention.trim_stream("t/s", pack_sequence(100, 1), master.now)
    assert (dict(master.state.streams), dict(master.state.segments)) == before


def test_a_deleted_stream_is_refused_and_undeleted_whole_within_the_grace(master: Master) -> None:
    epochs = roll_sealed(master, 2)
    record = master.state.stream("t/s")
    segments = dict(master.state.segments)
    count, until = master.state.tenancy.delete_stream("t/s", master.now)
    assert count == 3 and until == master.now + GRACE
    for refused in (
        lambda: beat(master, "w2"),
        lambda: master.state.list_segments("t/s", 0),
        lambda: master.state.retention.trim_stream("t/s", pack_sequence(epochs[1], 1), master.now),
        lambda: master.state.tenancy.update_stream("t/s", 1, None),
    ):
        with pytest.raises(StreamDeleted):
            refused()
    with pytest.raises(AlreadyExists):
        master.state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, master.now)
    # Its replicas are not garbage meanwhile, after a restart too.
    state = master.restart()
    key = (record.stream_id, epochs[0])
    member = state.segments[key].copy_set[0]
    assert state.registry.store_heartbeat(member, 1, 0, {key: Held(2, 11, 11, 1)}, master.now) == []
    assert state.retention.remove_due(until - 1) == ([], [])
    restored = state.tenancy.undelete_stream("t/s")
    unheld = replace(record, leader_id="", leader_secret_sha256="", leader_principal="")
    assert restored == unheld and dict(state.segments) == segments
    assert state.retention.remove_due(until + 1) == ([], [])
    assert state.list_segments("t/s", 0)[1]
    with pytest.raises(InvalidArgument):
        state.tenancy.undelete_stream("t/s")


def test_an_undeleted_stream_grants_its_next_writer_an_epoch_above_the_deleted_one(
    master: Master,
) -> None:
    """The stores fence the deleted stream's epochs until they hear of the undelete; a
    writer granted after it must lead a later epoch, even the old holder's client."""
    roll_sealed(master, 1)
    held = beat(master, "w1", master.state.stream("t/s").epoch)
    assert held.leads
    master.state.tenancy.delete_stream("t/s", master.now)
    fenced = master.state.stream("t/s").epoch
    restored = master.state.tenancy.undelete_stream("t/s")
    assert restored.epoch == fenced and restored.leader_id == ""
    # Within the old lease nobody renews the fenced epoch, its holder neither.
    assert not beat(master, "w1", fenced).leads
    assert not beat(master, "w1").leads
    master.now = held.lease.expires_ms
    granted = beat(master, "w1")
    assert granted.leads and granted.lease.epoch == fenced + 1
    # After a master restart too: the record names no holder to wait for.
    master.state.tenancy.delete_stream("t/s", master.now)
    master.state.tenancy.undelete_stream("t/s")
    state = master.restart()
    assert state.leases["t/s"].holder == ""


def test_a_deleted_stream_goes_after_its_grace_and_its_replicas_are_garbage(
    master: Master,
) -> None:
    epochs = roll_sealed(master, 1)
    record = master.state.stream("t/s")
    _, until = master.state.tenancy.delete_stream("t/s", master.now)
    assert [p.segment_epoch for p in master.state.retention.pending_removals()] == [0]
    assert master.state.retention.remove_due(until) == (["t/s"], [])
    key = (record.stream_id, epochs[0])
    held = {key: Held(2, 11, 11, 1)}
    assert master.state.registry.store_heartbeat("a", 1, 0, held, until) == [key]
    assert "t/s" not in master.restart().streams


def test_a_pass_skips_an_idle_limited_stream_until_its_head_comes_of_age(
    master: Master, monkeypatch
) -> None:
    epochs = roll_sealed(master, 2)
    master.state.tenancy.update_stream("t/s", 5000, None)
    stream_id = master.state.stream("t/s").stream_id
    head = master.state.segments[(stream_id, epochs[0])]
    assert master.state.retention.apply_retention(master.now) == []
    assert master.state.retention_looks["t/s"] == head.sealed_at_ms + 5001
    with monkeypatch.context() as patched:
        patched.setattr(retention, "retention_trims", lambda *_: pytest.fail("looked at"))
        assert master.state.retention.apply_retention(head.sealed_at_ms + 5000) == []
    trims = master.state.retention.apply_retention(head.sealed_at_ms + 5001)
    assert [t.epochs for t in trims] == [(epochs[0],)]
    assert "t/s" not in master.state.retention_looks, "a trim changed it: looked at next pass"


def stream_indexes(state) -> tuple[object, ...]:
    return (
        state.sorted_names,
        state.tenant_streams,
        state.deleted,
        sorted(state.limited),
        state.trimmed,
        state.names,
    )


def test_the_stream_indexes_match_a_fresh_load_after_every_change(master: Master) -> None:
    """Each index kept as records change equals the one a restart builds from them."""
    state = master.state
    epochs = roll_sealed(master, 2)
    changes = [
        lambda: state.tenancy.create_stream("u/a", 3, 2, 0, 0, True, master.now),
        lambda: state.tenancy.create_stream("t/b", 3, 2, 0, 0, True, master.now),
        lambda: state.tenancy.update_stream("t/s", 0, 10),
        lambda: state.retention.trim_stream("t/s", pack_sequence(epochs[1], 1), master.now),
        lambda: state.tenancy.delete_stream("u/a", master.now),
        lambda: state.tenancy.delete_stream("t/b", master.now),
        lambda: state.tenancy.undelete_stream("t/b"),
        lambda: state.retention.remove_due(master.now + GRACE),
    ]
    for change in changes:
        change()
        assert stream_indexes(state) == stream_indexes(master.restart()), change
        state = master.state
        state.delete_grace_ms = GRACE
    assert state.tenant_streams == {"t": 2} and not state.deleted and not state.trimmed
