"""The master's metadata in etcd: one transaction per commit, conditional on this master
being the active one and on nothing having been written since its last commit.

Records live under `PREFIX/meta/` (`master.etcd`). Every commit is one etcd `Txn`
whose comparisons are the *guard*:

- `ActiveGuard` (a running master): its election key still exists with the creation
  revision it won with (the key is bound to its election lease, so it is gone once the
  lease expired or was revoked: a deposed master, paused or cut off, writes nothing),
  and the *writer key* `PREFIX/writer` still has the revision of this master's last
  commit. Each commit rewrites the writer key, so a transaction of this master that
  etcd applies late (after a timeout, through another member) fails instead of
  overwriting newer records: an epoch is never written twice.
- `NoMasterGuard` (restoring a backup): no master is in the election at all.

A comparison that fails raises `NotActive` (the election key is gone) or
`MetadataChanged` (it is there, but the writer key moved: memory no longer matches etcd
and the master must load it again); nothing was written. A commit etcd does not answer
in time raises `MetadataUnavailable`. Either way the `on_failure` callback hears of it
first, so the election can step this master down.

A commit blocks the caller (the master's state is synchronous and runs on its event
loop) for at most `commit_timeout_s`, which the election keeps well below its lease's
TTL so that the keepalive on the same loop is never starved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NoReturn

import grpc

from streamengine.etcd import rpc_pb2
from streamengine.master.etcd import EtcdClient
from streamengine.master.metadata import (
    MetadataError,
    MetadataUnavailable,
    NotActive,
    Transaction,
    prefix_end,
)
from streamengine.protocol.limits import GRPC_MESSAGE_BYTES_MAX

# A load reads the records page by page at one revision. etcd 3.4 walks its index from
# a page's first key to the end of the range for every page, whatever its limit, so a
# load costs etcd pages x records: 2,000-record pages took 151 pages and 7 s of etcd at
# 100,000 streams. Pages are sized to hold about `PAGE_BYTES` (from the records of the
# page before), within gRPC's message limit with room for a page of larger records;
# a page refused as too large is read again at half the size.
PAGE_BYTES = 4 << 20
assert PAGE_BYTES * 2 <= GRPC_MESSAGE_BYTES_MAX
RECORDS_PER_PAGE_FIRST = 1000
RECORDS_PER_PAGE_MAX = 50_000
LOAD_TIMEOUT_S = 10.0
# One member's share of a read: a member cut off the network leaves time for the others.
READ_ATTEMPT_TIMEOUT_S = 3.0
# A page of the load is larger, and etcd's cost grows with the catalog: more time, and
# a member cut off the network costs the load one such attempt.
PAGE_TIMEOUT_S = 30.0
PAGE_ATTEMPT_TIMEOUT_S = 10.0
COMMIT_TIMEOUT_S_DEFAULT = 0.5
WRITER_KEY = b"/writer"


def page_records(page_bytes: int, records: int) -> int:
    """How many records the next page asks for, after a page of `records` records in
    `page_bytes`: about `PAGE_BYTES` of records like these."""
    assert records > 0
    per_record = max(1, page_bytes // records)
    return max(1, min(RECORDS_PER_PAGE_MAX, PAGE_BYTES // per_record))


class MetadataChanged(MetadataError):
    """The records in etcd changed without this master knowing (a transaction of its own
    applied late): nothing was written, and memory must be loaded again."""


@dataclass(frozen=True, slots=True)
class ActiveGuard:
    """What the active master's commits compare: its election key, and the writer key's
    revision as of its last commit (0: absent)."""

    election_key: bytes
    election_revision: int
    writer_revision: int


@dataclass(frozen=True, slots=True)
class NoMasterGuard:
    """Commits only while no master is in the election (a restore)."""


Guard = ActiveGuard | NoMasterGuard


def _put(key: bytes, value: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value))


def _delete(key: bytes, range_end: bytes = b"") -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(
        request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end)
    )


def _range(key: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))


class EtcdMetadata:
    def __init__(
        self,
        client: EtcdClient,
        commit_timeout_s: float = COMMIT_TIMEOUT_S_DEFAULT,
    ) -> None:
        self.client = client
        self.prefix = client.config.meta_prefix
        self.writer_key = client.config.prefix + WRITER_KEY
        self.election_prefix = client.config.election_name + b"/"
        self.commit_timeout_s = commit_timeout_s
        self.guard: Guard | None = None
        self.on_failure: Callable[[MetadataError], None] = lambda error: None
        # Who is active, for the error a standby's commit raises.
        self.active_address = ""

    def activate(self, election_key: bytes, election_revision: int) -> None:
        """Guard every commit from now on with this master's election key (won with
        `election_revision`) and the writer key as it is now. Load the records after
        this, never before: they are then at least as new as the writer key."""
        writer_revision, _ = self.writer_revision()
        self.guard = ActiveGuard(election_key, election_revision, writer_revision)

    def deactivate(self) -> None:
        self.guard = None

    # ---- reading ----

    def writer_revision(self) -> tuple[int, int]:
        """(the writer key's revision, 0 when absent; etcd's revision now)."""

        def attempt(member: str, timeout_s: float) -> rpc_pb2.RangeResponse:
            request = rpc_pb2.RangeRequest(key=self.writer_key)
            return self.client.kv(member).Range(request, timeout=timeout_s)

        reply = self._read(attempt)
        revision = reply.kvs[0].mod_revision if reply.kvs else 0
        return revision, reply.header.revision

    def read_all(self) -> list[tuple[bytes, bytes]]:
        return self.read_all_at(0)

    def read_all_at(self, revision: int) -> list[tuple[bytes, bytes]]:
        """Every record, as of etcd revision `revision` (0: now), page by page."""
        records: list[tuple[bytes, bytes]] = []
        start, end = self.prefix, prefix_end(self.prefix)
        limit = RECORDS_PER_PAGE_FIRST
        while True:
            reply = self._page(start, end, revision, limit)
            # Later pages read the same revision as the first: one consistent view.
            revision = revision or reply.header.revision
            records.extend((kv.key[len(self.prefix) :], kv.value) for kv in reply.kvs)
            if not reply.more:
                return records
            start = reply.kvs[-1].key + b"\0"
            limit = page_records(reply.ByteSize(), len(reply.kvs))

    def _page(self, start: bytes, end: bytes, revision: int, limit: int) -> rpc_pb2.RangeResponse:
        """A page of at most `limit` records, fewer if that many do not fit in a message."""
        while True:
            request = rpc_pb2.RangeRequest(key=start, range_end=end, limit=limit, revision=revision)
            try:
                return self.client.call(
                    partial(self._range, request), PAGE_TIMEOUT_S, PAGE_ATTEMPT_TIMEOUT_S
                )
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or limit == 1:
                    raise MetadataUnavailable(f"etcd did not answer a read: {error}") from error
                limit //= 2

    def _range(
        self, request: rpc_pb2.RangeRequest, member: str, timeout_s: float
    ) -> rpc_pb2.RangeResponse:
        return self.client.kv(member).Range(request, timeout=timeout_s)

    def election_empty(self) -> bool:
        def attempt(member: str, timeout_s: float) -> rpc_pb2.RangeResponse:
            request = rpc_pb2.RangeRequest(
                key=self.election_prefix,
                range_end=prefix_end(self.election_prefix),
                count_only=True,
            )
            return self.client.kv(member).Range(request, timeout=timeout_s)

        return self._read(attempt).count == 0

    def _read(
        self, attempt: Callable[[str, float], rpc_pb2.RangeResponse]
    ) -> rpc_pb2.RangeResponse:
        try:
            return self.client.call(attempt, LOAD_TIMEOUT_S, READ_ATTEMPT_TIMEOUT_S)
        except grpc.RpcError as error:
            raise MetadataUnavailable(f"etcd did not answer a read: {error}") from error

    # ---- writing ----

    def _compares(self, guard: Guard) -> list[rpc_pb2.Compare]:
        if isinstance(guard, NoMasterGuard):
            return [
                rpc_pb2.Compare(
                    result=rpc_pb2.Compare.EQUAL,
                    target=rpc_pb2.Compare.VERSION,
                    key=self.election_prefix,
                    range_end=prefix_end(self.election_prefix),
                    version=0,
                )
            ]
        return [
            rpc_pb2.Compare(
                result=rpc_pb2.Compare.EQUAL,
                target=rpc_pb2.Compare.CREATE,
                key=guard.election_key,
                create_revision=guard.election_revision,
            ),
            rpc_pb2.Compare(
                result=rpc_pb2.Compare.EQUAL,
                target=rpc_pb2.Compare.MOD,
                key=self.writer_key,
                mod_revision=guard.writer_revision,
            ),
        ]

    def _operations(self, transaction: Transaction, guard: Guard) -> list[rpc_pb2.RequestOp]:
        ops = [
            _delete(self.prefix + prefix, prefix_end(self.prefix + prefix))
            for prefix in transaction.delete_prefixes
        ]
        ops += [_delete(self.prefix + key) for key in transaction.deletes]
        ops += [_put(self.prefix + key, value) for key, value in transaction.puts]
        if isinstance(guard, ActiveGuard):
            ops.append(_put(self.writer_key, guard.election_key))
        return ops

    def commit(self, transaction: Transaction) -> None:
        transaction.check()
        guard = self.guard
        if guard is None:
            self._fail(NotActive("this master is a standby", self.active_address))
        assert guard is not None
        request = rpc_pb2.TxnRequest(
            compare=self._compares(guard),
            success=self._operations(transaction, guard),
            # On failure, say why: is the election key still ours?
            failure=[_range(guard.election_key)] if isinstance(guard, ActiveGuard) else [],
        )

        def attempt(member: str, timeout_s: float) -> rpc_pb2.TxnResponse:
            return self.client.kv(member).Txn(request, timeout=timeout_s)

        try:
            reply = self.client.call(attempt, self.commit_timeout_s)
        except grpc.RpcError as error:
            self._fail(MetadataUnavailable(f"etcd did not commit in time: {error.code()}"))
        if reply.succeeded:
            if isinstance(guard, ActiveGuard):
                self.guard = ActiveGuard(
                    guard.election_key, guard.election_revision, reply.header.revision
                )
            return
        self.guard = None
        if isinstance(guard, NoMasterGuard):
            self._fail(NotActive("a master is running: stop every master first"))
        held = reply.responses[0].response_range.kvs if reply.responses else []
        if held and held[0].create_revision == guard.election_revision:
            self._fail(MetadataChanged("etcd's records changed since this master's last commit"))
        self._fail(NotActive("this master lost the election", self.active_address))

    def _fail(self, error: MetadataError) -> NoReturn:
        self.on_failure(error)
        raise error

    def close(self) -> None:
        self.client.close()
