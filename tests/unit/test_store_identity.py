"""Who a store is, decided without I/O: the cluster it joined and its incarnation.

The store core takes part in writes and seals only once it joined its cluster, and
never in those of a segment its earlier incarnation held; the master tells a new
incarnation which replicas it lost, asks their open segments to roll and refills the
sealed ones; a rebuild adopts the id most stores keep.
"""

from __future__ import annotations

import pytest

from streamengine.master.core.errors import WrongCluster
from streamengine.master.core.model import Held, SegmentState
from streamengine.master.core.rebuild import adopted_cluster_id
from streamengine.master.state import MasterState
from streamengine.segment_store.core.commands import JoinCommand, Joined, SegmentKey
from streamengine.segment_store.core.errors import NotJoined, ReplicaLost
from streamengine.segment_store.kv import MemoryKV
from tests.metadata_backends import MetadataPlace
from tests.store_commands import CommandedCore
from tests.unit.lease_helpers import fixed_secrets, writer

LEASE = 1000
TIMEOUT = 3000
NOW = 1_000_000
SEGMENT = SegmentKey(7, 2)
OTHER = SegmentKey(7, 3)


# ---- the store core ----


def joining_core(kv: MemoryKV | None = None) -> CommandedCore:
    return CommandedCore(kv or MemoryKV(), joins_cluster=True)


def test_a_store_takes_no_write_or_seal_before_it_joined_its_cluster() -> None:
    core = joining_core()
    with pytest.raises(NotJoined):
        core.check_takes_part(SEGMENT)
    assert core.execute(JoinCommand("cluster-a")) == Joined(())
    core.check_takes_part(SEGMENT)
    assert core.catalog.cluster_id() == "cluster-a"


def test_a_core_without_a_cluster_takes_writes_at_once() -> None:
    CommandedCore(MemoryKV()).check_takes_part(SEGMENT)


def test_a_store_never_joins_another_cluster() -> None:
    core = joining_core()
    core.execute(JoinCommand("cluster-a"))
    with pytest.raises(NotJoined):
        core.execute(JoinCommand("cluster-b"))
    assert core.catalog.cluster_id() == "cluster-a"
    assert core.execute(JoinCommand("cluster-a")) == Joined(())


def test_lost_replicas_are_refused_kept_across_a_restart_and_go_with_a_delete() -> None:
    kv = MemoryKV()
    core = joining_core(kv)
    core.seal(OTHER, 4)  # held: a copy brought it since, so it is not lost
    assert core.execute(JoinCommand("cluster-a", (SEGMENT, OTHER))) == Joined((SEGMENT,))
    with pytest.raises(ReplicaLost):
        core.check_takes_part(SEGMENT)
    core.check_takes_part(OTHER)
    restarted = joining_core(kv)
    with pytest.raises(ReplicaLost):
        restarted.check_takes_part(SEGMENT)
    restarted.delete(SEGMENT)
    restarted.check_takes_part(SEGMENT)
    assert joining_core(kv).catalog.incarnation() == 0


def test_the_incarnation_is_made_once_and_kept_with_the_database() -> None:
    kv = MemoryKV()
    assert joining_core(kv).catalog.keep_incarnation(11) == 11
    assert joining_core(kv).catalog.keep_incarnation(12) == 11
    assert joining_core(MemoryKV()).catalog.keep_incarnation(12) == 12


# ---- the master ----


def master_with_a_stream(place: MetadataPlace) -> MasterState:
    state = fixed_secrets(MasterState(place.open(), NOW, LEASE, TIMEOUT))
    for number, sid in enumerate("abc"):
        state.registry.register_store(
            sid, f"127.0.0.1:{number + 1}", "", 0, NOW, incarnation=number + 1
        )
        state.registry.store_heartbeat(sid, 0, 0, {}, NOW)
    state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, NOW)
    return state


def test_a_master_makes_its_cluster_id_once_and_keeps_it(metadata_place: MetadataPlace) -> None:
    first = fixed_secrets(MasterState(metadata_place.open(), NOW, LEASE, TIMEOUT))
    assert first.cluster_id.startswith("cluster-")
    again = fixed_secrets(MasterState(metadata_place.open(), NOW, LEASE, TIMEOUT))
    assert again.cluster_id == first.cluster_id


def test_a_store_of_another_cluster_is_refused(metadata_place: MetadataPlace) -> None:
    state = fixed_secrets(MasterState(metadata_place.open(), NOW, LEASE, TIMEOUT))
    with pytest.raises(WrongCluster, match="cluster-other"):
        state.registry.register_store("a", "127.0.0.1:1", "", 0, NOW, 5, "cluster-other")
    assert "a" not in state.stores
    registered = state.registry.register_store("a", "127.0.0.1:1", "", 0, NOW, 5, state.cluster_id)
    assert registered.cluster_id == state.cluster_id and registered.lost == ()


def test_a_new_incarnation_loses_every_replica_its_store_held(
    metadata_place: MetadataPlace,
) -> None:
    state = master_with_a_stream(metadata_place)
    now = NOW + LEASE
    view = state.leadership.writer_heartbeat("t/s", writer("w1"), 0, 0, 0, now)
    assert view.segment is not None and "c" in view.segment.copy_set
    key = view.segment.key
    state.registry.store_heartbeat("c", 0, 0, {key: Held(1, 3, 3, 300)}, now)
    assert state.leadership.writer_heartbeat("t/s", writer("w1"), 1, 0, 0, now).roll_reason == ""

    same = state.registry.register_store("c", "127.0.0.1:3", "", 0, now, incarnation=3)
    assert same.lost == ()
    wiped = state.registry.register_store("c", "127.0.0.1:3", "", 0, now, incarnation=33)
    assert wiped.lost == (key,)
    assert state.stores["c"].incarnation == 33
    assert key not in state.live["c"].held, "what it reported was its old incarnation's"
    reason = state.leadership.writer_heartbeat("t/s", writer("w1"), 1, 0, 0, now).roll_reason
    assert "new incarnation" in reason and "c" in reason
    # A restarted master knows the incarnation and what it lost: the same answer again.
    restarted = fixed_secrets(MasterState(metadata_place.open(), now, LEASE, TIMEOUT))
    assert restarted.stores["c"].incarnation == 33
    again = restarted.registry.register_store("c", "127.0.0.1:3", "", 0, now, incarnation=33)
    assert again.lost == (key,)
    assert restarted.segments[key].state == SegmentState.OPEN


RESTART = 0  # in a registration sequence: the master restarts from its metadata


@pytest.mark.parametrize(
    ("incarnations", "answered_lost"),
    [
        ((3,), (False,)),  # the incarnation it had
        ((3, 3), (False, False)),  # a restart of the same database
        ((33,), (True,)),  # wiped: a new incarnation
        ((33, 33), (True, True)),  # the answer was lost: the retry hears it too
        ((33, RESTART, 33), (True, True)),  # the master died after its commit
        ((33, 33, 33), (True, True, True)),  # every start until it joined, and after
        ((33, 34), (True, True)),  # wiped again before it joined
        ((33, RESTART, 34), (True, True)),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v[0], int) else None,
)
def test_every_registration_of_a_new_incarnation_answers_what_it_lost(
    metadata_place: MetadataPlace, incarnations: tuple[int, ...], answered_lost: tuple[bool, ...]
) -> None:
    """Issue 35: a registration's answer may never reach its store (the reply lost, the
    master killed after its commit, the store crashing before it joins); a store that
    joins with no lost marks answers a recovery's seal as an empty replica. So the
    master answers the replicas an incarnation lost to each of its registrations."""
    state = master_with_a_stream(metadata_place)
    now = NOW + LEASE
    view = state.leadership.writer_heartbeat("t/s", writer("w1"), 0, 0, 0, now)
    assert view.segment is not None and "c" in view.segment.copy_set
    key = view.segment.key
    answers = []
    for incarnation in incarnations:
        if incarnation == RESTART:
            state = fixed_secrets(MasterState(metadata_place.open(), now, LEASE, TIMEOUT))
            continue
        registered = state.registry.register_store(
            "c", "127.0.0.1:3", "", 0, now, incarnation=incarnation
        )
        answers.append(registered.lost == (key,))
        assert registered.lost in ((), (key,))
        assert state.stores["c"].incarnation == incarnation
    assert tuple(answers) == answered_lost
    if any(answered_lost):
        reason = state.leadership.writer_heartbeat("t/s", writer("w1"), 1, 0, 0, now).roll_reason
        assert "new incarnation" in reason, "its open segment rolls, after a restart too"


def test_a_lost_replica_whose_segment_was_dropped_is_answered_no_more(
    metadata_place: MetadataPlace,
) -> None:
    state = master_with_a_stream(metadata_place)
    now = NOW + LEASE
    view = state.leadership.writer_heartbeat("t/s", writer("w1"), 0, 0, 0, now)
    assert view.segment is not None
    key = view.segment.key
    assert state.registry.register_store("c", "127.0.0.1:3", "", 0, now, 33).lost == (key,)
    state.drop_segment(key)
    assert state.registry.register_store("c", "127.0.0.1:3", "", 0, now, 33).lost == ()


def test_a_store_that_predates_incarnations_loses_nothing(metadata_place: MetadataPlace) -> None:
    state = fixed_secrets(MasterState(metadata_place.open(), NOW, LEASE, TIMEOUT))
    state.registry.register_store("a", "127.0.0.1:1", "", 0, NOW)
    assert state.registry.register_store("a", "127.0.0.1:1", "", 0, NOW, incarnation=9).lost == ()
    assert state.stores["a"].incarnation == 9


@pytest.mark.parametrize(
    ("kept", "chosen", "refused"),
    [
        ({}, "", []),
        ({"a": "", "b": ""}, "", []),
        ({"a": "x", "b": "", "c": "x"}, "x", []),
        ({"a": "x", "b": "y", "c": "x"}, "x", ["b"]),
        ({"a": "y", "b": "x"}, "x", ["a"]),  # a tie: the first in order
    ],
)
def test_a_rebuild_adopts_the_id_most_stores_keep(
    kept: dict[str, str], chosen: str, refused: list[str]
) -> None:
    adopted, notes = adopted_cluster_id(kept)
    assert adopted == chosen
    assert [note.split()[1] for note in notes] == refused


def test_a_rebuilding_master_has_no_id_until_it_adopts_one(metadata_place: MetadataPlace) -> None:
    state = fixed_secrets(
        MasterState(metadata_place.open(), NOW, LEASE, TIMEOUT, make_cluster_id=None)
    )
    assert state.cluster_id == ""
    registered = state.registry.register_store("a", "127.0.0.1:1", "", 0, NOW, 5, "cluster-x")
    assert registered.cluster_id == "" and state.store_cluster_ids == {"a": "cluster-x"}
    state.registry.adopt_cluster_id("cluster-x")
    again = fixed_secrets(MasterState(metadata_place.open(), NOW, LEASE, TIMEOUT))
    assert again.cluster_id == "cluster-x"


def test_a_tail_of_a_lost_replica_is_refused_and_of_one_not_written_yet_waits() -> None:
    """A follower tailing a replica the store lost with an earlier incarnation would
    wait for good: no write fills it again. One not written yet is an open segment's."""
    core = joining_core()
    core.execute(JoinCommand("cluster-a", (SEGMENT,)))
    with pytest.raises(ReplicaLost):
        core.held_meta(SEGMENT)
    assert core.held_meta(OTHER).acked_index == 0
    core.seal(OTHER, 4)
    assert core.held_meta(OTHER).fence > 0
