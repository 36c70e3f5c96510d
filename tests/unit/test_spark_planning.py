"""Spark planning: which index ranges of which segments a scan reads, and offsets."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyspark", reason="the spark extra is not installed")

from streamengine.client import spark
from streamengine.client.core.replicas import FollowerTiming
from streamengine.client.errors import InvalidArgument, Unavailable
from streamengine.client.packed import Packed
from streamengine.client.spark import (
    STREAM_BATCH_ROWS_MAX,
    ScanPartition,
    SegmentRange,
    _limit_end,
    _packed_batch,
    _SegmentInfo,
    _ShortRead,
    _StreamLayout,
    _verified_rows,
    acked_end,
    balance,
    plan_ranges,
    stream_sequence_of,
)
from streamengine.protocol import certificate
from streamengine.protocol.certificate import (
    Certificate,
    CertificateMismatch,
    ChunkCheck,
    certificate_of,
)
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.sequence import pack_sequence
from streamengine.protocol.transport import PLAINTEXT
from streamengine.v1 import segment_store_pb2
from tests.unit.test_packed import packed_reply

R = ("a:1", "b:1", "c:1")


def layout(*segments: _SegmentInfo, open_acked: dict[int, int] | None = None) -> _StreamLayout:
    return _StreamLayout(7, tuple(segments), open_acked or {})


def sealed(epoch: int, final: int) -> _SegmentInfo:
    return _SegmentInfo(epoch, True, final, R)


def opened(epoch: int) -> _SegmentInfo:
    return _SegmentInfo(epoch, False, 0, R)


def spans(ranges: list) -> list[tuple[int, int, int]]:  # type: ignore[type-arg]
    return [(r.epoch, r.first_index, r.last_index) for r in ranges]


def test_one_partition_per_sealed_segment_bridge_excluded_open_skipped() -> None:
    plan = plan_ranges("t/s", layout(sealed(1, 5), sealed(3, 2), opened(4)), 0, None, False)
    assert spans(plan) == [(1, 1, 4), (3, 1, 1)]
    assert plan[0].replicas == R and plan[0].stream_id == 7


def test_an_empty_sealed_segment_has_no_partition() -> None:
    assert plan_ranges("t/s", layout(sealed(1, 1)), 0, None, False) == []


@pytest.mark.parametrize(
    ("final", "most", "expected"),
    [
        (11, 4, [(1, 1, 3), (1, 4, 6), (1, 7, 10)]),
        (9, 4, [(1, 1, 4), (1, 5, 8)]),
        (10, 3, [(1, 1, 3), (1, 4, 6), (1, 7, 9)]),
        (5, 100, [(1, 1, 4)]),
    ],
)
def test_large_segments_split_into_equal_index_ranges_of_at_most_the_size(
    final: int, most: int, expected: list[tuple[int, int, int]]
) -> None:
    plan = plan_partitions(layout(sealed(1, final)), most)
    assert [piece for pieces in parts(plan) for piece in pieces] == expected


def test_partitions_balance_stores_whose_copy_sets_differ() -> None:
    segments = [
        _SegmentInfo(1, True, 101, ("a:1", "b:1")),
        _SegmentInfo(2, True, 101, ("a:1", "b:1")),
        _SegmentInfo(3, True, 101, ("a:1", "c:1")),
        _SegmentInfo(4, True, 101, ("b:1", "c:1")),
    ]
    plan = plan_ranges("t/s", layout(*segments), 0, None, False)
    assert [p.replicas[0] for p in plan] == ["a:1", "b:1", "c:1", "b:1"]


def test_include_open_reads_up_to_the_acked_index() -> None:
    segments = layout(sealed(1, 3), opened(2), open_acked={2: 6})
    plan = plan_ranges("t/s", segments, 0, None, True)
    assert spans(plan) == [(1, 1, 2), (2, 1, 6)]
    assert [r.sealed for r in plan] == [True, False]


def _reply_with_bridge() -> segment_store_pb2.ReadReply:
    """Indexes 41-50 of a segment a recovery sealed at 50: events 41-42, holes, the
    BRIDGE."""
    entries = [StoredEntry.make(41, EntryKind.EVENT, 1, b"e41")]
    entries.append(StoredEntry.make(42, EntryKind.EVENT, 1, b"e42"))
    entries += [StoredEntry.make(i, EntryKind.HOLE, 3) for i in range(43, 50)]
    entries.append(StoredEntry.make(50, EntryKind.BRIDGE, 3))
    return packed_reply(entries)


def test_a_range_planned_open_ends_at_a_bridge_its_recovery_wrote() -> None:
    """The acked index a plan took from an open segment's replica may be the bridge of
    a recovery the master has not recorded yet (runtime seed 16): the range is whole
    there, not short."""
    part = SegmentRange("t/s", 7, 1, 41, 50, R, sealed=False)
    batch, after = _packed_batch(part, _reply_with_bridge(), 41)
    assert batch is not None and batch.column("index").to_pylist() == [41, 42]
    assert after == 51


def test_a_bridge_inside_a_sealed_segments_range_is_a_short_read() -> None:
    part = SegmentRange("t/s", 7, 1, 41, 55, R)
    with pytest.raises(_ShortRead, match="ends before index 55"):
        _packed_batch(part, _reply_with_bridge(), 41)


@pytest.mark.parametrize(
    ("answers", "expected"), [((None, 40, None), 100), ((None, 120, 0), 120), ((0, 0, 0), 100)]
)
def test_an_open_segment_is_planned_to_the_most_any_replica_or_the_master_knows(
    monkeypatch: pytest.MonkeyPatch, answers: tuple[int | None, ...], expected: int
) -> None:
    told = dict(zip(R, answers, strict=True))
    monkeypatch.setattr(spark, "_replica_acked", lambda _id, _epoch, address, _t: told[address])
    segment = _SegmentInfo(2, False, 0, R, acked_index=100)
    assert spark._open_acked("t/s", 7, segment, PLAINTEXT) == expected


def test_an_open_segment_none_of_whose_replicas_answers_fails_the_plan_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue #36 (0): the plan once took it as acked 0 and scanned nothing of it."""
    asked: list[str] = []

    def no_answer(_id: int, _epoch: int, address: str, _transport: object) -> None:
        asked.append(address)

    monkeypatch.setattr(spark, "_replica_acked", no_answer)
    monkeypatch.setattr(spark, "FollowerTiming", FollowerTiming.fast)  # asks again soon
    segment = _SegmentInfo(2, False, 0, R, acked_index=100)
    with pytest.raises(Unavailable, match=r"segment 2 .*\(a:1, b:1, c:1\)"):
        spark._open_acked("t/s", 7, segment, PLAINTEXT)
    assert len(asked) > len(R)  # asked again before giving up


def test_a_sequence_range_clips_both_ends() -> None:
    segments = layout(sealed(1, 10), sealed(2, 10), sealed(3, 10))
    plan = plan_ranges("t/s", segments, pack_sequence(1, 5), pack_sequence(3, 4), False)
    assert spans(plan) == [(1, 5, 9), (2, 1, 9), (3, 1, 3)]


def test_acked_end_stops_at_the_open_segment() -> None:
    assert acked_end(layout()) == 0
    assert acked_end(layout(sealed(1, 4))) == pack_sequence(1, 4)
    assert acked_end(layout(sealed(1, 4), opened(3), open_acked={3: 9})) == pack_sequence(3, 10)


def test_max_events_per_trigger_limits_the_end_across_segments() -> None:
    segments = layout(sealed(1, 4), opened(3), open_acked={3: 9})
    end = acked_end(segments)
    assert _limit_end(segments, 0, end, 2) == pack_sequence(1, 3)
    assert _limit_end(segments, 0, end, 5) == pack_sequence(3, 3)
    assert _limit_end(segments, 0, end, 1000) == end


def test_a_certified_segment_carries_its_certificate_into_every_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Partitions split at the chunk end nearest to each equal cut, where no partition
    then holds more than the size asked for (a partition reads the whole chunks around
    its range and checks them: a chunk cut in two is read twice); each carries the
    certificate to its executor."""
    monkeypatch.setattr(certificate, "CHUNK_ENTRIES_MAX", 4)  # chunks 1-4, 5-8, 9-11
    rows = [(i, int(EntryKind.EVENT), b"x") for i in range(1, 11)]
    made = certificate_of([*rows, (11, int(EntryKind.BRIDGE), b"")])
    segment = _SegmentInfo(1, True, 11, R, made)
    # The equal cut after 5 moves to the chunk end after 4.
    plan = [piece for p in plan_partitions(layout(segment), 6) for piece in p.ranges]
    assert spans(plan) == [(1, 1, 4), (1, 5, 10)]
    assert all(Certificate.decode(p.certificate) == made for p in plan)
    # Cuts after 2, 5 and 7: only the one after 5 can move (to 4) and keep every
    # partition within 3 entries.
    small = [piece for p in plan_partitions(layout(segment), 3) for piece in p.ranges]
    assert spans(small) == [(1, 1, 2), (1, 3, 4), (1, 5, 7), (1, 8, 10)]
    # A range that starts mid-chunk keeps its start; only the cuts move.
    late_plan = plan_ranges("t/s", layout(segment), pack_sequence(1, 3), None, False)
    late = [piece for p in balance(late_plan, 6) for piece in p.ranges]
    assert spans(late) == [(1, 3, 8), (1, 9, 10)]  # the cut after 6: 8 and 4 are as near


def parts(partitions: list[ScanPartition]) -> list[list[tuple[int, int, int]]]:
    return [spans(list(p.ranges)) for p in partitions]


def plan_partitions(segments: _StreamLayout, most: int) -> list[ScanPartition]:
    """What a Spark reader plans: a range per segment, balanced."""
    return balance(plan_ranges("t/s", segments, 0, None, False), most)


def test_a_scan_takes_as_few_partitions_as_fit_and_they_span_segments() -> None:
    """Three segments of 333 events, at most 500 a partition: two partitions of about
    500, not three of 333 (on two cores the third would run alone)."""
    segments = layout(sealed(1, 334), sealed(2, 334), sealed(3, 334))
    plan = plan_partitions(segments, 500)
    assert parts(plan) == [[(1, 1, 333), (2, 1, 166)], [(2, 167, 333), (3, 1, 333)]]
    assert [p.entries for p in plan] == [499, 500]
    # Segment 2 starts at its least loaded replica, its second piece at the next one.
    assert plan[0].ranges[1].replicas == ("b:1", "c:1", "a:1")
    assert plan[1].ranges[0].replicas == ("c:1", "a:1", "b:1")


def test_the_pieces_of_a_split_segment_start_at_its_replicas_in_turn() -> None:
    """Issue #36 (7): one large segment cut into pieces spreads them over its stores,
    each piece starting at the next replica, not all at the planned first one."""
    plan = plan_partitions(layout(sealed(1, 41)), 10)
    starts = [p.ranges[0].replicas for p in plan]
    assert starts == [R, ("b:1", "c:1", "a:1"), ("c:1", "a:1", "b:1"), R]
    assert all(sorted(replicas) == sorted(R) for replicas in starts)


@pytest.mark.parametrize(
    ("finals", "most", "expected"),
    [
        # The segment end is the nearest cut and keeps both within 600: it moves there.
        ((501, 500), 600, [[(1, 1, 500)], [(2, 1, 499)]]),
        # Within 500 only the equal cut fits.
        ((501, 500), 500, [[(1, 1, 500)], [(2, 1, 499)]]),
        ((401, 600), 500, [[(1, 1, 400), (2, 1, 99)], [(2, 100, 599)]]),
        # Everything fits one partition.
        ((11, 3, 5), 100, [[(1, 1, 10), (2, 1, 2), (3, 1, 4)]]),
        # Four of 250 out of four segments of 250.
        ((251,) * 4, 250, [[(1, 1, 250)], [(2, 1, 250)], [(3, 1, 250)], [(4, 1, 250)]]),
    ],
)
def test_partitions_cut_at_equal_shares_or_the_nearest_segment_end(
    finals: tuple[int, ...], most: int, expected: list[list[tuple[int, int, int]]]
) -> None:
    segments = layout(*(sealed(epoch, final) for epoch, final in enumerate(finals, 1)))
    plan = plan_partitions(segments, most)
    assert parts(plan) == expected
    assert all(p.entries <= most for p in plan)


def test_partition_cuts_inside_a_certified_segment_move_to_a_chunk_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(certificate, "CHUNK_ENTRIES_MAX", 4)  # chunks 1-4, 5-8, 9-11
    rows = [(i, int(EntryKind.EVENT), b"x") for i in range(1, 11)]
    made = certificate_of([*rows, (11, int(EntryKind.BRIDGE), b"")])
    segments = layout(sealed(1, 4), _SegmentInfo(2, True, 11, R, made))
    # 13 events, at most 7 a partition: the equal cut after 6 (index 3 of segment 2)
    # moves to the end of its chunk 1-4 there, keeping both within 7.
    plan = plan_partitions(segments, 7)
    assert parts(plan) == [[(1, 1, 3), (2, 1, 4)], [(2, 5, 10)]]
    assert Certificate.decode(plan[1].ranges[0].certificate) == made


def test_every_index_is_planned_once_in_order() -> None:
    rng = random.Random(7)
    for _ in range(300):
        finals = [rng.randint(1, 60) for _ in range(rng.randint(1, 6))]
        most = rng.randint(1, 80)
        segments = layout(*(sealed(epoch, final) for epoch, final in enumerate(finals, 1)))
        plan = plan_partitions(segments, most)
        indexes = [
            (r.epoch, index)
            for p in plan
            for r in p.ranges
            for index in range(r.first_index, r.last_index + 1)
        ]
        wanted = [(e, i) for e, f in enumerate(finals, 1) for i in range(1, f)]
        assert indexes == wanted, (finals, most)
        total = len(wanted)
        assert len(plan) == (-(-total // most) if total else 0), (finals, most)
        assert all(0 < p.entries <= most for p in plan), (finals, most)


def test_packed_replies_are_checked_as_columns_and_only_verified_rows_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(certificate, "CHUNK_ENTRIES_MAX", 4)
    entries = [StoredEntry.make(i, EntryKind.EVENT, 1, b"p%d" % i) for i in range(1, 10)]
    entries[2] = StoredEntry.make(3, EntryKind.HOLE, 2)
    entries.append(StoredEntry.make(10, EntryKind.BRIDGE, 2))
    made = certificate_of([(e.index, int(e.kind), e.payload) for e in entries])
    part = SegmentRange("t/s", 7, 1, 2, 9, R, certificate=made.encode())
    check = ChunkCheck(made, 2)
    first = Packed.of(packed_reply(entries[:6]))  # indexes 1-6: chunk 1-4 complete
    assert first is not None and first.feed(check) == 4
    ready, held = _verified_rows(part, [first], 4, 2)
    assert ready is not None and len(ready) == 1
    assert ready[0].column("index").to_pylist() == [2, 4]  # 3 a HOLE
    assert ready[0].column("payload").to_pylist() == [b"p2", b"p4"]
    second = Packed.of(packed_reply(entries[6:]))
    assert second is not None and second.feed(check) == 10
    ready, held = _verified_rows(part, [*held, second], 10, 5)
    assert ready is not None and len(ready) == 2  # a batch from each reply, not joined
    rows = pa.Table.from_batches(ready)
    assert rows.column("index").to_pylist() == [5, 6, 7, 8, 9]
    assert held == []
    # A payload changed with its crc made valid: the chunk holding it never leaves.
    tampered = list(entries)
    tampered[5] = StoredEntry.make(6, EntryKind.EVENT, 1, b"p6 changed")
    packed = Packed.of(packed_reply(tampered[:8]))
    assert packed is not None
    with pytest.raises(CertificateMismatch):
        packed.feed(ChunkCheck(made, 1))


def test_many_streams_are_planned_in_name_order_and_balanced_across_them() -> None:
    layouts = {
        "t/b": layout(sealed(1, 4)),
        "t/a": layout(sealed(2, 6), opened(3)),
        "t/c": layout(sealed(1, 2)),
    }
    plan = spark.plan_streams(layouts, 0, None, include_open=False)
    assert [(r.stream, r.epoch, r.first_index, r.last_index) for r in plan] == [
        ("t/a", 2, 1, 5),
        ("t/b", 1, 1, 3),
        ("t/c", 1, 1, 1),
    ]
    # The replicas' load is counted across streams: each range starts elsewhere.
    assert [r.replicas[0] for r in plan] == ["a:1", "b:1", "c:1"]
    # 9 entries of three streams, 5 at most a partition: two tasks, cut at a range end.
    partitions = balance(plan, 5)
    assert [[(r.stream, r.first_index, r.last_index) for r in p.ranges] for p in partitions] == [
        [("t/a", 1, 5)],
        [("t/b", 1, 3), ("t/c", 1, 1)],
    ]


def test_a_reader_names_one_stream_a_list_or_a_prefix() -> None:
    assert spark.selection_of({"stream": "t/a"}).names == ("t/a",)
    assert spark.selection_of({"streams": "t/a, t/b,"}).names == ("t/a", "t/b")
    assert spark.selection_of({"prefix": "t/"}).prefix == "t/"
    for options in ({}, {"stream": "t/a", "prefix": "t/"}, {"streams": "t/a,t/a"}):
        with pytest.raises(InvalidArgument):
            spark.selection_of(options)


def test_streaming_offsets_keep_one_sequence_or_one_per_stream() -> None:
    single = spark.StreamEngineStreamReader({"master": "m:1", "stream": "t/a"})
    assert single.initialOffset() == {"sequence": 0}
    assert single._sequences({"sequence": 7}) == {"t/a": 7}
    assert single._offset({"t/a": 9}) == {"sequence": 9}
    many = spark.StreamEngineStreamReader({"master": "m:1", "streams": "t/b,t/a"})
    offset = many._offset({"t/b": 3, "t/a": 5})
    assert offset == {"sequences": {"t/a": 5, "t/b": 3}}
    assert many._sequences(offset) == {"t/a": 5, "t/b": 3}


@pytest.mark.parametrize(
    ("batch_id", "position", "sequence"),
    [(0, 0, 0), (0, 999, 999), (1, 0, 1 << 32), (7, 5, 7 * (1 << 32) + 5)],
)
def test_a_streaming_rows_sequence_is_its_batch_then_its_position(
    batch_id: int, position: int, sequence: int
) -> None:
    assert stream_sequence_of(batch_id, position) == sequence
    with pytest.raises(InvalidArgument):
        stream_sequence_of(batch_id, STREAM_BATCH_ROWS_MAX)


def test_a_certified_range_leaves_a_replica_that_ends_inside_a_chunk_for_one_that_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member that missed the bridge serves its acked events, short of the chunk
    holding the bridge: nothing of that chunk verifies there. It answered that it
    serves through its acked index, the next read went to it again at once, and the
    scan never ended (runtime seed 377). The other replica serves the range now."""
    entries = [StoredEntry.make(i, EntryKind.EVENT, 1, b"p%d" % i) for i in range(1, 6)]
    entries.append(StoredEntry.make(6, EntryKind.BRIDGE, 2))
    made = certificate_of([(e.index, int(e.kind), e.payload) for e in entries])
    served = {"a:1": entries[:5], "b:1": entries}  # a:1 missed the bridge
    asked: list[str] = []

    def read(replica: spark._Replica, part: SegmentRange, request: object) -> Iterator[object]:
        asked.append(replica.address)
        assert len(asked) < 5, asked
        yield packed_reply(served[replica.address])

    monkeypatch.setattr(spark._Replica, "read", read)
    part = SegmentRange("t/s", 7, 1, 1, 5, ("a:1", "b:1"), certificate=made.encode())
    rows = pa.Table.from_batches(list(spark.read_range(part)))
    assert rows.column("index").to_pylist() == [1, 2, 3, 4, 5]
    assert asked == ["a:1", "b:1"]


@pytest.mark.parametrize("recorded", [True, False], ids=["seal recorded", "seal not recorded"])
def test_a_range_planned_open_and_sealed_since_is_read_under_the_listed_certificate(
    monkeypatch: pytest.MonkeyPatch, recorded: bool
) -> None:
    """The range was planned while its segment was open; a replica's first reply says it
    holds the bridge since, its copies at rest, one forged under a valid crc32c. The
    task asks the master: with the seal recorded, it reads under the certificate and
    takes the good replica's rows; before, no certificate exists and the range is read
    under crc32c as planned (runtime seed 1307 for the SDK's cursor)."""
    good = [StoredEntry.make(i, EntryKind.EVENT, 1, b"p%d" % i) for i in range(1, 6)]
    good.append(StoredEntry.make(6, EntryKind.BRIDGE, 2))
    forged = list(good)
    forged[1] = StoredEntry.make(2, EntryKind.EVENT, 1, b"forged")
    made = certificate_of([(e.index, int(e.kind), e.payload) for e in good])
    served = {"a:1": forged, "b:1": good}
    asked: list[tuple[str, bool]] = []

    def read(replica: spark._Replica, part: SegmentRange, request: Any) -> Iterator[object]:
        asked.append((replica.address, request.reader_verifies))
        assert len(asked) < 6, asked
        reply = packed_reply(served[replica.address][request.from_index - 1 : request.to_index])
        reply.bridge_index = 6
        yield reply

    listed = _SegmentInfo(1, recorded, 6 if recorded else 0, ("a:1", "b:1"))
    if recorded:
        listed = _SegmentInfo(1, True, 6, ("a:1", "b:1"), certificate=made)
    reports: list[str] = []
    monkeypatch.setattr(spark._Replica, "read", read)
    monkeypatch.setattr(
        spark, "fetch_layout", lambda *args, **kwargs: _StreamLayout(7, (listed,), {})
    )
    monkeypatch.setattr(spark, "_report", lambda part, address, problem: reports.append(address))
    part = SegmentRange("t/s", 7, 1, 1, 5, ("a:1", "b:1"), master="m:1", sealed=False)
    rows = pa.Table.from_batches(list(spark.read_range(part)))
    assert rows.column("index").to_pylist() == [1, 2, 3, 4, 5]
    payloads = rows.column("payload").to_pylist()
    if recorded:
        assert payloads[1] == b"p2"
        assert asked == [("a:1", False), ("a:1", True), ("b:1", True)]
        assert reports == ["a:1"]
    else:
        assert payloads[1] == b"forged"  # crc32c alone: nothing tells it
        assert asked == [("a:1", False), ("a:1", False)]
