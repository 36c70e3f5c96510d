"""An in-memory etcd v3 served on the simulated network: what the masters call of it.

Theory of operation. `MemoryEtcd` is one etcd member's data, with etcd's semantics and
time as an input (`now_ms`, the loop's virtual clock):

- one global revision, raised by each change (a put, a delete that deleted something, a
  transaction that changed anything: all its writes share one revision, a lease revoked
  with its keys); each key has its create and mod revision and its version (1 at
  creation, +1 per put, gone with a delete), and every change is kept, so a Range reads
  any past revision (nothing is compacted);
- `Range` (one key, `[key, range_end)`, `range_end` `\\0` for every key from `key`;
  limit, sort, count and keys only, a past revision), `Put` (bound to a lease or not),
  `DeleteRange`, and `Txn`: compares on value, version, create or mod revision or lease,
  over one key or a range as etcd compares (every key in it; an empty range compares
  as a key with zero fields, a value compare never holds), then the success or failure
  operations in order, refused whole when a branch puts a key twice or inside a range it
  deletes, or names a lease etcd does not know;
- leases: granted with a TTL raised to the minimum (`lease_ttl_s_min`, what etcd derives
  from its election timeout: 1 s for the integration tests' etcd), renewed by each
  keepalive to TTL from its receipt, revoked with their keys; an expired lease goes
  with its keys at the next check of etcd's lessor (every `LEASE_CHECK_MS`, counted
  from the member's start): a keepalive after its expiry is answered TTL 0.

`SimEtcd` is the member as a node: the KV and Lease services on a `SimServer` at
`<name>:2379`, with etcd's status codes and messages for what it refuses, and
UNIMPLEMENTED for what no master calls (Watch, Cluster, Maintenance, Auth, Compact,
LeaseLeases, nested transactions, the put options ignore_value and ignore_lease).
Blocking calls (the masters' commits, `master.etcd_metadata`) reach it through
`SimNetwork`'s blocking channels, asyncio calls (the election) through its channels.
Its data outlives `serve()`: a restarted member refreshes every lease to its full TTL,
as an etcd leader does when it takes office.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, TypeVar

import grpc

from streamengine.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc
from tests.sim.runtime.process import SimProcess
from tests.sim.runtime.transport import SimNetwork, SimServer

T = TypeVar("T")

# etcd's lessor revokes expired leases this often (`lease.lessor`'s runLoop).
LEASE_CHECK_MS = 500
# etcd's `--max-txn-ops` default.
TXN_OPS_MAX = 128
# etcd's largest lease TTL (`lease.MaxLeaseTTL`).
LEASE_TTL_S_MAX = 9_000_000_000
# What etcd's minimum TTL is with `--election-timeout=500` (1.5 election timeouts,
# rounded up to a second), as the integration tests run it; 2 s with etcd's defaults.
LEASE_TTL_S_MIN_DEFAULT = 1
CLUSTER_ID = 0x5E7C1D
MEMBER_ID = 0x5E7E7CD
RAFT_TERM = 2
PORT = 2379


class EtcdError(Exception):
    """A request etcd refuses: its status code and etcd's own message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _empty_key() -> EtcdError:
    return EtcdError(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided")


def _lease_not_found() -> EtcdError:
    return EtcdError(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")


def _unimplemented(what: str) -> EtcdError:
    return EtcdError(
        grpc.StatusCode.UNIMPLEMENTED,
        f"the simulated etcd does not serve {what} (no master calls it)",
    )


@dataclass(frozen=True, slots=True)
class _Entry:
    """One key as of one revision; `deleted` marks the revision that deleted it."""

    create_revision: int
    mod_revision: int
    version: int
    value: bytes
    lease: int
    deleted: bool = False

    def key_value(self, key: bytes, keys_only: bool = False) -> kv_pb2.KeyValue:
        return kv_pb2.KeyValue(
            key=key,
            create_revision=self.create_revision,
            mod_revision=self.mod_revision,
            version=self.version,
            value=b"" if keys_only else self.value,
            lease=self.lease,
        )


@dataclass(slots=True)
class _Lease:
    lease_id: int
    ttl_s: int
    expires_ms: int
    # The keys bound to it, in the order they were bound (a dict: an ordered set).
    keys: dict[bytes, None] = field(default_factory=dict)


def _in_range(key: bytes, start: bytes, end: bytes) -> bool:
    """Whether `key` is in etcd's range `[start, end)` (one key when `end` is empty,
    every key from `start` when it is `\\0`)."""
    if not end:
        return key == start
    return key >= start and (end == b"\0" or key < end)


_SORT_FIELDS = {
    rpc_pb2.RangeRequest.KEY: lambda kv: kv.key,
    rpc_pb2.RangeRequest.VERSION: lambda kv: kv.version,
    rpc_pb2.RangeRequest.CREATE: lambda kv: kv.create_revision,
    rpc_pb2.RangeRequest.MOD: lambda kv: kv.mod_revision,
    rpc_pb2.RangeRequest.VALUE: lambda kv: kv.value,
}

_COMPARE_FIELDS = {
    rpc_pb2.Compare.VERSION: ("version", lambda e: e.version),
    rpc_pb2.Compare.CREATE: ("create_revision", lambda e: e.create_revision),
    rpc_pb2.Compare.MOD: ("mod_revision", lambda e: e.mod_revision),
    rpc_pb2.Compare.LEASE: ("lease", lambda e: e.lease),
}


class MemoryEtcd:
    """One etcd member's keys and leases (see the module doc); `now_ms` is the caller's
    virtual clock, `started_ms` when the member's lessor started counting."""

    def __init__(
        self,
        started_ms: int,
        lease_ids: Iterable[int],
        lease_ttl_s_min: int = LEASE_TTL_S_MIN_DEFAULT,
    ) -> None:
        self.revision = 1
        self.lease_ttl_s_min = lease_ttl_s_min
        self._started_ms = started_ms
        # Every change of every key, in revision order, and every key ever written, sorted.
        self._history: dict[bytes, list[_Entry]] = {}
        self._keys: list[bytes] = []
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = iter(lease_ids)

    # ---- time ----

    def expire(self, now_ms: int) -> None:
        """Revoke what the lessor's checks up to `now_ms` found expired, soonest first."""
        checked_ms = now_ms - (now_ms - self._started_ms) % LEASE_CHECK_MS
        due = sorted(
            (lease.expires_ms, lease.lease_id)
            for lease in self._leases.values()
            if lease.expires_ms <= checked_ms
        )
        for _, lease_id in due:
            self._revoke(lease_id)

    def refresh_leases(self, now_ms: int) -> None:
        """Every lease to its full TTL from now: what a new etcd leader does."""
        self._started_ms = now_ms
        for lease in self._leases.values():
            lease.expires_ms = now_ms + lease.ttl_s * 1000

    # ---- reading ----

    def header(self) -> rpc_pb2.ResponseHeader:
        return rpc_pb2.ResponseHeader(
            cluster_id=CLUSTER_ID, member_id=MEMBER_ID, revision=self.revision, raft_term=RAFT_TERM
        )

    def _at(self, key: bytes, revision: int) -> _Entry | None:
        """`key` as of `revision`, None when absent then."""
        changes = self._history.get(key, [])
        if changes and changes[-1].mod_revision <= revision:
            entry: _Entry | None = changes[-1]  # the usual read: the latest
        else:
            index = bisect.bisect_right([e.mod_revision for e in changes], revision)
            entry = changes[index - 1] if index else None
        return None if entry is None or entry.deleted else entry

    def _current(self, key: bytes) -> _Entry | None:
        changes = self._history.get(key)
        return None if not changes or changes[-1].deleted else changes[-1]

    def _live(self, start: bytes, end: bytes, revision: int) -> list[tuple[bytes, _Entry]]:
        """The keys of `[start, end)` alive at `revision`, by key."""
        if not end:
            entry = self._at(start, revision)
            return [] if entry is None else [(start, entry)]
        first = bisect.bisect_left(self._keys, start)
        found = []
        for key in self._keys[first:]:
            if not _in_range(key, start, end):
                break
            entry = self._at(key, revision)
            if entry is not None:
                found.append((key, entry))
        return found

    def range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        if not request.key:
            raise _empty_key()
        for option in ("min_mod_revision", "max_mod_revision", "min_create_revision",
                       "max_create_revision"):  # fmt: skip
            if getattr(request, option):
                raise _unimplemented(f"Range's {option}")
        revision = request.revision or self.revision
        if revision > self.revision:
            raise EtcdError(
                grpc.StatusCode.OUT_OF_RANGE,
                "etcdserver: mvcc: required revision is a future revision",
            )
        kvs = [
            entry.key_value(key, request.keys_only)
            for key, entry in self._live(request.key, request.range_end, revision)
        ]
        count = len(kvs)
        if request.count_only:
            return rpc_pb2.RangeResponse(header=self.header(), count=count)
        order, target = request.sort_order, request.sort_target
        if order == rpc_pb2.RangeRequest.NONE and target != rpc_pb2.RangeRequest.KEY:
            order = rpc_pb2.RangeRequest.ASCEND  # etcd's default for a sort by another field
        if order != rpc_pb2.RangeRequest.NONE:
            kvs.sort(key=_SORT_FIELDS[target], reverse=order == rpc_pb2.RangeRequest.DESCEND)
        more = 0 < request.limit < count
        if request.limit:
            kvs = kvs[: request.limit]
        return rpc_pb2.RangeResponse(header=self.header(), kvs=kvs, more=more, count=count)

    # ---- writing ----

    def _record(self, key: bytes, entry: _Entry) -> None:
        changes = self._history.get(key)
        if changes is None:
            changes = self._history[key] = []
            bisect.insort(self._keys, key)
        changes.append(entry)

    def _detach(self, key: bytes, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.keys.pop(key, None)

    def _put(self, request: rpc_pb2.PutRequest, revision: int) -> rpc_pb2.PutResponse:
        if request.ignore_value or request.ignore_lease:
            raise _unimplemented("Put's ignore_value and ignore_lease")
        key = request.key
        previous = self._current(key)
        if previous is None:
            entry = _Entry(revision, revision, 1, request.value, request.lease)
        else:
            self._detach(key, previous.lease)
            entry = replace(
                previous,
                mod_revision=revision,
                version=previous.version + 1,
                value=request.value,
                lease=request.lease,
            )
        self._record(key, entry)
        if request.lease:
            self._leases[request.lease].keys[key] = None
        reply = rpc_pb2.PutResponse(header=rpc_pb2.ResponseHeader(revision=revision))
        if request.prev_kv and previous is not None:
            reply.prev_kv.CopyFrom(previous.key_value(key))
        return reply

    def _delete(
        self, request: rpc_pb2.DeleteRangeRequest, revision: int
    ) -> rpc_pb2.DeleteRangeResponse:
        deleted = self._live(request.key, request.range_end, self.revision + 1)
        for key, entry in deleted:
            self._detach(key, entry.lease)
            self._record(key, _Entry(0, revision, 0, b"", 0, deleted=True))
        reply = rpc_pb2.DeleteRangeResponse(
            header=rpc_pb2.ResponseHeader(revision=revision), deleted=len(deleted)
        )
        if request.prev_kv:
            reply.prev_kvs.extend(entry.key_value(key) for key, entry in deleted)
        return reply

    def _check_put(self, request: rpc_pb2.PutRequest) -> None:
        if not request.key:
            raise _empty_key()
        if request.lease and request.lease not in self._leases:
            raise _lease_not_found()

    def put(self, request: rpc_pb2.PutRequest) -> rpc_pb2.PutResponse:
        self._check_put(request)
        reply = self._put(request, self.revision + 1)
        self.revision += 1
        reply.header.CopyFrom(self.header())
        return reply

    def delete_range(self, request: rpc_pb2.DeleteRangeRequest) -> rpc_pb2.DeleteRangeResponse:
        if not request.key:
            raise _empty_key()
        reply = self._delete(request, self.revision + 1)
        if reply.deleted:
            self.revision += 1
        reply.header.CopyFrom(self.header())
        return reply

    # ---- transactions ----

    def _holds(self, compare: rpc_pb2.Compare) -> bool:
        entries = [e for _, e in self._live(compare.key, compare.range_end, self.revision)]
        values: list[Any]
        if compare.target == rpc_pb2.Compare.VALUE:
            wanted: Any = compare.value if compare.WhichOneof("target_union") == "value" else b""
            # A value compare on a missing key never holds (etcd: nil is no value).
            values = [e.value for e in entries]
            if not values:
                return False
        else:
            field_name, read = _COMPARE_FIELDS[compare.target]
            set_field = compare.WhichOneof("target_union") == field_name
            wanted = getattr(compare, field_name) if set_field else 0
            values = [read(e) for e in entries] or [0]
        result = compare.result
        for value in values:
            holds = {
                rpc_pb2.Compare.EQUAL: value == wanted,
                rpc_pb2.Compare.NOT_EQUAL: value != wanted,
                rpc_pb2.Compare.GREATER: value > wanted,
                rpc_pb2.Compare.LESS: value < wanted,
            }[result]
            if not holds:
                return False
        return True

    def _check_branch(self, ops: Iterable[rpc_pb2.RequestOp]) -> None:
        """etcd's checks of a branch before it applies any of it."""
        puts: list[bytes] = []
        deletes: list[tuple[bytes, bytes]] = []
        for op in ops:
            kind = op.WhichOneof("request")
            if kind == "request_put":
                self._check_put(op.request_put)
                puts.append(op.request_put.key)
            elif kind == "request_delete_range":
                if not op.request_delete_range.key:
                    raise _empty_key()
                deletes.append((op.request_delete_range.key, op.request_delete_range.range_end))
            elif kind == "request_range":
                if not op.request_range.key:
                    raise _empty_key()
            else:
                raise _unimplemented("nested transactions")
        duplicate = len(set(puts)) != len(puts) or any(
            _in_range(key, start, end) for key in puts for start, end in deletes
        )
        if duplicate:
            raise EtcdError(
                grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request"
            )

    def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        if max(len(request.compare), len(request.success), len(request.failure)) > TXN_OPS_MAX:
            raise EtcdError(
                grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: too many operations in txn request"
            )
        self._check_branch(request.success)
        self._check_branch(request.failure)
        succeeded = all(self._holds(compare) for compare in request.compare)
        revision = self.revision + 1
        changed = False
        responses = []
        for op in request.success if succeeded else request.failure:
            kind = op.WhichOneof("request")
            if kind == "request_put":
                responses.append(
                    rpc_pb2.ResponseOp(response_put=self._put(op.request_put, revision))
                )
                changed = True
            elif kind == "request_delete_range":
                deleted = self._delete(op.request_delete_range, revision)
                changed = changed or deleted.deleted > 0
                responses.append(rpc_pb2.ResponseOp(response_delete_range=deleted))
            else:
                # Reads in a transaction see its own writes before them.
                ranged = (
                    self.range(op.request_range)
                    if not changed
                    else self._range_at(op.request_range, revision)
                )
                responses.append(rpc_pb2.ResponseOp(response_range=ranged))
        if changed:
            self.revision = revision
        return rpc_pb2.TxnResponse(header=self.header(), succeeded=succeeded, responses=responses)

    def _range_at(self, request: rpc_pb2.RangeRequest, revision: int) -> rpc_pb2.RangeResponse:
        """A read in a transaction after its first write: as of the revision it writes."""
        saved, self.revision = self.revision, revision
        try:
            return self.range(request)
        finally:
            self.revision = saved

    # ---- leases ----

    def grant(self, request: rpc_pb2.LeaseGrantRequest, now_ms: int) -> rpc_pb2.LeaseGrantResponse:
        if request.TTL > LEASE_TTL_S_MAX:
            raise EtcdError(grpc.StatusCode.OUT_OF_RANGE, "etcdserver: too large lease TTL")
        lease_id = request.ID or next(self._lease_ids)
        if lease_id in self._leases:
            raise EtcdError(grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: lease already exists")
        ttl_s = max(request.TTL, self.lease_ttl_s_min)
        self._leases[lease_id] = _Lease(lease_id, ttl_s, now_ms + ttl_s * 1000)
        return rpc_pb2.LeaseGrantResponse(header=self.header(), ID=lease_id, TTL=ttl_s)

    def keep_alive(self, lease_id: int, now_ms: int) -> rpc_pb2.LeaseKeepAliveResponse:
        """Renewed to its TTL from now; TTL 0 when etcd does not know it (or it expired:
        etcd then answers once its lessor revoked it)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_ms <= now_ms:
            return rpc_pb2.LeaseKeepAliveResponse(header=self.header(), ID=lease_id, TTL=0)
        lease.expires_ms = now_ms + lease.ttl_s * 1000
        return rpc_pb2.LeaseKeepAliveResponse(header=self.header(), ID=lease_id, TTL=lease.ttl_s)

    def revoke(self, lease_id: int) -> rpc_pb2.LeaseRevokeResponse:
        if lease_id not in self._leases:
            raise _lease_not_found()
        self._revoke(lease_id)
        return rpc_pb2.LeaseRevokeResponse(header=self.header())

    def _revoke(self, lease_id: int) -> None:
        """The lease and its keys, deleted at one revision."""
        lease = self._leases.pop(lease_id)
        revision = self.revision + 1
        for key in sorted(lease.keys):
            self._record(key, _Entry(0, revision, 0, b"", 0, deleted=True))
        if lease.keys:
            self.revision = revision

    def time_to_live(
        self, request: rpc_pb2.LeaseTimeToLiveRequest, now_ms: int
    ) -> rpc_pb2.LeaseTimeToLiveResponse:
        lease = self._leases.get(request.ID)
        if lease is None:
            return rpc_pb2.LeaseTimeToLiveResponse(header=self.header(), ID=request.ID, TTL=-1)
        return rpc_pb2.LeaseTimeToLiveResponse(
            header=self.header(),
            ID=lease.lease_id,
            # etcd truncates the remaining seconds.
            TTL=max(0, lease.expires_ms - now_ms) // 1000,
            grantedTTL=lease.ttl_s,
            keys=sorted(lease.keys) if request.keys else [],
        )


# ---- the member on the network ----


async def _answer(context: Any, answer: Callable[[], T]) -> T:
    """`answer()`, or the status etcd refuses the request with."""
    try:
        return answer()
    except EtcdError as error:
        await context.abort(error.code, error.details)
        raise AssertionError("abort raises") from error


class _KVService(rpc_pb2_grpc.KVServicer):
    def __init__(self, member: SimEtcd) -> None:
        self.member = member

    async def Range(self, request: Any, context: Any) -> rpc_pb2.RangeResponse:
        return await _answer(context, lambda: self.member.now().range(request))

    async def Put(self, request: Any, context: Any) -> rpc_pb2.PutResponse:
        return await _answer(context, lambda: self.member.now().put(request))

    async def DeleteRange(self, request: Any, context: Any) -> rpc_pb2.DeleteRangeResponse:
        return await _answer(context, lambda: self.member.now().delete_range(request))

    async def Txn(self, request: Any, context: Any) -> rpc_pb2.TxnResponse:
        reply = await _answer(context, lambda: self.member.now().txn(request))
        for observe in self.member.txn_observers:
            observe(self.member.data, request, reply)
        return reply

    async def Compact(self, request: Any, context: Any) -> rpc_pb2.CompactionResponse:
        return await _answer(context, _refused(_unimplemented("Compact")))


class _LeaseService(rpc_pb2_grpc.LeaseServicer):
    def __init__(self, member: SimEtcd) -> None:
        self.member = member

    async def LeaseGrant(self, request: Any, context: Any) -> rpc_pb2.LeaseGrantResponse:
        member = self.member
        return await _answer(context, lambda: member.now().grant(request, member.now_ms()))

    async def LeaseRevoke(self, request: Any, context: Any) -> rpc_pb2.LeaseRevokeResponse:
        return await _answer(context, lambda: self.member.now().revoke(request.ID))

    async def LeaseKeepAlive(
        self, request_iterator: Any, context: Any
    ) -> AsyncIterator[rpc_pb2.LeaseKeepAliveResponse]:
        async for request in request_iterator:
            yield self.member.now().keep_alive(request.ID, self.member.now_ms())

    async def LeaseTimeToLive(self, request: Any, context: Any) -> rpc_pb2.LeaseTimeToLiveResponse:
        return self.member.now().time_to_live(request, self.member.now_ms())

    async def LeaseLeases(self, request: Any, context: Any) -> rpc_pb2.LeaseLeasesResponse:
        return await _answer(context, _refused(_unimplemented("LeaseLeases")))


def _refused(error: EtcdError) -> Callable[[], NoReturn]:
    def refuse() -> NoReturn:
        raise error

    return refuse


TxnObserver = Callable[[MemoryEtcd, rpc_pb2.TxnRequest, rpc_pb2.TxnResponse], None]


class SimEtcd(SimProcess):
    """One etcd member as a node of the network: `serve()` runs it (in a task of its
    node's context, or `start(group)`) until cancelled (`crash()`); its data outlives
    it, and a `restart()` serves it again."""

    def __init__(
        self,
        network: SimNetwork,
        name: str = "etcd",
        lease_ttl_s_min: int = LEASE_TTL_S_MIN_DEFAULT,
    ) -> None:
        super().__init__()
        self.network = network
        self.name = name
        self.address = f"{name}:{PORT}"
        rng = network.rng
        # etcd's lease ids are random; these come from the seed.
        lease_ids = iter(lambda: rng.getrandbits(62) + 1, None)
        self.data = MemoryEtcd(self.now_ms(), lease_ids, lease_ttl_s_min)
        self.serving = asyncio.Event()
        self._served = False
        # Told of every transaction applied, with the data just after it (checkers).
        self.txn_observers: list[TxnObserver] = []

    def url(self, prefix: str = "") -> str:
        """A master's `--metadata` for this member, keys under `prefix`."""
        return f"etcd://{self.address}" + (f"/{prefix.strip('/')}" if prefix else "")

    def now_ms(self) -> int:
        return round(self.network.loop.time() * 1000)

    def now(self) -> MemoryEtcd:
        """The data as of now: the lessor's checks up to now done."""
        self.data.expire(self.now_ms())
        return self.data

    async def serve(self) -> None:
        if self._served:
            self.data.refresh_leases(self.now_ms())
        self._served = True
        server = SimServer(self.network, self.name)
        rpc_pb2_grpc.add_KVServicer_to_server(_KVService(self), server)
        rpc_pb2_grpc.add_LeaseServicer_to_server(_LeaseService(self), server)
        server.add_insecure_port(self.address)
        await server.start()
        self.serving.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.serving.clear()
            await server.stop(None)
