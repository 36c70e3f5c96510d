"""The narrow key-value interface the segment store needs.

The store needs four things from its engine: point gets, ordered range scans, an atomic
batch of puts and deletes, and a way to make everything written so far durable. Keys
are raw bytes compared bytewise, so fixed-width big-endian keys sort numerically.
Its engines (`segment_store.kv`): `RocksKV`, and `MemoryKV` with the same semantics for
unit tests and the deterministic simulator.

Damage is an error, never an end: an engine that finds stored data damaged under a read
raises `KVCorruption`, and a scan that stopped there did not reach the end of its range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from streamengine.protocol.entry import CorruptEntry


class KVCorruption(CorruptEntry):
    """The engine found stored data damaged under a read (a block that fails its
    checksum): what it covers cannot be read, and a scan that stopped there did not
    reach the end of its range."""


class Put(NamedTuple):
    # A tuple, not a dataclass: the store builds one per entry on its hot path.
    key: bytes
    value: bytes


class PutMany(NamedTuple):
    """Puts of many keys in one op: the entries of a write, with no object per entry."""

    keys: Sequence[bytes]
    values: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes


@dataclass(frozen=True, slots=True)
class DeleteRange:
    """Deletes every key in [start, end)."""

    start: bytes
    end: bytes


KVOp = Put | PutMany | Delete | DeleteRange


class KV(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def scan(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[tuple[bytes, bytes]]:
        """Keys in [start, end) in ascending order, at most `limit` of them (0: all);
        with `max_bytes`, stops once the values returned reach that many bytes."""
        ...

    def scan_values(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[bytes]:
        """The values `scan` would return, without their keys."""
        ...

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        """Apply every op atomically: after a crash all of them are visible or none."""
        ...

    def sync(self) -> None:
        """Make every write made so far durable."""
        ...

    def recover(self) -> None:
        """After a refused write: make the KV take writes again, or raise why it cannot
        yet. RocksDB latches an IO error (a full disk) and refuses every later write
        until it is reopened, even once space is free."""
        ...

    def close(self) -> None: ...
