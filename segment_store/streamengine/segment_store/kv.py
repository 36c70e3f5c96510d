"""The engines behind the store's narrow key-value interface (`segment_store.core.kv`).

`RocksKV` keeps RocksDB in raw mode (no pickling, the plain bytewise comparator). The
raw mode is passed explicitly on every open because rocksdict writes its side config
file without fsync: after a power loss it may be empty, and an open that relied on it
would silently fall back to the pickling mode. `MemoryKV` has the same semantics for
unit tests and the deterministic simulator, crash included: what was written without a
sync is lost by `crash()`.

A write-ahead log damaged in its middle is an error too: the store refuses to open it
(`_open`) rather than replay a prefix and forget acknowledged writes and fences.

Damage is an error, never an end: RocksDB reports a block that fails its checksum only
through the iterator's `status()`, while rocksdict's own loops (`items()`, `values()`)
just stop there, as at the end of the range. `RocksKV` iterates itself and checks the
status whenever an iterator stops by itself, so a scan over a damaged block raises
`KVCorruption` instead of returning a silently truncated range (found by the fault
suite, S12 seed 1).

Group commit splits a durable write in two: `write(ops, sync=False)`, then `sync()`.
rocksdict holds the GIL for a whole `write()`, fsync included, so threads cannot share
a synced write; `flush_wal(True)` releases it, so one sync covers every batch written
before it and the event loop keeps running meanwhile.
"""

from __future__ import annotations

import bisect
import contextlib
import shutil
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from streamengine.segment_store.core.kv import (
    Delete,
    KVCorruption,
    KVOp,
    Put,
    PutMany,
)

if TYPE_CHECKING:
    from rocksdict import Rdict, RdictIter


def _corruption(error: Exception, path: Path) -> Exception:
    """rocksdict raises bare Exceptions; a corruption becomes a KVCorruption."""
    if str(error).startswith("Corruption"):
        return KVCorruption(f"{path}: {error}")
    return error


class MemoryKV:
    """Sorted in memory; `crash()` forgets what was written since the last sync, as a
    power loss would with `sync=False` writes."""

    def __init__(self) -> None:
        self._keys: list[bytes] = []
        self._values: dict[bytes, bytes] = {}
        self._durable_keys: list[bytes] = []
        self._durable_values: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        return self._values.get(key)

    def scan(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[tuple[bytes, bytes]]:
        with self._lock:
            lo = bisect.bisect_left(self._keys, start)
            hi = bisect.bisect_left(self._keys, end)
            if limit:
                hi = min(hi, lo + limit)
            found: list[tuple[bytes, bytes]] = []
            total = 0
            for key in self._keys[lo:hi]:
                value = self._values[key]
                found.append((key, value))
                total += len(value)
                if max_bytes and total >= max_bytes:
                    break
            return found

    def scan_values(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[bytes]:
        return [value for _, value in self.scan(start, end, limit, max_bytes)]

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        with self._lock:
            for op in ops:
                if isinstance(op, Put | PutMany):
                    pairs = [op] if isinstance(op, Put) else zip(op.keys, op.values, strict=True)
                    for key, value in pairs:
                        if key not in self._values:
                            bisect.insort(self._keys, key)
                        self._values[key] = value
                elif isinstance(op, Delete):
                    if self._values.pop(op.key, None) is not None:
                        self._keys.remove(op.key)
                else:
                    lo = bisect.bisect_left(self._keys, op.start)
                    hi = bisect.bisect_left(self._keys, op.end)
                    for key in self._keys[lo:hi]:
                        del self._values[key]
                    del self._keys[lo:hi]
            if sync:
                self._checkpoint()

    def sync(self) -> None:
        with self._lock:
            self._checkpoint()

    def crash(self) -> None:
        """Lose every write not yet synced."""
        with self._lock:
            self._keys = list(self._durable_keys)
            self._values = dict(self._durable_values)

    def recover(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _checkpoint(self) -> None:
        self._durable_keys = list(self._keys)
        self._durable_values = dict(self._values)


class _Gate:
    """Many users of the database at once, or its reopening alone."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._users = 0
        self._exclusive = False

    def enter(self) -> None:
        with self._changed:
            while self._exclusive:
                self._changed.wait()
            self._users += 1

    def leave(self) -> None:
        with self._changed:
            self._users -= 1
            if self._users == 0:
                self._changed.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._changed:
            while self._exclusive:
                self._changed.wait()
            self._exclusive = True
            while self._users:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._exclusive = False
                self._changed.notify_all()


# RocksDB holds writes in memtables until they are flushed: at most this many of this
# size, one filling while the others flush. A named part of the store's memory bound
# (besides the write queue and the transport's buffers).
MEMTABLE_BYTES = 32 << 20
MEMTABLES_MAX = 2
# RocksDB's data blocks: 16 KiB rather than its default 4 KiB. Bulk reads (catch-up,
# Spark, a replica's copy, the scrub) pass over whole segments, and a scan costs less per
# entry with larger blocks, little less again beyond 16 KiB (docs/performance.md,
# "RocksDB block size"); a point lookup (a rewrite's check of what is held) reads one
# block either way. Files written before keep their blocks until a compaction rewrites
# them.
BLOCK_BYTES = 16 << 10
# `scan_values` takes rows from rocksdict's loop this many at a time (its byte cap is
# checked per piece).
SCAN_PIECE_ROWS = 4096


class RocksKV:
    """RocksDB through rocksdict, raw mode, one column family."""

    def __init__(self, path: Path | str, recover_free_bytes_min: int = 64 << 20) -> None:
        from rocksdict import WriteOptions

        self.path = Path(path)
        # Reopening a database takes space (a new WAL, a flush of what the old one
        # held): below this much free space `recover` does not try.
        self.recover_free_bytes_min = recover_free_bytes_min
        self._gate = _Gate()
        self._db: Rdict | None = self._open()
        self._plain = WriteOptions()
        self._synced = WriteOptions()
        self._synced.sync = True

    def _open(self) -> Rdict:
        from rocksdict import BlockBasedOptions, DBRecoveryMode, Options, Rdict

        options = Options(raw_mode=True)
        options.create_if_missing(True)
        table = BlockBasedOptions()
        table.set_block_size(BLOCK_BYTES)
        options.set_block_based_table_factory(table)
        options.set_write_buffer_size(MEMTABLE_BYTES)
        options.set_max_write_buffer_number(MEMTABLES_MAX)
        # A record damaged in the middle of the write-ahead log fails the open: RocksDB's
        # default (point in time) would drop it and every later record without a word,
        # and the store would come back without writes it had acknowledged, fences
        # included. Only an incomplete last record (a write cut by a crash, never
        # acknowledged) is dropped.
        options.set_wal_recovery_mode(DBRecoveryMode.tolerate_corrupted_tail_records())
        return Rdict(str(self.path), options)

    @contextmanager
    def _use(self) -> Iterator[Rdict]:
        self._gate.enter()
        try:
            if self._db is None:
                raise OSError(f"{self.path} is closed: reopening it failed; retrying")
            yield self._db
        finally:
            self._gate.leave()

    def get(self, key: bytes) -> bytes | None:
        with self._use() as db:
            try:
                value = db.get(key)
            except Exception as error:
                raise _corruption(error, self.path) from None
        return None if value is None else bytes(value)

    def _iterator(self, db: Rdict, start: bytes, end: bytes) -> RdictIter:
        """A fresh iterator (it pins its own snapshot: the scan is consistent) over
        [start, end), at start."""
        from rocksdict import ReadOptions

        read = ReadOptions()
        read.set_iterate_upper_bound(end)
        it = db.iter(read)
        it.seek(start)
        return it

    def _ended(self, it: RdictIter) -> None:
        """An iterator stopped by itself: the end of its range, or damage it could not
        read past, which only its status tells."""
        try:
            it.status()
        except Exception as error:
            raise _corruption(error, self.path) from None

    def scan(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[tuple[bytes, bytes]]:
        found: list[tuple[bytes, bytes]] = []
        total = 0
        with self._use() as db:
            it = self._iterator(db, start, end)
            valid, key, value, step = it.valid, it.key, it.value, it.next
            while valid():
                row = (key(), value())
                found.append(row)
                total += len(row[1])
                if (limit and len(found) >= limit) or (max_bytes and total >= max_bytes):
                    return found
                step()
            self._ended(it)
        return found

    def scan_values(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[bytes]:
        """`scan`'s values, cheaper per row (no key, no tuple, one call into rocksdict
        per row rather than three) when `limit` is what the range holds
        (`StoreCore.read_run`): rocksdict's own loop ends silently at a block it cannot
        read, so a scan that ends short of `limit` is read again with `scan`, whose
        iterator says whether damage ended it."""
        from rocksdict import ReadOptions

        read = ReadOptions()
        read.set_iterate_upper_bound(end)
        # A bulk read (catch-up, Spark, a replica's copy) passes once over blocks that
        # would only push hotter ones out of the block cache; filling it costs the scan
        # more CPU per entry too (docs/performance.md, "Reads").
        read.fill_cache(False)  # type: ignore[call-arg]  # the stub omits its argument
        wanted = limit or sys.maxsize
        found: list[bytes] = []
        total = 0
        with self._use() as db:
            rows = db.values(from_key=start, read_opt=read)
            while len(found) < wanted:
                piece = list(islice(rows, min(SCAN_PIECE_ROWS, wanted - len(found))))
                if not piece:
                    break
                size = sum(map(len, piece))
                if max_bytes and total + size >= max_bytes:
                    for value in piece:  # cut once the cap is reached, as `scan` does
                        found.append(value)
                        total += len(value)
                        if total >= max_bytes:
                            return found
                found += piece
                total += size
        if len(found) < wanted:
            return [value for _, value in self.scan(start, end, limit, max_bytes)]
        return found

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for op in ops:
            if isinstance(op, PutMany):
                put = batch.put
                for key, value in zip(op.keys, op.values, strict=True):
                    put(key, value)
            elif isinstance(op, Put):
                batch.put(op.key, op.value)
            elif isinstance(op, Delete):
                batch.delete(op.key)
            else:
                batch.delete_range(op.start, op.end)
        with self._use() as db:
            db.write(batch, self._synced if sync else self._plain)

    def sync(self) -> None:
        with self._use() as db:
            db.flush_wal(True)

    def recover(self) -> None:
        free = shutil.disk_usage(self.path).free
        if free < self.recover_free_bytes_min:
            raise OSError(f"No space left on device: {free} bytes free at {self.path}")
        with self._gate.alone():
            self._close_db()
            # What the old database acknowledged is in its WAL; the reopen replays it.
            self._db = self._open()

    def close(self) -> None:
        with self._gate.alone():
            self._close_db()

    def _close_db(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            # After an IO error close() raises it again ("Writer has previous error"),
            # yet it does close: the database opens again at once.
            with contextlib.suppress(Exception):
                db.close()
