"""Damage at rest for the real-process integrity tests: bits flipped in a stopped store's
files (an SST block, the write-ahead log), and copies rewritten behind its back (a
flipped payload bit under the old crc, or another payload under a valid crc: what only
the certificate catches). The store must be stopped: RocksDB holds its files locked."""

from __future__ import annotations

import os
from pathlib import Path

from streamengine.protocol.entry import VALUE_HEADER_BYTES, StoredEntry, decode_value, encode_value
from streamengine.segment_store.core.keys import entry_key
from streamengine.segment_store.server import DB_DIR


def db_dir(store_root: Path) -> Path:
    return store_root / DB_DIR


def flip_bits(path: Path, offsets: list[int]) -> None:
    """Flip one bit at each offset, durably."""
    with path.open("r+b") as file:
        for offset in offsets:
            file.seek(offset)
            byte = file.read(1)[0]
            file.seek(offset)
            file.write(bytes([byte ^ 0x10]))
        file.flush()
        os.fsync(file.fileno())


def largest(store_root: Path, suffix: str) -> Path:
    files = [p for p in db_dir(store_root).iterdir() if p.suffix == suffix and p.stat().st_size]
    assert files, f"no {suffix} file under {db_dir(store_root)}"
    return max(files, key=lambda p: p.stat().st_size)


def flip_in_sst(store_root: Path) -> Path:
    """Two bits in the data blocks of the store's largest SST (a third and half way in:
    the index and footer sit at the end), so reading the entries there fails RocksDB's
    block checksum."""
    sst = largest(store_root, ".sst")
    size = sst.stat().st_size
    flip_bits(sst, [size // 3, size // 2])
    return sst


def flip_in_wal(store_root: Path) -> Path:
    """Two bits half way into the store's write-ahead log: a record in its middle."""
    wal = largest(store_root, ".log")
    size = wal.stat().st_size
    flip_bits(wal, [size // 2, size // 2 + 1])
    return wal


def rewrite_copy(
    store_root: Path, stream_id: int, epoch: int, index: int, payload: bytes, valid_crc: bool
) -> bytes:
    """Replace the payload of one stored copy; its crc recomputed (`valid_crc`: only the
    certificate can tell) or kept (the copy fails its crc32c). Returns the old payload."""
    from rocksdict import Options, Rdict

    db = Rdict(str(db_dir(store_root)), Options(raw_mode=True))
    try:
        key = entry_key(stream_id, epoch, index)
        stored = db.get(key)
        assert isinstance(stored, bytes), f"no copy of {stream_id}/{epoch}/{index}"
        old = decode_value(index, stored)
        crc = StoredEntry.make(index, old.kind, old.epoch, payload).crc32c
        db.put(key, encode_value(old.kind, old.epoch, crc if valid_crc else old.crc32c, payload))
        assert len(stored) - VALUE_HEADER_BYTES == len(old.payload)
        return old.payload
    finally:
        db.close()
