"""One codec between wire and stored entries: both directions agree, and an unknown kind
or a packed batch that does not add up is refused wherever it is parsed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamengine.protocol import codec
from streamengine.protocol.entry import (
    VALUE_HEADER_BYTES,
    CorruptEntry,
    EntryKind,
    PackedEntries,
    StoredEntry,
    encode_value,
    first_corrupt_value,
)
from streamengine.segment_store.core.errors import BadRequest
from streamengine.segment_store.core.writes import check_batch
from streamengine.segment_store.writes import batch_of
from streamengine.v1 import entry_pb2, segment_store_pb2

ENTRIES = [
    StoredEntry.make(1, EntryKind.EVENT, 3, b"payload"),
    StoredEntry.make(2, EntryKind.HOLE, 4),
    StoredEntry.make(3, EntryKind.BRIDGE, 4),
]


def test_round_trip_keeps_every_field() -> None:
    assert codec.entries_from_pb([codec.entry_to_pb(e) for e in ENTRIES]) == ENTRIES


def test_a_packed_write_round_trips_its_entries() -> None:
    request = segment_store_pb2.WriteRequest.FromString(
        codec.write_request(ENTRIES, writer_epoch=4).SerializeToString()
    )
    assert request.first_index == 1 and list(request.value_lengths) == [20, 13, 13]
    assert batch_of(request).entries() == ENTRIES
    assert batch_of(request).heads() == ([1, 2, 3], [3, 4, 4])
    assert batch_of(segment_store_pb2.WriteRequest(acked_index=3)) == PackedEntries(0, ())


def test_a_batch_counts_its_payload_bytes_the_same_however_it_was_made() -> None:
    payloads = sum(len(e.payload) for e in ENTRIES)
    packed, lengths = PackedEntries.of(ENTRIES).to_wire()
    from_wire = PackedEntries.from_wire(1, packed, lengths)
    built = PackedEntries.of(ENTRIES)
    assert from_wire.payload_bytes() == built.payload_bytes() == payloads == 7
    assert built.payload_bytes() == payloads  # asked again: the count it keeps
    assert from_wire == built and PackedEntries(0, ()).payload_bytes() == 0


@pytest.mark.parametrize(
    ("case", "first_index", "packed", "lengths"),
    [
        ("lengths over the bytes", 1, b"x" * 20, [21]),
        ("lengths under the bytes", 1, b"x" * 20, [19]),
        ("bytes without lengths", 1, b"x" * 20, []),
        ("values without a first index", 0, b"x" * 20, [20]),
    ],
)
def test_a_packed_batch_that_does_not_add_up_is_bad_input(
    case: str, first_index: int, packed: bytes, lengths: list[int]
) -> None:
    with pytest.raises(CorruptEntry):
        PackedEntries.from_wire(first_index, packed, lengths)
    request = segment_store_pb2.WriteRequest(
        first_index=first_index, packed_values=packed, value_lengths=lengths
    )
    with pytest.raises(BadRequest):
        batch_of(request)


def test_wire_entries_from_stored_values_match_the_stored_entries() -> None:
    values = [encode_value(e.kind, e.epoch, e.crc32c, e.payload) for e in ENTRIES]
    wire = codec.entries_from_values([e.index for e in ENTRIES], values, verify=True)
    assert codec.entries_from_pb(wire) == ENTRIES


def test_an_unknown_kind_is_malformed_for_every_reader() -> None:
    unknown = entry_pb2.Entry(index=7, kind=9, epoch=1)  # type: ignore[arg-type]
    with pytest.raises(codec.MalformedEntry, match="entry 7: unknown kind 9"):
        codec.entry_from_pb(unknown)
    with pytest.raises(BadRequest, match="index 7: unknown kind 9"):
        check_batch(9, PackedEntries.of([StoredEntry(7, 9, 1, b"", 0)]))  # type: ignore[arg-type]


def test_a_packed_batch_is_cut_into_pieces_a_write_may_carry() -> None:
    sizes = [10, 10, 30, 5, 50, 1]
    batch = PackedEntries.of(
        [StoredEntry.make(7 + n, EntryKind.EVENT, 2, b"p" * size) for n, size in enumerate(sizes)]
    )
    pieces = batch.pieces(entries_max=3, bytes_max=40)
    assert [(p.first_index, [len(v) - 13 for v in p.values]) for p in pieces] == [
        (7, [10, 10]),  # 10 + 10 + 30 is over 40 bytes
        (9, [30, 5]),
        (11, [50]),  # alone over the bytes: a piece holds one value at least
        (12, [1]),
    ]
    assert [e for p in pieces for e in p.entries()] == batch.entries()
    assert batch.pieces(entries_max=2, bytes_max=1000)[0].last_index == 8
    assert PackedEntries(0, ()).pieces(3, 40) == []


@given(
    st.lists(st.binary(max_size=40), min_size=1, max_size=12),
    st.integers(0, 11),
    st.sampled_from(["none", "flip", "kind", "short"]),
)
def test_the_served_values_check_finds_the_first_damage_the_write_check_finds(
    payloads: list[bytes], at: int, damage: str
) -> None:
    """A store checks what it serves with `first_corrupt_value`, what it takes with
    `PackedEntries.check`: the same values fail both, at the same position."""
    first = 5
    entries = [StoredEntry.make(first + n, EntryKind.EVENT, 3, p) for n, p in enumerate(payloads)]
    values = list(PackedEntries.of(entries).values)
    at = min(at, len(values) - 1)
    value = bytearray(values[at])
    if damage == "flip":
        value[-1 if len(value) > VALUE_HEADER_BYTES else 1] ^= 0x10
    elif damage == "kind":
        value[0] = 99
    elif damage == "short":
        value = value[: VALUE_HEADER_BYTES - 1]
    values[at] = bytes(value)
    expected = None if damage == "none" else at
    assert first_corrupt_value(first, values) == expected
    if damage != "short":
        assert PackedEntries(first, tuple(values)).check()[2] == expected
