"""Runs through the cursor: a packed reply (Arrow columns) and a pushed batch (Python
columns) hand out the same events, as record batches or as `StreamEvent`s, under a
certificate a verified chunk at a time, holes never as rows."""

from __future__ import annotations

import pytest

from streamengine.client.core.subscription import Cursor, ListRun, ReadFrom, SegmentView
from streamengine.client.packed import EVENT_SCHEMA, Packed, released_batch, released_events
from streamengine.protocol import certificate
from streamengine.protocol.certificate import certificate_of
from streamengine.protocol.entry import EntryKind, StoredEntry, encode_value
from streamengine.protocol.sequence import pack_sequence
from streamengine.v1 import segment_store_pb2

REPLICAS = ("a:1", "b:1", "c:1")


def packed_reply(entries: list[StoredEntry]) -> segment_store_pb2.ReadReply:
    """A store's packed Read reply holding `entries`."""
    values = [encode_value(e.kind, e.epoch, e.crc32c, e.payload) for e in entries]
    return segment_store_pb2.ReadReply(
        packed_values=b"".join(values),
        value_lengths=[len(v) for v in values],
        first_index=entries[0].index,
    )


def list_run(entries: list[StoredEntry]) -> ListRun:
    return ListRun(entries[0].index, bytes(e.kind for e in entries), [e.payload for e in entries])


def packed_run(entries: list[StoredEntry]) -> Packed:
    packed = Packed.of(packed_reply(entries))
    assert packed is not None
    return packed


# Indexes 1-9 with a HOLE at 3, the BRIDGE at 10; chunks of 4 (1-4, 5-8, 9-10).
ENTRIES = [StoredEntry.make(i, EntryKind.EVENT, 1, b"p%d" % i) for i in range(1, 10)]
ENTRIES[2] = StoredEntry.make(3, EntryKind.HOLE, 2)
ENTRIES.append(StoredEntry.make(10, EntryKind.BRIDGE, 2))
EXPECTED = [(pack_sequence(4, i), 4, i, b"p%d" % i) for i in (2, 4, 5, 6, 7, 8, 9)]


@pytest.mark.parametrize("make_run", [list_run, packed_run])
@pytest.mark.parametrize("with_certificate", [False, True])
def test_a_run_hands_out_the_events_from_the_position_to_the_bridge(
    monkeypatch: pytest.MonkeyPatch, make_run: object, with_certificate: bool
) -> None:
    monkeypatch.setattr(certificate, "CHUNK_ENTRIES_MAX", 4)
    assert callable(make_run)
    made = certificate_of([(e.index, int(e.kind), e.payload) for e in ENTRIES])
    segment = SegmentView(4, REPLICAS, True, 10, made if with_certificate else None)
    as_batches, as_events = Cursor(pack_sequence(4, 2)), Cursor(pack_sequence(4, 2))
    batches, events = [], []
    for cursor in (as_batches, as_events):
        cursor.on_segments([segment, SegmentView(5, REPLICAS, False, 0)], 0)
        # Under the certificate, the read starts at the chunk holding the position.
        expected = ReadFrom(4, REPLICAS[0], 1, checked=True) if with_certificate else (
            ReadFrom(4, REPLICAS[0], 2)
        )
        assert cursor.next(0) == expected
    start = 0 if with_certificate else 1
    for low, high in ((start, 5), (5, 10)):  # two replies: 1-5 (or 2-5), 6-10
        run = make_run(ENTRIES[low:high])
        batches += [released_batch(r) for r in as_batches.on_run(4, run, 0)]
        released = as_events.on_run(4, run, 0)
        events += [e for r in released for e in released_events(r)]
        # Handed out a few at a time (`subscription.EVENTS_PER_LIST`): the same events.
        for most in (1, 2, 3):
            pieces = [p for r in released for p in r.pieces(most)]
            assert all(p.stop - p.start <= most for p in pieces)
            in_pieces = [e for p in pieces for e in released_events(p)]
            assert in_pieces == [e for r in released for e in released_events(r)]
    rows = [
        row
        for batch in batches
        for row in zip(*(batch.column(n).to_pylist() for n in EVENT_SCHEMA.names), strict=True)
    ]
    assert [(s, e, i, p) for e, i, s, p in rows] == EXPECTED
    assert [(e.sequence, e.epoch, e.index, e.payload) for e in events] == EXPECTED
    # The bridge hopped to the next segment.
    assert as_batches.next(0) == ReadFrom(5, REPLICAS[0], 1)
    assert as_batches.last_yielded == pack_sequence(4, 9)


@pytest.mark.parametrize(
    "copy",
    [
        StoredEntry.make(6, EntryKind.EVENT, 1, b"forged, crc valid"),
        # A bit flipped at rest under the old crc32c: a store asked with
        # `reader_verifies` sends it unchecked, and the certificate stops it.
        StoredEntry(6, EntryKind.EVENT, 1, b"e6 flipped", ENTRIES[5].crc32c),
    ],
    ids=["forged", "flipped"],
)
def test_a_packed_chunk_that_differs_is_never_handed_out(
    monkeypatch: pytest.MonkeyPatch, copy: StoredEntry
) -> None:
    monkeypatch.setattr(certificate, "CHUNK_ENTRIES_MAX", 4)
    made = certificate_of([(e.index, int(e.kind), e.payload) for e in ENTRIES])
    cursor = Cursor(0)
    cursor.on_segments([SegmentView(4, REPLICAS, True, 10, made)], 0)
    assert cursor.next(0) == ReadFrom(4, REPLICAS[0], 1, checked=True)
    forged = list(ENTRIES)
    forged[5] = copy
    # One reply holds chunk 1-4 and the forged chunk 5-8: 1-4 leave, nothing of 5-8,
    # and the next replica is read from 5 (the forged one never again from there).
    released = cursor.on_run(4, packed_run(forged[:8]), 0)
    assert [released_batch(r).column("index").to_pylist() for r in released] == [[1, 2, 4]]
    [report] = cursor.take_reports()
    assert report.replica == REPLICAS[0] and "5..8" in report.problem
    assert cursor.next(1) == ReadFrom(4, REPLICAS[1], 5, checked=True)
    released = cursor.on_run(4, packed_run(ENTRIES[4:]), 1)
    indexes = [released_batch(r).column("index").to_pylist() for r in released]
    assert indexes == [[5, 6, 7, 8, 9]]
