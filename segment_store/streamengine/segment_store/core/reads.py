"""Reads of a segment store's replicas: entries, runs of stored values, digests and
certificates, over the published state (`catalog.StoreCatalog`) and the KV.

A read that finds a stored copy damaged marks the segment damaged in the catalog
(`reading`) and raises CorruptEntry.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from streamengine.protocol.entry import CorruptEntry, StoredEntry, decode_value
from streamengine.segment_store.core.catalog import StoreCatalog
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.keys import entry_index, entry_key
from streamengine.segment_store.core.kv import KV
from streamengine.segment_store.core.scrub import ReplicaScan, ScanResult

# Entries decoded per KV scan while reading or hashing a segment: bounds the memory of
# one scan whatever the segment's size.
SCAN_ENTRIES_MAX = 4096

_DIGEST_HELD = struct.Struct(">QBI")  # index, kind, payload length
# A run of absent indexes hashes as one record (first, last): the digest's cost follows
# what is held, not how far `up_to` reaches.
_DIGEST_ABSENT = struct.Struct(">BQQ")  # 0, first, last


@dataclass(frozen=True, slots=True)
class DigestInfo:
    digest: bytes
    up_to_index: int
    entries_held: int
    acked_index: int
    fence: int


class SegmentReader:
    """Reads of the segments `catalog` publishes, from `kv`."""

    def __init__(self, kv: KV, catalog: StoreCatalog) -> None:
        self.kv = kv
        self.catalog = catalog

    @contextmanager
    def reading(self, segment: SegmentKey) -> Iterator[None]:
        """Around a read of `segment`: a damaged copy found marks it damaged."""
        try:
            yield
        except CorruptEntry:
            self.catalog.mark_damaged(segment)
            raise

    def read(
        self,
        segment: SegmentKey,
        from_index: int,
        to_index: int = 0,
        acked_only: bool = False,
        limit: int = 0,
        max_bytes: int = 0,
    ) -> list[StoredEntry]:
        """Held entries in from_index..to_index (0: up to the last held), in order,
        at most `limit` (0: all) and, past the first, at most `max_bytes` of values
        (0: no bound); with `acked_only`, none above the acked index.
        Raises SegmentNotFound, and CorruptEntry if a stored copy fails its crc."""
        rows = self.read_rows(segment, from_index, to_index, acked_only, limit, max_bytes)
        with self.reading(segment):
            return [decode_value(entry_index(key), value) for key, value in rows]

    def read_rows(
        self,
        segment: SegmentKey,
        from_index: int,
        to_index: int = 0,
        acked_only: bool = False,
        limit: int = 0,
        max_bytes: int = 0,
    ) -> list[tuple[bytes, bytes]]:
        """What `read` reads, as stored (key, value) rows, not yet decoded or verified:
        the serving path decodes whole batches at once (`streamengine.protocol.entry`)."""
        meta = self.catalog.require(segment)
        upper = meta.last_index if to_index == 0 else min(to_index, meta.last_index)
        if acked_only:
            upper = min(upper, meta.acked_index)
        first = max(from_index, 1)
        if upper < first:
            return []
        with self.reading(segment):
            return self.kv.scan(
                entry_key(segment.stream_id, segment.epoch, first),
                entry_key(segment.stream_id, segment.epoch, upper + 1),
                limit,
                max_bytes,
            )

    def read_run(
        self, segment: SegmentKey, first: int, upper: int, limit: int, max_bytes: int
    ) -> list[bytes]:
        """Stored values (not verified) of consecutive indexes from `first` up to
        `upper`: at most `limit`, cut once they reach `max_bytes`, and cut before the
        first index not held. Raises SegmentNotFound."""
        meta = self.catalog.require(segment)
        last = min(upper, meta.last_index, first + limit - 1)
        if last < first:
            return []
        start = entry_key(segment.stream_id, segment.epoch, first)
        end = entry_key(segment.stream_id, segment.epoch, last + 1)
        with self.reading(segment):
            if last <= meta.matched_index:
                # Every index up to the matched one is held, so the values alone say
                # which index each is. A run shorter than asked without reaching the
                # byte cap means the segment changed under the scan: then read it with
                # keys. The limit is what the range holds, as `scan_values` wants it.
                values = self.kv.scan_values(start, end, last - first + 1, max_bytes)
                if len(values) == last - first + 1 or sum(map(len, values)) >= max_bytes > 0:
                    return values
            values = []
            for key, value in self.kv.scan(start, end, limit, max_bytes):
                if entry_index(key) != first + len(values):
                    break
                values.append(value)
            return values

    def digest(self, segment: SegmentKey, up_to: int = 0) -> DigestInfo:
        """SHA-256 over (index, kind, payload) of indexes 1..up_to (0: the acked index);
        an index not held hashes as absent, so replicas differing anywhere differ."""
        meta = self.catalog.require(segment)
        up_to_index = meta.acked_index if up_to == 0 else up_to
        sha = hashlib.sha256()
        held = 0
        next_index = 1
        while next_index <= up_to_index:
            chunk = self.read(segment, next_index, up_to_index, limit=SCAN_ENTRIES_MAX)
            for entry in chunk:
                if entry.index > next_index:
                    sha.update(_DIGEST_ABSENT.pack(0, next_index, entry.index - 1))
                sha.update(_DIGEST_HELD.pack(entry.index, entry.kind, len(entry.payload)))
                sha.update(entry.payload)
                held += 1
                next_index = entry.index + 1
            if len(chunk) < SCAN_ENTRIES_MAX:
                if next_index <= up_to_index:
                    sha.update(_DIGEST_ABSENT.pack(0, next_index, up_to_index))
                break
        return DigestInfo(sha.digest(), up_to_index, held, meta.acked_index, meta.fence)

    def certify(self, segment: SegmentKey, final_index: int) -> ScanResult:
        """Read the replica from index 1 to `final_index` at once (no rate), checking
        every copy: the certificate of what it holds, or where it is damaged. Raises
        SegmentNotFound."""
        scan = ReplicaScan(final_index, SCAN_ENTRIES_MAX, 0)
        while (step := scan.next_read()) is not None:
            first, upper, limit, _ = step
            try:
                values = self.read_run(segment, first, upper, limit, 0)
            except CorruptEntry as error:
                scan.damaged(first, str(error))
                break
            scan.feed(values)
        assert scan.result is not None
        return scan.result
