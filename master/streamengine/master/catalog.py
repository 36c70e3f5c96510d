"""How the master's records are laid out as keys and values in the metadata store.

Every mutation of the master's state is one `Batch` (a `metadata.Transaction` built
record by record) committed before the request that caused it is answered, so an
epoch, a seal or a copy-set swap the master has told anyone about survives a crash of
the master, its host, or a change of active master. Where the records live is the
metadata back end's business (`master.metadata`): the embedded RocksDB or etcd.

Key layout (raw bytes; ids big-endian so a stream's segments sort by epoch):
  m/next_stream_id                 -> u64
  m/signing_key                    -> the master's Ed25519 private key (32 raw bytes), as
                                      written before keys rotated: read once, then moved
                                      to the first y/ record
  y/<key id hex>                   -> JSON KeyRecord with its private key in hex (the
                                      master's signing keys, `core.keys`)
  m/revocations_version            -> u64 (bumped by every token revocation)
  m/rebuilt_through                -> u64 (the highest stream id when the metadata was
                                      rebuilt from the stores: unknown ids up to it are kept)
  m/cluster_id                     -> the cluster's id (utf-8), made at the first start or
                                      adopted from the stores by a rebuild
  m/rebuilding                     -> b"" while a rebuild from the stores is being written:
                                      metadata holding it is unfinished, never served
  t/<tenant>                       -> JSON {created_at_ms}
  s/<tenant/stream>                -> JSON StreamRecord
  g/<stream_id u64><epoch u64>     -> JSON SegmentRecord
  r/<store_id>                     -> JSON StoreRecord
  d/<store_id>\\0<stream_id u64><epoch u64> -> b"" (a replica the store must delete)
  k/<token_id>                     -> JSON TokenRecord (tokens issued, until they expire)
  c/<serial, hex>                  -> JSON {not_after_ms, common_name, revoked_at_ms}: a
                                      certificate revoked (`protocol.cert_revocations`),
                                      until it expires

The signing keys sit with the rest of the metadata so that a master started on the
same metadata (a restart, or a standby on shared storage) signs and verifies with the
same keys, and every grant and token issued before stays valid.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from streamengine.master.core.errors import InvalidArgument
from streamengine.master.core.keys import KeyRecord
from streamengine.master.core.model import (
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StoreRecord,
    StreamRecord,
    TokenRecord,
)
from streamengine.master.metadata import Metadata, Transaction
from streamengine.protocol.cert_revocations import RevokedCert, serial_text
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.limits import EPOCH_MAX
from streamengine.protocol.producers import ProducerPosition

_U64 = struct.Struct(">Q")
_KEY = struct.Struct(">QQ")

_NEXT_STREAM_ID = b"m/next_stream_id"
_SIGNING_KEY = b"m/signing_key"
_REVOCATIONS_VERSION = b"m/revocations_version"
_REBUILT_THROUGH = b"m/rebuilt_through"
_CLUSTER_ID = b"m/cluster_id"
_REBUILDING = b"m/rebuilding"
_TOKEN = b"k/"
_SIGNING_KEYS = b"y/"
_REVOKED_CERT = b"c/"
_TENANT = b"t/"
_STREAM = b"s/"
_SEGMENT = b"g/"
_STORE = b"r/"
_DELETE = b"d/"


_RAW_DECODE = json.JSONDecoder().raw_decode
_SEGMENT_STATES = {int(state): state for state in SegmentState}
# Records decoded by one call of the JSON scanner when a catalog loads: large enough
# that the per-call cost vanishes, small enough that a call (which holds the
# interpreter's lock throughout) stays a few milliseconds, so the loop that keeps the
# election lease alive runs on meanwhile.
RECORDS_PER_DECODE = 1000


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _segment_key(key: SegmentKey) -> bytes:
    return _SEGMENT + _KEY.pack(*key)


def _delete_key(store_id: str, key: SegmentKey) -> bytes:
    return _DELETE + store_id.encode() + b"\0" + _KEY.pack(*key)


def encode_stream(record: StreamRecord) -> bytes:
    value = asdict(record)
    # The bytes of a record from before producers existed, when it has none.
    if not record.has_producers:
        del value["has_producers"]
    if not record.producers_epoch:
        del value["producers"], value["producers_epoch"]
    return _json(value)


def decode_stream(raw: bytes) -> StreamRecord:
    return _stream_of(_load_json(raw))


def _stream_of(value: dict[str, Any]) -> StreamRecord:
    """A stream record from its decoded JSON (one from before producers has none)."""
    value["producers"] = tuple(ProducerPosition(**p) for p in value.get("producers", ()))
    return StreamRecord(**value)


def encode_segment(record: SegmentRecord) -> bytes:
    value = asdict(record)
    value["copy_set"] = list(record.copy_set)
    value["state"] = int(record.state)
    value["bad"] = list(record.bad)
    value["verified"] = list(record.verified)
    certificate = record.certificate
    value["certificate"] = (
        base64.b64encode(certificate.encode()).decode() if certificate is not None else ""
    )
    if not record.released_acked_index:
        del value["released_acked_index"]  # kept only while owed: most records never
    if record.producers is None:
        del value["producers"]  # the bytes of a record from before producers existed
    else:
        value["producers"] = [asdict(position) for position in record.producers]
    return _json(value)


def _load_json(raw: bytes) -> Any:
    """`json.loads` of a record this module wrote: its C scanner alone, without the
    checks for encodings and surrounding whitespace (a third of the decoding in a
    master's start)."""
    text = raw.decode()
    value, end = _RAW_DECODE(text)
    if end != len(text):
        raise json.JSONDecodeError("extra data", text, end)
    return value


def _load_json_bulk(raws: list[bytes]) -> list[Any]:
    """`_load_json` of each record, the records of a load decoded in chunks of
    `RECORDS_PER_DECODE` as one JSON array each: one call of the C scanner per chunk
    instead of one per record, its key strings shared. A chunk that does not come back
    as one value per record (a damaged record) is decoded record by record, which
    names the damaged one."""
    values: list[Any] = []
    for start in range(0, len(raws), RECORDS_PER_DECODE):
        chunk = raws[start : start + RECORDS_PER_DECODE]
        try:
            decoded = json.loads(b"[" + b",".join(chunk) + b"]")
        except ValueError:
            decoded = None
        if not isinstance(decoded, list) or len(decoded) != len(chunk):
            decoded = [_load_json(raw) for raw in chunk]
        values.extend(decoded)
    return values


def _segment_of(value: dict[str, Any], shared: dict[Any, Any]) -> SegmentRecord:
    """A segment record from its decoded JSON; `shared` hands out one object for equal
    copy sets and names, so 200,000 segments on three stores hold a few tuples and
    strings, not 200,000 of each."""
    copy_set = tuple(value["copy_set"])
    copy_set = shared.setdefault(copy_set, copy_set)
    verified = tuple(value.get("verified", ()))
    verified = shared.setdefault(verified, verified)
    bad = value.get("bad")
    encoded = value.get("certificate", "")
    stream = value["stream"]
    return SegmentRecord(
        stream_id=value["stream_id"],
        stream=shared.setdefault(stream, stream),
        epoch=value["epoch"],
        copy_set=copy_set,
        state=_SEGMENT_STATES[value["state"]],
        final_index=value["final_index"],
        created_at_ms=value["created_at_ms"],
        sealed_at_ms=value["sealed_at_ms"],
        settled_at_ms=value["settled_at_ms"],
        certificate=Certificate.decode(base64.b64decode(encoded)) if encoded else None,
        certified_by=value.get("certified_by", ""),
        bad=tuple(bad) if bad else (),
        verified=verified,
        removal_at_ms=value.get("removal_at_ms", 0),
        lost_from_index=value.get("lost_from_index", 0),
        producers=_positions_of(value.get("producers")),
        released_acked_index=value.get("released_acked_index", 0),
    )


def _positions_of(producers: list[dict[str, Any]] | None) -> tuple[ProducerPosition, ...] | None:
    """The producer positions a sealed segment's record holds (None: its sealing
    leader sent none)."""
    if producers is None:
        return None
    return tuple(ProducerPosition(**position) for position in producers)


def decode_segment(raw: bytes) -> SegmentRecord:
    """A segment record; one written before certificates existed has none."""
    return _segment_of(_load_json(raw), {})


class Batch(Transaction):
    """A transaction built record by record, committed by `Catalog.commit`."""

    def next_stream_id(self, value: int) -> Batch:
        self.puts.append((_NEXT_STREAM_ID, _U64.pack(value)))
        return self

    def tenant(self, name: str, created_at_ms: int) -> Batch:
        self.puts.append((_TENANT + name.encode(), _json({"created_at_ms": created_at_ms})))
        return self

    def stream(self, record: StreamRecord) -> Batch:
        self.puts.append((_STREAM + record.name.encode(), encode_stream(record)))
        return self

    def drop_stream(self, name: str) -> Batch:
        self.deletes.append(_STREAM + name.encode())
        return self

    def segment(self, record: SegmentRecord) -> Batch:
        self.puts.append((_segment_key(record.key), encode_segment(record)))
        return self

    def drop_segment(self, key: SegmentKey) -> Batch:
        self.deletes.append(_segment_key(key))
        return self

    def drop_segments_of(self, stream_id: int) -> Batch:
        """Every segment of a stream, in one operation however many there are."""
        self.delete_prefixes.append(_SEGMENT + _U64.pack(stream_id))
        return self

    def store(self, record: StoreRecord) -> Batch:
        self.puts.append((_STORE + record.store_id.encode(), _json(asdict(record))))
        return self

    def delete_replica(self, store_id: str, key: SegmentKey) -> Batch:
        self.puts.append((_delete_key(store_id, key), b""))
        return self

    def replica_deleted(self, store_id: str, key: SegmentKey) -> Batch:
        self.deletes.append(_delete_key(store_id, key))
        return self

    def signing_key(self, record: KeyRecord, private_bytes: bytes) -> Batch:
        value = asdict(record) | {"private": private_bytes.hex()}
        self.puts.append((_SIGNING_KEYS + record.key_id.encode(), _json(value)))
        return self

    def drop_signing_key(self, key_id: str) -> Batch:
        self.deletes.append(_SIGNING_KEYS + key_id.encode())
        return self

    def drop_unrotated_signing_key(self) -> Batch:
        """The key as written before keys rotated (moved to a y/ record)."""
        self.deletes.append(_SIGNING_KEY)
        return self

    def token(self, record: TokenRecord) -> Batch:
        self.puts.append((_TOKEN + record.token_id.encode(), _json(asdict(record))))
        return self

    def drop_token(self, token_id: str) -> Batch:
        self.deletes.append(_TOKEN + token_id.encode())
        return self

    def revoked_cert(self, entry: RevokedCert) -> Batch:
        value = {
            "not_after_ms": entry.not_after_ms,
            "common_name": entry.common_name,
            "revoked_at_ms": entry.revoked_at_ms,
        }
        self.puts.append((_REVOKED_CERT + serial_text(entry.serial).encode(), _json(value)))
        return self

    def drop_revoked_cert(self, serial: int) -> Batch:
        self.deletes.append(_REVOKED_CERT + serial_text(serial).encode())
        return self

    def revocations_version(self, value: int) -> Batch:
        self.puts.append((_REVOCATIONS_VERSION, _U64.pack(value)))
        return self

    def rebuilt_through(self, stream_id: int) -> Batch:
        self.puts.append((_REBUILT_THROUGH, _U64.pack(stream_id)))
        return self

    def cluster_id(self, value: str) -> Batch:
        self.puts.append((_CLUSTER_ID, value.encode()))
        return self

    def rebuilding(self, unfinished: bool) -> Batch:
        if unfinished:
            self.puts.append((_REBUILDING, b""))
        else:
            self.deletes.append(_REBUILDING)
        return self


@dataclass
class Loaded:
    next_stream_id: int
    tenants: dict[str, int]
    streams: dict[str, StreamRecord]
    segments: dict[SegmentKey, SegmentRecord]
    stores: dict[str, StoreRecord]
    deletes: set[tuple[str, SegmentKey]]
    # The private key as written before keys rotated, if it is still there.
    unrotated_signing_key: bytes | None = None
    # key id -> (record, private key)
    signing_keys: dict[str, tuple[KeyRecord, bytes]] = field(default_factory=dict)
    tokens: dict[str, TokenRecord] = field(default_factory=dict)
    revocations_version: int = 0
    revoked_certs: list[RevokedCert] = field(default_factory=list)
    rebuilt_through: int = 0
    cluster_id: str = ""
    rebuilding: bool = False


class Catalog:
    """The master's records over one metadata store."""

    def __init__(self, metadata: Metadata):
        self.metadata = metadata

    def close(self) -> None:
        self.metadata.close()

    def commit(self, batch: Batch) -> None:
        if batch.ops():
            self.metadata.commit(batch)

    def load(self) -> Loaded:
        return decode_records(self.metadata.read_all())


def raise_epochs(records: list[tuple[bytes, bytes]], by: int) -> list[tuple[bytes, bytes]]:
    """The records with every stream's latest epoch raised by `by`, so that none of the
    epochs granted after these records were written is granted again (a restore of an
    old backup)."""
    assert by >= 0
    raised = []
    for key, value in records:
        if key.startswith(_STREAM) and by:
            record = decode_stream(value)
            if record.epoch + by > EPOCH_MAX:
                raise InvalidArgument(f"{record.name}: epoch {record.epoch} + {by} is too high")
            value = encode_stream(replace(record, epoch=record.epoch + by))
        raised.append((key, value))
    return raised


def decode_records(records: list[tuple[bytes, bytes]]) -> Loaded:
    """The catalog from every record of the metadata store. Records under prefixes the
    master does not know are left alone (another part of the master owns them)."""
    loaded = Loaded(1, {}, {}, {}, {}, set())
    # Segments and streams, nearly every record, are decoded in bulk after the pass.
    segments: list[bytes] = []
    streams: list[bytes] = []
    for key, value in records:
        if key.startswith(_SEGMENT):
            segments.append(value)
        elif key.startswith(_STREAM):
            streams.append(value)
        elif key == _NEXT_STREAM_ID:
            loaded.next_stream_id = _U64.unpack(value)[0]
        elif key.startswith(_TENANT):
            loaded.tenants[key[len(_TENANT) :].decode()] = json.loads(value)["created_at_ms"]
        elif key.startswith(_STORE):
            loaded.stores[key[len(_STORE) :].decode()] = StoreRecord(**json.loads(value))
        elif key.startswith(_DELETE):
            packed = key[len(_DELETE) :]
            store_id, segment = packed[: -_KEY.size - 1], packed[-_KEY.size :]
            loaded.deletes.add((store_id.decode(), _KEY.unpack(segment)))
        elif key == _SIGNING_KEY:
            loaded.unrotated_signing_key = value
        elif key.startswith(_SIGNING_KEYS):
            fields = json.loads(value)
            private = bytes.fromhex(fields.pop("private"))
            loaded.signing_keys[fields["key_id"]] = (KeyRecord(**fields), private)
        elif key == _REVOCATIONS_VERSION:
            loaded.revocations_version = _U64.unpack(value)[0]
        elif key == _REBUILT_THROUGH:
            loaded.rebuilt_through = _U64.unpack(value)[0]
        elif key == _CLUSTER_ID:
            loaded.cluster_id = value.decode()
        elif key == _REBUILDING:
            loaded.rebuilding = True
        elif key.startswith(_TOKEN):
            loaded.tokens[key[len(_TOKEN) :].decode()] = TokenRecord(**json.loads(value))
        elif key.startswith(_REVOKED_CERT):
            serial = int(key[len(_REVOKED_CERT) :], 16)
            loaded.revoked_certs.append(RevokedCert(serial, **json.loads(value)))
    for fields in _load_json_bulk(streams):
        stream = _stream_of(fields)
        loaded.streams[stream.name] = stream
    # A segment's name is its stream's: one string for both.
    shared: dict[Any, Any] = {name: name for name in loaded.streams}
    for fields in _load_json_bulk(segments):
        record = _segment_of(fields, shared)
        loaded.segments[record.key] = record
    return loaded
