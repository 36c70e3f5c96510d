"""Certificates: what a sealed segment must contain, as digests of its content.

Theory of operation. A sealed segment's content is the kind and payload of every index
from 1 to its final index (the BRIDGE), in index order. The copy epoch is not part of it:
replicas of one sealed segment legitimately hold the same content under different copy
epochs (a final copy an earlier recovery rewrote with its epoch stays on one store while
another store holds the original, `streamengine.client.core.recovery`, step 3), and the
entry's crc32c guards the epoch of each copy anyway.

The content is cut into *chunks* by a rule that depends on the content alone: a chunk
ends after `CHUNK_ENTRIES_MAX` entries, once its payloads reach `CHUNK_BYTES_MAX`, or at
the final index. Each chunk has a digest:

    SHA-256(tag | first index | last index | SHA-256(kinds) | SHA-256(lengths) | SHA-256(payloads))

over three columns of the chunk, one byte per kind, one big-endian u32 per payload
length, and the payloads back to back; three columns rather than one record per entry,
so that a reader holding a packed reply (Spark: values in one buffer) hashes whole
columns without a Python object per row. The certificate is the final index and the
list of (last index, digest) of its chunks; its *root* is SHA-256 over all of that.

Who uses what: a writer (`ContentDigest`, fed as it assigns indexes) and a store
(scrubbing or verifying a copy) compute a certificate from content; the master keeps
one per sealed segment; a reader checks what it receives chunk by chunk against it
(`ChunkCheck`) and hands out a chunk's events only once the chunk verified, so a
replica that differs from the certificate anywhere (a stale copy whose crc is valid, an
index missing or added, a crc collision) is caught before anything of that chunk is
returned. Per-entry crc32c catches a flipped bit at once; the chunk digest catches
what a valid crc cannot, at the cost of holding back at most one chunk.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from streamengine.protocol.entry import EntryKind
from streamengine.protocol.limits import EVENT_BYTES_MAX, INDEX_MAX

# A chunk is what a reader holds back before handing out its events: bounded in bytes
# (a reader's memory) and in entries (a chunk of empty events still ends).
CHUNK_BYTES_MAX = 4 << 20
CHUNK_ENTRIES_MAX = 65_536
DIGEST_BYTES = 32

assert CHUNK_BYTES_MAX >= 2 * EVENT_BYTES_MAX, "a chunk holds several of the largest events"

_CHUNK_TAG = b"streamengine chunk v1"
_ROOT_TAG = b"streamengine certificate v1"
_U64 = struct.Struct(">Q")
_TWO_U64 = struct.Struct(">QQ")
_ENCODED_HEAD = struct.Struct(">4sQI")
_ENCODED_CHUNK = struct.Struct(f">Q{DIGEST_BYTES}s")
_MAGIC = b"SEC1"
_SWAP = sys.byteorder == "little"  # lengths are hashed big-endian

assert array.array("I").itemsize == 4, "payload lengths hash as u32"


class MalformedCertificate(ValueError):
    """A certificate that cannot describe any segment."""


class CertificateMismatch(ValueError):
    """Content that differs from its certificate: `first_index..last_index` is the chunk
    that did not verify."""

    def __init__(self, first_index: int, last_index: int, detail: str = "") -> None:
        self.first_index = first_index
        self.last_index = last_index
        super().__init__(
            f"indexes {first_index}..{last_index} differ from the certificate"
            + (f": {detail}" if detail else "")
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    last_index: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class Certificate:
    """The final index of a sealed segment and the digests of its chunks, in order."""

    final_index: int
    chunks: tuple[Chunk, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.final_index <= INDEX_MAX:
            raise MalformedCertificate(f"final index {self.final_index} not in 1..{INDEX_MAX}")
        if not self.chunks:
            raise MalformedCertificate("a certificate needs at least one chunk")
        previous = 0
        for chunk in self.chunks:
            if len(chunk.digest) != DIGEST_BYTES:
                raise MalformedCertificate(f"chunk digest of {len(chunk.digest)} bytes")
            if not previous < chunk.last_index <= previous + CHUNK_ENTRIES_MAX:
                raise MalformedCertificate(
                    f"chunk ending at {chunk.last_index} does not follow {previous}"
                )
            previous = chunk.last_index
        if previous != self.final_index:
            raise MalformedCertificate(f"chunks end at {previous}, not at {self.final_index}")

    def root(self) -> bytes:
        """One digest for the whole certificate: what two certificates are compared by."""
        sha = hashlib.sha256(_ROOT_TAG)
        sha.update(_U64.pack(self.final_index))
        for chunk in self.chunks:
            sha.update(_U64.pack(chunk.last_index))
            sha.update(chunk.digest)
        return sha.digest()

    def chunk_of(self, index: int) -> tuple[int, int]:
        """(first, last) index of the chunk holding `index`."""
        if not 1 <= index <= self.final_index:
            raise IndexError(f"index {index} outside 1..{self.final_index}")
        position = bisect.bisect_left(self._lasts(), index)
        first = self.chunks[position - 1].last_index + 1 if position else 1
        return first, self.chunks[position].last_index

    def _lasts(self) -> list[int]:
        return [chunk.last_index for chunk in self.chunks]

    def encode(self) -> bytes:
        head = _ENCODED_HEAD.pack(_MAGIC, self.final_index, len(self.chunks))
        return head + b"".join(_ENCODED_CHUNK.pack(c.last_index, c.digest) for c in self.chunks)

    @classmethod
    def decode(cls, data: bytes) -> Certificate:
        if len(data) < _ENCODED_HEAD.size:
            raise MalformedCertificate(f"certificate of {len(data)} bytes")
        magic, final_index, count = _ENCODED_HEAD.unpack_from(data)
        if magic != _MAGIC or len(data) != _ENCODED_HEAD.size + count * _ENCODED_CHUNK.size:
            raise MalformedCertificate("not an encoded certificate")
        chunks = tuple(
            Chunk(*_ENCODED_CHUNK.unpack_from(data, _ENCODED_HEAD.size + i * _ENCODED_CHUNK.size))
            for i in range(count)
        )
        return cls(final_index, chunks)

    def describe(self) -> str:
        return f"final {self.final_index}, {len(self.chunks)} chunks, root {self.root().hex()[:16]}"


def _lengths_bytes(lengths: Iterable[int]) -> bytes:
    column = array.array("I", lengths)
    if _SWAP:
        column.byteswap()
    return column.tobytes()


@dataclass(slots=True)
class _OpenChunk:
    """The hashes of a chunk being read or built."""

    first_index: int
    entries: int = 0
    payload_bytes: int = 0
    kinds: hashlib._Hash = field(default_factory=hashlib.sha256)
    lengths: hashlib._Hash = field(default_factory=hashlib.sha256)
    payloads: hashlib._Hash = field(default_factory=hashlib.sha256)

    def add_run(self, kinds: bytes, lengths: bytes, payloads: Iterable[bytes | memoryview]) -> None:
        """Consecutive entries: their kinds (a byte each), lengths (`_lengths_bytes`)
        and payloads (pieces whose concatenation is the payloads back to back)."""
        self.kinds.update(kinds)
        self.lengths.update(lengths)
        # One update of the pieces joined costs less than one per piece (a writer's
        # append passes its events' payloads, 100 bytes each, say).
        self.payloads.update(b"".join(payloads))
        self.entries += len(kinds)

    def digest(self, last_index: int) -> bytes:
        assert last_index == self.first_index + self.entries - 1, (last_index, self)
        sha = hashlib.sha256(_CHUNK_TAG)
        sha.update(_TWO_U64.pack(self.first_index, last_index))
        for column in (self.kinds, self.lengths, self.payloads):
            sha.update(column.digest())
        return sha.digest()

    def copy(self) -> _OpenChunk:
        return _OpenChunk(
            self.first_index,
            self.entries,
            self.payload_bytes,
            self.kinds.copy(),
            self.lengths.copy(),
            self.payloads.copy(),
        )


class ContentDigest:
    """A certificate built from a segment's content, fed in index order from index 1
    (by the writer as it assigns indexes, by a store reading a replica). Chunks are cut
    by the module's rule; `finish` closes the last one at the final index."""

    def __init__(self) -> None:
        self._chunks: list[Chunk] = []
        self._open = _OpenChunk(1)
        self._through = 0

    @property
    def through_index(self) -> int:
        """The last index fed so far (0: none)."""
        return self._through

    def copy(self) -> ContentDigest:
        """An independent snapshot: feeding either leaves the other as it was."""
        other = ContentDigest()
        other._chunks = list(self._chunks)
        other._open = self._open.copy()
        other._through = self._through
        return other

    def add(self, index: int, kind: int, payload: bytes | memoryview) -> None:
        """One entry, the next index."""
        if index != self._through + 1:
            raise ValueError(f"index {index} does not follow {self._through}")
        self._open.add_run(bytes((kind,)), _lengths_bytes((len(payload),)), (payload,))
        self._open.payload_bytes += len(payload)
        self._through = index
        self._cut_if_full()

    def add_events(self, first_index: int, payloads: Sequence[bytes]) -> None:
        """EVENTs at consecutive indexes from `first_index` (a writer's append)."""
        self.add_run(first_index, bytes((EntryKind.EVENT,)) * len(payloads), payloads)

    def add_run(
        self, first_index: int, kinds: bytes, payloads: Sequence[bytes | memoryview]
    ) -> None:
        """Entries at consecutive indexes from `first_index`, a kind byte and a payload
        each: whole runs hashed at once between the cuts."""
        if first_index != self._through + 1:
            raise ValueError(f"index {first_index} does not follow {self._through}")
        assert len(kinds) == len(payloads), "a kind per payload"
        start = 0
        while start < len(payloads):
            room_entries = CHUNK_ENTRIES_MAX - self._open.entries
            room_bytes = CHUNK_BYTES_MAX - self._open.payload_bytes
            stop = min(len(payloads), start + room_entries)
            lengths = list(map(len, payloads[start:stop]))
            taken = sum(lengths)
            if taken >= room_bytes:
                # The chunk ends with the entry that fills it.
                ends = list(accumulate(lengths))
                stop = start + bisect.bisect_left(ends, room_bytes) + 1
                lengths = lengths[: stop - start]
                taken = ends[stop - start - 1]
            run = payloads[start:stop]
            self._open.add_run(kinds[start:stop], _lengths_bytes(lengths), run)
            self._open.payload_bytes += taken
            self._through += len(run)
            self._cut_if_full()
            start = stop

    def finish(self) -> Certificate:
        """The certificate of a segment whose final index is the last one fed."""
        if self._through == 0:
            raise MalformedCertificate("no content: a sealed segment holds its bridge at least")
        chunks = list(self._chunks)
        if self._open.entries:
            chunks.append(Chunk(self._through, self._open.digest(self._through)))
        return Certificate(self._through, tuple(chunks))

    def _cut_if_full(self) -> None:
        chunk = self._open
        if chunk.entries >= CHUNK_ENTRIES_MAX or chunk.payload_bytes >= CHUNK_BYTES_MAX:
            self._chunks.append(Chunk(self._through, chunk.digest(self._through)))
            self._open = _OpenChunk(self._through + 1)


def certificate_of(entries: Iterable[tuple[int, int, bytes]]) -> Certificate:
    """The certificate of content given as (index, kind, payload) from index 1."""
    digest = ContentDigest()
    for index, kind, payload in entries:
        digest.add(index, kind, payload)
    return digest.finish()


class ChunkCheck:
    """A reader's check of what it receives against a certificate, chunk by chunk.

    Feed consecutive entries starting at the first index of a chunk (`start_of`);
    `verified_through` is the last index of the last chunk that verified: only entries
    up to it may be handed out. A chunk that differs raises `CertificateMismatch`, and
    the check is then over (a new one starts at a chunk boundary, on another replica)."""

    def __init__(self, certificate: Certificate, from_index: int) -> None:
        first, last = certificate.chunk_of(from_index)
        self.certificate = certificate
        self._position = bisect.bisect_left(certificate._lasts(), from_index)
        self._open = _OpenChunk(first)
        self._chunk_last = last
        self._next = first
        self.verified_through = first - 1
        self._failed = False

    @staticmethod
    def start_of(certificate: Certificate, index: int) -> int:
        """Where a read that must hand out `index` starts: its chunk's first index."""
        return certificate.chunk_of(index)[0]

    @property
    def next_index(self) -> int:
        """The index the check expects next."""
        return self._next

    @property
    def done(self) -> bool:
        return self.verified_through >= self.certificate.final_index

    def feed(self, first_index: int, kinds: Sequence[int], payloads: Sequence[bytes]) -> int:
        """Entries at consecutive indexes from `first_index` (entries before the next
        index expected are skipped: a resend); returns `verified_through`."""
        skip = self._next - first_index
        if skip < 0:
            raise CertificateMismatch(
                self._open.first_index, self._chunk_last, f"index {self._next} was skipped"
            )
        position = skip
        while position < len(kinds):
            self._check_not_failed()
            take = min(len(kinds) - position, self._chunk_last - self._next + 1)
            run_kinds = kinds[position : position + take]
            run_payloads = payloads[position : position + take]
            self._open.add_run(
                bytes(run_kinds), _lengths_bytes(map(len, run_payloads)), run_payloads
            )
            self._advance(take)
            position += take
        return self.verified_through

    def feed_packed(
        self,
        first_index: int,
        kinds: bytes,
        lengths: Sequence[int],
        payloads: bytes | memoryview,
        offsets: Sequence[int],
    ) -> int:
        """`feed` over columns (Spark's packed replies): `kinds` one byte each,
        `lengths` of the payloads, `payloads` back to back with `offsets[i]` where the
        i-th begins (len(kinds) + 1 of them). Slices whole runs, no object per entry."""
        skip = self._next - first_index
        if skip < 0:
            raise CertificateMismatch(
                self._open.first_index, self._chunk_last, f"index {self._next} was skipped"
            )
        view = memoryview(payloads)
        position = skip
        while position < len(kinds):
            self._check_not_failed()
            take = min(len(kinds) - position, self._chunk_last - self._next + 1)
            end = position + take
            self._open.add_run(
                kinds[position:end],
                _lengths_bytes(lengths[position:end]),
                (view[offsets[position] : offsets[end]],),
            )
            self._advance(take)
            position = end
        return self.verified_through

    def _check_not_failed(self) -> None:
        if self._failed:
            raise RuntimeError("a check that failed takes nothing more")
        if self.done:
            raise CertificateMismatch(
                self.certificate.final_index + 1,
                self.certificate.final_index + 1,
                "entries past the final index",
            )

    def _advance(self, count: int) -> None:
        self._next += count
        if self._next <= self._chunk_last:
            return
        expected = self.certificate.chunks[self._position]
        got = self._open.digest(self._chunk_last)
        if got != expected.digest:
            self._failed = True
            raise CertificateMismatch(self._open.first_index, self._chunk_last)
        self.verified_through = self._chunk_last
        self._position += 1
        if self._position < len(self.certificate.chunks):
            self._open = _OpenChunk(self._chunk_last + 1)
            self._chunk_last = self.certificate.chunks[self._position].last_index
