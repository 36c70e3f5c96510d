"""The one place where wire entries (`streamengine.v1.Entry`) and stored entries meet,
and where the other wire messages a master and its stores both read (certificates of
segments, revoked TLS certificates) become their types.

Writers, recovery, stores, repair and readers all convert through here, so an unknown
kind is refused the same way everywhere (`MalformedEntry`, which a store answers as a bad
request) and an entry is built from the same fields in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from streamengine.protocol.cert_revocations import RevokedCert, parse_serial, serial_text
from streamengine.protocol.certificate import Certificate, Chunk, MalformedCertificate
from streamengine.protocol.entry import EntryKind, PackedEntries, StoredEntry, unpack_values
from streamengine.protocol.producers import PRODUCERS_MAX, ProducerPosition
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2


class MalformedEntry(ValueError):
    """A wire entry this version cannot represent (an unknown kind)."""


_KINDS: dict[int, EntryKind] = {int(kind): kind for kind in EntryKind}


def entry_to_pb(entry: StoredEntry) -> entry_pb2.Entry:
    return entry_pb2.Entry(
        index=entry.index,
        kind=entry.kind.value,  # type: ignore[arg-type]  # an EntryKind number
        epoch=entry.epoch,
        payload=entry.payload,
        crc32c=entry.crc32c,
    )


def write_request(
    entries: Sequence[StoredEntry] | PackedEntries, **fields: Any
) -> segment_store_pb2.WriteRequest:
    """A Write carrying `entries` (consecutive indexes) packed, with `fields` as its other
    fields: the one place a Write's entries are packed."""
    batch = entries if isinstance(entries, PackedEntries) else PackedEntries.of(entries)
    packed_values, value_lengths = batch.to_wire()
    return segment_store_pb2.WriteRequest(
        first_index=batch.first_index,
        packed_values=packed_values,
        value_lengths=value_lengths,
        **fields,
    )


def entry_from_pb(entry: entry_pb2.Entry) -> StoredEntry:
    """A received entry as a stored one; its checksum is checked by whoever stores or
    serves it. Raises MalformedEntry for a kind this version does not know."""
    kind = _KINDS.get(entry.kind)
    if kind is None:
        raise MalformedEntry(f"entry {entry.index}: unknown kind {entry.kind}")
    return StoredEntry(entry.index, kind, entry.epoch, entry.payload, entry.crc32c)


def entries_from_pb(entries: Iterable[entry_pb2.Entry]) -> list[StoredEntry]:
    """`entry_from_pb` of each, inlined: every written event passes here at each store."""
    kinds, stored = _KINDS, StoredEntry
    converted = []
    for entry in entries:
        kind = kinds.get(entry.kind)
        if kind is None:
            raise MalformedEntry(f"entry {entry.index}: unknown kind {entry.kind}")
        converted.append(stored(entry.index, kind, entry.epoch, entry.payload, entry.crc32c))
    return converted


def entries_from_values(
    indexes: Sequence[int], values: Sequence[bytes], verify: bool
) -> list[entry_pb2.Entry]:
    """Wire entries straight from stored values (the read path: no `StoredEntry` per
    row); with `verify`, every copy is checked first (CorruptEntry)."""
    kinds, epochs, payloads, crcs = unpack_values(indexes, values, verify)
    entry = entry_pb2.Entry
    return [
        entry(index=i, kind=k, epoch=e, payload=p, crc32c=c)  # type: ignore[arg-type]
        for i, k, e, p, c in zip(indexes, kinds, epochs, payloads, crcs, strict=True)
    ]


def certificate_to_pb(
    certificate: Certificate, with_chunks: bool = True
) -> entry_pb2.SegmentCertificate:
    return entry_pb2.SegmentCertificate(
        final_index=certificate.final_index,
        root=certificate.root(),
        chunks=[
            entry_pb2.CertificateChunk(last_index=c.last_index, digest=c.digest)
            for c in (certificate.chunks if with_chunks else ())
        ],
    )


def certificate_from_pb(message: entry_pb2.SegmentCertificate) -> Certificate:
    """A certificate with its chunks; raises MalformedCertificate when the message
    holds none, or a root that its chunks do not make."""
    certificate = Certificate(
        message.final_index,
        tuple(Chunk(c.last_index, c.digest) for c in message.chunks),
    )
    if message.root and message.root != certificate.root():
        raise MalformedCertificate("the root does not match the chunks")
    return certificate


def revoked_cert_to_pb(entry: RevokedCert) -> master_pb2.RevokedCertificate:
    return master_pb2.RevokedCertificate(
        serial=serial_text(entry.serial),
        not_after_ms=entry.not_after_ms,
        common_name=entry.common_name,
        revoked_at_ms=entry.revoked_at_ms,
    )


def revoked_cert_from_pb(message: master_pb2.RevokedCertificate) -> RevokedCert:
    """Raises ValueError for a serial or a name no certificate has."""
    return RevokedCert(
        parse_serial(message.serial),
        message.not_after_ms,
        message.common_name,
        message.revoked_at_ms,
    )


class MalformedProducers(ValueError):
    """Producer positions that cannot be (a bad id or sequence, one producer twice)."""


def producer_positions_to_pb(positions: Iterable[ProducerPosition]) -> entry_pb2.ProducerPositions:
    return entry_pb2.ProducerPositions(
        positions=[
            entry_pb2.ProducerPosition(
                producer_id=p.producer_id,
                last_sequence=p.last_sequence,
                last_stream_sequence=p.last_stream_sequence,
            )
            for p in positions
        ]
    )


def producer_positions_from_pb(
    message: entry_pb2.ProducerPositions,
) -> tuple[ProducerPosition, ...]:
    """The positions, by producer id; raises MalformedProducers."""
    if len(message.positions) > PRODUCERS_MAX:
        raise MalformedProducers(
            f"{len(message.positions)} producer positions, at most {PRODUCERS_MAX}"
        )
    try:
        positions = sorted(
            (
                ProducerPosition(p.producer_id, p.last_sequence, p.last_stream_sequence)
                for p in message.positions
            ),
            key=lambda p: p.producer_id,
        )
    except ValueError as error:  # InvalidProducer too
        raise MalformedProducers(f"a producer position that cannot be: {error}") from None
    ids = [p.producer_id for p in positions]
    if len(set(ids)) != len(ids):
        raise MalformedProducers("a producer named twice among the positions")
    return tuple(positions)
