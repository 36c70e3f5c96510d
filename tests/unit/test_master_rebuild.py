"""The master's metadata rebuilt from the stores' records (`streamengine.master.core.rebuild`), one
rule per test, with tables of what the stores answered."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from streamengine.master import records
from streamengine.master.catalog import Batch
from streamengine.master.core import rebuild
from streamengine.master.core.errors import RebuildUnfinished
from streamengine.master.core.model import SegmentRecord, SegmentState, StoreRecord, StreamRecord
from streamengine.master.core.rebuild import REBUILD_EPOCH_GAP
from streamengine.master.rebuild import commit as commit_rebuilt
from streamengine.master.records import (
    MalformedRecord,
    RecordEncodings,
    record_from_bytes,
    record_pb,
)
from streamengine.master.state import MasterState
from streamengine.master.unrecorded import every_store_reported
from streamengine.protocol.certificate import Certificate, Chunk
from streamengine.protocol.limits import EPOCH_MAX
from streamengine.protocol.producers import ProducerPosition
from streamengine.protocol.segment_records import RECORDS_PER_HEARTBEAT_MAX, record_version
from streamengine.protocol.sequence import pack_sequence
from streamengine.v1 import entry_pb2
from tests.metadata_backends import RocksDBPlace

NOW = 1_000_000
ORDERS = StreamRecord("acme/orders", 5, 3, 2, 1 << 20, 60_000, 0, "", 10)
OPEN, SEALING, SEALED = SegmentState.OPEN, SegmentState.SEALING, SegmentState.SEALED


def seg(
    epoch: int,
    state: SegmentState = SEALED,
    final: int = 0,
    copy_set: tuple[str, ...] = ("s1", "s2", "s3"),
    settled: int = 100,
    stream: StreamRecord = ORDERS,
) -> SegmentRecord:
    final = final or (10 if state == SEALED else 0)
    return SegmentRecord(
        stream.stream_id, stream.name, epoch, copy_set, state, final, 1, 2 if final else 0, settled
    )


def held(
    store: str,
    segment: SegmentRecord | None,
    epoch: int = 0,
    fence: int = 0,
    bridge: int = 0,
    stream: StreamRecord = ORDERS,
    tenant: str = "acme",
    granted: tuple[str, ...] = (),
    granted_name: str = "",
    granted_quorum: int = 0,
) -> rebuild.Holding:
    epoch = segment.epoch if segment is not None else epoch
    record = (stream, segment) if segment is not None else None
    return rebuild.Holding(
        store,
        stream.stream_id,
        epoch,
        fence or epoch,
        5,
        bridge,
        tenant,
        record,
        granted,
        granted_name,
        granted_quorum,
    )


def test_streams_segments_and_tenants_come_back_as_recorded() -> None:
    one, two = seg(1), seg(2, OPEN)
    out = rebuild.rebuild(
        [held(s, one) for s in ("s1", "s2", "s3")] + [held(s, two) for s in ("s1", "s2")], NOW
    )
    assert out.streams == {"acme/orders": replace(ORDERS, epoch=2 + REBUILD_EPOCH_GAP)}
    # The open segment has a later epoch now: the next leader seals it.
    assert out.segments == {(5, 1): one, (5, 2): replace(two, state=SEALING)}
    assert out.tenants == {"acme": NOW}
    assert out.next_stream_id == 6
    assert out.notes == []


@pytest.mark.parametrize(
    ("case", "fences", "epoch"),
    [
        ("the segments' epochs", [0, 0], 3),
        ("a fence above every segment (a leader sealed it)", [7, 0], 7),
        ("the highest fence of any store", [4, 6], 6),
    ],
)
def test_the_streams_epoch_is_past_the_highest_any_store_knows(
    case: str, fences: list[int], epoch: int
) -> None:
    """`REBUILD_EPOCH_GAP` past it: the lost master may have granted and listed later
    epochs no store saw (the runtime world's seed 9054)."""
    three = seg(3, OPEN)
    out = rebuild.rebuild(
        [held("s1", three, fence=fences[0]), held("s2", three, fence=fences[1])], NOW
    )
    assert out.streams["acme/orders"].epoch == epoch + REBUILD_EPOCH_GAP, case
    # The open segment below the stream's epoch waits for a leader to seal it.
    assert out.segments[(5, 3)].state == SEALING, case


def test_a_rebuilt_epoch_stays_below_the_last_there_is() -> None:
    top = seg(EPOCH_MAX - 5, OPEN)
    out = rebuild.rebuild([held("s1", top), held("s2", top)], NOW)
    assert out.streams["acme/orders"].epoch == EPOCH_MAX - 1


@pytest.mark.parametrize(
    ("case", "records", "state", "final"),
    [
        ("the sealed record wins over an open one", [seg(1, OPEN), seg(1)], SEALED, 10),
        ("a sealing record over an open one", [seg(1, OPEN), seg(1, SEALING)], SEALING, 0),
        (
            "sealed records that disagree: the latest settled (logged)",
            [seg(1, final=9, settled=50), seg(1, final=12, settled=80)],
            SEALED,
            12,
        ),
    ],
)
def test_the_records_of_one_segment_agree_on_the_sealed_one(
    case: str, records: list[SegmentRecord], state: SegmentState, final: int
) -> None:
    holdings = [held(f"s{i + 1}", r, fence=2) for i, r in enumerate(records)]
    out = rebuild.rebuild(holdings, NOW)
    segment = out.segments[(5, 1)]
    assert (segment.state, segment.final_index) == (state, final), case
    assert bool(out.notes) == ("disagree" in case), (case, out.notes)


def test_a_copy_set_changed_by_repair_is_the_latest_settled() -> None:
    before = seg(1, copy_set=("s1", "s2", "s3"), settled=100)
    after = seg(1, copy_set=("s1", "s2", "s4"), settled=200)
    out = rebuild.rebuild([held("s3", before), held("s1", after), held("s4", after)], NOW)
    assert out.segments[(5, 1)].copy_set == ("s1", "s2", "s4")


def whole_copy(store: str, segment: SegmentRecord) -> rebuild.Holding:
    """A repair's confirmed copy of sealed `segment`, its record not yet sent there."""
    return rebuild.Holding(
        store,
        segment.stream_id,
        segment.epoch,
        segment.epoch + 1,
        segment.final_index,
        segment.final_index,
        "acme",
        None,
    )


@pytest.mark.parametrize(
    ("case", "holders", "answered", "copy_set"),
    [
        ("every member holds it", ["s1", "s2", "s3"], ["s1", "s2", "s3"], ("s1", "s2", "s3")),
        (
            "a member that answered without it gives its place to a repair's whole copy",
            ["s1", "s2", "s4"],
            ["s1", "s2", "s3", "s4"],
            ("s1", "s2", "s4"),
        ),
        (
            "a member that did not answer stays",
            ["s1", "s2", "s4"],
            ["s1", "s2", "s4"],
            ("s1", "s2", "s3"),
        ),
        (
            "whole copies take the places in store order",
            ["s1", "s5", "s4"],
            ["s1", "s2", "s3", "s4", "s5"],
            ("s1", "s4", "s5"),
        ),
        (
            "with no whole copy to take its place, a member without it stays to be refilled",
            ["s2"],
            ["s1", "s2", "s3"],
            ("s1", "s2", "s3"),
        ),
        (
            "a whole copy takes no place of a member holding one",
            ["s1", "s2", "s3", "s4"],
            ["s1", "s2", "s3", "s4"],
            ("s1", "s2", "s3"),
        ),
    ],
)
def test_a_sealed_copy_set_is_rebuilt_from_the_stores_holding_it(
    case: str, holders: list[str], answered: list[str], copy_set: tuple[str, ...]
) -> None:
    """The records the stores kept may predate a repair's swap (runtime seed 67: the
    metadata was lost 20 ms after a repair moved a segment off a wiped store)."""
    recorded = seg(1, copy_set=("s1", "s2", "s3"))
    holdings = [
        held(s, recorded, fence=2) if s in recorded.copy_set else whole_copy(s, recorded)
        for s in holders
    ]
    whole = {s: rebuild.Answered(INCARNATION, CLUSTER) for s in answered}
    out = rebuild.rebuild(holdings, NOW, whole, {s: registered_as(s) for s in answered})
    segment = out.segments[(5, 1)]
    assert segment.copy_set == copy_set, case
    changed = copy_set != recorded.copy_set
    assert (segment.settled_at_ms == NOW) == changed, case
    assert any("the stores hold it on" in note for note in out.notes) == changed, case


def test_an_unconfirmed_copy_takes_no_place_in_a_sealed_copy_set() -> None:
    recorded = seg(1, copy_set=("s1", "s2", "s3"))
    partial = replace(whole_copy("s4", recorded), acked_index=0)
    answered = {s: rebuild.Answered(INCARNATION, CLUSTER) for s in ("s1", "s2", "s3", "s4")}
    out = rebuild.rebuild([held("s1", recorded), held("s2", recorded), partial], NOW, answered)
    assert out.segments[(5, 1)].copy_set == ("s1", "s2", "s3")


def test_an_acked_bridge_seals_a_segment_whose_seal_record_did_not_arrive() -> None:
    out = rebuild.rebuild([held("s1", seg(1, OPEN), bridge=8), held("s2", seg(1, OPEN))], NOW)
    segment = out.segments[(5, 1)]
    assert (segment.state, segment.final_index) == (SEALED, 8)
    assert any("sealed at 8" in note for note in out.notes)


def test_a_segment_without_a_record_gets_its_holders_as_copy_set() -> None:
    out = rebuild.rebuild(
        [held("s1", seg(1)), held("s2", None, epoch=2), held("s3", None, epoch=2)], NOW
    )
    segment = out.segments[(5, 2)]
    assert (segment.copy_set, segment.state) == (("s2", "s3"), SEALING)
    assert out.streams["acme/orders"].epoch == 2 + REBUILD_EPOCH_GAP


FIVE = ("s2", "s0", "s1", "s3", "s4")


@pytest.mark.parametrize(
    ("case", "granted", "copy_set"),
    [
        ("both holders keep the copy set their grants listed", [FIVE, FIVE], FIVE),
        ("one keeps it (the other, a store older than the field, none)", [FIVE, ()], FIVE),
        ("none keeps one: the stores that hold it", [(), ()], ("s0", "s3")),
        ("the holders disagree: the stores that hold it", [FIVE, FIVE[:4]], ("s0", "s3")),
        (
            "a holder outside the copy set kept: the stores that hold it",
            [("s0", "s1", "s2"), ("s0", "s1", "s2")],
            ("s0", "s3"),
        ),
    ],
)
def test_a_segment_without_a_record_gets_the_copy_set_its_grants_listed(
    case: str, granted: list[tuple[str, ...]], copy_set: tuple[str, ...]
) -> None:
    """The members that never got a write are members still: counted as the stores
    that hold it, a copy set of two waits for good for a recovery's R = 3 answers (the
    runtime world's seed 432)."""
    holdings = [held("s0", seg(1, copy_set=FIVE))] + [
        held(store, None, epoch=2, granted=kept)
        for store, kept in zip(("s0", "s3"), granted, strict=True)
    ]
    out = rebuild.rebuild(holdings, NOW)
    segment = out.segments[(5, 2)]
    assert (segment.copy_set, segment.state) == (copy_set, SEALING), case
    assert any(note.startswith("acme/orders segment 2: no record") for note in out.notes), case


def test_an_unrecorded_segments_member_with_a_new_disk_loses_it_and_the_others_are_spared() -> None:
    """Seed 432's rebuild: N=5 W=3, a segment opened on five stores and written on two
    (s0, s3) before the metadata was lost, no record of it on any; s1 and s2 of the
    cluster answered holding nothing of it, s4 answered with a new disk. s4's replica
    is lost (it cannot stand for one); s1 and s2 answer a recovery's seal as the empty
    members they are: with s0 and s3, four members that answer, R = 3 of them decide."""
    holdings = [held(s, seg(1, copy_set=FIVE)) for s in ("s0", "s1", "s2", "s3")]
    holdings += [held(s, None, epoch=2, granted=FIVE) for s in ("s0", "s3")]
    answered = {s: rebuild.Answered(INCARNATION, CLUSTER) for s in ("s0", "s1", "s2", "s3")}
    answered["s4"] = rebuild.Answered(INCARNATION, "")
    registered = {s: registered_as(s) for s in FIVE}
    out = rebuild.rebuild(holdings, NOW, answered, registered)
    assert out.segments[(5, 2)].copy_set == FIVE
    assert out.stores == {"s4": replace(registered["s4"], lost=((5, 1), (5, 2)))}


def test_the_rebuild_awaits_the_members_the_grants_name_of_a_segment_no_record_reached() -> None:
    holdings = [
        held("s1", seg(1), granted=("s1", "s7")),
        held("s1", None, epoch=2, granted=("s1", "s5", "s6")),
    ]
    # A recorded segment's members are those its record names.
    assert rebuild.named_stores(holdings) == {"s1", "s2", "s3", "s5", "s6"}


def test_the_rebuild_awaits_every_store_a_cluster_view_lists() -> None:
    """The runtime world's seed 2092 (N=1, three stores): store2 alone answered, holding
    nothing; store0, down since before the loss, held all eight streams. Its view names
    the stores the rebuild must wait for, and the stream ids no new stream may take."""
    view = rebuild.View(("store0", "store1", "store2"), 8)
    assert rebuild.named_stores([], [view]) == {"store0", "store1", "store2"}
    assert rebuild.named_stores([held("s1", seg(1))], [rebuild.View(("s4",), 5)]) == {
        "s1",
        "s2",
        "s3",
        "s4",
    }


@pytest.mark.parametrize(
    ("case", "holdings", "views", "next_stream_id"),
    [
        ("no view, nothing held", [], [], 1),
        ("ids a view says were given, nothing held", [], [rebuild.View(("s1",), 8)], 9),
        ("a view below the ids held", [held("s1", seg(1))], [rebuild.View(("s1",), 3)], 6),
        ("a view at the highest id held", [held("s1", seg(1))], [rebuild.View(("s1",), 5)], 6),
        ("a view above the ids held", [held("s1", seg(1))], [rebuild.View(("s1",), 40)], 41),
        (
            "the highest of the views",
            [held("s1", seg(1))],
            [rebuild.View(("s1",), 7), rebuild.View(("s1",), 12)],
            13,
        ),
        (
            "a view past every u64 id is malformed",
            [held("s1", seg(1))],
            [rebuild.View(("s1",), rebuild.STREAM_IDS_MAX)],
            6,
        ),
    ],
)
def test_no_stream_takes_an_id_the_lost_master_gave(
    case: str, holdings: list[rebuild.Holding], views: list[rebuild.View], next_stream_id: int
) -> None:
    """The runtime world's seeds 2008 and 2092: rebuilt from a store that held nothing,
    the master gave the operator's new stream id 1, which stores that had not answered
    held (two streams' data under one id, on the same stores)."""
    out = rebuild.rebuild(holdings, NOW, views=views)
    assert out.next_stream_id == next_stream_id, case
    assert any("gave stream ids up to" in n for n in out.notes) == (
        next_stream_id > max((h.stream_id for h in holdings), default=0) + 1
    ), case


def test_a_stream_without_any_record_is_kept_under_its_tenant_not_deleted() -> None:
    nameless = replace(ORDERS, stream_id=9)
    out = rebuild.rebuild(
        [held(s, None, epoch=1, stream=nameless, tenant="acme") for s in ("s1", "s2")], NOW
    )
    stream = out.streams["acme/stream-9"]
    assert (stream.stream_id, stream.replicas, stream.write_quorum) == (9, 2, 2)
    assert out.next_stream_id == 10
    # With the copy set its grants listed, as many replicas as that names.
    out = rebuild.rebuild(
        [
            held(s, None, epoch=1, stream=nameless, tenant="acme", granted=("s1", "s2", "s3"))
            for s in ("s1", "s2")
        ],
        NOW,
    )
    stream = out.streams["acme/stream-9"]
    assert (stream.replicas, stream.write_quorum) == (3, 2)
    assert out.segments[(9, 1)].copy_set == ("s1", "s2", "s3")


def test_a_stream_no_record_or_card_reached_is_named_as_its_grants_said() -> None:
    """The runtime world's seeds 4600 and 4989 (N=1, one store): streams written
    before any heartbeat reply brought their records or cards to the store, then the
    metadata lost. The name a grant said wins over none; a record or a card, which
    carry the policy too, win over it."""
    nameless = replace(ORDERS, stream_id=9)
    three = ("s1", "s2", "s3")
    granted = [
        held(
            s,
            None,
            epoch=1,
            stream=nameless,
            granted=three,
            granted_name="acme/orders",
            granted_quorum=3,
        )
        for s in three
    ] + [held("s1", None, epoch=2, stream=nameless, granted=three)]
    out = rebuild.rebuild(granted, NOW)
    stream = out.streams["acme/orders"]
    # The quorum it was created with, not a majority of its copy sets.
    assert (stream.stream_id, stream.replicas, stream.write_quorum) == (9, 3, 3)
    assert any("named as its grants said acme/orders" in note for note in out.notes)
    card = replace(nameless, name="acme/clicks", replicas=3, write_quorum=2)
    out = rebuild.rebuild(granted, NOW, views=[rebuild.View(("s1",), 9, (card,))])
    assert set(out.streams) == {"acme/clicks"}
    out = rebuild.rebuild(
        [held("s1", seg(1)), held("s1", None, epoch=2, granted=("s1",), granted_name="acme/x")],
        NOW,
    )
    assert set(out.streams) == {"acme/orders"}


def test_a_name_with_two_ids_is_the_higher_and_ids_never_collide() -> None:
    old = replace(ORDERS, stream_id=3)
    out = rebuild.rebuild([held("s1", seg(1, stream=old), stream=old), held("s1", seg(1))], NOW)
    assert out.streams["acme/orders"].stream_id == 5
    assert list(out.segments) == [(5, 1)]
    assert out.next_stream_id == 6
    assert any("not rebuilt" in note for note in out.notes)


CLUSTER = "cluster-kept"
INCARNATION, RENEWED = 7, 8


def registered_as(store: str, incarnation: int = INCARNATION) -> StoreRecord:
    return StoreRecord(store, f"{store}:1", "", False, incarnation)


# s3 is named by every copy set below and answered as the case says; s1 and s2 hold
# both segments and keep the cluster id.
@pytest.mark.parametrize(
    ("case", "s3_holds", "s3_answered", "s3_registered", "lost"),
    [
        (
            "a new disk (no cluster id) loses every replica its copy sets name",
            [],
            rebuild.Answered(INCARNATION, ""),
            INCARNATION,
            [(5, 1), (5, 2)],
        ),
        (
            "a new disk loses only what it does not hold",
            [1],
            rebuild.Answered(INCARNATION, ""),
            INCARNATION,
            [(5, 2)],
        ),
        (
            "a store registered as a new incarnation after it answered holds none of it",
            [1, 2],
            rebuild.Answered(INCARNATION, CLUSTER),
            RENEWED,
            [(5, 1), (5, 2)],
        ),
        (
            "a store of the cluster that holds nothing of a segment never had it",
            [1],
            rebuild.Answered(INCARNATION, CLUSTER),
            INCARNATION,
            [],
        ),
        (
            "an incarnation not known is judged by its cluster id",
            [],
            rebuild.Answered(0, CLUSTER),
            INCARNATION,
            [],
        ),
        ("a store that did not answer is not judged", [], None, INCARNATION, []),
    ],
)
def test_a_member_with_a_database_newer_than_its_records_loses_its_replicas(
    case: str,
    s3_holds: list[int],
    s3_answered: rebuild.Answered | None,
    s3_registered: int,
    lost: list[tuple[int, int]],
) -> None:
    sealed = replace(seg(1), verified=("s1", "s3"))
    segments = {1: sealed, 2: seg(2, OPEN)}
    holdings = [held(s, segment) for segment in segments.values() for s in ("s1", "s2")]
    holdings += [held("s3", segments[epoch]) for epoch in s3_holds]
    answered = {s: rebuild.Answered(INCARNATION, CLUSTER) for s in ("s1", "s2")}
    if s3_answered is not None:
        answered["s3"] = s3_answered
    registered = {s: registered_as(s) for s in ("s1", "s2")}
    registered["s3"] = registered_as("s3", s3_registered)
    out = rebuild.rebuild(holdings, NOW, answered, registered)
    if lost:
        assert out.stores == {"s3": replace(registered["s3"], lost=tuple(lost))}, case
        assert any(note.startswith("store s3 ") for note in out.notes), case
    else:
        assert out.stores == {}, case
    # The copy sets stay as recorded; a lost replica is no longer verified.
    assert [s.copy_set for s in out.segments.values()] == [("s1", "s2", "s3")] * 2, case
    verified = ("s1",) if (5, 1) in lost else ("s1", "s3")
    assert out.segments[(5, 1)].verified == verified, case


def test_a_rebuilt_stores_lost_replicas_are_answered_at_its_next_registration(
    tmp_path: Path,
) -> None:
    """Committed with the catalog, they are answered as a new incarnation's are: the
    open one's leader is asked to roll, the store marks both lost before it joins."""
    holdings = [held(s, segment) for segment in (seg(1), seg(2, OPEN)) for s in ("s1", "s2")]
    answered = {
        "s1": rebuild.Answered(INCARNATION, CLUSTER),
        "s2": rebuild.Answered(INCARNATION, CLUSTER),
        "s3": rebuild.Answered(INCARNATION, ""),
    }
    registered = {s: registered_as(s) for s in ("s1", "s2", "s3")}
    rebuilt = rebuild.rebuild(holdings, NOW, answered, registered)
    rebuilt.cluster_id = CLUSTER
    place = RocksDBPlace(tmp_path / "rebuilt")
    commit_rebuilt(place.open(), rebuilt)
    state = MasterState(place.open(), NOW, 1_000, 3_000)
    again = state.registry.register_store("s3", "s3:1", "", 1 << 30, NOW, INCARNATION, "")
    assert again.lost == ((5, 1), (5, 2))
    assert state.lost_members == {(5, 2): {"s3"}}
    place.close()


@pytest.mark.parametrize(
    ("case", "kept_cluster_id", "lost"),
    [
        ("a new disk holds none of what the records name it for", "", [(5, 1), (5, 2)]),
        ("a store of the cluster keeps what it held", CLUSTER, []),
    ],
)
def test_a_store_that_missed_the_rebuild_is_judged_by_its_cluster_id(
    tmp_path: Path, case: str, kept_cluster_id: str, lost: list[tuple[int, int]]
) -> None:
    """s3, named by every copy set, was silent past the rebuild's deadline: the rebuilt
    master never registered it, and its first registration says what it kept."""
    holdings = [held(s, segment) for segment in (seg(1), seg(2, OPEN)) for s in ("s1", "s2")]
    rebuilt = rebuild.rebuild(holdings, NOW)
    rebuilt.cluster_id = CLUSTER
    place = RocksDBPlace(tmp_path / "rebuilt")
    commit_rebuilt(place.open(), rebuilt)
    state = MasterState(place.open(), NOW, 1_000, 3_000)
    first = state.registry.register_store("s3", "s3:1", "", 1 << 30, NOW, 9, kept_cluster_id)
    assert first.lost == tuple(lost), case
    assert state.lost_members == ({(5, 2): {"s3"}} if lost else {}), case
    again = state.registry.register_store("s3", "s3:1", "", 1 << 30, NOW, 9, kept_cluster_id)
    assert again.lost == tuple(lost), case
    place.close()


@pytest.mark.parametrize(
    ("case", "registered", "answered", "joined", "named", "now", "ready", "missing"),
    [
        ("nobody answered yet", ["s1"], [], [], [], 0, False, ["s1"]),
        ("every registered and named store answered", ["s1"], ["s1"], ["s1"], ["s1"], 0, True, []),
        (
            "a store a record names is awaited",
            ["s1"],
            ["s1"],
            ["s1"],
            ["s1", "s2"],
            0,
            False,
            ["s2"],
        ),
        ("a registered store is awaited", ["s1", "s2"], ["s1"], ["s1"], [], 0, False, ["s2"]),
        (
            "the deadline ends the wait",
            ["s1", "s2"],
            ["s1"],
            ["s1"],
            ["s3"],
            10,
            True,
            ["s2", "s3"],
        ),
        ("stores had no time to register yet", ["s1"], ["s1"], ["s1"], ["s1"], -1, False, []),
        # The runtime world's seed 2008: store1 (fsync never, its power cut) came back
        # with a new disk and answered alone, while store0 and store2 held every stream.
        ("a store that knows no cluster is not enough", ["s1"], ["s1"], [], [], 0, False, []),
        ("one that keeps a cluster id is", ["s1", "s2"], ["s1", "s2"], ["s2"], [], 0, True, []),
        ("the deadline ends that wait too", ["s1"], ["s1"], [], [], 10, True, []),
    ],
)
def test_the_rebuild_waits_for_the_stores(
    case: str,
    registered: list[str],
    answered: list[str],
    joined: list[str],
    named: list[str],
    now: int,
    ready: bool,
    missing: list[str],
) -> None:
    assert (
        rebuild.ready(registered, answered, named, now, 10, earliest_ms=0, joined=joined) == ready
    ), case
    assert rebuild.missing(registered, answered, named) == missing, case


def test_a_record_goes_to_the_stores_and_comes_back_whole() -> None:
    certificate = Certificate(10, (Chunk(10, b"\x01" * 32),))
    segment = replace(seg(4), certificate=certificate, certified_by="writer", bad=("s2",))
    encoded = record_pb(ORDERS, segment).SerializeToString(deterministic=True)
    assert record_from_bytes(encoded) == (ORDERS, segment)
    # The store keeps the bytes of the record it parsed from the reply: the same bytes,
    # so the version it reports is the master's and the record is not sent again.
    parsed = entry_pb2.SegmentRecord.FromString(encoded)
    assert parsed.SerializeToString(deterministic=True) == encoded
    with pytest.raises(MalformedRecord):
        record_from_bytes(b"\xff\xff")


@pytest.mark.parametrize(
    ("case", "marked", "has_producers"),
    [
        ("no record says so", [False, False], False),
        ("one record says so (the others sent before the mark)", [False, True], True),
    ],
)
def test_a_stream_marked_as_having_producers_stays_marked(
    case: str, marked: list[bool], has_producers: bool
) -> None:
    one, two = seg(1), seg(2, OPEN)
    holdings = [
        held("s1", one, stream=replace(ORDERS, has_producers=marked[0])),
        held("s1", two, stream=replace(ORDERS, has_producers=marked[1])),
    ]
    out = rebuild.rebuild(holdings, NOW)
    assert out.streams["acme/orders"].has_producers is has_producers, case
    encoded = record_pb(replace(ORDERS, has_producers=True), one).SerializeToString()
    assert record_from_bytes(encoded)[0].has_producers


def test_the_stream_keeps_the_newest_producer_positions_any_record_carries() -> None:
    older = (ProducerPosition("ingest", 9, pack_sequence(1, 10)),)
    newer = (ProducerPosition("ingest", 19, pack_sequence(2, 10)),)
    one, two = seg(1), seg(2)
    holdings = [
        held("s1", one, stream=replace(ORDERS, producers=older, producers_epoch=1)),
        held("s2", two, stream=replace(ORDERS, producers=newer, producers_epoch=2)),
        held("s3", two, stream=ORDERS),  # sent before any seal recorded positions
    ]
    out = rebuild.rebuild(holdings, NOW)
    assert out.streams["acme/orders"].producers == newer
    assert out.streams["acme/orders"].producers_epoch == 2
    kept = replace(ORDERS, producers=newer, producers_epoch=2)
    assert record_from_bytes(record_pb(kept, two).SerializeToString())[0] == kept


def test_records_are_sent_only_to_members_whose_version_differs() -> None:
    encodings = RecordEncodings()
    one, two = seg(1), seg(2, copy_set=("s2", "s3", "s4"))
    segments = {one.key: one, two.key: two}
    versions = {one.key: 0, two.key: 0}
    sent = encodings.to_send("s1", versions, segments, lambda _: ORDERS)
    assert [r.id.epoch for r in sent] == [1]  # s1 is no member of segment 2
    kept = encodings.encoded(ORDERS, one).version
    assert encodings.to_send("s1", {one.key: kept}, segments, lambda _: ORDERS) == []
    sealed_again = replace(one, copy_set=("s1", "s2", "s4"))
    segments[one.key] = sealed_again
    assert len(encodings.to_send("s1", {one.key: kept}, segments, lambda _: ORDERS)) == 1


def test_the_cluster_view_goes_to_the_stores_and_comes_back() -> None:
    views = records.ClusterViews()
    stores = {"s2": None, "s1": None}
    view = views.current(stores, 7)
    assert list(view.message.stores) == ["s1", "s2"] and view.message.stream_ids_through == 7
    # Its version is what a store reports of the bytes it keeps.
    assert view.version == record_version(view.message.SerializeToString(deterministic=True))
    assert views.current(stores, 7) is view
    assert views.current(stores, 8).version != view.version
    stores["s3"] = None
    assert list(views.current(stores, 8).message.stores) == ["s1", "s2", "s3"]
    # With the streams no store keeps a record of, encoded again when their key changes.
    carded = views.current(stores, 8, 1, lambda: (ORDERS,))
    assert views.current(stores, 8, 1, lambda: ()) is carded
    assert records.cluster_view_from_pb(carded.message) == rebuild.View(
        ("s1", "s2", "s3"), 8, (ORDERS,)
    )
    # A rebuild reads back what a kept view names that can be: store ids, streams named
    # and of a policy as a stream can be, of an id the view says was given.
    kept = entry_pb2.ClusterView(
        stores=["s2", "s1", "", "../x", "s1"],
        stream_ids_through=9,
        streams=[
            records.card_pb(ORDERS),
            records.card_pb(replace(ORDERS, stream_id=10)),
            records.card_pb(replace(ORDERS, stream_id=6, name="no-tenant")),
            records.card_pb(replace(ORDERS, stream_id=7, replicas=2, write_quorum=3)),
        ],
    )
    assert records.cluster_view_from_pb(kept) == rebuild.View(("s1", "s2"), 9, (ORDERS,))


def unrecorded_of(state: MasterState) -> tuple[StreamRecord, ...]:
    return state.unrecorded.newest(lambda i: state.streams[state.names[i]])


def reported(state: MasterState, now_ms: int) -> bool:
    return every_store_reported(state.live.values(), state.store_timeout_ms, now_ms)


def test_the_view_carries_the_streams_no_store_keeps_a_record_of(tmp_path: Path) -> None:
    """A stream created and never written, or written with no record reaching a store
    yet, goes in the cluster view every store keeps (the runtime world's seed 2499), from
    the moment every store alive has said what it keeps, until a store keeps a record."""
    place = RocksDBPlace(tmp_path / "meta")
    state = MasterState(place.open(), NOW, 1_000, 3_000)
    for store in ("s1", "s2"):
        state.registry.register_store(store, f"{store}:1", "", 1 << 30, NOW, 9, "")
    first = state.tenancy.create_stream("acme/one", 2, 2, 1 << 20, 60_000, True, NOW)
    second = state.tenancy.create_stream("acme/two", 2, 2, 1 << 20, 60_000, True, NOW)
    assert [s.name for s in unrecorded_of(state)] == ["acme/two", "acme/one"]
    # Every stream looks unrecorded until each store alive gave a whole report.
    assert not reported(state, NOW)
    state.registry.store_heartbeat("s1", 0, 0, {}, NOW)
    assert not reported(state, NOW)
    state.registry.store_heartbeat("s2", 0, 0, {}, NOW)
    assert reported(state, NOW)
    changes = state.unrecorded.changes
    state.unrecorded.note_recorded([first.stream_id])
    assert [s.name for s in unrecorded_of(state)] == ["acme/two"]
    assert state.unrecorded.changes > changes
    # A stream deleted leaves the view, undeleted it comes back, and recorded it stays out.
    state.tenancy.delete_stream("acme/two", NOW)
    assert unrecorded_of(state) == ()
    state.tenancy.undelete_stream("acme/two")
    assert [s.stream_id for s in unrecorded_of(state)] == [second.stream_id]
    state.tenancy.delete_stream("acme/one", NOW)
    state.tenancy.undelete_stream("acme/one")
    assert [s.stream_id for s in unrecorded_of(state)] == [second.stream_id]
    # A store silent past the store timeout is not waited for.
    state.registry.register_store("s3", "s3:1", "", 1 << 30, NOW, 9, "")
    assert not reported(state, NOW + 1)
    assert reported(state, NOW + 3_001)
    place.close()


@pytest.mark.parametrize(
    ("case", "holdings", "cards", "streams"),
    [
        (
            "created and never written: rebuilt without segments",
            [],
            [ORDERS],
            {"acme/orders": (5, 3, 2, REBUILD_EPOCH_GAP)},
        ),
        (
            "written, no record on any store: named and placed as the card says",
            [held("s1", None, epoch=4, granted=("s1", "s2", "s3"))],
            [ORDERS],
            {"acme/orders": (5, 3, 2, 4 + REBUILD_EPOCH_GAP)},
        ),
        (
            "a record wins over a card",
            [held("s1", seg(2))],
            [replace(ORDERS, name="acme/other")],
            {"acme/orders": (5, 3, 2, 2 + REBUILD_EPOCH_GAP)},
        ),
        (
            "a name a card and a record give two ids is the higher id's",
            [held("s1", seg(2))],
            [replace(ORDERS, stream_id=3)],
            {"acme/orders": (5, 3, 2, 2 + REBUILD_EPOCH_GAP)},
        ),
    ],
)
def test_a_stream_no_record_reached_is_rebuilt_as_the_views_carry_it(
    case: str,
    holdings: list[rebuild.Holding],
    cards: list[StreamRecord],
    streams: dict[str, tuple[int, int, int, int]],
) -> None:
    """The runtime world's seed 2499 (N=1, one store): eight streams created and never
    written (store0 down while their leader held them), and since its schedule moved,
    all sixteen written only after the last heartbeat the lost master answered, were
    lost, or kept as `acme/stream-<id>`, and their writers told NotFound for good."""
    out = rebuild.rebuild(holdings, NOW, views=[rebuild.View(("s1",), 5, tuple(cards))])
    got = {
        name: (s.stream_id, s.replicas, s.write_quorum, s.epoch) for name, s in out.streams.items()
    }
    assert got == streams, case
    assert out.tenants == {"acme": NOW}, case
    assert out.next_stream_id == 6, case


def test_a_heartbeat_carries_a_bounded_number_of_records() -> None:
    segments = {(5, e): seg(e) for e in range(1, 2 * RECORDS_PER_HEARTBEAT_MAX)}
    sent = RecordEncodings().to_send("s1", dict.fromkeys(segments, 0), segments, lambda _: ORDERS)
    assert len(sent) == RECORDS_PER_HEARTBEAT_MAX


class _CutShort(Exception):
    pass


def test_a_rebuild_cut_short_is_never_served_and_a_whole_one_is(tmp_path: Path) -> None:
    """The rebuild's first transaction marks the metadata unfinished and its last one
    clears the mark: a master loading a rebuild cut short in between refuses it."""
    rebuilt = rebuild.rebuild([held("s1", seg(1)), held("s2", seg(1))], NOW)
    rebuilt.cluster_id = "cluster-kept"
    cut = RocksDBPlace(tmp_path / "cut")
    catalog = cut.open()
    real_commit = catalog.commit
    commits = 0

    def failing_second_commit(batch: Batch) -> None:
        nonlocal commits
        commits += 1
        if commits == 2:
            raise _CutShort()
        real_commit(batch)

    catalog.commit = failing_second_commit  # type: ignore[method-assign]
    with pytest.raises(_CutShort):
        commit_rebuilt(catalog, rebuilt)
    with pytest.raises(RebuildUnfinished, match="stopped halfway"):
        MasterState(cut.open(), NOW, 1_000, 3_000)
    cut.close()

    whole = RocksDBPlace(tmp_path / "whole")
    commit_rebuilt(whole.open(), rebuilt)
    state = MasterState(whole.open(), NOW, 1_000, 3_000)
    assert state.cluster_id == "cluster-kept" and list(state.streams) == ["acme/orders"]
    whole.close()


def test_a_seal_changes_the_records_of_its_segment_and_later_ones_only() -> None:
    positions = (ProducerPosition("ingest", 19, pack_sequence(2, 10)),)
    one, two, three = seg(1), seg(2), seg(3, OPEN)
    kept = replace(ORDERS, producers=positions, producers_epoch=2)
    before = [record_pb(ORDERS, s).SerializeToString() for s in (one, two, three)]
    after = [record_pb(kept, s).SerializeToString() for s in (one, two, three)]
    assert [b == a for b, a in zip(before, after, strict=True)] == [True, False, False]


def test_a_heartbeat_encodes_a_bounded_number_of_records_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a start the master knows none of a store's records: a store holding many
    segments has them compared over several heartbeats, and a record that changes once
    they are known is sent at the next."""
    monkeypatch.setattr(records, "ENCODINGS_PER_HEARTBEAT_MAX", 10)
    encodings = RecordEncodings()
    segments = {(5, e): seg(e) for e in range(1, 36)}
    kept = dict.fromkeys(segments, 0)  # a store without records: each one is sent
    sent_per_heartbeat = []
    while any(version == 0 for version in kept.values()):
        sent = encodings.to_send("s1", kept, segments, lambda _: ORDERS)
        sent_per_heartbeat.append(len(sent))
        for record in sent:  # the store keeps them and reports their versions
            kept[(record.id.stream_id, record.id.epoch)] = record_version(
                record.SerializeToString(deterministic=True)
            )
    assert sent_per_heartbeat == [10, 10, 10, 5]
    assert encodings.to_send("s1", kept, segments, lambda _: ORDERS) == []
    segments[(5, 30)] = replace(segments[(5, 30)], copy_set=("s1", "s2", "s4"))
    sent = encodings.to_send("s1", kept, segments, lambda _: ORDERS)
    assert [r.id.epoch for r in sent] == [30]


@pytest.mark.parametrize(
    ("kept", "tenant", "named"),
    [
        ("acme/orders", "acme", "acme/orders"),
        ("other/orders", "acme", ""),  # another tenant's name: not this stream's
        ("no-slash", "acme", ""),
        ("", "acme", ""),
    ],
)
def test_a_name_a_store_kept_is_taken_only_when_it_is_the_streams_tenants(
    kept: str, tenant: str, named: str
) -> None:
    """With its write quorum: none without a name, nor one past the replicas a copy set
    can hold."""
    from streamengine.master.rebuild import _holding
    from streamengine.v1 import entry_pb2, segment_store_pb2

    held_pb = segment_store_pb2.HeldSegmentRecord(
        segment=entry_pb2.SegmentId(stream_id=9, epoch=1),
        fence=1,
        tenant=tenant,
        stream_name=kept,
        write_quorum=2,
    )
    holding = _holding("s1", held_pb)
    assert (holding.stream_name, holding.write_quorum) == (named, 2 if named else 0)
    held_pb.write_quorum = 99
    assert _holding("s1", held_pb).write_quorum == 0
