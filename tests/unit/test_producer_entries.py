"""Producer marks (`streamengine.protocol.entry`, "Producer marks"): their layout, their
crc, a store taking them, and readers never handing one out."""

from __future__ import annotations

import pytest

from streamengine.client.core.subscription import Cursor, SegmentView
from streamengine.client.packed import EVENT_SCHEMA, Packed, released_batch
from streamengine.protocol.entry import (
    PRODUCER_ID_BYTES_MAX,
    CorruptEntry,
    EntryKind,
    InvalidProducer,
    PackedEntries,
    ProducerMark,
    StoredEntry,
    decode_value,
    event_crcs,
    producer_crc,
)
from streamengine.protocol.sequence import pack_sequence
from streamengine.segment_store.core.writes import check_batch
from streamengine.v1 import segment_store_pb2

REPLICAS = ("a:1", "b:1", "c:1")


def test_a_mark_round_trips_and_names_its_last_sequence() -> None:
    mark = ProducerMark("orders-ingest-7", 41, 3)
    assert ProducerMark.decode(mark.encode()) == mark
    assert mark.last_sequence == 43


@pytest.mark.parametrize(
    "producer_id, first, count",
    [
        ("", 0, 1),
        ("x" * (PRODUCER_ID_BYTES_MAX + 1), 0, 1),
        ("a\nb", 0, 1),
        ("p", -1, 1),
        ("p", 0, 0),
        ("p", (1 << 63) - 1, 2),
    ],
)
def test_a_mark_that_cannot_be_written_is_refused(producer_id: str, first: int, count: int) -> None:
    with pytest.raises(InvalidProducer):
        ProducerMark(producer_id, first, count)


@pytest.mark.parametrize("payload", [b"", b"\x05abc", ProducerMark("p", 1, 1).encode() + b"!"])
def test_a_mark_payload_that_does_not_parse_is_corrupt(payload: bytes) -> None:
    with pytest.raises(CorruptEntry):
        ProducerMark.decode(payload)


def writer_batch() -> PackedEntries:
    """Index 5 a mark for the events at 6 and 7, as a writer packs them."""
    mark = ProducerMark("p", 10, 2).encode()
    payloads = [mark, b"e6", b"e7"]
    crcs = event_crcs(3, 5, payloads)
    crcs[0] = producer_crc(3, 5, mark)
    return PackedEntries.events(3, 5, payloads, crcs, marks=(5,))


def test_a_packed_mark_verifies_as_a_producer_entry_and_its_events_stay_plain() -> None:
    batch = writer_batch()
    entries = batch.entries()
    assert [e.kind for e in entries] == [EntryKind.PRODUCER, EntryKind.EVENT, EntryKind.EVENT]
    assert entries[1] == StoredEntry.make(6, EntryKind.EVENT, 3, b"e6")
    assert ProducerMark.decode(entries[0].payload) == ProducerMark("p", 10, 2)
    # The crc covers the kind: the same bytes as an EVENT do not verify.
    as_event = bytes([EntryKind.EVENT]) + batch.values[0][1:]
    with pytest.raises(CorruptEntry):
        decode_value(5, as_event)


def test_a_store_takes_a_mark_with_its_payload() -> None:
    kinds, _ = check_batch(3, writer_batch())
    assert kinds == [EntryKind.PRODUCER, EntryKind.EVENT, EntryKind.EVENT]


def entries_with_a_mark() -> list[StoredEntry]:
    mark = ProducerMark("p", 0, 2).encode()
    return [
        StoredEntry.make(1, EntryKind.EVENT, 4, b"plain"),
        StoredEntry.make(2, EntryKind.PRODUCER, 4, mark),
        StoredEntry.make(3, EntryKind.EVENT, 4, b"p0"),
        StoredEntry.make(4, EntryKind.EVENT, 4, b"p1"),
    ]


def test_a_reader_never_hands_out_a_mark() -> None:
    cursor = Cursor(0)
    cursor.on_segments([SegmentView(4, REPLICAS, False, 0)], 0)
    events = cursor.on_entries(4, entries_with_a_mark(), 0)
    assert [(e.index, e.payload) for e in events] == [(1, b"plain"), (3, b"p0"), (4, b"p1")]


def test_a_reader_of_packed_replies_never_hands_out_a_mark() -> None:
    entries = entries_with_a_mark()
    values = [PackedEntries.of([e]).values[0] for e in entries]
    reply = segment_store_pb2.ReadReply(
        packed_values=b"".join(values), value_lengths=[len(v) for v in values], first_index=1
    )
    packed = Packed.of(reply)
    assert packed is not None
    cursor = Cursor(0)
    cursor.on_segments([SegmentView(4, REPLICAS, False, 0)], 0)
    rows = [
        row
        for released in cursor.on_run(4, packed, 0)
        for row in zip(
            *(released_batch(released).column(n).to_pylist() for n in EVENT_SCHEMA.names),
            strict=True,
        )
    ]
    assert [(sequence, payload) for _, _, sequence, payload in rows] == [
        (pack_sequence(4, 1), b"plain"),
        (pack_sequence(4, 3), b"p0"),
        (pack_sequence(4, 4), b"p1"),
    ]
