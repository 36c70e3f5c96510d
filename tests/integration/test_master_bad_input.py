"""Bad input to a real master gets a clear gRPC status and changes nothing (invariant 6)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from streamengine.client import StreamClient
from streamengine.client.types import StreamInfo
from streamengine.protocol.limits import CREATE_STREAMS_PER_CALL_MAX, LEASE_BATCH_ENTRIES_MAX
from streamengine.testing import ServerProcess, make_master
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

pytestmark = pytest.mark.security

STREAM = "acme/orders"
Code = grpc.StatusCode
# The grants the fixture's leader w1 got, by epoch: requests below name them as
# `b"grant:EPOCH"`, and `with_grant` puts the real one in before sending.
GRANTS: dict[int, bytes] = {}
P = entry_pb2.ReplicationPolicy
m = master_pb2


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = make_master(tmp_path_factory.mktemp("bad"), ["--lease-ms", "300"])
    process.start()
    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            for n in range(3):
                stub.RegisterStore(
                    m.RegisterStoreRequest(store_id=f"s{n}", address=f"127.0.0.1:{n + 1}")
                )
            stub.CreateStream(
                m.CreateStreamRequest(
                    name=STREAM, policy=P(replicas=3, write_quorum=2), create_tenant=True
                )
            )
            # A leader with a rolled segment, so there is something to seal and roll.
            reply = stub.WriterHeartbeat(m.WriterHeartbeatRequest(stream=STREAM, client_id="w1"))
            while reply.role != m.LEADER:
                reply = stub.WriterHeartbeat(
                    m.WriterHeartbeatRequest(stream=STREAM, client_id="w1")
                )
            GRANTS[reply.epoch] = reply.grant
            rolled = stub.RollSegment(
                m.RollSegmentRequest(
                    stream=STREAM,
                    client_id="w1",
                    epoch=reply.epoch,
                    grant=reply.grant,
                    lease_secret=reply.lease_secret,
                )
            )
            GRANTS[rolled.epoch] = rolled.grant
        yield process
    finally:
        process.kill()


def snapshot(stub: master_pb2_grpc.MasterStub) -> tuple[Any, ...]:
    streams = stub.ListStreams(m.ListStreamsRequest())
    for info in streams.streams:
        info.leader_id = ""  # the lease runs out during the test; not metadata
        info.acked_index = 0
    segments = [stub.ListSegments(m.ListSegmentsRequest(stream=s.name)) for s in streams.streams]
    stores = stub.GetClusterStatus(m.GetClusterStatusRequest()).stores
    return (
        stub.ListTenants(m.ListTenantsRequest()),
        streams,
        segments,
        [(s.store_id, s.address, s.zone, s.draining) for s in stores],
    )


BAD: list[tuple[str, str, Any, grpc.StatusCode]] = [
    (
        "no slash in a name",
        "CreateStream",
        m.CreateStreamRequest(
            name="orders", policy=P(replicas=3, write_quorum=2), create_tenant=True
        ),
        Code.INVALID_ARGUMENT,
    ),
    (
        "empty stream part",
        "CreateStream",
        m.CreateStreamRequest(name="acme/", policy=P(replicas=3, write_quorum=2)),
        Code.INVALID_ARGUMENT,
    ),
    (
        "bad characters",
        "CreateStream",
        m.CreateStreamRequest(name="acme/or ders", policy=P(replicas=3, write_quorum=2)),
        Code.INVALID_ARGUMENT,
    ),
    (
        "W > N",
        "CreateStream",
        m.CreateStreamRequest(name="acme/x", policy=P(replicas=2, write_quorum=3)),
        Code.INVALID_ARGUMENT,
    ),
    ("no policy", "CreateStream", m.CreateStreamRequest(name="acme/x"), Code.INVALID_ARGUMENT),
    (
        "N too large",
        "CreateStream",
        m.CreateStreamRequest(name="acme/x", policy=P(replicas=99, write_quorum=2)),
        Code.INVALID_ARGUMENT,
    ),
    (
        "unknown tenant",
        "CreateStream",
        m.CreateStreamRequest(name="nobody/x", policy=P(replicas=3, write_quorum=2)),
        Code.NOT_FOUND,
    ),
    (
        "existing stream, other policy",
        "CreateStream",
        m.CreateStreamRequest(name=STREAM, policy=P(replicas=3, write_quorum=3)),
        Code.ALREADY_EXISTS,
    ),
    (
        "one stream of a call refused",
        "CreateStreams",
        m.CreateStreamsRequest(
            streams=[
                m.CreateStreamRequest(name="acme/fine", policy=P(replicas=3, write_quorum=2)),
                m.CreateStreamRequest(name="acme/or ders", policy=P(replicas=3, write_quorum=2)),
            ]
        ),
        Code.INVALID_ARGUMENT,
    ),
    (
        "more streams than one call holds",
        "CreateStreams",
        m.CreateStreamsRequest(
            streams=[
                m.CreateStreamRequest(name=f"acme/s{n}", policy=P(replicas=3, write_quorum=2))
                for n in range(CREATE_STREAMS_PER_CALL_MAX + 1)
            ]
        ),
        Code.INVALID_ARGUMENT,
    ),
    ("bad tenant", "CreateTenant", m.CreateTenantRequest(tenant="a/b"), Code.INVALID_ARGUMENT),
    ("bad tenant filter", "ListStreams", m.ListStreamsRequest(tenant="..x"), Code.INVALID_ARGUMENT),
    (
        "oversized page",
        "ListStreams",
        m.ListStreamsRequest(page_size=1_000_000),
        Code.INVALID_ARGUMENT,
    ),
    ("bad page token", "ListStreams", m.ListStreamsRequest(page_token="x!"), Code.INVALID_ARGUMENT),
    (
        "page token of other filters",
        "ListStreams",
        m.ListStreamsRequest(tenant="acme", page_token="MQBvdGhlci8Ab3RoZXIveA=="),
        Code.INVALID_ARGUMENT,
    ),
    ("unknown stream", "DescribeStream", m.DescribeStreamRequest(name="acme/none"), Code.NOT_FOUND),
    ("delete unknown", "DeleteStream", m.DeleteStreamRequest(name="acme/none"), Code.NOT_FOUND),
    (
        "undelete unknown",
        "UndeleteStream",
        m.UndeleteStreamRequest(name="acme/none"),
        Code.NOT_FOUND,
    ),
    (
        "undelete a stream not deleted",
        "UndeleteStream",
        m.UndeleteStreamRequest(name=STREAM),
        Code.INVALID_ARGUMENT,
    ),
    (
        "negative retention age",
        "CreateStream",
        m.CreateStreamRequest(
            name="acme/y", policy=P(replicas=3, write_quorum=2), retention_age_ms=-1
        ),
        Code.INVALID_ARGUMENT,
    ),
    (
        "negative retention bytes",
        "UpdateStream",
        m.UpdateStreamRequest(name=STREAM, retention_bytes=-5),
        Code.INVALID_ARGUMENT,
    ),
    (
        "update unknown",
        "UpdateStream",
        m.UpdateStreamRequest(name="acme/none", retention_bytes=5),
        Code.NOT_FOUND,
    ),
    (
        "trim unknown",
        "TrimStream",
        m.TrimStreamRequest(name="acme/none", before_sequence=1 << 32),
        Code.NOT_FOUND,
    ),
    (
        "trim over a segment not sealed (segment 1 is sealing, 2 open)",
        "TrimStream",
        m.TrimStreamRequest(name=STREAM, before_sequence=3 << 32),
        Code.FAILED_PRECONDITION,
    ),
    (
        "trim before a sequence past the last epoch",
        "TrimStream",
        m.TrimStreamRequest(name=STREAM, before_sequence=1 << 63),
        Code.INVALID_ARGUMENT,
    ),
    (
        "trim before the largest uint64",
        "TrimStream",
        m.TrimStreamRequest(name=STREAM, before_sequence=(1 << 64) - 1),
        Code.INVALID_ARGUMENT,
    ),
    (
        "heartbeat unknown stream",
        "WriterHeartbeat",
        m.WriterHeartbeatRequest(stream="acme/none", client_id="w"),
        Code.NOT_FOUND,
    ),
    (
        "heartbeat without client id",
        "WriterHeartbeat",
        m.WriterHeartbeatRequest(stream=STREAM),
        Code.INVALID_ARGUMENT,
    ),
    (
        "heartbeat with an epoch never granted",
        "WriterHeartbeat",
        m.WriterHeartbeatRequest(stream=STREAM, client_id="w9", epoch=99),
        Code.INVALID_ARGUMENT,
    ),
    (
        "roll by a non-leader, with the leader's grant",
        "RollSegment",
        m.RollSegmentRequest(stream=STREAM, client_id="w9", epoch=2, grant=b"grant:2"),
        Code.PERMISSION_DENIED,
    ),
    (
        "roll by the leader of an old epoch",
        "RollSegment",
        m.RollSegmentRequest(stream=STREAM, client_id="w1", epoch=1, grant=b"grant:1"),
        Code.FAILED_PRECONDITION,
    ),
    (
        "roll without a grant",
        "RollSegment",
        m.RollSegmentRequest(stream=STREAM, client_id="w1", epoch=2),
        Code.PERMISSION_DENIED,
    ),
    (
        "more rolls in one batch than LEASE_BATCH_ENTRIES_MAX",
        "RollSegments",
        m.RollSegmentsRequest(
            rolls=[m.RollSegmentRequest(stream=STREAM, client_id="w1", epoch=2)]
            * (LEASE_BATCH_ENTRIES_MAX + 1)
        ),
        Code.INVALID_ARGUMENT,
    ),
    (
        "more seals in one batch than LEASE_BATCH_ENTRIES_MAX",
        "SealSegments",
        m.SealSegmentsRequest(
            seals=[
                m.SealSegmentRequest(
                    stream=STREAM, segment_epoch=1, writer_epoch=2, final_index=3, client_id="w1"
                )
            ]
            * (LEASE_BATCH_ENTRIES_MAX + 1)
        ),
        Code.INVALID_ARGUMENT,
    ),
    (
        "seal with a stale epoch",
        "SealSegment",
        m.SealSegmentRequest(
            stream=STREAM,
            segment_epoch=2,
            writer_epoch=2,
            final_index=3,
            client_id="w1",
            grant=b"grant:2",
        ),
        Code.FAILED_PRECONDITION,
    ),
    (
        "seal with an epoch never granted (so under no grant of it)",
        "SealSegment",
        m.SealSegmentRequest(
            stream=STREAM,
            segment_epoch=1,
            writer_epoch=9,
            final_index=3,
            client_id="w1",
            grant=b"grant:2",
        ),
        Code.PERMISSION_DENIED,
    ),
    (
        "seal at index 0",
        "SealSegment",
        m.SealSegmentRequest(
            stream=STREAM,
            segment_epoch=1,
            writer_epoch=2,
            final_index=0,
            client_id="w1",
            grant=b"grant:2",
        ),
        Code.INVALID_ARGUMENT,
    ),
    (
        "seal a segment the grant does not list",
        "SealSegment",
        m.SealSegmentRequest(
            stream=STREAM,
            segment_epoch=7,
            writer_epoch=2,
            final_index=3,
            client_id="w1",
            grant=b"grant:2",
        ),
        Code.PERMISSION_DENIED,
    ),
    (
        "seal without a grant, at the largest epoch",
        "SealSegment",
        m.SealSegmentRequest(
            stream=STREAM, segment_epoch=1, writer_epoch=(1 << 31) - 1, final_index=3
        ),
        Code.PERMISSION_DENIED,
    ),
    (
        "release with the leader's published id and no grant",
        "ReleaseLease",
        m.ReleaseLeaseRequest(stream=STREAM, client_id="w1", epoch=2),
        Code.PERMISSION_DENIED,
    ),
    (
        "segments of an unknown stream",
        "ListSegments",
        m.ListSegmentsRequest(stream="acme/none"),
        Code.NOT_FOUND,
    ),
    ("drain an unknown store", "DrainStore", m.DrainStoreRequest(store_id="nope"), Code.NOT_FOUND),
    (
        "register without an id",
        "RegisterStore",
        m.RegisterStoreRequest(address="127.0.0.1:1"),
        Code.INVALID_ARGUMENT,
    ),
    (
        "register without host:port",
        "RegisterStore",
        m.RegisterStoreRequest(store_id="s9", address="x"),
        Code.INVALID_ARGUMENT,
    ),
]


def with_grant(request: Any) -> Any:
    """`request` with the fixture's grant it names (`b"grant:EPOCH"`), if any."""
    named = getattr(request, "grant", b"")
    if not named.startswith(b"grant:"):
        return request
    filled = type(request)()
    filled.CopyFrom(request)
    filled.grant = GRANTS[int(named.removeprefix(b"grant:"))]
    return filled


@pytest.mark.parametrize(("case", "method", "request_", "code"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_changes_nothing(master: ServerProcess, case, method, request_, code) -> None:
    with grpc.insecure_channel(master.address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        before = snapshot(stub)
        with pytest.raises(grpc.RpcError) as raised:
            getattr(stub, method)(with_grant(request_), timeout=5)
        assert raised.value.code() == code, f"{case}: {raised.value.details()}"
        assert raised.value.details(), "a clear message"
        assert snapshot(stub) == before, case


def test_seal_contradiction_is_aborted_and_repeat_is_idempotent(master: ServerProcess) -> None:
    with grpc.insecure_channel(master.address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        seal = m.SealSegmentRequest(
            stream=STREAM,
            segment_epoch=1,
            writer_epoch=2,
            final_index=4,
            client_id="w1",
            grant=GRANTS[2],
        )
        first = stub.SealSegment(seal)
        assert first.state == entry_pb2.SEALED and first.final_index == 4
        assert stub.SealSegment(seal) == first
        before = snapshot(stub)
        seal.final_index = 5
        with pytest.raises(grpc.RpcError) as raised:
            stub.SealSegment(seal)
        assert raised.value.code() == Code.ABORTED
        assert snapshot(stub) == before


def test_streams_created_many_to_a_call_are_listed_and_named_again_as_they_stand(
    master: ServerProcess,
) -> None:
    names = [f"bulk/s{n:03}" for n in range(2 * CREATE_STREAMS_PER_CALL_MAX + 7)]

    async def create() -> tuple[list[StreamInfo], list[StreamInfo]]:
        async with StreamClient(master.address) as client:
            created = await client.create_streams(names)
            again = await client.create_streams(names[:3] + names[-3:])
            return created, again

    created, again = asyncio.run(create())
    assert [s.name for s in created] == names
    ids = [s.stream_id for s in created]
    assert ids == list(range(ids[0], ids[0] + len(names)))
    assert [s.stream_id for s in again] == ids[:3] + ids[-3:]
    with grpc.insecure_channel(master.address) as channel:
        listed = master_pb2_grpc.MasterStub(channel).ListStreams(
            m.ListStreamsRequest(tenant="bulk")
        )
    assert [s.name for s in listed.streams] == names
