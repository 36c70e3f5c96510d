"""The in-memory etcd (`etcd.py`): etcd's semantics for what the masters call, the same
exchange run against it and against a real etcd, and the master's own etcd client
(`master.etcd`) reaching it through its seams, blocking and asyncio."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest

from streamengine.etcd import rpc_pb2, rpc_pb2_grpc
from streamengine.master.etcd import EtcdClient, parse_etcd_url
from streamengine.master.etcd_metadata import EtcdMetadata, NoMasterGuard
from streamengine.master.metadata import NotActive, Transaction, prefix_end
from streamengine.testing import EtcdCluster
from tests.sim.faults import Faults
from tests.sim.runtime.etcd import LEASE_CHECK_MS, SimEtcd
from tests.sim.runtime.loop import run
from tests.sim.runtime.transport import SimNetwork, node_context

_prefixes = itertools.count(1)
Exchange = Callable[[grpc.aio.Channel, bytes], Coroutine[Any, Any, list[str]]]


def _on_sim_etcd(
    body: Callable[[SimNetwork, SimEtcd], Coroutine[Any, Any, Any]],
    seed: int = 1,
    faults: Faults | None = None,
) -> Any:
    """`body` as node `m1` beside an etcd member on a simulated network."""

    async def main() -> Any:
        network = SimNetwork(asyncio.get_running_loop(), faults)
        etcd = SimEtcd(network)
        with network.installed():
            async with asyncio.TaskGroup() as group:
                etcd.start(group)
                await etcd.serving.wait()
                try:
                    return await group.create_task(body(network, etcd), context=node_context("m1"))
                finally:
                    await etcd.crash()

    return run(main(), seed)


def _code(error: BaseException) -> str:
    assert isinstance(error, grpc.RpcError)
    return error.code().name


async def _kv_exchange(channel: grpc.aio.Channel, prefix: bytes) -> list[str]:
    """Puts, reads, deletes and transactions under `prefix`, and what etcd answered:
    revisions relative to the first put's."""
    kv = rpc_pb2_grpc.KVStub(channel)
    a, b, c = prefix + b"a", prefix + b"b", prefix + b"c"
    first = (await kv.Put(rpc_pb2.PutRequest(key=a, value=b"1"))).header.revision
    trace = []

    def rel(revision: int) -> int:
        return revision - first

    def kvs(reply: rpc_pb2.RangeResponse) -> str:
        return " ".join(
            f"{kv.key[len(prefix) :].decode()}={kv.value.decode()}"
            f"@c{rel(kv.create_revision)}m{rel(kv.mod_revision)}v{kv.version}"
            for kv in reply.kvs
        )

    await kv.Put(rpc_pb2.PutRequest(key=a, value=b"2"))
    await kv.Put(rpc_pb2.PutRequest(key=c, value=b"3"))
    put = await kv.Put(rpc_pb2.PutRequest(key=b, value=b"4", prev_kv=True))
    trace.append(f"put b at {rel(put.header.revision)} prev {put.HasField('prev_kv')}")
    end = prefix_end(prefix)
    everything = await kv.Range(rpc_pb2.RangeRequest(key=prefix, range_end=end))
    trace.append(f"range {kvs(everything)} count {everything.count} more {everything.more}")
    limited = await kv.Range(rpc_pb2.RangeRequest(key=prefix, range_end=end, limit=2))
    trace.append(f"limit 2: {kvs(limited)} count {limited.count} more {limited.more}")
    by_creation = await kv.Range(
        rpc_pb2.RangeRequest(
            key=prefix,
            range_end=end,
            sort_order=rpc_pb2.RangeRequest.DESCEND,
            sort_target=rpc_pb2.RangeRequest.CREATE,
        )
    )
    trace.append(f"newest first: {kvs(by_creation)}")
    ascending = await kv.Range(
        rpc_pb2.RangeRequest(key=prefix, range_end=end, sort_target=rpc_pb2.RangeRequest.MOD)
    )
    trace.append(f"by mod, order unset: {kvs(ascending)}")
    # Limited: a real etcd may hold keys of others after these.
    from_b = await kv.Range(rpc_pb2.RangeRequest(key=b, range_end=b"\0", keys_only=True, limit=2))
    trace.append(f"from b on, keys only: {kvs(from_b)}")
    past = await kv.Range(rpc_pb2.RangeRequest(key=prefix, range_end=end, revision=first))
    trace.append(f"as of the first put: {kvs(past)} header {rel(past.header.revision)}")
    counted = await kv.Range(rpc_pb2.RangeRequest(key=prefix, range_end=end, count_only=True))
    trace.append(f"count only: {counted.count} kvs {len(counted.kvs)}")
    try:
        await kv.Range(rpc_pb2.RangeRequest(key=a, revision=first + 1_000_000))
    except grpc.RpcError as error:
        trace.append(f"a future revision: {_code(error)}")
    deleted = await kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=a, prev_kv=True))
    trace.append(f"delete a: {deleted.deleted} at {rel(deleted.header.revision)} "
                 f"prev {len(deleted.prev_kvs)}")  # fmt: skip
    none = await kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=a))
    trace.append(f"delete a again: {none.deleted} at {rel(none.header.revision)}")
    await kv.Put(rpc_pb2.PutRequest(key=a, value=b"5"))
    again = await kv.Range(rpc_pb2.RangeRequest(key=a))
    trace.append(f"a created again: {kvs(again)}")
    return trace + await _txn_exchange(kv, prefix, rel, kvs)


async def _txn_exchange(
    kv: rpc_pb2_grpc.KVAsyncStub,
    prefix: bytes,
    rel: Callable[[int], int],
    kvs: Callable[[rpc_pb2.RangeResponse], str],
) -> list[str]:
    trace = []
    key, end = prefix + b"new", prefix_end(prefix)
    create = rpc_pb2.Compare(
        result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.CREATE, key=key, create_revision=0
    )
    put = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=b"x"))
    read = rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))
    for attempt in (1, 2):
        reply = await kv.Txn(rpc_pb2.TxnRequest(compare=[create], success=[put], failure=[read]))
        answers = [r.WhichOneof("response") for r in reply.responses]
        trace.append(f"create-once {attempt}: {reply.succeeded} {answers} at "
                     f"{rel(reply.header.revision)}")  # fmt: skip
        if not reply.succeeded:
            trace.append(f"  found {kvs(reply.responses[0].response_range)}")
    compares = {
        "value of a missing key": rpc_pb2.Compare(
            result=rpc_pb2.Compare.NOT_EQUAL,
            target=rpc_pb2.Compare.VALUE,
            key=prefix + b"missing",
            value=b"x",
        ),
        "value equal": rpc_pb2.Compare(
            result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.VALUE, key=key, value=b"x"
        ),
        "version over an empty range": rpc_pb2.Compare(
            result=rpc_pb2.Compare.EQUAL,
            target=rpc_pb2.Compare.VERSION,
            key=prefix + b"zz/",
            range_end=prefix_end(prefix + b"zz/"),
            version=0,
        ),
        "version of every key > 0": rpc_pb2.Compare(
            result=rpc_pb2.Compare.GREATER,
            target=rpc_pb2.Compare.VERSION,
            key=prefix,
            range_end=end,
            version=0,
        ),
        "mod revision less than a huge one": rpc_pb2.Compare(
            result=rpc_pb2.Compare.LESS, target=rpc_pb2.Compare.MOD, key=key, mod_revision=1 << 40
        ),
        "lease is 0": rpc_pb2.Compare(
            result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.LEASE, key=key, lease=0
        ),
    }
    for name, compare in compares.items():
        reply = await kv.Txn(rpc_pb2.TxnRequest(compare=[compare]))
        trace.append(f"{name}: {reply.succeeded} at {rel(reply.header.revision)}")
    # Two puts in one transaction share its revision; a read after them sees them.
    both = await kv.Txn(
        rpc_pb2.TxnRequest(
            success=[
                rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=prefix + b"t1", value=b"1")),
                rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=prefix + b"t2", value=b"2")),
                rpc_pb2.RequestOp(
                    request_range=rpc_pb2.RangeRequest(key=prefix + b"t", range_end=prefix + b"u")
                ),
            ]
        )
    )
    trace.append(f"two puts: at {rel(both.header.revision)}, read "
                 f"{kvs(both.responses[2].response_range)}")  # fmt: skip
    refused = {
        "a key put twice": [put, put],
        "a put inside a deleted range": [
            put,
            rpc_pb2.RequestOp(
                request_delete_range=rpc_pb2.DeleteRangeRequest(key=prefix, range_end=end)
            ),
        ],
        "a put on an unknown lease": [
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, lease=0x7E57))
        ],
        "an empty key": [rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b""))],
    }
    for name, ops in refused.items():
        try:
            await kv.Txn(rpc_pb2.TxnRequest(success=ops))
        except grpc.RpcError as error:
            trace.append(f"{name}: {_code(error)}")
    after = await kv.Range(rpc_pb2.RangeRequest(key=key))
    trace.append(f"unchanged: {kvs(after)}")
    return trace


async def _lease_exchange(channel: grpc.aio.Channel, prefix: bytes) -> list[str]:
    """Grant, keepalive, a key bound, revoke; then a lease left to expire."""
    kv, leases = rpc_pb2_grpc.KVStub(channel), rpc_pb2_grpc.LeaseStub(channel)
    loop = asyncio.get_running_loop()
    trace = []
    granted = await leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=0))
    trace.append(f"granted TTL {granted.TTL} (asked 0)")
    lease_id = granted.ID
    key = prefix + b"bound"
    first = (await kv.Put(rpc_pb2.PutRequest(key=key, value=b"v", lease=lease_id))).header.revision
    bound = await kv.Range(rpc_pb2.RangeRequest(key=key))
    trace.append(f"bound key's lease is the grant's: {bound.kvs[0].lease == lease_id}")
    alive = await leases.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id, keys=True))
    trace.append(f"time to live: granted {alive.grantedTTL}, keys {len(alive.keys)}")
    call = leases.LeaseKeepAlive()
    await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
    renewed = await call.read()
    assert isinstance(renewed, rpc_pb2.LeaseKeepAliveResponse)
    trace.append(f"keepalive TTL {renewed.TTL}")
    revoked = await leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease_id))
    trace.append(f"revoked at +{revoked.header.revision - first}")
    gone = await kv.Range(rpc_pb2.RangeRequest(key=key))
    trace.append(f"its key after the revoke: {len(gone.kvs)}")
    await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
    unknown = await call.read()
    assert isinstance(unknown, rpc_pb2.LeaseKeepAliveResponse)
    trace.append(f"keepalive of a revoked lease: TTL {unknown.TTL}")
    call.cancel()
    dead = await leases.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id))
    trace.append(f"time to live of a revoked lease: {dead.TTL}")
    try:
        await leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease_id))
    except grpc.RpcError as error:
        trace.append(f"revoked twice: {_code(error)}")
    # Left without keepalives: gone with its key, never before its TTL (timed from
    # before the grant: etcd counts from its receipt, later).
    asked_s = loop.time()
    expiring = (await leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=1))).ID
    await kv.Put(rpc_pb2.PutRequest(key=key, value=b"w", lease=expiring))
    while (await kv.Range(rpc_pb2.RangeRequest(key=key, count_only=True))).count:
        assert loop.time() - asked_s < 5.0, "the lease never expired"
        await asyncio.sleep(0.02)
    trace.append(f"expired, not before its TTL: {loop.time() - asked_s >= 1.0}")
    return trace


EXCHANGES: list[Exchange] = [_kv_exchange, _lease_exchange]


def _on_stand_in(exchange: Exchange) -> list[str]:
    async def body(network: SimNetwork, etcd: SimEtcd) -> list[str]:
        channel = network.etcd_channel_for(etcd.address)
        return await exchange(channel, b"/p/")

    return _on_sim_etcd(body)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_the_stand_in_answers_as_a_real_etcd(exchange: Exchange, session_etcd: EtcdCluster) -> None:
    async def on_real_etcd() -> list[str]:
        async with grpc.aio.insecure_channel(session_etcd.endpoints[0]) as channel:
            return await exchange(channel, b"/sim-compare%d/" % next(_prefixes))

    assert _on_stand_in(exchange) == asyncio.run(on_real_etcd())


def test_the_stand_in_keeps_etcd_s_revisions_and_leases() -> None:
    """What the exchanges see, spelled out (the stand-in alone: no etcd needed)."""
    kv = _on_stand_in(_kv_exchange)
    assert "put b at 3 prev False" in kv
    assert "range a=2@c0m1v2 b=4@c3m3v1 c=3@c2m2v1 count 3 more False" in kv
    assert "limit 2: a=2@c0m1v2 b=4@c3m3v1 count 3 more True" in kv
    assert "newest first: b=4@c3m3v1 c=3@c2m2v1 a=2@c0m1v2" in kv
    assert "as of the first put: a=1@c0m0v1 header 3" in kv
    assert "delete a again: 0 at 4" in kv
    assert "a created again: a=5@c5m5v1" in kv
    assert "version over an empty range: True at 6" in kv
    assert "a put inside a deleted range: INVALID_ARGUMENT" in kv
    assert "a put on an unknown lease: NOT_FOUND" in kv
    leases = _on_stand_in(_lease_exchange)
    assert leases == [
        "granted TTL 1 (asked 0)",
        "bound key's lease is the grant's: True",
        "time to live: granted 1, keys 1",
        "keepalive TTL 1",
        "revoked at +1",
        "its key after the revoke: 0",
        "keepalive of a revoked lease: TTL 0",
        "time to live of a revoked lease: -1",
        "revoked twice: NOT_FOUND",
        "expired, not before its TTL: True",
    ]


def test_an_expired_lease_goes_with_its_keys_at_the_next_lessor_check() -> None:
    """In virtual time, exactly: a 1 s lease granted 0.3 s after the member started
    expires at 1.3 s and goes at the lessor's check of 1.5 s, its key with it, at one
    revision; a keepalive between expiry and check is answered TTL 0."""
    assert LEASE_CHECK_MS == 500

    async def body(network: SimNetwork, etcd: SimEtcd) -> list[str]:
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        kv = rpc_pb2_grpc.KVStub(network.etcd_channel_for(etcd.address))
        trace = []
        await asyncio.sleep(0.3 - (loop.time() - started_s))
        lease_id = etcd.data.grant(rpc_pb2.LeaseGrantRequest(TTL=1), etcd.now_ms()).ID
        put = await kv.Put(rpc_pb2.PutRequest(key=b"k", lease=lease_id))
        for at_s in (1.29, 1.31, 1.49, 1.51):
            await asyncio.sleep(started_s + at_s - loop.time())
            ttl = etcd.now().keep_alive(lease_id, etcd.now_ms()).TTL if at_s > 1.3 else "-"
            count = (await kv.Range(rpc_pb2.RangeRequest(key=b"k", count_only=True))).count
            revision = etcd.data.revision - put.header.revision
            trace.append(f"{at_s}: key {count}, keepalive TTL {ttl}, revision +{revision}")
        return trace

    assert _on_sim_etcd(body, faults=Faults.none()) == [
        "1.29: key 1, keepalive TTL -, revision +0",
        "1.31: key 1, keepalive TTL 0, revision +0",
        "1.49: key 1, keepalive TTL 0, revision +0",
        "1.51: key 0, keepalive TTL 0, revision +1",
    ]


def test_what_no_master_calls_is_unimplemented() -> None:
    async def body(network: SimNetwork, etcd: SimEtcd) -> list[str]:
        channel = network.etcd_channel_for(etcd.address)
        codes = []
        for call in (
            rpc_pb2_grpc.KVStub(channel).Compact(rpc_pb2.CompactionRequest(revision=1)),
            rpc_pb2_grpc.LeaseStub(channel).LeaseLeases(rpc_pb2.LeaseLeasesRequest()),
            rpc_pb2_grpc.ClusterStub(channel).MemberList(rpc_pb2.MemberListRequest()),
        ):
            try:
                await call
            except grpc.RpcError as error:
                codes.append(_code(error))
        watch = rpc_pb2_grpc.WatchStub(channel).Watch()
        try:
            await watch.read()
        except grpc.RpcError as error:
            codes.append(_code(error))
        return codes

    assert _on_sim_etcd(body) == ["UNIMPLEMENTED"] * 4


def test_the_master_s_etcd_client_reaches_it_blocking_and_asyncio() -> None:
    """`EtcdMetadata` commits and reads with blocking calls, the election with asyncio
    ones: both through `master.etcd`'s seams; a member cut off fails the blocking call
    UNAVAILABLE, as grpc does, and nothing is written."""

    async def body(network: SimNetwork, etcd: SimEtcd) -> list[str]:
        client = EtcdClient(parse_etcd_url(etcd.url("se")))
        metadata = EtcdMetadata(client)
        metadata.guard = NoMasterGuard()
        metadata.commit(Transaction(puts=[(b"k1", b"v1"), (b"k2", b"v2")]))
        trace = [f"read {metadata.read_all()}"]
        grant = await client.aio_lease(client.member).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=5))
        key = client.config.election_name + b"/1"
        await client.aio_kv(client.member).Put(rpc_pb2.PutRequest(key=key, lease=grant.ID))
        try:
            metadata.commit(Transaction(puts=[(b"k3", b"v3")]))
        except NotActive:
            trace.append("a restore's commit refused while a master is in the election")
        network.cut("m1", etcd.name)
        try:
            metadata.read_all()
        except Exception as error:
            trace.append(f"cut off: {type(error).__name__}")
        network.heal()
        trace.append(f"after healing: {metadata.read_all()}")
        await client.aclose()
        return trace

    assert _on_sim_etcd(body) == [
        "read [(b'k1', b'v1'), (b'k2', b'v2')]",
        "a restore's commit refused while a master is in the election",
        "cut off: MetadataUnavailable",
        "after healing: [(b'k1', b'v1'), (b'k2', b'v2')]",
    ]
