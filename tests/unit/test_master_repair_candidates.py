"""Which segments the repairer looks at: confirmed segments are left alone until a
member's store dies, drains or stops holding the bridge; a tick judges a bounded,
rotating window."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streamengine.master.catalog import Batch
from streamengine.master.core import integrity, repair
from streamengine.master.core.model import Held, SegmentRecord, SegmentState, StreamRecord
from streamengine.master.state import MasterState
from streamengine.protocol.certificate import certificate_of
from streamengine.protocol.entry import EntryKind
from tests.metadata_backends import MetadataPlace

TIMEOUT = 3000
NOW = 1_000_000


@pytest.fixture
def state(metadata_place: MetadataPlace):
    catalog = metadata_place.open()
    batch = Batch().tenant("t", 0).next_stream_id(2)
    batch.stream(StreamRecord("t/s", 1, 3, 2, 1, 1, 20, "", 0))
    for epoch in range(1, 21):
        members = tuple(f"s{(epoch + k) % 4}" for k in range(3))
        batch.segment(
            SegmentRecord(
                1, "t/s", epoch, members, SegmentState.SEALED, 5, 0, 0, 0, verified=members
            )
        )
    catalog.commit(batch)
    master = MasterState(catalog, NOW, 1000, TIMEOUT, bridge_grace_ms=0)
    for number in range(4):
        master.registry.register_store(f"s{number}", f"127.0.0.1:{number + 1}", "", 0, NOW)
    yield master


def report_all(state: MasterState, now: int, skip: str = "", acked: int = 5) -> None:
    for sid in sorted(state.stores):
        if sid == skip:
            continue
        held = {
            key: Held(2, acked, acked, 100)
            for key in state.members.get(sid, ())
            if key in state.segments
        }
        state.registry.store_heartbeat(sid, 0, 0, held, now)


def test_confirmed_segments_are_skipped_until_something_changes(state: MasterState) -> None:
    assert state.repair_candidates(state.store_views(NOW)) == [], "trusted at the start"
    state.unconfirmed.update(state.segments)  # as after a change to each
    report_all(state, NOW)
    assert len(state.repair_candidates(state.store_views(NOW))) == 20
    assert state.replicas.plan_repairs(NOW, set(), 3) == []
    assert state.repair_candidates(state.store_views(NOW)) == [], "all confirmed"

    # s1 stops holding the bridge of its segments: only those are looked at again.
    held = {k: Held(2, 4, 4, 100) for k in state.members["s1"]}
    state.registry.store_heartbeat("s1", 0, 0, held, NOW + 1)
    suspects = {s.key for s in state.repair_candidates(state.store_views(NOW + 1))}
    assert suspects == state.members["s1"]

    # s2 dies: its segments are candidates without any new report.
    later = NOW + TIMEOUT + 10
    report_all(state, later, skip="s2")
    suspects = {s.key for s in state.repair_candidates(state.store_views(later))}
    assert state.members["s2"] <= suspects
    tasks = state.replicas.plan_repairs(later, set(), 3)
    assert len(tasks) == 3 and all(t.replaced == "s2" for t in tasks)


def test_a_start_trusts_only_segments_every_replica_of_which_was_verified(
    metadata_place: MetadataPlace,
) -> None:
    """A start judges what was not settled before; a trusted segment a member's first
    heartbeat does not hold is suspect at once."""
    catalog = metadata_place.open()
    batch = Batch().tenant("t", 0).next_stream_id(2)
    batch.stream(StreamRecord("t/s", 1, 3, 2, 1, 1, 4, "", 0))
    members = ("s0", "s1", "s2")
    sealed = SegmentRecord(1, "t/s", 1, members, SegmentState.SEALED, 5, 0, 0, 0)
    batch.segment(replace(sealed, verified=members))
    batch.segment(replace(sealed, epoch=2, verified=members[:2]))
    batch.segment(replace(sealed, epoch=3, verified=members, bad=("s2",)))
    batch.segment(replace(sealed, epoch=4, state=SegmentState.OPEN, final_index=0))
    catalog.commit(batch)
    state = MasterState(catalog, NOW, 1000, TIMEOUT, bridge_grace_ms=0)
    assert state.unconfirmed == {(1, 2), (1, 3)}
    state.registry.register_store("s0", "127.0.0.1:1", "", 0, NOW)
    state.registry.store_heartbeat("s0", 0, 0, {}, NOW)
    assert state.unconfirmed == {(1, 1), (1, 2), (1, 3)}, "s0 no longer holds it"


def test_a_tick_judges_a_bounded_rotating_window(state: MasterState, monkeypatch) -> None:
    monkeypatch.setattr(repair, "JUDGED_PER_TICK", 6)
    state.unconfirmed.update(state.segments)  # as after a change to each
    report_all(state, NOW)
    seen = []
    while state.unconfirmed:
        before = set(state.unconfirmed)
        state.replicas.plan_repairs(NOW, set(), 3)
        confirmed = before - state.unconfirmed
        assert 0 < len(confirmed) <= 6
        seen += sorted(confirmed)
    assert sorted(seen) == sorted(state.segments)


def test_a_segment_is_confirmed_only_once_every_replica_matched_the_certificate(
    metadata_place: MetadataPlace,
) -> None:
    catalog = metadata_place.open()
    batch = Batch().tenant("t", 0).next_stream_id(2)
    batch.stream(StreamRecord("t/s", 1, 3, 2, 1, 1, 2, "", 0))
    members = ("s0", "s1", "s2")
    batch.segment(SegmentRecord(1, "t/s", 1, members, SegmentState.SEALED, 5, 0, 0, 0))
    catalog.commit(batch)
    state = MasterState(catalog, NOW, 1000, TIMEOUT, bridge_grace_ms=0)
    for number in range(3):
        state.registry.register_store(f"s{number}", f"127.0.0.1:{number + 1}", "", 0, NOW)
    report_all(state, NOW)
    content = certificate_of((i, EntryKind.EVENT, b"x") for i in range(1, 6))

    def confirmed_with(good: int) -> bool:
        state.replicas.plan_repairs(NOW, set(), 3)
        exposed = {e.segment: e.good for e in state.replicas.exposures(NOW)}
        return (1, 1) not in state.unconfirmed and exposed.get((1, 1), 3) == good

    assert not confirmed_with(0), "no replica was read back: none counts as good"
    for store in ("s0", "s1"):
        state.integrity.replica_reported(store, (1, 1), integrity.Clean(content), NOW)
    assert state.replicas.exposures(NOW)[0].good == 2, "W agreeing replicas certified it"
    assert not confirmed_with(2)
    assert state.replicas.plan_repairs(NOW, set(), 3) == [], "an unverified replica is not replaced"
    state.integrity.replica_reported("s2", (1, 1), integrity.Clean(content), NOW)
    assert confirmed_with(3) and state.replicas.exposures(NOW) == []


def test_a_healthy_segment_just_sealed_is_being_verified_and_one_whose_store_is_gone_lacks(
    metadata_place: MetadataPlace,
) -> None:
    """Status counts a sealed segment under-replicated only when a member lacks its
    replica; one whose members are all live but not yet read back is being verified."""
    catalog = metadata_place.open()
    batch = Batch().tenant("t", 0).next_stream_id(2)
    batch.stream(StreamRecord("t/s", 1, 3, 2, 1, 1, 2, "", 0))
    members = ("s0", "s1", "s2")
    batch.segment(SegmentRecord(1, "t/s", 1, members, SegmentState.SEALED, 5, 0, NOW, NOW))
    catalog.commit(batch)
    state = MasterState(catalog, NOW, 1000, TIMEOUT, bridge_grace_ms=500)
    for number in range(3):
        state.registry.register_store(f"s{number}", f"127.0.0.1:{number + 1}", "", 0, NOW)
    sealed = state.segments[(1, 1)]

    # Before any store reported it at the bridge, and after, until its scrubs report.
    assert state.replicas.below_n(NOW) == ([], [sealed])
    report_all(state, NOW + 1)
    assert state.replicas.below_n(NOW + 1) == ([], [sealed])
    [exposure] = state.replicas.exposures(NOW + 1)
    assert exposure.verifying and exposure.unverified == 3 and exposure.good == 0

    # s2 goes silent past the store timeout: its replica is lacking.
    later = NOW + TIMEOUT + 10
    report_all(state, later, skip="s2")
    assert state.replicas.below_n(later) == ([sealed], [])
