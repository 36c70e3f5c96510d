"""Key and metadata layout of the segment store.

Entries: `b"e" | stream_id u64 | segment epoch u64 | index u64`, big-endian, so one
segment is one contiguous key range in index order. Metadata: `b"m" | stream_id u64 |
segment epoch u64`, one key per segment, written in the same batch as the entries it
describes, so after a crash the metadata never covers entries that are not there and
never misses entries that are.

Metadata value: fence, acked index, matched index, last index, payload bytes, held
entries, then the indexes holding a BRIDGE copy (u64 each).

Tenants: `b"t" | stream_id u64` -> the tenant of the stream, as the grants (or the
master's copy requests) that brought its data here said, so that the store knows whose
data it serves to readers. Written in the batch of the first write or seal under it.

Segment records: `b"g" | stream_id u64 | segment epoch u64` -> the master's record of
the segment (`v1.SegmentRecord`, serialized, as the master sent it: stream name,
policy, copy set, seal state, final index, certificate), so that a master that lost its
metadata rebuilds it from the stores (`master --rebuild`). Kept only while the segment
is held, and deleted in the batch that deletes the segment.

Copy sets as granted: `b"p" | stream_id u64 | segment epoch u64` -> the segment's copy
set as the grant of the first write or seal that brought it here listed it (u8 count,
then each store id as text), so that a master rebuilding its metadata knows every member
of a segment whose record never reached a store, those that never got a write too.
Written in the batch that first holds the segment, deleted in the batch that deletes it.

Stream names as granted: `b"n" | stream_id u64` -> the stream's name (as text) and
write quorum (u8) as the grant of a write or seal that first brought one of its
segments here said them, so that a master rebuilding its metadata names a stream none
of whose records or cards reached a store. Written in that batch; kept, as the tenant
is.

Identity: `b"i"` -> the store's incarnation (u64, made when the database is created:
an empty or replaced database is a new incarnation); `b"c"` -> the id of the cluster
whose master it first registered with. Lost replicas: `b"x" | stream_id u64 | segment
epoch u64` -> b"", a segment of the copy set the store was in under an earlier
incarnation: it holds none of it and refuses to seal or write it (a master's copy may
still bring it here); deleted with the segment.

Authority: `b"a"` -> what the store trusts of its master (`authority.AuthorityRecord`:
its public keys and token revocations), so that it checks grants and tokens after a
restart before the master answers.

Cluster view: `b"v"` -> the master's last cluster view (`v1.ClusterView`, serialized,
as the master sent it: every store it knows, the highest stream id it gave), so that a
master rebuilding its metadata waits for every store and gives no stream id again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from streamengine.protocol.signing import PayloadReader, PayloadWriter

ENTRY_PREFIX = b"e"
META_PREFIX = b"m"
TENANT_PREFIX = b"t"
AUTHORITY_KEY = b"a"
RECORD_PREFIX = b"g"
INCARNATION_KEY = b"i"
CLUSTER_ID_KEY = b"c"
CLUSTER_VIEW_KEY = b"v"
LOST_PREFIX = b"x"
PLACED_PREFIX = b"p"
NAME_PREFIX = b"n"

_SEGMENT = struct.Struct(">QQ")
_ENTRY = struct.Struct(">QQQ")
_META = struct.Struct(">QQQQQQ")
_U64 = struct.Struct(">Q")
U64_MAX = (1 << 64) - 1

# Segments of one store stay in memory, each with its bridge indexes; recoveries that
# leave a stale bridge behind are rare, and a segment with this many is malformed input.
BRIDGES_PER_SEGMENT_MAX = 64


def entry_key(stream_id: int, epoch: int, index: int) -> bytes:
    return ENTRY_PREFIX + _ENTRY.pack(stream_id, epoch, index)


def entry_key_prefix(stream_id: int, epoch: int) -> bytes:
    """The segment's part of its entry keys; an entry key is this + index u64."""
    return ENTRY_PREFIX + _SEGMENT.pack(stream_id, epoch)


def entry_index(key: bytes) -> int:
    index: int = _U64.unpack_from(key, 1 + _SEGMENT.size)[0]
    return index


def segment_entries_range(stream_id: int, epoch: int) -> tuple[bytes, bytes]:
    """[start, end) covering every entry key of the segment."""
    return entry_key(stream_id, epoch, 0), _segment_end(ENTRY_PREFIX, stream_id, epoch)


def meta_key(stream_id: int, epoch: int) -> bytes:
    return META_PREFIX + _SEGMENT.pack(stream_id, epoch)


def meta_segment(key: bytes) -> tuple[int, int]:
    stream_id, epoch = _SEGMENT.unpack_from(key, 1)
    return stream_id, epoch


def meta_range() -> tuple[bytes, bytes]:
    return META_PREFIX, bytes([META_PREFIX[0] + 1])


def record_key(stream_id: int, epoch: int) -> bytes:
    return RECORD_PREFIX + _SEGMENT.pack(stream_id, epoch)


def record_range() -> tuple[bytes, bytes]:
    return RECORD_PREFIX, bytes([RECORD_PREFIX[0] + 1])


def lost_key(stream_id: int, epoch: int) -> bytes:
    return LOST_PREFIX + _SEGMENT.pack(stream_id, epoch)


def lost_range() -> tuple[bytes, bytes]:
    return LOST_PREFIX, bytes([LOST_PREFIX[0] + 1])


def placed_key(stream_id: int, epoch: int) -> bytes:
    return PLACED_PREFIX + _SEGMENT.pack(stream_id, epoch)


def encode_copy_set(copy_set: tuple[str, ...]) -> bytes:
    assert 0 < len(copy_set) <= 255 and all(copy_set), copy_set
    out = PayloadWriter().u8(len(copy_set))
    for store in copy_set:
        out.text(store)
    return out.bytes()


def decode_copy_set(raw: bytes) -> tuple[str, ...]:
    """Raises MalformedPayload unless `raw` is `encode_copy_set`'s."""
    reader = PayloadReader(raw)
    copy_set = tuple(reader.text() for _ in range(reader.u8()))
    reader.finish()
    return copy_set


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(raw: bytes) -> int:
    value: int = _U64.unpack(raw)[0]
    return value


def name_key(stream_id: int) -> bytes:
    return NAME_PREFIX + _U64.pack(stream_id)


def encode_granted_stream(name: str, write_quorum: int) -> bytes:
    return PayloadWriter().text(name).u8(write_quorum).bytes()


def decode_granted_stream(raw: bytes) -> tuple[str, int]:
    """Raises MalformedPayload unless `raw` is `encode_granted_stream`'s."""
    reader = PayloadReader(raw)
    granted = reader.text(), reader.u8()
    reader.finish()
    return granted


def tenant_key(stream_id: int) -> bytes:
    return TENANT_PREFIX + _U64.pack(stream_id)


def tenant_stream(key: bytes) -> int:
    stream_id: int = _U64.unpack_from(key, 1)[0]
    return stream_id


def tenant_range() -> tuple[bytes, bytes]:
    return TENANT_PREFIX, bytes([TENANT_PREFIX[0] + 1])


def _segment_end(prefix: bytes, stream_id: int, epoch: int) -> bytes:
    # The first key after the segment: the next epoch, or the next stream at epoch 0.
    if epoch < U64_MAX:
        return prefix + _SEGMENT.pack(stream_id, epoch + 1)
    if stream_id < U64_MAX:
        return prefix + _SEGMENT.pack(stream_id + 1, 0)
    return bytes([prefix[0] + 1])


@dataclass(frozen=True, slots=True)
class SegmentMeta:
    """What a store knows about one segment, persisted under its meta key."""

    fence: int = 0
    acked_index: int = 0
    matched_index: int = 0
    last_index: int = 0
    payload_bytes: int = 0
    entries: int = 0
    bridges: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.acked_index <= self.matched_index <= self.last_index, self
        assert self.entries <= self.last_index, self
        assert list(self.bridges) == sorted(set(self.bridges)), self

    def encode(self) -> bytes:
        head = _META.pack(
            self.fence,
            self.acked_index,
            self.matched_index,
            self.last_index,
            self.payload_bytes,
            self.entries,
        )
        return head + b"".join(_U64.pack(b) for b in self.bridges)

    @classmethod
    def decode(cls, value: bytes) -> SegmentMeta:
        if len(value) < _META.size or (len(value) - _META.size) % _U64.size:
            raise ValueError(f"segment metadata of {len(value)} bytes is malformed")
        fence, acked, matched, last, payload_bytes, entries = _META.unpack_from(value)
        count = (len(value) - _META.size) // _U64.size
        bridges = struct.unpack_from(f">{count}Q", value, _META.size)
        return cls(fence, acked, matched, last, payload_bytes, entries, tuple(bridges))

    @property
    def bridge_index(self) -> int:
        """The first BRIDGE at or below the acked index, else 0: where readers stop."""
        if self.bridges and self.bridges[0] <= self.acked_index:
            return self.bridges[0]
        return 0
