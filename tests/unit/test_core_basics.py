"""Entry encoding, crc32c corruption detection, sequence packing, replication policy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamengine.protocol.entry import (
    CorruptEntry,
    EntryKind,
    StoredEntry,
    decode_value,
    encode_value,
)
from streamengine.protocol.limits import EPOCH_MAX, INDEX_MAX
from streamengine.protocol.policy import InvalidPolicy, ReplicationPolicy
from streamengine.protocol.sequence import pack_sequence, unpack_sequence


def stored(entry: StoredEntry) -> bytes:
    return encode_value(entry.kind, entry.epoch, entry.crc32c, entry.payload)


@pytest.mark.parametrize(
    "entry",
    [
        StoredEntry.make(1, EntryKind.EVENT, 1, b"hello"),
        StoredEntry.make(7, EntryKind.EVENT, 3, b""),
        StoredEntry.make(2, EntryKind.HOLE, 5),
        StoredEntry.make(INDEX_MAX, EntryKind.BRIDGE, EPOCH_MAX),
    ],
)
def test_entry_round_trips(entry: StoredEntry) -> None:
    assert decode_value(entry.index, stored(entry)) == entry


def test_every_single_bit_flip_is_detected() -> None:
    value = bytearray(stored(StoredEntry.make(9, EntryKind.EVENT, 4, b"payload-bytes")))
    for byte in range(len(value)):
        for bit in range(8):
            corrupted = bytearray(value)
            corrupted[byte] ^= 1 << bit
            with pytest.raises(CorruptEntry):
                decode_value(9, bytes(corrupted))


@pytest.mark.parametrize(
    ("case", "value", "index"),
    [
        ("copy moved to another index", StoredEntry.make(3, EntryKind.EVENT, 1, b"x"), 4),
        ("truncated header", None, 1),
    ],
)
def test_misplaced_or_truncated_values_are_corrupt(
    case: str, value: StoredEntry | None, index: int
) -> None:
    raw = stored(value) if value is not None else b"\x01\x00"
    with pytest.raises(CorruptEntry):
        decode_value(index, raw)


def test_unknown_kind_is_corrupt() -> None:
    entry = StoredEntry.make(1, EntryKind.EVENT, 1, b"x")
    raw = bytearray(stored(entry))
    raw[0] = 9
    with pytest.raises(CorruptEntry, match="unknown kind"):
        decode_value(1, bytes(raw))


def test_holes_and_bridges_carry_no_payload() -> None:
    with pytest.raises(ValueError):
        StoredEntry.make(1, EntryKind.HOLE, 1, b"x")


def test_rewriting_with_a_new_epoch_keeps_content_and_reverifies() -> None:
    original = StoredEntry.make(5, EntryKind.EVENT, 1, b"abc")
    rewritten = original.with_epoch(4)
    assert rewritten.epoch == 4 and rewritten.same_content(original)
    rewritten.verify()
    assert rewritten.crc32c != original.crc32c


@pytest.mark.parametrize(
    ("epoch", "index", "sequence"),
    [(0, 0, 0), (1, 1, (1 << 32) | 1), (3, 7, 3 * 2**32 + 7), (EPOCH_MAX, INDEX_MAX, 2**63 - 1)],
)
def test_sequence_packing(epoch: int, index: int, sequence: int) -> None:
    assert pack_sequence(epoch, index) == sequence
    assert unpack_sequence(sequence) == (epoch, index)


@pytest.mark.parametrize(
    ("epoch", "index"), [(-1, 0), (EPOCH_MAX + 1, 0), (0, INDEX_MAX + 1), (0, -1)]
)
def test_sequence_out_of_range(epoch: int, index: int) -> None:
    with pytest.raises(ValueError):
        pack_sequence(epoch, index)


@given(
    st.integers(0, EPOCH_MAX),
    st.integers(0, INDEX_MAX),
    st.integers(0, EPOCH_MAX),
    st.integers(0, INDEX_MAX),
)
def test_sequences_order_like_epoch_then_index(e1: int, i1: int, e2: int, i2: int) -> None:
    assert (pack_sequence(e1, i1) < pack_sequence(e2, i2)) == ((e1, i1) < (e2, i2))


@pytest.mark.parametrize(
    ("replicas", "write_quorum", "read_quorum"),
    [(1, 1, 1), (3, 2, 2), (3, 3, 1), (3, 1, 3), (5, 3, 3), (4, 2, 3)],
)
def test_read_quorum_is_n_minus_w_plus_one(
    replicas: int, write_quorum: int, read_quorum: int
) -> None:
    policy = ReplicationPolicy(replicas, write_quorum)
    assert policy.read_quorum == read_quorum
    assert policy.read_quorum + policy.write_quorum > policy.replicas


@pytest.mark.parametrize(("replicas", "write_quorum"), [(0, 0), (3, 0), (3, 4), (-1, 1), (16, 2)])
def test_impossible_policies_are_refused(replicas: int, write_quorum: int) -> None:
    with pytest.raises(InvalidPolicy):
        ReplicationPolicy(replicas, write_quorum)


@pytest.mark.parametrize(
    ("write_quorum", "matched", "acked"),
    [
        (2, [5, 3, 9], 5),
        (2, [5, 5, 0], 5),
        (3, [5, 3, 9], 3),
        (1, [5, 3, 9], 9),
        (2, [7], 0),  # fewer answers than W: nothing acked
        (2, [], 0),
        (2, [0, 0, 4], 0),
    ],
)
def test_acked_index_is_the_wth_largest_matched(
    write_quorum: int, matched: list[int], acked: int
) -> None:
    assert ReplicationPolicy(3, write_quorum).acked_index(matched) == acked
