"""The embedded metadata store: one RocksDB under the master's `--data` (the default).

rocksdict in raw mode (no pickling, no private comparator), every transaction one
`WriteBatch` written with `sync=True`, so whatever the master answered after a commit
survives a crash of the master or its host. One master process owns the directory;
`snapshot_records` reads a live one from another process (a secondary instance) for
backups.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from streamengine.master.metadata import MetadataUnavailable, Transaction, prefix_end

# The RocksDB directory inside `--data`.
CATALOG_DIR = "catalog"


def _options() -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    return options


def _records(db: Rdict) -> list[tuple[bytes, bytes]]:
    records = []
    # A fresh iterator reads one consistent version of the database.
    for key, value in db.items():
        assert isinstance(key, bytes) and isinstance(value, bytes), "raw mode gives bytes"
        records.append((key, value))
    return records


class RocksDBMetadata:
    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / CATALOG_DIR
        self._db = Rdict(str(self.path), _options())
        self._sync = WriteOptions()
        self._sync.sync = True

    def read_all(self) -> list[tuple[bytes, bytes]]:
        return _records(self._db)

    def commit(self, transaction: Transaction) -> None:
        transaction.check()
        if not transaction.ops():
            return
        batch = WriteBatch(raw_mode=True)
        for prefix in transaction.delete_prefixes:
            batch.delete_range(prefix, prefix_end(prefix))
        for key in transaction.deletes:
            batch.delete(key)
        for key, value in transaction.puts:
            batch.put(key, value)
        try:
            self._db.write(batch, self._sync)
        except Exception as error:  # rocksdict raises plain exceptions for I/O errors
            raise MetadataUnavailable(f"RocksDB write failed: {error}") from error

    def close(self) -> None:
        self._db.close()


def snapshot_records(data_dir: Path) -> list[tuple[bytes, bytes]]:
    """Every record of the embedded store under `data_dir`, read as a RocksDB secondary
    instance: safe while a master runs on it (a secondary never writes the primary's
    files), and consistent (one iterator over what the primary had written)."""
    path = data_dir / CATALOG_DIR
    if not (path / "CURRENT").exists():
        raise FileNotFoundError(f"no master metadata under {data_dir}")
    with tempfile.TemporaryDirectory(prefix="streamengine-secondary-") as secondary:
        db = Rdict(str(path), _options(), access_type=AccessType.secondary(secondary))
        try:
            db.try_catch_up_with_primary()
            return _records(db)
        finally:
            db.close()
