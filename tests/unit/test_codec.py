"""One codec between wire and stored entries: both directions agree, and an unknown kind
is refused the same way wherever an entry is parsed."""

from __future__ import annotations

import pytest

from streamengine.protocol import codec
from streamengine.protocol.entry import EntryKind, StoredEntry, encode_value
from streamengine.segment_store.service import entries_from_pb as store_entries_from_pb
from streamengine.segment_store.store import BadRequest
from streamengine.v1 import entry_pb2

ENTRIES = [
    StoredEntry.make(1, EntryKind.EVENT, 3, b"payload"),
    StoredEntry.make(2, EntryKind.HOLE, 4),
    StoredEntry.make(3, EntryKind.BRIDGE, 4),
]


def test_round_trip_keeps_every_field() -> None:
    assert codec.entries_from_pb(codec.entries_to_pb(ENTRIES)) == ENTRIES


def test_wire_entries_from_stored_values_match_the_stored_entries() -> None:
    values = [encode_value(e.kind, e.epoch, e.crc32c, e.payload) for e in ENTRIES]
    wire = codec.entries_from_values([e.index for e in ENTRIES], values, verify=True)
    assert codec.entries_from_pb(wire) == ENTRIES


def test_an_unknown_kind_is_malformed_for_every_reader() -> None:
    unknown = entry_pb2.Entry(index=7, kind=9, epoch=1)  # type: ignore[arg-type]
    with pytest.raises(codec.MalformedEntry, match="entry 7: unknown kind 9"):
        codec.entry_from_pb(unknown)
    with pytest.raises(BadRequest, match="entry 7: unknown kind 9"):
        store_entries_from_pb([unknown])
