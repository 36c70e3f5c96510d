"""A master's start over a large catalog: the records decoded in bulk and the indexes
built in one pass are exactly what decoding each record and putting each segment one by
one make (issue #38: restart to serving at 100,000 streams)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from streamengine.master import catalog
from streamengine.master.catalog import Batch, Catalog, decode_records, decode_segment
from streamengine.master.core.model import (
    SegmentRecord,
    SegmentState,
    StoreRecord,
    StreamRecord,
)
from streamengine.master.core.repair import trusted_at_start
from streamengine.master.metadata import MemoryMetadata
from streamengine.master.state import MasterState
from streamengine.protocol.certificate import Certificate, Chunk

NOW = 1_000_000
STORES = ("a", "b", "c", "d")


def _segments(stream: StreamRecord, number: int) -> list[SegmentRecord]:
    """Segments in every shape a catalog holds: sealed and trusted, sealed with a bad or
    an unverified member, trimmed, certified, lost, open, sealing."""
    copy_set = tuple(STORES[(number + i) % len(STORES)] for i in range(3))
    certificate = Certificate(10, (Chunk(10, bytes([number % 256]) * 32),))
    base = SegmentRecord(
        stream.stream_id, stream.name, 1, copy_set, SegmentState.SEALED, 10, 1, 2, 2
    )
    shapes = [
        replace(base, verified=tuple(sorted(copy_set))),
        replace(base, bad=copy_set[:1], verified=copy_set[1:]),
        replace(base, certificate=certificate, certified_by="w"),
        replace(base, removal_at_ms=NOW + 5, lost_from_index=7),
    ]
    sealed = shapes[number % len(shapes)]
    later = [
        SegmentRecord(stream.stream_id, stream.name, 2, copy_set, SegmentState.OPEN, 0, 3, 0, 0),
        SegmentRecord(stream.stream_id, stream.name, 3, copy_set, SegmentState.SEALING, 0, 4, 0, 0),
    ]
    return [sealed, *later[: number % 3]]


def _catalog(streams: int) -> tuple[Catalog, list[SegmentRecord]]:
    metadata = MemoryMetadata()
    place = Catalog(metadata)
    place.commit(Batch().next_stream_id(streams + 1).tenant("t", 0))
    segments: list[SegmentRecord] = []
    for number in range(streams):
        stream = StreamRecord(f"t/s{number:04d}", number + 1, 3, 2, 1 << 20, 60_000, 3, "", 0)
        batch = Batch().stream(stream)
        for segment in _segments(stream, number):
            batch.segment(segment)
            segments.append(segment)
        place.commit(batch)
    return place, segments


def test_bulk_decoding_gives_what_decoding_each_record_gives(monkeypatch) -> None:
    # Chunks far smaller than the records, so records straddle several.
    monkeypatch.setattr(catalog, "RECORDS_PER_DECODE", 7)
    place, segments = _catalog(50)
    loaded = place.load()
    assert loaded.segments == {s.key: s for s in segments}
    records = place.metadata.read_all()
    assert loaded.segments == {
        decode_segment(v).key: decode_segment(v) for k, v in records if k.startswith(b"g/")
    }
    assert sorted(loaded.streams) == [f"t/s{n:04d}" for n in range(50)]
    # One object for equal copy sets, and a segment's stream name is its stream's.
    copy_sets = {id(s.copy_set) for s in loaded.segments.values()}
    assert len(copy_sets) == len({s.copy_set for s in loaded.segments.values()})
    for segment in loaded.segments.values():
        assert segment.stream is loaded.streams[segment.stream].name


def test_a_damaged_record_is_named_as_when_decoded_alone(monkeypatch) -> None:
    monkeypatch.setattr(catalog, "RECORDS_PER_DECODE", 4)
    place, _ = _catalog(5)
    records = place.metadata.read_all()
    # A value that would join its neighbours into one valid array element too many.
    damaged = [(k, b'1,{"x":2}' if k == b"s/t/s0002" else v) for k, v in records]
    with pytest.raises(json.JSONDecodeError, match="extra data"):
        decode_records(damaged)


def test_indexes_built_at_a_start_equal_those_put_segment_keeps() -> None:
    place, segments = _catalog(40)
    loaded = MasterState(place, NOW, 1000, 3000)
    one_by_one = MasterState(Catalog(MemoryMetadata()), NOW, 1000, 3000)
    for segment in segments:
        one_by_one.put_segment(segment)
    # What a start leaves to judge: the sealed segments not trusted.
    one_by_one.unconfirmed = {
        k for k in one_by_one.unconfirmed if not trusted_at_start(one_by_one.segments[k])
    }
    for index in ("segments", "trimmed", "epochs", "unsealed_epochs", "sealing", "unconfirmed"):
        assert getattr(loaded, index) == getattr(one_by_one, index), index
    assert loaded.members == one_by_one.members
    assert list(loaded.members) == list(one_by_one.members), "the same order"
    assert loaded.checks == one_by_one.checks
    # Each shape is there, so the comparison covers every branch.
    assert loaded.trimmed and loaded.sealing and loaded.unconfirmed and loaded.checks
    assert any(
        k not in loaded.unconfirmed
        for k, s in loaded.segments.items()
        if s.state == SegmentState.SEALED
    )


def test_stores_have_the_store_timeout_from_when_a_long_load_ends() -> None:
    place, _ = _catalog(3)
    batch = Batch()
    for number, store_id in enumerate(STORES):
        batch.store(StoreRecord(store_id, f"127.0.0.1:{number + 1}", "", False))
    place.commit(batch)
    timeout_ms = 3000
    state = MasterState(place, NOW, 1000, timeout_ms)
    loaded_ms = NOW + 2 * timeout_ms  # a load longer than the store timeout
    assert not any(v.alive for v in state.store_views(loaded_ms).values()), "before"
    state.registry.count_silence_from(loaded_ms)
    assert all(v.alive for v in state.store_views(loaded_ms + timeout_ms).values())
    assert not any(v.alive for v in state.store_views(loaded_ms + timeout_ms + 1).values())
    assert state.replicas.plan_repairs(loaded_ms, set(), 3) == [], "nothing to copy"
    # The restart rule still counts from the start of the load.
    assert state.granting_leases(NOW + 1000)
