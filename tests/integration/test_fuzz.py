"""Mutated messages to every RPC of a real master and real stores: the servers keep
serving, answer each with a status (never an unhandled error), and the data they hold
is exactly what it was (its digests, replica by replica, and the master's metadata).

Each RPC gets a seed message that means something (the victim tenant's stream names,
segment ids, a real grant, a forged one) and hypothesis mutates its bytes: flips,
cuts, insertions, or bytes of its own. Who sends them: calls that could change
anything go with a read token of another tenant (so authorization is what stands in
the way), and read-only calls also as an unauthenticated plaintext caller (who may read
anything, and so reaches deeper: ranges, segments, subscriptions). Writes and seals
also go unauthenticated under forged grants: no mutation of one verifies. Write goes to
the stores' data port (docs/data-plane.md), its mutated messages as frames' payloads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.segment_driver import Driver
from streamengine.client import StreamClient
from streamengine.master.core.listing import encode_page_token
from streamengine.protocol import codec, framed, framing
from streamengine.protocol.auth import RPC_NEEDS
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.signing import SigningKey
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.testing import Cluster, data_address_of, is_serving, running_cluster
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2
from tests.integration.authority_helpers import bearer, create_token

m = master_pb2
s = segment_store_pb2
P = entry_pb2.ReplicationPolicy
CALL_TIMEOUT_S = 3.0
# Examples per RPC and caller: 33 RPCs, a few hundred calls in all, some seconds.
EXAMPLES = 25
FORGER = GrantSigner(SigningKey(bytes(range(50, 82))))
READ_ONLY = {
    "Master/ListTenants",
    "Master/ListStreams",
    "Master/DescribeStream",
    "Master/ListSegments",
    "Master/GetClusterStatus",
    # A reader's report only moves a replica up the store's scrub queue.
    "Master/ReportReplica",
    "SegmentStore/Read",
    "SegmentStore/Subscribe",
    "SegmentStore/Digest",
    "SegmentStore/GetSegmentState",
    "SegmentStore/ListSegmentRecords",
    # Refused without a grant of the master's, whoever calls.
    "SegmentStore/Write",
    "SegmentStore/Seal",
}
STREAMING = {"SegmentStore/Write": "stream", "SegmentStore/Subscribe": "stream"}
# Served on the stores' data port (docs/data-plane.md), by method.
DATA_PORT = {
    "SegmentStore/Write": framing.WRITE,
    "SegmentStore/Read": framing.READ,
    "SegmentStore/Subscribe": framing.SUBSCRIBE,
}
SERVER_STREAMING = {"SegmentStore/Read", "Master/HoldLease", "Master/HoldLeaseSession"}
HELD_OPEN = {"Master/HoldLease", "Master/HoldLeaseSession"}


class Victim:
    """The data the fuzz must not change, and what it knows to aim at."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

        async def fill() -> None:
            async with StreamClient(cluster.master_address) as client:
                await client.create_stream("victim/data")
                for round_ in range(2):  # two leaders: a sealed segment and an open one
                    async with client.writer("victim/data", leadership_timeout_s=15) as writer:
                        await writer.append_batch([b"%d-%d" % (round_, i) for i in range(20)])

        asyncio.run(fill())
        self.driver = Driver(cluster.master_address, "victim/data", client_id="victim-driver")
        self.driver.lead()
        assert self.driver.segment is not None
        segments = self.call("Master/ListSegments", m.ListSegmentsRequest(stream="victim/data"))
        self.segments = list(segments.segments)
        self.sealed = next(x for x in self.segments if x.state == entry_pb2.SEALED)

    def call(self, rpc: str, request: Any) -> Any:
        service, method = rpc.split("/")
        with grpc.insecure_channel(self.cluster.master_address) as channel:
            stub = channel.unary_unary(
                f"/streamengine.v1.{service}/{method}",
                request_serializer=type(request).SerializeToString,
                response_deserializer=_REPLIES[rpc].FromString,
            )
            return stub(request, timeout=CALL_TIMEOUT_S)

    def digests(self) -> tuple[Any, ...]:
        """Everything the victim holds: the master's word and every replica's digest."""
        info = self.call("Master/DescribeStream", m.DescribeStreamRequest(name="victim/data"))
        segments = self.call("Master/ListSegments", m.ListSegmentsRequest(stream="victim/data"))
        replicas = []
        for segment in segments.segments:
            for replica in segment.copy_set:
                replicas.append((segment.id.epoch, replica.store_id, digest(replica, segment.id)))
        # Not the leader: the driver's lease runs out meanwhile, which changes no data.
        return (
            (info.name, info.stream_id, info.epoch, info.unsealed_segments),
            tuple((x.id.epoch, x.state, x.final_index) for x in segments.segments),
            tuple(replicas),
        )

    def seeds(self) -> dict[str, list[Any]]:
        """Meaningful requests of every RPC, to mutate."""
        driver = self.driver
        assert driver.segment is not None
        open_id, sealed_id = driver.segment.id, self.sealed.id
        forged = FORGER.sign(
            Grant(
                open_id.stream_id,
                driver.epoch + 1,
                "victim",
                "intruder",
                (GrantSegment(sealed_id.epoch, tuple(r.store_id for r in self.sealed.copy_set)),),
                expires_at_ms=1 << 62,
            )
        )
        event = StoredEntry.make(1, EntryKind.EVENT, driver.epoch, b"x")
        lease: dict[str, Any] = {
            "stream": "victim/data",
            "client_id": "victim-driver",
            "epoch": driver.epoch,
        }
        return {
            "Master/RegisterStore": [m.RegisterStoreRequest(store_id="store0", address="h:1")],
            "Master/StoreHeartbeat": [m.StoreHeartbeatRequest(store_id="store0")],
            "Master/CreateTenant": [m.CreateTenantRequest(tenant="victim")],
            "Master/ListTenants": [m.ListTenantsRequest()],
            "Master/CreateStream": [
                m.CreateStreamRequest(name="victim/x", policy=P(replicas=3, write_quorum=2))
            ],
            "Master/CreateStreams": [
                m.CreateStreamsRequest(
                    streams=[
                        m.CreateStreamRequest(
                            name=f"victim/x{n}", policy=P(replicas=3, write_quorum=2)
                        )
                        for n in range(3)
                    ]
                )
            ],
            "Master/ListStreams": [
                m.ListStreamsRequest(tenant="victim"),
                m.ListStreamsRequest(
                    name_prefix="victim/d",
                    page_size=1,
                    page_token=encode_page_token("victim/d", "victim/data"),
                ),
            ],
            "Master/DescribeStream": [m.DescribeStreamRequest(name="victim/data")],
            "Master/DeleteStream": [m.DeleteStreamRequest(name="victim/data")],
            "Master/UndeleteStream": [m.UndeleteStreamRequest(name="victim/data")],
            "Master/UpdateStream": [
                m.UpdateStreamRequest(name="victim/data", retention_age_ms=1, retention_bytes=1)
            ],
            "Master/TrimStream": [
                m.TrimStreamRequest(name="victim/data", before_sequence=(sealed_id.epoch + 1) << 32)
            ],
            "Master/WriterHeartbeat": [
                m.WriterHeartbeatRequest(stream="victim/data", client_id="victim-driver")
            ],
            "Master/LeaseHeartbeat": [
                m.LeaseHeartbeatRequest(leases=[
                    m.WriterHeartbeatRequest(stream="victim/data", client_id="victim-driver")
                ])
            ],
            "Master/HoldLeaseSession": [m.HoldLeaseSessionRequest(session=bytes(range(16)))],
            "Master/ReleaseLease": [
                m.ReleaseLeaseRequest(**lease, grant=driver.grant),
                m.ReleaseLeaseRequest(**lease, grant=forged),
            ],
            "Master/HoldLease": [
                m.HoldLeaseRequest(**lease, grant=driver.grant),
                m.HoldLeaseRequest(**lease, grant=forged),
            ],
            "Master/RollSegment": [
                m.RollSegmentRequest(**lease, grant=driver.grant),
                m.RollSegmentRequest(**lease, grant=forged),
            ],
            "Master/RollSegments": [
                m.RollSegmentsRequest(rolls=[m.RollSegmentRequest(**lease, grant=driver.grant)]),
                m.RollSegmentsRequest(rolls=[m.RollSegmentRequest(**lease, grant=forged)]),
            ],
            "Master/ListSegments": [m.ListSegmentsRequest(stream="victim/data", from_epoch=1)],
            "Master/ReportReplica": [
                m.ReportReplicaRequest(
                    stream="victim/data",
                    segment_epoch=sealed_id.epoch,
                    store_address=self.sealed.copy_set[0].address,
                    problem="a chunk's checksum did not match",
                )
            ],
            "Master/SealSegment": [
                m.SealSegmentRequest(
                    stream="victim/data",
                    segment_epoch=sealed_id.epoch,
                    writer_epoch=driver.epoch,
                    client_id="victim-driver",
                    final_index=3,
                    grant=grant,
                )
                for grant in (driver.grant, forged)
            ],
            "Master/SealSegments": [
                m.SealSegmentsRequest(
                    seals=[
                        m.SealSegmentRequest(
                            stream="victim/data",
                            segment_epoch=sealed_id.epoch,
                            writer_epoch=driver.epoch,
                            client_id="victim-driver",
                            final_index=3,
                            grant=grant,
                        )
                    ]
                )
                for grant in (driver.grant, forged)
            ],
            "Master/GetClusterStatus": [m.GetClusterStatusRequest()],
            "Master/DrainStore": [m.DrainStoreRequest(store_id="store0")],
            "Master/Rebalance": [m.RebalanceRequest()],
            "Master/RequestRoll": [m.RequestRollRequest(stream="victim/data")],
            "Master/CreateToken": [
                m.CreateTokenRequest(tenant="victim", role=m.TOKEN_ROLE_ADMIN, ttl_ms=60_000)
            ],
            "Master/RevokeToken": [m.RevokeTokenRequest(token_id="0123456789abcdef")],
            "Master/RotateSigningKey": [m.RotateSigningKeyRequest()],
            "Master/ListSigningKeys": [m.ListSigningKeysRequest()],
            "Master/RevokeCertificate": [
                m.RevokeCertificateRequest(
                    certificate=m.RevokedCertificate(
                        serial="abc", not_after_ms=1 << 62, common_name="client x"
                    )
                )
            ],
            "Master/ListRevokedCertificates": [m.ListRevokedCertificatesRequest()],
            "SegmentStore/Write": [
                codec.write_request(
                    [event],
                    segment=segment,
                    writer_epoch=epoch,
                    acked_index=1,
                    request_id=1,
                    grant=grant,
                )
                for segment, epoch, grant in (
                    (open_id, driver.epoch, driver.grant),
                    (sealed_id, driver.epoch + 1, forged),
                )
            ],
            "SegmentStore/Seal": [
                s.SealRequest(segment=sealed_id, new_epoch=driver.epoch + 1, grant=forged),
                s.SealRequest(segment=open_id, new_epoch=driver.epoch, grant=driver.grant),
            ],
            "SegmentStore/Read": [
                s.ReadRequest(segment=sealed_id, from_index=1, to_index=5),
                s.ReadRequest(segment=sealed_id, packed=True),
            ],
            "SegmentStore/Subscribe": [
                s.SubscribeRequest(start=s.SubscribeStart(segment=sealed_id, from_index=1)),
                # Multiplexed: a tail named, and a stop (as a later message would be).
                s.SubscribeRequest(
                    start=s.SubscribeStart(segment=sealed_id, from_index=1, tail=1)
                ),
                s.SubscribeRequest(stop=s.SubscribeStop(tail=1)),
            ],
            "SegmentStore/CopySegment": [
                s.CopySegmentRequest(
                    segment=sealed_id,
                    source_address=self.sealed.copy_set[1].address,
                    source_data_address=self.sealed.copy_set[1].data_address,
                    final_index=self.sealed.final_index,
                    fence=driver.epoch,
                )
            ],
            "SegmentStore/Digest": [s.DigestRequest(segment=sealed_id, up_to_index=3)],
            "SegmentStore/Delete": [s.DeleteRequest(segment=sealed_id)],
            "SegmentStore/GetSegmentState": [s.GetSegmentStateRequest(segment=sealed_id)],
            "SegmentStore/ListSegmentRecords": [
                s.ListSegmentRecordsRequest(after_stream_id=sealed_id.stream_id)
            ],
        }


def digest(replica: entry_pb2.Replica, segment: entry_pb2.SegmentId) -> tuple[Any, ...]:
    """A replica's digest of everything it holds of `segment`, with its fence and acked
    index (None when it holds nothing of it: the open segment before any write)."""
    with grpc.insecure_channel(replica.address) as channel:
        try:
            reply = channel.unary_unary(
                "/streamengine.v1.SegmentStore/Digest",
                request_serializer=s.DigestRequest.SerializeToString,
                response_deserializer=s.DigestReply.FromString,
            )(s.DigestRequest(segment=segment, up_to_index=1000), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND, error
            return (None,)
    return reply.digest, reply.fence, reply.acked_index, reply.entries_held


_REPLIES: dict[str, Any] = {
    "Master/ListSegments": m.ListSegmentsReply,
    "Master/DescribeStream": m.StreamInfo,
}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Victim, str]]:
    root = tmp_path_factory.mktemp("fuzz")
    with running_cluster(root, stores=3, master_args=["--lease-ms", "1000"]) as cluster:
        victim = Victim(cluster)
        token, _ = create_token(cluster.master_address, "fuzz", m.TOKEN_ROLE_READ)
        before = victim.digests()
        yield cluster, victim, token
        for server in [cluster.master, *cluster.stores]:
            assert is_serving(server.address), f"{server.name} stopped serving"
        assert victim.digests() == before, "the fuzz changed the victim's data"


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    """Bytes near `seed`: a few flipped, cut, or inserted; or bytes of no seed at all."""

    @st.composite
    def near(draw: st.DrawFn) -> bytes:
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 4))):
            how = draw(st.sampled_from(["flip", "cut", "insert", "set"]))
            at = draw(st.integers(0, max(len(data) - 1, 0)))
            if how == "flip" and data:
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif how == "cut":
                del data[at : at + draw(st.integers(1, 16))]
            elif how == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=8))
            elif data:
                data[at] = draw(st.integers(0, 255))
        return bytes(data)

    return st.one_of(near(), st.binary(max_size=64))


def send_framed(
    address: str, rpc: str, messages: list[bytes], token: str | None
) -> grpc.StatusCode:
    """One request of raw request bytes on the data port of the store at gRPC `address`
    (a Read of the first alone); the status of its first answer (a refused request's, or
    the call's: a live tail's first reply is OK), or of a Read once its replies are read."""
    transport = Transport(token=token) if token else PLAINTEXT
    method = DATA_PORT[rpc]
    sent = messages[:1] if rpc in SERVER_STREAMING else messages

    async def write() -> int:
        async with (
            asyncio.timeout(CALL_TIMEOUT_S),
            framed.connect(data_address_of(address), transport) as connection,
        ):
            call = await connection.call(method)
            for message in sent:
                await call.send_parts([message])
            await call.end()
            reply = await call.receive()
            while method is framing.READ and reply is not None:
                reply = await call.receive()
        if isinstance(reply, s.WriteReply) and reply.status == s.REFUSED:
            return reply.error.code
        return grpc.StatusCode.OK.value[0]

    try:
        code = asyncio.run(write())
    except CallError as error:
        code = error.code.value
    except TimeoutError:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return next(c for c in grpc.StatusCode if c.value[0] == code)


def send(address: str, rpc: str, messages: list[bytes], token: str | None) -> grpc.StatusCode:
    """One call with raw request bytes; the status it ended with."""
    if rpc in DATA_PORT:
        return send_framed(address, rpc, messages, token)
    service, method = rpc.split("/")
    path = f"/streamengine.v1.{service}/{method}"
    metadata = bearer(token) if token else None
    with grpc.insecure_channel(address) as channel:
        try:
            if rpc in STREAMING:
                streaming: grpc.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
                    path
                )
                call = streaming(iter(messages), timeout=CALL_TIMEOUT_S, metadata=metadata)
                next(iter(call), None)  # the first answer (a live tail goes on: enough)
                call.cancel()
            elif rpc in SERVER_STREAMING:
                reading: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(path)
                replies = reading(messages[0], timeout=CALL_TIMEOUT_S, metadata=metadata)
                if rpc in HELD_OPEN:
                    next(iter(replies), None)  # the first answer: it stays open after
                    replies.cancel()
                else:
                    for _ in replies:
                        pass
            else:
                unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(path)
                unary(messages[0], timeout=CALL_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def address_of(cluster: Cluster, victim: Victim, rpc: str) -> str:
    if rpc.startswith("Master/"):
        return cluster.master_address
    return victim.sealed.copy_set[0].address


CASES = [
    (rpc, caller)
    for rpc in sorted(RPC_NEEDS)
    for caller in ("token", "plaintext")
    if caller == "token" or rpc in READ_ONLY
]


@pytest.mark.parametrize(("rpc", "caller"), CASES, ids=[f"{r}-{c}" for r, c in CASES])
def test_mutated_messages_change_nothing_and_break_nothing(
    target: tuple[Cluster, Victim, str], rpc: str, caller: str
) -> None:
    cluster, victim, token = target
    seeds = [seed.SerializeToString() for seed in victim.seeds()[rpc]]
    if caller == "plaintext":
        # A plaintext caller may do anything the master's real grant allows: it gets
        # only the forged ones.
        seeds = [seed for seed in seeds if victim.driver.grant not in seed]
    assert seeds, rpc
    address = address_of(cluster, victim, rpc)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        seed = data.draw(st.sampled_from(seeds))
        count = data.draw(st.integers(1, 3)) if rpc in STREAMING else 1
        messages = [data.draw(mutated(seed)) for _ in range(count)]
        code = send(address, rpc, messages, token if caller == "token" else None)
        # UNKNOWN is what gRPC answers for an exception a handler did not turn into a
        # status: the servers must have an answer for everything.
        assert code != grpc.StatusCode.UNKNOWN, (rpc, messages)
        if caller == "token" and rpc not in _ANSWERED_TO_OTHERS:
            assert code in _REFUSALS, (rpc, code)

    fuzz()
    assert is_serving(address)


# What another tenant's read token gets, unless the bytes do not even parse.
_REFUSALS = {
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,  # a request that does not parse (grpc-core's own answer)
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Listings answer everyone (filtered); a stream of nothing but garbage may end cleanly.
_ANSWERED_TO_OTHERS = {
    "Master/ListTenants",
    "Master/ListStreams",
    "Master/GetClusterStatus",
    "SegmentStore/Write",
    "SegmentStore/Subscribe",
    # A batch answers each entry in its reply (refused as a WriterHeartbeat, a
    # RollSegment or a SealSegment is: test_authority_table.py); a lease session holds
    # nothing by itself.
    "Master/LeaseHeartbeat",
    "Master/RollSegments",
    "Master/SealSegments",
    "Master/HoldLeaseSession",
}


@pytest.mark.parametrize(
    "rpc",
    ["Master/CreateStream", "SegmentStore/Read", "SegmentStore/Write", "SegmentStore/Subscribe"],
)
def test_a_request_that_does_not_parse_is_invalid_argument(
    target: tuple[Cluster, Victim, str], rpc: str
) -> None:
    """Field number 0 is no protobuf: every kind of RPC says so, as bad input."""
    cluster, victim, _ = target
    assert send(address_of(cluster, victim, rpc), rpc, [b"\x00"], None) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
