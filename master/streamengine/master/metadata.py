"""The master's metadata store: key/value records, written in transactions.

The master's state (`master.state`, through the record encoding of `master.catalog`)
needs exactly three things of the store that keeps its records:

- `read_all()`: every record, sorted by key, as of one moment (a master loads them
  all when it starts or becomes the active one);
- `commit(transaction)`: puts, deletes and prefix deletes applied together or not at
  all, durably, before it returns;
- `close()`.

Back ends: the embedded RocksDB under `--data` (`master.rocksdb_metadata`, one master),
etcd v3 (`master.etcd_metadata`, several masters of which one is active: every commit is
conditional on this master still holding the election), and `MemoryMetadata` here (the
simulator). A back end raises only the errors below, so the state and the service
handle every one of them the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from streamengine.master.core.errors import MasterError

# etcd refuses a transaction of more than `--max-txn-ops` operations (128 by default);
# a few are kept for the comparisons that make a write conditional. Every back end
# enforces the same bound, so a batch that would fail on etcd fails in every test.
OPS_PER_TRANSACTION_MAX = 120


class MetadataError(MasterError):
    """Base of the failures of a metadata store."""


class MetadataUnavailable(MetadataError):
    """The store did not answer in time, or failed: the transaction may or may not have
    been applied, so what the master holds in memory may no longer match it."""


class NotActive(MetadataError):
    """This master is not (or no longer) the active one: nothing was written. Carries the
    active master's address when it is known."""

    def __init__(self, message: str, active_address: str = "") -> None:
        super().__init__(message)
        self.active_address = active_address


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range end)."""
    trimmed = prefix.rstrip(b"\xff")
    assert trimmed, "a prefix of only 0xff bytes has no end"
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


@dataclass
class Transaction:
    """Mutations applied together, atomically and durably, by `Metadata.commit`."""

    puts: list[tuple[bytes, bytes]] = field(default_factory=list)
    deletes: list[bytes] = field(default_factory=list)
    # Every key starting with one of these is deleted.
    delete_prefixes: list[bytes] = field(default_factory=list)

    def ops(self) -> int:
        return len(self.puts) + len(self.deletes) + len(self.delete_prefixes)

    def check(self) -> None:
        assert self.ops() <= OPS_PER_TRANSACTION_MAX, (
            f"{self.ops()} operations in one transaction (at most {OPS_PER_TRANSACTION_MAX})"
        )
        keys = [key for key, _ in self.puts] + self.deletes
        assert len(set(keys)) == len(keys), "a transaction touches each key once (etcd refuses)"
        assert all(keys) and all(self.delete_prefixes), "no empty key or prefix"
        assert not any(k.startswith(p) for k in keys for p in self.delete_prefixes), (
            "no key under a prefix the same transaction deletes (etcd refuses the overlap)"
        )


class Metadata(Protocol):
    def read_all(self) -> list[tuple[bytes, bytes]]:
        """Every record, sorted by key, as of one moment."""
        ...

    def commit(self, transaction: Transaction) -> None:
        """Apply `transaction` entirely and durably, or raise (`MetadataError`)."""
        ...

    def close(self) -> None: ...


def apply(records: dict[bytes, bytes], transaction: Transaction) -> None:
    """A transaction's effect on a plain dict of records (it touches each key once, so
    the order of its parts does not matter)."""
    for prefix in transaction.delete_prefixes:
        for key in [k for k in records if k.startswith(prefix)]:
            del records[key]
    for key in transaction.deletes:
        records.pop(key, None)
    for key, value in transaction.puts:
        records[key] = value


class MemoryMetadata:
    """Records in a dict; a commit is durable at once, as a synced RocksDB write is. The
    simulator's master runs over it."""

    def __init__(self, records: Iterable[tuple[bytes, bytes]] = ()) -> None:
        self.data: dict[bytes, bytes] = dict(records)

    def read_all(self) -> list[tuple[bytes, bytes]]:
        return sorted(self.data.items())

    def commit(self, transaction: Transaction) -> None:
        transaction.check()
        apply(self.data, transaction)

    def close(self) -> None:
        pass
