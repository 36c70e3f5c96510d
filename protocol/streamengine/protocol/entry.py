"""Entries: kinds, the crc32c that guards each copy, and the stored value layout.

The checksum covers (kind, epoch, index, payload): a copy moved to another index, given
another epoch or kind, or with a flipped payload bit no longer verifies. The writer
computes it once per event; stores verify on write, readers on read.

Stored value layout (big-endian): kind u8 | epoch u64 | crc32c u32 | payload.

Producer marks. An `append_batch` with a producer id writes one PRODUCER entry right
before its events: its payload names the producer and the producer sequence of the
first event, and the events that follow it at consecutive indexes carry the next
sequences, up to `count`. The events themselves stay plain EVENTs, byte for byte what an
append without a producer writes, and readers hand out EVENTs only, so neither readers
nor appends without a producer pay anything for it. The mark is an entry like any other:
its crc covers it, recovery copies it with its events, and a new leader rebuilds the
producer table from the marks and the events that follow them
(`streamengine.protocol.producers`).

Mark payload layout (big-endian): id length u8 | producer id | first sequence u64 |
count u32.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import google_crc32c


class EntryKind(enum.IntEnum):
    """Numbers match `streamengine.v1.EntryKind`."""

    EVENT = 1
    HOLE = 2
    BRIDGE = 3
    PRODUCER = 4


# The kinds whose entries carry a payload.
PAYLOAD_KINDS = frozenset((EntryKind.EVENT, EntryKind.PRODUCER))


# A producer id is at most this many bytes of UTF-8: it is kept per producer in the
# leader's table and in the master's seal records.
PRODUCER_ID_BYTES_MAX = 128
# Producer sequences, like indexes, fit a signed 64-bit integer (Spark's long).
PRODUCER_SEQUENCE_MAX = (1 << 63) - 1

_CRC_HEADER = struct.Struct(">BQQ")  # kind, epoch, index
_VALUE_HEADER = struct.Struct(">BQI")  # kind, epoch, crc32c
VALUE_HEADER_BYTES = _VALUE_HEADER.size


class CorruptEntry(ValueError):
    """A stored or received copy whose checksum or layout does not verify."""


def entry_crc(kind: int, epoch: int, index: int, payload: bytes) -> int:
    header_crc = google_crc32c.value(_CRC_HEADER.pack(kind, epoch, index))
    crc: int = google_crc32c.extend(header_crc, payload)
    return crc


def event_crcs(epoch: int, first_index: int, payloads: Sequence[bytes]) -> list[int]:
    """The crc32c of each EVENT of copy epoch `epoch` at consecutive indexes from
    `first_index` (a writer's append), in one tight loop."""
    header, value, extend = _CRC_HEADER.pack, google_crc32c.value, google_crc32c.extend
    event = EntryKind.EVENT.value
    return [
        extend(value(header(event, epoch, index)), payload)
        for index, payload in enumerate(payloads, first_index)
    ]


def first_corrupt(
    indexes: Sequence[int],
    kinds: Sequence[int],
    epochs: Sequence[int],
    payloads: Sequence[bytes],
    crcs: Sequence[int],
) -> int | None:
    """Position of the first entry of a batch (as columns) whose checksum or kind does
    not verify, else None. One tight loop: readers check every entry they receive."""
    pack, value, extend = _CRC_HEADER.pack, google_crc32c.value, google_crc32c.extend
    for position, (index, kind, epoch, payload, crc) in enumerate(
        zip(indexes, kinds, epochs, payloads, crcs, strict=True)
    ):
        if kind not in _KINDS or extend(value(pack(kind, epoch, index)), payload) != crc:
            return position
    return None


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """One copy of one index, as a store holds it."""

    index: int
    kind: EntryKind
    epoch: int
    payload: bytes
    crc32c: int

    @classmethod
    def make(cls, index: int, kind: EntryKind, epoch: int, payload: bytes = b"") -> StoredEntry:
        if kind not in PAYLOAD_KINDS and payload:
            raise ValueError(f"a {kind.name} carries no payload")
        return cls(index, kind, epoch, payload, entry_crc(kind, epoch, index, payload))

    def verify(self) -> None:
        if self.kind not in _KINDS:
            raise CorruptEntry(f"index {self.index}: unknown kind {int(self.kind)}")
        if entry_crc(self.kind, self.epoch, self.index, self.payload) != self.crc32c:
            raise CorruptEntry(f"index {self.index}: crc32c mismatch")

    def with_epoch(self, epoch: int) -> StoredEntry:
        """The same content rewritten by the leader of `epoch` (recovery)."""
        return StoredEntry.make(self.index, self.kind, epoch, self.payload)

    def same_content(self, other: StoredEntry) -> bool:
        return self.kind == other.kind and self.payload == other.payload


_KINDS = frozenset(EntryKind)


class InvalidProducer(ValueError):
    """A producer id or sequence that cannot be written."""


@dataclass(frozen=True, slots=True)
class ProducerMark:
    """What a PRODUCER entry says: the `count` events right after it carry the producer
    sequences `first_sequence`, `first_sequence + 1`, ... of `producer_id`."""

    producer_id: str
    first_sequence: int
    count: int

    def __post_init__(self) -> None:
        check_producer_id(self.producer_id)
        if not 0 <= self.first_sequence <= PRODUCER_SEQUENCE_MAX - self.count + 1:
            raise InvalidProducer(
                f"producer sequences {self.first_sequence}.. (+{self.count}) outside "
                f"0..{PRODUCER_SEQUENCE_MAX}"
            )
        if not 1 <= self.count <= 0xFFFF_FFFF:
            raise InvalidProducer(f"a producer mark of {self.count} events")

    @property
    def last_sequence(self) -> int:
        return self.first_sequence + self.count - 1

    def encode(self) -> bytes:
        name = self.producer_id.encode()
        return bytes((len(name),)) + name + _MARK_TAIL.pack(self.first_sequence, self.count)

    @classmethod
    def decode(cls, payload: bytes) -> ProducerMark:
        """The mark a PRODUCER entry's payload holds; raises CorruptEntry."""
        if not payload or len(payload) != 1 + payload[0] + _MARK_TAIL.size:
            raise CorruptEntry(f"a producer mark of {len(payload)} bytes does not parse")
        end = 1 + payload[0]
        first, count = _MARK_TAIL.unpack_from(payload, end)
        try:
            return cls(bytes(payload[1:end]).decode(), first, count)
        except (UnicodeDecodeError, InvalidProducer) as error:
            raise CorruptEntry(f"a producer mark that does not parse: {error}") from None


_MARK_TAIL = struct.Struct(">QI")  # first sequence, count


def check_producer_id(producer_id: str) -> None:
    """Raises InvalidProducer unless `producer_id` can name a producer."""
    size = len(producer_id.encode())
    if not 1 <= size <= PRODUCER_ID_BYTES_MAX or not producer_id.isprintable():
        raise InvalidProducer(
            f"a producer id is 1..{PRODUCER_ID_BYTES_MAX} bytes of printable UTF-8, "
            f"not {producer_id!r}"
        )


def producer_crc(epoch: int, index: int, mark: bytes) -> int:
    """The crc32c of a PRODUCER entry whose payload is `mark`."""
    return entry_crc(EntryKind.PRODUCER, epoch, index, mark)


def encode_value(kind: int, epoch: int, crc: int, payload: bytes) -> bytes:
    return _VALUE_HEADER.pack(kind, epoch, crc) + payload


def decode_value(index: int, value: bytes) -> StoredEntry:
    """Decode a stored value and verify it; raises CorruptEntry."""
    if len(value) < VALUE_HEADER_BYTES:
        raise CorruptEntry(f"index {index}: value of {len(value)} bytes is truncated")
    kind, epoch, crc = _VALUE_HEADER.unpack_from(value)
    if kind not in _KINDS:
        raise CorruptEntry(f"index {index}: unknown kind {kind}")
    entry = StoredEntry(index, EntryKind(kind), epoch, bytes(value[VALUE_HEADER_BYTES:]), crc)
    entry.verify()
    return entry


def unpack_values(
    indexes: Sequence[int], values: Sequence[bytes], verify: bool = True
) -> tuple[list[int], list[int], list[bytes], list[int]]:
    """Stored values of consecutive reads as columns (kinds, epochs, payloads, crcs),
    each verified in one tight loop unless the receiver verifies them itself; raises
    CorruptEntry naming the first bad index. The read path of stores: no object per
    entry."""
    unpack, header = _VALUE_HEADER.unpack_from, VALUE_HEADER_BYTES
    kinds: list[int] = []
    epochs: list[int] = []
    payloads: list[bytes] = []
    crcs: list[int] = []
    for value in values:
        if len(value) < header:
            raise CorruptEntry(f"index {indexes[len(kinds)]}: stored value is truncated")
        kind, epoch, crc = unpack(value)
        kinds.append(kind)
        epochs.append(epoch)
        payloads.append(value[header:])
        crcs.append(crc)
    bad = first_corrupt(indexes, kinds, epochs, payloads, crcs) if verify else None
    if bad is not None:
        raise CorruptEntry(f"index {indexes[bad]}: crc32c mismatch or unknown kind")
    return kinds, epochs, payloads, crcs


def first_corrupt_value(first_index: int, values: Sequence[bytes]) -> int | None:
    """Position of the first stored value (of consecutive indexes from `first_index`)
    that does not verify, else None."""
    # Its own loop, not `PackedEntries.check`'s: a store checks every value it serves,
    # and collecting kinds and epochs it does not need cost it a sixth of the check.
    unpack, pack, header = _VALUE_HEADER.unpack_from, _CRC_HEADER.pack, VALUE_HEADER_BYTES
    value_crc, extend, known = google_crc32c.value, google_crc32c.extend, _KINDS
    for position, value in enumerate(values):
        if len(value) < header:
            return position
        kind, epoch, crc = unpack(value)
        if (
            extend(value_crc(pack(kind, epoch, first_index + position)), value[header:]) != crc
            or kind not in known
        ):
            return position
    return None


@dataclass(frozen=True, slots=True)
class PackedEntries:
    """Entries of consecutive indexes from `first_index`, each as its stored value (the
    layout above): what a Write carries and a store puts as it is. A batch of any size
    is two columns, not an object per entry."""

    first_index: int
    values: Sequence[bytes]
    # The payloads' bytes, once known: a store checks and bounds a batch by them in
    # several places, and summing thousands of lengths each time shows in its CPU per
    # entry (docs/performance.md).
    _payload_bytes: int | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def of(cls, entries: Sequence[StoredEntry]) -> PackedEntries:
        """Entries of consecutive indexes, packed (the writer's and recovery's side)."""
        if not entries:
            return EMPTY_BATCH
        pack = _VALUE_HEADER.pack
        first = entries[0].index
        assert all(e.index == first + n for n, e in enumerate(entries)), "not consecutive"
        return cls(first, [pack(e.kind, e.epoch, e.crc32c) + e.payload for e in entries])

    @classmethod
    def events(
        cls,
        epoch: int,
        first_index: int,
        payloads: Sequence[bytes],
        crcs: Sequence[int],
        marks: Sequence[int] = (),
    ) -> PackedEntries:
        """EVENTs of copy epoch `epoch` at consecutive indexes, from their payloads and
        crcs (`event_crcs`), packed: a writer's batch. The indexes in `marks` are
        PRODUCER entries instead (their crcs are `producer_crc`'s)."""
        pack, event = _VALUE_HEADER.pack, EntryKind.EVENT.value
        values = [pack(event, epoch, crc) + p for crc, p in zip(crcs, payloads, strict=True)]
        for index in marks:
            position = index - first_index
            assert 0 <= position < len(values), (index, first_index, len(values))
            values[position] = pack(EntryKind.PRODUCER, epoch, crcs[position]) + payloads[position]
        return cls(first_index, values) if values else EMPTY_BATCH

    @classmethod
    def from_wire(cls, first_index: int, packed: bytes, lengths: Sequence[int]) -> PackedEntries:
        """The values of a packed message; raises CorruptEntry when the lengths do not
        add up to the bytes, or values come without a first index."""
        if sum(lengths) != len(packed):
            raise CorruptEntry(
                f"value lengths add up to {sum(lengths)} bytes, the packed values are {len(packed)}"
            )
        if not lengths:
            return EMPTY_BATCH
        if first_index <= 0:
            raise CorruptEntry("packed values without a first index")
        values = []
        start = 0
        for length in lengths:
            end = start + length
            values.append(packed[start:end])
            start = end
        batch = cls(first_index, values)
        object.__setattr__(batch, "_payload_bytes", len(packed) - VALUE_HEADER_BYTES * len(values))
        return batch

    def to_wire(self) -> tuple[bytes, list[int]]:
        """(packed values, value lengths), the fields of a packed message."""
        return b"".join(self.values), [len(v) for v in self.values]

    def __len__(self) -> int:
        return len(self.values)

    @property
    def last_index(self) -> int:
        """The last index, or 0 for an empty batch."""
        return self.first_index + len(self.values) - 1 if self.values else 0

    def pieces(self, entries_max: int, bytes_max: int) -> list[PackedEntries]:
        """The batch cut into consecutive pieces of at most `entries_max` values and
        `bytes_max` payload bytes each (a piece holds one value at least): a packed
        Read reply, which may be larger, written as Writes."""
        pieces = []
        start = 0
        values = self.values
        while start < len(values):
            stop = start
            payload = 0
            while stop < len(values) and stop - start < entries_max:
                size = len(values[stop]) - VALUE_HEADER_BYTES
                if stop > start and payload + size > bytes_max:
                    break
                payload += size
                stop += 1
            pieces.append(PackedEntries(self.first_index + start, values[start:stop]))
            start = stop
        return pieces

    def payload_bytes(self) -> int:
        known = self._payload_bytes
        if known is None:
            known = sum(map(len, self.values)) - VALUE_HEADER_BYTES * len(self.values)
            object.__setattr__(self, "_payload_bytes", known)
        return known

    def heads(self) -> tuple[list[int], list[int]]:
        """(kinds, epochs) of the values, unchecked; raises CorruptEntry for a value
        shorter than its header."""
        if self.values and min(map(len, self.values)) < VALUE_HEADER_BYTES:
            raise CorruptEntry("a packed value is shorter than its header")
        heads = list(map(_KIND_EPOCH.unpack_from, self.values))
        return [h[0] for h in heads], [h[1] for h in heads]

    def check(self) -> tuple[list[int], list[int], int | None]:
        """(kinds, epochs, the position of the first value that does not verify or
        None) in one pass: a store checks a whole Write so. Raises CorruptEntry for a
        value shorter than its header."""
        values = self.values
        if values and min(map(len, values)) < VALUE_HEADER_BYTES:
            raise CorruptEntry("a packed value is shorter than its header")
        unpack, pack, header = _VALUE_HEADER.unpack_from, _CRC_HEADER.pack, VALUE_HEADER_BYTES
        value_crc, extend, known = google_crc32c.value, google_crc32c.extend, _KINDS
        kinds: list[int] = []
        epochs: list[int] = []
        add_kind, add_epoch = kinds.append, epochs.append
        bad = None
        for index, value in enumerate(values, self.first_index):
            kind, epoch, crc = unpack(value)
            add_kind(kind)
            add_epoch(epoch)
            if bad is None and (
                extend(value_crc(pack(kind, epoch, index)), value[header:]) != crc
                or kind not in known
            ):
                bad = index - self.first_index
        return kinds, epochs, bad

    def entries(self) -> list[StoredEntry]:
        """Each value decoded and verified (CorruptEntry): for the paths that look at
        entries one by one (recovery's reads, tests), not the store's write path."""
        return [decode_value(self.first_index + n, v) for n, v in enumerate(self.values)]


_KIND_EPOCH = struct.Struct(">BQ")  # the prefix of a stored value
EMPTY_BATCH = PackedEntries(0, ())
