"""No resource before authentication, on a secured cluster of real processes: a
streaming call proves who calls when it opens, from its metadata, and each principal
holds a bounded share of a store, so that nobody reaching a store's port locks it.

Before, 520 Write streams opened with only `ca.crt` and sending nothing took all of a
store's 512 concurrent calls: a reader's GetSegmentState then failed
RESOURCE_EXHAUSTED, as would a leader's appends, recoveries and repairs. Write, Read and
Subscribe now go on the data plane, whose connections say who calls in their hello: an
anonymous one is refused there, and each Write or Subscribe request counts against its
principal's share as a gRPC stream does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from bench.segment_driver import write_stream
from streamengine.client import StreamClient
from streamengine.client.data_connections import DataConnections
from streamengine.protocol import framed, framing
from streamengine.protocol.framed import CallError
from streamengine.protocol.framing import StatusCode
from streamengine.protocol.limits import DATA_REQUESTS_MAX
from streamengine.protocol.transport import Transport
from streamengine.segment_store.core.authority import STREAMS_PER_PRINCIPAL_MAX
from streamengine.testing import Cluster, running_cluster, wait_until
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

Code = grpc.StatusCode
STREAM = "acme/orders"
HOG = "hog/idle"
ANONYMOUS_STREAMS = 600
ANONYMOUS_DATA_CONNECTIONS = 20
# Streams a principal opens beyond its limit: each must be refused, the others held.
EXCESS_STREAMS = 8
# A refusal at open takes milliseconds; seconds would mean the store waited for
# something (Subscribe once waited 10 s for its first message before it authorized).
REFUSED_AT_OPEN_S = 5.0
# What a tenant's read of a few events and a leader's appends take on this cluster when
# idle is well under a second; this leaves room for a loaded test machine.
USUAL_S = 5.0
CALL_TIMEOUT_S = 10.0
ANY_SEGMENT = entry_pb2.SegmentId(stream_id=1, epoch=1)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("admission")
    with running_cluster(root, stores=3, master_args=["--lease-ms", "1000"], tls=True) as cluster:
        admin = cluster.client_transport
        with admin.channel(cluster.master_address) as channel:
            master = master_pb2_grpc.MasterStub(channel)
            policy = entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2)
            for name in (STREAM, HOG):
                master.CreateStream(
                    master_pb2.CreateStreamRequest(name=name, policy=policy, create_tenant=True),
                    timeout=CALL_TIMEOUT_S,
                )
        yield cluster


def tenant(cluster: Cluster, name: str, role: master_pb2.TokenRole.ValueType) -> Transport:
    """What a tenant's application holds: `ca.crt` and a token the cluster admin made."""
    with cluster.client_transport.channel(cluster.master_address) as channel:
        reply = master_pb2_grpc.MasterStub(channel).CreateToken(
            master_pb2.CreateTokenRequest(tenant=name, role=role), timeout=CALL_TIMEOUT_S
        )
    assert cluster.certs is not None
    return Transport.for_client(cluster.certs.tenant_dir, reply.token)


def anonymous(cluster: Cluster) -> Transport:
    """`ca.crt` alone: neither a certificate nor a token."""
    assert cluster.certs is not None
    return Transport.for_client(cluster.certs.tenant_dir)


async def lead_append_and_read(cluster: Cluster, writer: Transport, reader: Transport) -> float:
    """A new leader of STREAM appends, a reader reads it all back and asks a store of
    its state; how long it all took, in seconds, but the leader's flush to the store
    being flooded (its busy loop accepts the connection late: bounded on its own)."""
    assert cluster.certs is not None
    started = time.monotonic()
    payloads = [f"event at {started}".encode()]
    async with (
        StreamClient(
            cluster.master_address, certs_dir=cluster.certs.tenant_dir, token=writer.token
        ) as client,
        client.writer(STREAM, leadership_timeout_s=USUAL_S) as leader,
    ):
        await leader.append_batch(payloads)
        # Every store holds it, the one being flooded too, so that each can be asked
        # of its state below.
        flushing = time.monotonic()
        assert await leader.flush(timeout_s=USUAL_S)
        started += time.monotonic() - flushing
    async with StreamClient(
        cluster.master_address, certs_dir=cluster.certs.tenant_dir, token=reader.token
    ) as client:
        events = [event.payload async for event in client.read(STREAM)]
    assert events[-1:] == payloads
    with reader.channel(cluster.master_address) as channel:
        listing = master_pb2_grpc.MasterStub(channel).ListSegments(
            master_pb2.ListSegmentsRequest(stream=STREAM), timeout=CALL_TIMEOUT_S
        )
    segment = entry_pb2.SegmentId(stream_id=listing.stream_id, epoch=listing.segments[-1].id.epoch)
    for store in cluster.stores:
        with reader.channel(store.address) as channel:
            state = store_grpc.SegmentStoreStub(channel).GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(segment=segment), timeout=USUAL_S
            )
        assert state.last_index >= 0
    return time.monotonic() - started


async def test_anonymous_streams_are_refused_at_open_and_lock_nothing(secured: Cluster) -> None:
    """600 calls with only ca.crt to a store's gRPC port each end PERMISSION_DENIED at
    once, and so do data-plane connections (Write, Read, Subscribe) at their hello;
    while they are made, a tenant's reads and a leader's appends go on as usual."""
    writer = tenant(secured, "acme", master_pb2.TOKEN_ROLE_WRITE)
    reader = tenant(secured, "acme", master_pb2.TOKEN_ROLE_READ)
    store = secured.stores[0].address
    async with anonymous(secured).aio_channel(store) as channel:
        stub = store_grpc.SegmentStoreStub(channel)
        calls: list[Any] = [
            stub.GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(segment=ANY_SEGMENT),
                timeout=CALL_TIMEOUT_S,
            )
            for _ in range(ANONYMOUS_STREAMS)
        ]
        try:
            codes, data_codes, took_s = await asyncio.gather(
                asyncio.wait_for(
                    asyncio.gather(*(call.code() for call in calls)), REFUSED_AT_OPEN_S
                ),
                asyncio.wait_for(
                    asyncio.gather(
                        *(
                            anonymous_data_connection(secured)
                            for _ in range(ANONYMOUS_DATA_CONNECTIONS)
                        )
                    ),
                    REFUSED_AT_OPEN_S,
                ),
                lead_append_and_read(secured, writer, reader),
            )
        finally:
            for call in calls:
                call.cancel()
    assert set(codes) == {Code.PERMISSION_DENIED}, sorted({c.name for c in codes})
    assert set(data_codes) == {StatusCode.UNAUTHENTICATED}
    assert took_s < USUAL_S
    assert "presented no certificate or token" in await calls[0].details()


async def anonymous_data_connection(cluster: Cluster) -> StatusCode:
    """How a store's data port answers a connection with neither certificate nor token."""
    try:
        async with framed.connect(cluster.stores[0].data_address, anonymous(cluster)):
            pass
    except CallError as error:
        assert "certificate or a token" in error.details, error
        return error.code
    return StatusCode.OK


async def test_a_principal_holding_all_its_streams_leaves_the_store_to_others(
    secured: Cluster,
) -> None:
    """A tenant's token opens STREAMS_PER_PRINCIPAL_MAX Subscribe calls on a store's
    data port and a few more, and leaves them idle: the excess is refused
    RESOURCE_EXHAUSTED naming the limit, the rest stay held, and another tenant's
    leader and reader go on as usual. Once they close, the same token opens streams
    again."""
    hog = tenant(secured, "hog", master_pb2.TOKEN_ROLE_WRITE)
    writer = tenant(secured, "acme", master_pb2.TOKEN_ROLE_WRITE)
    reader = tenant(secured, "acme", master_pb2.TOKEN_ROLE_READ)
    data_address = secured.stores[0].data_address
    opened = STREAMS_PER_PRINCIPAL_MAX + EXCESS_STREAMS
    # Connections enough to open them all at once (each holds DATA_REQUESTS_MAX).
    pools = [DataConnections(hog) for _ in range(-(-opened // (DATA_REQUESTS_MAX - 8)))]
    ends: list[asyncio.Task[CallError | None]] = []
    try:
        for n in range(opened):
            call = await pools[n % len(pools)].call(data_address, framing.SUBSCRIBE)
            await call.send(HELD_OPEN)
            ends.append(asyncio.create_task(call_end(call)))
        await wait_until(
            lambda: sum(end.done() for end in ends) >= EXCESS_STREAMS,
            REFUSED_AT_OPEN_S,
            "the calls past the limit refused",
        )
        refused = [end.result() for end in ends if end.done()]
        assert len(refused) == EXCESS_STREAMS
        for error in refused:
            assert error is not None and error.code is StatusCode.RESOURCE_EXHAUSTED, error
            assert "STREAMS_PER_PRINCIPAL_MAX" in error.details
        took_s = await lead_append_and_read(secured, writer, reader)
        assert took_s < USUAL_S
        assert sum(end.done() for end in ends) == EXCESS_STREAMS, "the rest are held"
        # The data plane's Write counts against the same share.
        assert not await hog_admitted(hog, data_address)
    finally:
        for end in ends:
            end.cancel()
        for pool in pools:
            await pool.close()
    # The store counts the streams no more once it sees them end.
    await wait_until(
        lambda: hog_admitted(hog, data_address),
        REFUSED_AT_OPEN_S,
        "a stream admitted",
        0.05,
    )


# A multiplexed call whose one tail is of no stream: answered with the tail's end, the
# call held open (silent for up to three keepalive intervals of a minute).
HELD_OPEN = segment_store_pb2.SubscribeRequest(
    start=segment_store_pb2.SubscribeStart(
        segment=entry_pb2.SegmentId(stream_id=1 << 40, epoch=1),
        from_index=1,
        keepalive_interval_ms=60_000,
        tail=1,
    )
)


async def call_end(call: framed.ClientCall) -> CallError | None:
    """How a call ends: its error, or None at the store's End."""
    try:
        while await call.receive() is not None:
            pass
    except CallError as error:
        return error
    return None


async def hog_admitted(hog: Transport, data_address: str) -> bool:
    """Whether a Write stream of `hog` gets past its open: a write without a grant is
    then refused for the grant (PERMISSION_DENIED, in its reply: the stream goes on),
    not for the caller's limit (the call's end)."""
    request = segment_store_pb2.WriteRequest(
        segment=entry_pb2.SegmentId(stream_id=1, epoch=1), writer_epoch=1, request_id=1
    )
    try:
        replies = await write_stream(data_address, [request], hog, timeout_s=5.0)
    except CallError as error:
        assert error.code is StatusCode.RESOURCE_EXHAUSTED, error
        return False
    assert [reply.status for reply in replies] == [segment_store_pb2.REFUSED], replies
    assert replies[0].error.code == Code.PERMISSION_DENIED.value[0], replies[0].error
    return True


async def test_an_anonymous_lease_hold_is_refused_at_open(secured: Cluster) -> None:
    """The master's call held open (HoldLease) proves who calls before its first reply:
    with ca.crt alone it ends UNAUTHENTICATED at once."""
    request = master_pb2.HoldLeaseRequest(stream=STREAM, client_id="nobody", epoch=1)
    async with anonymous(secured).aio_channel(secured.master.address) as channel:
        call = master_pb2_grpc.MasterStub(channel).HoldLease(request, timeout=CALL_TIMEOUT_S)
        code = await asyncio.wait_for(call.code(), REFUSED_AT_OPEN_S)
        assert code == Code.UNAUTHENTICATED, await call.details()
        assert "certificate proof or a token" in await call.details()
