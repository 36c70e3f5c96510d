"""The master's state over a real metadata store, each back end in turn (the embedded
RocksDB, and etcd with every commit guarded by a real election key), clock injected:
leases and epochs, segments, seals, deletes, restarts. Each test names the rule it
checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamengine.master.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotEnoughStores,
    NotFound,
    NotLeader,
    QuotaExceeded,
    SealConflict,
    TooManyUnsealed,
)
from streamengine.master.core.leadership import Claim
from streamengine.master.core.model import Held, SegmentKey, SegmentState
from streamengine.master.leadership import grant_producers
from streamengine.master.state import MasterState
from streamengine.master.stores import HELD_JUDGED_MS
from streamengine.master.tenancy import StreamSpec
from streamengine.protocol.limits import CREATE_STREAMS_PER_CALL_MAX
from streamengine.protocol.producers import ProducerPosition
from streamengine.protocol.sequence import pack_sequence
from tests.metadata_backends import MetadataPlace, RocksDBPlace
from tests.unit.lease_helpers import fixed_secrets, writer

LEASE = 1000
TIMEOUT = 3000


class Master:
    """A MasterState that can be 'restarted' over the same metadata."""

    def __init__(self, place: MetadataPlace):
        self.place = place
        self.now = 1_000_000
        self.catalog = place.open()
        self.state = fixed_secrets(MasterState(self.catalog, self.now, LEASE, TIMEOUT))

    def restart(self) -> MasterState:
        self.catalog = self.place.open()
        self.state = fixed_secrets(MasterState(self.catalog, self.now, LEASE, TIMEOUT))
        return self.state

    def stores(self, *ids: str, zone: str = "") -> None:
        for sid in ids:
            self.state.registry.register_store(
                sid, f"127.0.0.1:{1000 + len(sid)}", zone, 0, self.now
            )
            self.state.registry.store_heartbeat(sid, 0, 0, {}, self.now)


@pytest.fixture
def master(metadata_place: MetadataPlace):
    m = Master(metadata_place)
    m.stores("a", "b", "c", "d")
    m.state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, m.now)
    m.now += LEASE  # past the start-up window
    yield m


def beat(m: Master, client: str, epoch: int = 0):
    return m.state.leadership.writer_heartbeat("t/s", writer(client), epoch, 0, 0, m.now)


def delete_and_remove(m: Master, name: str) -> int:
    """Delete `name` and let its grace pass: its records go, its replicas are garbage."""
    segments, until = m.state.tenancy.delete_stream(name, m.now)
    m.now = until
    assert m.state.retention.remove_due(m.now)[0] == [name]
    return segments


def snapshot(m: Master):
    s = m.state
    return (dict(s.streams), dict(s.segments), dict(s.tenants), dict(s.stores), set(s.deletes))


def test_first_heartbeat_is_granted_epoch_1_with_a_copy_set(master: Master) -> None:
    view = beat(master, "w1")
    assert view.leads and view.lease.epoch == 1
    assert view.segment is not None and len(set(view.segment.copy_set)) == 3
    assert view.segment.state == SegmentState.OPEN and view.unsealed == ()


def test_two_writers_exactly_one_leads(master: Master) -> None:
    first, second = beat(master, "w1"), beat(master, "w2")
    assert first.leads and not second.leads
    assert second.lease.holder == "w1" and second.segment is None


def test_takeover_after_expiry_gets_higher_epoch_and_old_segment_to_seal(master: Master) -> None:
    beat(master, "w1")
    master.now += LEASE
    view = beat(master, "w2")
    assert view.leads and view.lease.epoch == 2
    assert [(s.epoch, s.state) for s in view.unsealed] == [(1, SegmentState.SEALING)]


def test_epoch_is_persisted_before_it_is_returned(master: Master) -> None:
    beat(master, "w1")
    state = master.restart()
    assert state.streams["t/s"].epoch == 1 and state.streams["t/s"].leader_id == "w1"
    assert state.segments[(1, 1)].copy_set == master.state.segments[(1, 1)].copy_set


def test_after_restart_no_grant_for_one_lease_period_then_higher_epoch(master: Master) -> None:
    beat(master, "w1")
    master.restart()
    master.stores("a", "b", "c", "d")
    assert not master.state.granting_leases(master.now)
    master.now += LEASE - 1
    assert not beat(master, "w2").leads, "no lease is granted early"
    master.now += 1
    view = beat(master, "w2")
    assert view.leads and view.lease.epoch == 2


def test_after_restart_the_previous_holder_keeps_its_lease(master: Master) -> None:
    beat(master, "w1")
    master.restart()
    master.now += LEASE // 2
    # The lease secret's digest was persisted with the epoch: only the holder proves it.
    usurper = master.state.leadership.writer_heartbeat("t/s", Claim("w1"), 1, 0, 0, master.now)
    assert not usurper.leads and not usurper.secret
    view = beat(master, "w1", 1)
    assert view.leads and view.lease.epoch == 1, "renewed, not re-granted"
    assert not view.secret, "the secret is handed only with the grant"


def test_third_epoch_with_two_unsealed_gets_no_segment_then_rolls(master: Master) -> None:
    beat(master, "w1")
    master.now += LEASE
    beat(master, "w2")
    master.now += LEASE
    view = beat(master, "w3")
    assert view.leads and view.lease.epoch == 3 and view.segment is None
    assert [s.epoch for s in view.unsealed] == [1, 2]
    with pytest.raises(TooManyUnsealed):
        master.state.leadership.roll_segment("t/s", writer("w3"), 3, [], master.now)
    for epoch in (1, 2):
        master.state.integrity.seal_segment("t/s", epoch, 3, 10, master.now)
    rolled = master.state.leadership.roll_segment("t/s", writer("w3"), 3, [], master.now)
    assert rolled.lease.epoch == 4 and rolled.segment is not None and rolled.unsealed == ()
    assert len(master.state.unsealed(1)) == 1


def test_never_more_than_two_unsealed_segments(master: Master) -> None:
    for step in range(8):
        beat(master, f"w{step}")
        assert len(master.state.unsealed(1)) <= 2
        master.now += LEASE


def test_roll_gives_next_epoch_new_copy_set_and_respects_exclusions(master: Master) -> None:
    first = beat(master, "w1").segment
    assert first is not None
    excluded = first.copy_set[0]
    rolled = master.state.leadership.roll_segment("t/s", writer("w1"), 1, [excluded], master.now)
    assert rolled.lease.epoch == 2 and rolled.segment is not None
    assert excluded not in rolled.segment.copy_set
    assert [s.epoch for s in rolled.unsealed] == [1]


@pytest.mark.parametrize(
    ("rule", "client", "epoch", "error"),
    [
        ("a follower cannot roll", "w2", 1, NotLeader),
        ("a stale epoch cannot roll", "w1", 0, NotLeader),
    ],
)
def test_roll_refused(master: Master, rule, client, epoch, error) -> None:
    beat(master, "w1")
    before = snapshot(master)
    with pytest.raises(error):
        master.state.leadership.roll_segment("t/s", writer(client), epoch, [], master.now)
    assert snapshot(master) == before, rule


def test_roll_with_too_few_stores_changes_nothing(master: Master) -> None:
    beat(master, "w1")
    before = snapshot(master)
    with pytest.raises(NotEnoughStores):
        master.state.leadership.roll_segment("t/s", writer("w1"), 1, ["a", "b"], master.now)
    assert snapshot(master) == before
    assert master.state.leases["t/s"].epoch == 1


def test_grant_with_too_few_live_stores_changes_nothing(master: Master) -> None:
    master.now += TIMEOUT + 1
    master.stores("a", "b")
    before = snapshot(master)
    with pytest.raises(NotEnoughStores):
        beat(master, "w1")
    assert snapshot(master) == before and master.state.leases["t/s"].epoch == 0


@pytest.mark.parametrize(
    ("rule", "segment_epoch", "writer_epoch", "final", "error"),
    [
        ("the sealer's epoch must be above the segment's", 2, 2, 5, NotLeader),
        ("an epoch never granted cannot seal", 1, 3, 5, NotLeader),
        ("the bridge is at index 1 or later", 1, 2, 0, InvalidArgument),
        ("an unknown segment", 7, 2, 5, NotFound),
    ],
)
def test_seal_refused_changes_nothing(
    master: Master, rule, segment_epoch, writer_epoch, final, error
) -> None:
    beat(master, "w1")
    master.state.leadership.roll_segment("t/s", writer("w1"), 1, [], master.now)
    before = snapshot(master)
    with pytest.raises(error):
        master.state.integrity.seal_segment("t/s", segment_epoch, writer_epoch, final, master.now)
    assert snapshot(master) == before, rule


def test_seal_is_idempotent_and_refuses_a_contradiction(master: Master) -> None:
    beat(master, "w1")
    master.state.leadership.roll_segment("t/s", writer("w1"), 1, [], master.now)
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 7, master.now)
    assert sealed.state == SegmentState.SEALED and sealed.final_index == 7
    assert master.state.integrity.seal_segment("t/s", 1, 2, 7, master.now + 5) == sealed
    with pytest.raises(SealConflict):
        master.state.integrity.seal_segment("t/s", 1, 2, 8, master.now)
    assert master.restart().segments[(1, 1)].final_index == 7


def test_release_lets_another_writer_lead_at_once(master: Master) -> None:
    beat(master, "w1")
    assert not master.state.leadership.release_lease("t/s", writer("w2"), 1, master.now)
    assert master.state.leadership.release_lease("t/s", writer("w1"), 1, master.now)
    view = beat(master, "w2")
    assert view.leads and view.lease.epoch == 2


@pytest.mark.parametrize(
    ("rule", "name", "replicas", "quorum", "create_tenant", "error"),
    [
        ("a name needs tenant/stream", "nostream", 3, 2, True, InvalidArgument),
        ("three parts are malformed", "a/b/c", 3, 2, True, InvalidArgument),
        ("a part may not start with a dot", "t/.x", 3, 2, True, InvalidArgument),
        ("a part has no spaces", "t/a b", 3, 2, True, InvalidArgument),
        ("a part is at most 64 characters", "t/" + "x" * 65, 3, 2, True, InvalidArgument),
        ("W > N is impossible", "t/x", 2, 3, True, InvalidArgument),
        ("N = 0 is impossible", "t/x", 0, 0, True, InvalidArgument),
        ("W = 0 is impossible", "t/x", 3, 0, True, InvalidArgument),
        ("an unknown tenant without create_tenant", "u/x", 3, 2, False, NotFound),
        ("the same name with another policy", "t/s", 3, 3, False, AlreadyExists),
    ],
)
def test_create_stream_refused_changes_nothing(
    master: Master, rule, name, replicas, quorum, create_tenant, error
) -> None:
    before = snapshot(master)
    with pytest.raises(error):
        master.state.tenancy.create_stream(name, replicas, quorum, 0, 0, create_tenant, master.now)
    assert snapshot(master) == before, rule


def test_create_stream_is_idempotent_and_ids_are_never_reused(master: Master) -> None:
    same = master.state.tenancy.create_stream("t/s", 3, 2, 0, 0, False, master.now)
    assert same.stream_id == 1
    delete_and_remove(master, "t/s")
    again = master.state.tenancy.create_stream("t/s", 3, 2, 0, 0, False, master.now)
    assert again.stream_id == 2
    assert master.restart().next_stream_id == 3


def test_delete_stream_has_stores_delete_its_replicas(master: Master) -> None:
    segment = beat(master, "w1").segment
    assert segment is not None
    assert delete_and_remove(master, "t/s") == 1
    held = {segment.key: Held(1, 0, 3, 10)}
    for member in segment.copy_set:
        assert master.state.registry.store_heartbeat(member, 10, 0, held, master.now) == [
            segment.key
        ]
    # Once a store stops reporting it, the pending delete is done.
    member = segment.copy_set[0]
    assert master.state.registry.store_heartbeat(member, 0, 0, {}, master.now) == []
    assert (member, segment.key) not in master.restart().deletes
    with pytest.raises(NotFound):
        master.state.stream("t/s")


def test_a_delta_report_applies_to_the_last_whole_one_and_judges_what_it_names(
    master: Master,
) -> None:
    """A store's delta (`segment_store.core.held_reports`) applies only once the master
    holds its whole report, and again only after its next whole report once it
    registered; it judges the segments it names and the store's pending deletes: a
    replica the store no longer holds ends its pending delete, one still held is asked
    for again. A segment the delta does not name is judged from what the master holds
    once `HELD_JUDGED_MS` passed since every replica was, whole report or not."""
    registry = master.state.registry
    segment = beat(master, "w1").segment
    assert segment is not None
    member = segment.copy_set[0]
    live = master.state.live[member]
    assert live.whole, "every store of the fixture sent a whole report"
    held = {segment.key: Held(1, 3, 3, 10)}
    assert registry.store_heartbeat(member, 10, 0, held, master.now, removed=()) == []
    assert live.held[segment.key].acked_index == 3
    quiet: dict[SegmentKey, Held] = {}
    master.state.deletes.add((member, segment.key))  # as a repair that moved it away
    assert registry.store_heartbeat(member, 10, 0, quiet, master.now, removed=()) == [
        segment.key
    ], "a pending delete is asked for at every delta"
    master.state.deletes.discard((member, segment.key))
    delete_and_remove(master, "t/s")
    judged_at = master.now
    assert registry.store_heartbeat(member, 10, 0, quiet, master.now, removed=()) == [
        segment.key
    ], "every replica judged again: the removed stream's is garbage"
    master.now += HELD_JUDGED_MS - 1
    assert registry.store_heartbeat(member, 10, 0, quiet, master.now, removed=()) == [], (
        "a replica the delta does not name waits for the next judgement"
    )
    assert live.judged_at_ms == judged_at
    master.now += 1
    assert registry.store_heartbeat(member, 10, 0, quiet, master.now, removed=()) == [
        segment.key
    ]
    assert registry.store_heartbeat(member, 10, 0, held, master.now) == [segment.key]
    assert registry.store_heartbeat(member, 0, 0, quiet, master.now, removed=(segment.key,)) == []
    assert segment.key not in live.held
    registry.register_store(member, f"127.0.0.1:{1000 + len(member)}", "", 0, master.now)
    assert not registry.takes_delta(member), "registered again: a whole report first"
    registry.store_heartbeat(member, 0, 0, {}, master.now)
    assert registry.takes_delta(member)


def test_replicas_of_a_deleted_stream_outside_its_copy_sets_are_garbage(master: Master) -> None:
    segment = beat(master, "w1").segment
    assert segment is not None
    outsider = next(s for s in ("a", "b", "c", "d") if s not in segment.copy_set)
    delete_and_remove(master, "t/s")
    held = {segment.key: Held(1, 0, 3, 10)}
    assert master.state.registry.store_heartbeat(outsider, 10, 0, held, master.now) == [segment.key]


def test_unknown_stream_ids_up_to_a_rebuild_are_kept_not_deleted(master: Master) -> None:
    """After `master --rebuild`, a stream id no rebuilt stream has may be held by a store
    that missed the rebuild: never garbage. Ids above it follow the usual rule."""
    from streamengine.master.catalog import Batch

    stream_id = master.state.stream("t/s").stream_id
    master.state.tenancy.create_stream("t/later", 3, 2, 0, 0, True, master.now)
    master.state.catalog.commit(Batch().rebuilt_through(stream_id))
    state = master.restart()
    later_unknown = (state.stream("t/later").stream_id, 1)
    assert later_unknown[0] > stream_id
    assert master.state is state
    delete_and_remove(master, "t/s")
    delete_and_remove(master, "t/later")
    held = {(stream_id, 1): Held(1, 0, 3, 10), later_unknown: Held(1, 0, 3, 10)}
    assert state.registry.store_heartbeat("a", 10, 0, held, master.now) == [later_unknown]


def test_unknown_store_heartbeat_is_asked_to_register(master: Master) -> None:
    assert master.state.registry.store_heartbeat("zz", 0, 0, {}, master.now) is None


@pytest.mark.parametrize(
    ("rule", "store_id", "address"),
    [
        ("a store id is a name part", "", "127.0.0.1:1"),
        ("an address is host:port", "e", "nowhere"),
    ],
)
def test_bad_registration_changes_nothing(master: Master, rule, store_id, address) -> None:
    before = snapshot(master)
    with pytest.raises(InvalidArgument):
        master.state.registry.register_store(store_id, address, "", 0, master.now)
    assert snapshot(master) == before, rule


def test_swap_replica_is_durable_and_the_replaced_store_deletes(master: Master) -> None:
    beat(master, "w1")
    master.state.leadership.roll_segment("t/s", writer("w1"), 1, [], master.now)
    old = master.state.integrity.seal_segment("t/s", 1, 2, 4, master.now)
    spare = next(s for s in "abcd" if s not in old.copy_set)
    replaced = old.copy_set[1]
    master.state.replicas.swap_replica(old.key, replaced, spare, Held(2, 4, 4, 10), master.now)
    state = master.restart()
    assert state.segments[old.key].copy_set == tuple(
        spare if m == replaced else m for m in old.copy_set
    )
    assert (replaced, old.key) in state.deletes


def test_a_sealed_replica_outside_the_copy_set_is_garbage(master: Master) -> None:
    beat(master, "w1")
    master.state.leadership.roll_segment("t/s", writer("w1"), 1, [], master.now)
    sealed = master.state.integrity.seal_segment("t/s", 1, 2, 4, master.now)
    outsider = next(s for s in "abcd" if s not in sealed.copy_set)
    held = {sealed.key: Held(2, 4, 4, 10)}
    assert master.state.registry.store_heartbeat(outsider, 0, 0, held, master.now) == [sealed.key]
    master.state.replicas.begin_copy(outsider, sealed.key)
    assert master.state.registry.store_heartbeat(outsider, 0, 0, held, master.now) == [], (
        "a copy in progress"
    )


def test_acked_index_shown_is_the_leaders_report_while_open_then_the_stores(
    master: Master,
) -> None:
    st = master.state
    first = beat(master, "w1").segment
    assert first is not None and st.segment_acked_index(first) == 0
    st.leadership.writer_heartbeat("t/s", writer("w1"), 1, 1500, 9000, master.now)
    assert st.segment_acked_index(first) == 1500
    assert st.stream_acked_index(first.stream_id) == (1, 1500)
    assert st.leadership.release_lease("t/s", writer("w1"), 1, master.now)
    assert st.stream_acked_index(first.stream_id) == (1, 1500), "kept after the writer left"
    # A store that reports more (an idle tick the master did not hear of) wins.
    member = first.copy_set[0]
    st.registry.store_heartbeat(member, 0, 0, {first.key: Held(1, 1600, 1600, 9000)}, master.now)
    assert st.segment_acked_index(first) == 1600
    # The next leader's segment starts from nothing: the old report is not about it.
    second = beat(master, "w2").segment
    assert second is not None and second.epoch == 2
    assert st.segment_acked_index(second) == 0
    assert st.stream_acked_index(first.stream_id) == (2, 0)
    sealed = st.integrity.seal_segment("t/s", 1, 2, 1601, master.now)
    for store in sealed.copy_set:
        st.registry.store_heartbeat(
            store, 0, 0, {sealed.key: Held(2, 1601, 1601, 9000)}, master.now
        )
    assert st.segment_acked_index(sealed) == 1601


def test_dead_member_of_open_segment_asks_leader_to_roll(master: Master) -> None:
    segment = beat(master, "w1").segment
    assert segment is not None
    dead = segment.copy_set[0]
    for _ in range(2 * TIMEOUT // LEASE + 1):
        master.now += LEASE // 2
        for sid in "abcd":
            if sid != dead:
                master.state.registry.store_heartbeat(sid, 0, 0, {}, master.now)
        view = beat(master, "w1", 1)
        assert view.leads and view.lease.epoch == 1
    assert view.roll_reason == f"store-dead: {segment.copy_set[0]}"


def test_operator_roll_request_reaches_the_leader_until_it_rolls(master: Master) -> None:
    assert master.state.leadership.request_roll("t/s", master.now) == ("", 0)  # nobody leads: no-op
    granted = beat(master, "w1")
    assert not granted.roll_reason
    assert master.state.leadership.request_roll("t/s", master.now) == ("w1", 1)
    assert beat(master, "w1", 1).roll_reason == "an operator asked for a roll"
    rolled = master.state.leadership.roll_segment("t/s", writer("w1"), 1, [], master.now)
    assert rolled.lease.epoch == 2 and not rolled.roll_reason
    assert not beat(master, "w1", 2).roll_reason


def test_roll_request_for_an_unknown_stream_is_not_found(master: Master) -> None:
    with pytest.raises(NotFound):
        master.state.leadership.request_roll("t/missing", master.now)


def test_embedded_catalog_is_raw_rocksdb(tmp_path: Path) -> None:
    place = RocksDBPlace(tmp_path / "m")
    place.open()
    place.close()
    config = json.loads((tmp_path / "m" / "catalog" / "rocksdict-config.json").read_text())
    assert config["raw_mode"] is True, "no pickled values, no private comparator"


def test_catalog_keys_are_big_endian_so_segments_sort_by_epoch(master: Master) -> None:
    beat(master, "w1")
    master.state.leadership.roll_segment("t/s", writer("w1"), 1, [], master.now)
    keys = [k for k, _ in master.catalog.metadata.read_all() if k[:2] == b"g/"]
    assert keys == sorted(keys) and len(keys) == 2, "segments sort by (stream id, epoch)"


def test_too_few_stores_for_a_new_segment_still_grant_an_epoch_that_seals_the_open_one(
    master: Master,
) -> None:
    """Two stores of four left for N = 3: no copy set can be placed, but the open
    segment only needs R of its own stores to be sealed. The next writer leads an epoch
    without a segment (as with two unsealed), seals it, and its roll waits for stores."""
    open_segment = beat(master, "w1").segment
    assert open_segment is not None
    master.now += TIMEOUT + 1
    master.stores("a", "b")  # c and d fall silent
    view = beat(master, "w2")
    assert view.leads and view.lease.epoch == 2 and view.segment is None
    assert [s.epoch for s in view.unsealed] == [1]
    assert master.state.segments[(1, 1)].state == SegmentState.SEALING
    master.state.integrity.seal_segment("t/s", 1, 2, 10, master.now)
    with pytest.raises(NotEnoughStores):
        master.state.leadership.roll_segment("t/s", writer("w2"), 2, [], master.now)


def test_a_grant_to_a_producer_marks_the_stream_for_good_before_it_answers(
    master: Master,
) -> None:
    plain = beat(master, "w1")
    assert plain.leads and not plain.stream.has_producers
    master.now += 2 * LEASE  # w1's lease runs out
    view = master.state.leadership.writer_heartbeat(
        "t/s", writer("w2"), 0, 0, 0, master.now, producer=True
    )
    assert view.leads and view.stream.has_producers
    # Persisted with the epoch: a restarted master still knows it.
    assert master.restart().streams["t/s"].has_producers
    master.now += 2 * LEASE
    again = beat(master, "w3")
    assert again.leads and again.lease.epoch == view.lease.epoch + 1
    assert again.stream.has_producers  # a plain writer's grant never clears it


def test_producer_positions_outlive_the_trim_of_every_sealed_segment(master: Master) -> None:
    positions = (ProducerPosition("ingest-1", 41, pack_sequence(1, 9)),)
    assert beat(master, "w1").lease.epoch == 1
    master.state.leadership.roll_segment("t/s", writer("w1"), 1, [], master.now)
    master.state.integrity.seal_segment("t/s", 1, 2, 10, master.now, producers=positions)
    trimmed = master.state.retention.trim_stream("t/s", pack_sequence(2, 0), master.now)
    assert trimmed.epochs == (1,)
    master.now += master.state.delete_grace_ms + 1
    assert master.state.retention.remove_due(master.now)[1] == [(1, 1)]
    assert (1, 1) not in master.state.segments
    master.now += 2 * LEASE  # w1's lease runs out
    for restarted in (False, True):
        state = master.restart() if restarted else master.state
        master.now += 2 * LEASE
        # Another writer each time: the holder would renew its lease, not win one.
        taker = writer("w3" if restarted else "w2")
        view = state.leadership.writer_heartbeat("t/s", taker, 0, 0, 0, master.now, producer=True)
        assert view.leads and [s.epoch for s in view.unsealed] == [2]
        # The resend from 0 is answered from these, not appended again.
        assert grant_producers(view, state.stream_segments(view.stream.stream_id)) == positions


# CreateStreams: many streams in one commit, all or none.


def spec(name: str, replicas: int = 3, quorum: int = 2, create_tenant: bool = True) -> StreamSpec:
    return StreamSpec(name, replicas, quorum, create_tenant=create_tenant)


def test_streams_created_together_take_consecutive_ids_and_their_tenants_once(master):
    first = master.state.next_stream_id
    # Each in a tenant of its own: the most records one call commits.
    names = [f"new{n}/s" for n in range(CREATE_STREAMS_PER_CALL_MAX)]
    records = master.state.tenancy.create_streams([spec(n) for n in names], master.now)
    assert [r.name for r in records] == names
    assert [r.stream_id for r in records] == list(range(first, first + len(names)))
    state = master.restart()
    assert {n.split("/")[0] for n in names} <= set(state.tenants)
    assert [state.streams[n].stream_id for n in names] == [r.stream_id for r in records]
    assert state.next_stream_id == first + len(names)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (spec("t/s", replicas=5), AlreadyExists),  # exists with another policy
        (spec("t/a b"), InvalidArgument),
        (spec("t/x", replicas=2, quorum=3), InvalidArgument),
        (spec("nobody/x", create_tenant=False), NotFound),
        (spec("t/y", replicas=4), AlreadyExists),  # repeated below with another policy
    ],
)
def test_one_refused_stream_creates_none_of_the_call(master, bad, error):
    before = (dict(master.state.streams), master.state.next_stream_id, set(master.state.tenants))
    specs = [spec("other/a"), spec("t/y"), bad, spec("t/z")]
    with pytest.raises(error):
        master.state.tenancy.create_streams(specs, master.now)
    after = (dict(master.state.streams), master.state.next_stream_id, set(master.state.tenants))
    assert after == before
    state = master.restart()
    assert "t/y" not in state.streams and "other" not in state.tenants


def test_a_stream_named_again_with_its_policy_is_answered_as_it_stands(master):
    existing = master.state.streams["t/s"]
    records = master.state.tenancy.create_streams(
        [spec("t/s"), spec("t/n"), spec("t/n")], master.now
    )
    assert records[0] == existing
    assert records[1] == records[2] and records[1].stream_id == existing.stream_id + 1


def test_more_streams_than_a_commit_holds_are_refused(master):
    specs = [spec(f"t/s{n}") for n in range(CREATE_STREAMS_PER_CALL_MAX + 1)]
    with pytest.raises(InvalidArgument, match="at most"):
        master.state.tenancy.create_streams(specs, master.now)
    assert "t/s0" not in master.state.streams


def test_a_tenant_quota_counts_the_streams_of_the_same_call(master):
    master.state.tenant_streams_max = 3  # t holds t/s already
    with pytest.raises(QuotaExceeded):
        master.state.tenancy.create_streams([spec("t/a"), spec("t/b"), spec("t/c")], master.now)
    assert "t/a" not in master.state.streams
    master.state.tenancy.create_streams([spec("t/a"), spec("t/b")], master.now)
    assert master.state.tenant_streams["t"] == 3


def test_a_listing_counts_segments_not_epochs(master: Master) -> None:
    """A reader looks a number of segments ahead (`segments_max`), wherever their
    epochs lie: a rebuilt master starts 2^20 epochs past what the stores knew, and a
    listing bounded by epochs saw none of its segments (the runtime world's seed 4)."""
    beat(master, "w1")
    leadership = master.state.leadership
    leadership.roll_segment("t/s", writer("w1"), 1, (), master.now)
    master.state.integrity.seal_segment("t/s", 1, 2, 7, master.now)
    leadership.roll_segment("t/s", writer("w1"), 2, (), master.now)
    _, listed = master.state.list_segments("t/s", 0)
    assert [s.epoch for s in listed] == [1, 2, 3]
    _, first = master.state.list_segments("t/s", 2, segments_max=1)
    assert [s.epoch for s in first] == [2]
    _, bounded = master.state.list_segments("t/s", 1, to_epoch=2, segments_max=5)
    assert [s.epoch for s in bounded] == [1, 2]
