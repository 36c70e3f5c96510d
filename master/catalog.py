"""The master's metadata in RocksDB (rocksdict, raw mode, synced writes).

Every mutation is one `WriteBatch` written with `sync=True` before the request that
caused it is answered, so an epoch, a seal or a copy-set swap the master has told
anyone about survives a crash of the master or its host.

Key layout (raw bytes; ids big-endian so a stream's segments sort by epoch):
  m/next_stream_id                 -> u64
  t/<tenant>                       -> JSON {created_at_ms}
  s/<tenant/stream>                -> JSON StreamRecord
  g/<stream_id u64><epoch u64>     -> JSON SegmentRecord
  r/<store_id>                     -> JSON StoreRecord
  d/<store_id>\\0<stream_id u64><epoch u64> -> b"" (a replica the store must delete)
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from streamengine.master.model import (
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StoreRecord,
    StreamRecord,
)
from streamengine.protocol.certificate import Certificate

_U64 = struct.Struct(">Q")
_KEY = struct.Struct(">QQ")

_NEXT_STREAM_ID = b"m/next_stream_id"
_TENANT = b"t/"
_STREAM = b"s/"
_SEGMENT = b"g/"
_STORE = b"r/"
_DELETE = b"d/"


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _segment_key(key: SegmentKey) -> bytes:
    return _SEGMENT + _KEY.pack(*key)


def _delete_key(store_id: str, key: SegmentKey) -> bytes:
    return _DELETE + store_id.encode() + b"\0" + _KEY.pack(*key)


def encode_segment(record: SegmentRecord) -> bytes:
    value = asdict(record)
    value["copy_set"] = list(record.copy_set)
    value["state"] = int(record.state)
    value["bad"] = list(record.bad)
    certificate = record.certificate
    value["certificate"] = (
        base64.b64encode(certificate.encode()).decode() if certificate is not None else ""
    )
    return _json(value)


def decode_segment(raw: bytes) -> SegmentRecord:
    """A segment record; one written before certificates existed has none."""
    value = json.loads(raw)
    value["copy_set"] = tuple(value["copy_set"])
    value["state"] = SegmentState(value["state"])
    value["bad"] = tuple(value.get("bad", ()))
    encoded = value.get("certificate", "")
    value["certificate"] = Certificate.decode(base64.b64decode(encoded)) if encoded else None
    return SegmentRecord(**value)


@dataclass
class Batch:
    """Mutations applied together, atomically and durably, by `Catalog.commit`."""

    puts: list[tuple[bytes, bytes]] = field(default_factory=list)
    deletes: list[bytes] = field(default_factory=list)

    def next_stream_id(self, value: int) -> Batch:
        self.puts.append((_NEXT_STREAM_ID, _U64.pack(value)))
        return self

    def tenant(self, name: str, created_at_ms: int) -> Batch:
        self.puts.append((_TENANT + name.encode(), _json({"created_at_ms": created_at_ms})))
        return self

    def stream(self, record: StreamRecord) -> Batch:
        self.puts.append((_STREAM + record.name.encode(), _json(asdict(record))))
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

    def store(self, record: StoreRecord) -> Batch:
        self.puts.append((_STORE + record.store_id.encode(), _json(asdict(record))))
        return self

    def delete_replica(self, store_id: str, key: SegmentKey) -> Batch:
        self.puts.append((_delete_key(store_id, key), b""))
        return self

    def replica_deleted(self, store_id: str, key: SegmentKey) -> Batch:
        self.deletes.append(_delete_key(store_id, key))
        return self


@dataclass
class Loaded:
    next_stream_id: int
    tenants: dict[str, int]
    streams: dict[str, StreamRecord]
    segments: dict[SegmentKey, SegmentRecord]
    stores: dict[str, StoreRecord]
    deletes: set[tuple[str, SegmentKey]]


class Catalog:
    """The one owner of the master's RocksDB."""

    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        self._db = Rdict(str(path / "catalog"), options)
        self._sync = WriteOptions()
        self._sync.sync = True

    def close(self) -> None:
        self._db.close()

    def commit(self, batch: Batch) -> None:
        if not batch.puts and not batch.deletes:
            return
        write = WriteBatch(raw_mode=True)
        for key in batch.deletes:
            write.delete(key)
        for key, value in batch.puts:
            write.put(key, value)
        self._db.write(write, self._sync)

    def _scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        for key, value in self._db.items(from_key=prefix):
            assert isinstance(key, bytes) and isinstance(value, bytes), "raw mode gives bytes"
            if not key.startswith(prefix):
                return
            yield key[len(prefix) :], value

    def load(self) -> Loaded:
        raw_next = self._db.get(_NEXT_STREAM_ID)
        tenants = {k.decode(): json.loads(v)["created_at_ms"] for k, v in self._scan(_TENANT)}
        streams = {k.decode(): StreamRecord(**json.loads(v)) for k, v in self._scan(_STREAM)}
        segments = {}
        for _, value in self._scan(_SEGMENT):
            record = decode_segment(value)
            segments[record.key] = record
        stores = {k.decode(): StoreRecord(**json.loads(v)) for k, v in self._scan(_STORE)}
        deletes = set()
        for key, _ in self._scan(_DELETE):
            store_id, packed = key[: -_KEY.size - 1], key[-_KEY.size :]
            deletes.add((store_id.decode(), _KEY.unpack(packed)))
        return Loaded(
            next_stream_id=_U64.unpack(raw_next)[0] if raw_next is not None else 1,
            tenants=tenants,
            streams=streams,
            segments=segments,
            stores=stores,
            deletes=deletes,
        )
