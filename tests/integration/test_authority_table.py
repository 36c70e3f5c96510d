"""The security review as a table: every RPC of both services, called by every kind of
caller of a TLS cluster, answers exactly the status written below.

Callers: nobody (the CA alone), a token of another tenant (its admin), the victim
tenant's read, write, second write and admin tokens, a cluster admin (client.root), a
client certificate that is not an admin's, a store's certificate and the master's.
Each request is harmless whoever may make it (a stream that does not exist, a store id
that is not the caller's, a write without a grant), so a caller allowed through
authorization meets the domain's answer instead (NOT_FOUND, ALREADY_EXISTS, ...): a
cell says which check a call stopped at. One cluster for the module. Write, Read and
Subscribe are called on the stores' data port (docs/data-plane.md), whose hello is a
row of its own.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from streamengine.client import StreamClient
from streamengine.protocol import codec, framed, framing
from streamengine.protocol.auth import RPC_NEEDS
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.transport import CA_CERT, Transport, client_cert_paths
from streamengine.testing import Cluster, running_cluster
from streamengine.tools import certs
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.integration.authority_helpers import create_token_as

pytestmark = pytest.mark.security

m = master_pb2
s = segment_store_pb2
TIMEOUT_S = 5.0
CALLERS = (
    "nobody",
    "other tenant",
    "read",
    "write",
    "write 2",
    "tenant admin",
    "cluster admin",
    "client cert",
    "store cert",
    "master cert",
)
# Statuses, short: each cell of the table is one.
OK, U, P, N, B = "OK", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND", "INVALID_ARGUMENT"
SHORT = {OK: "OK", U: "U", P: "P", N: "N", B: "B"}  # B: bad input
# fmt: off
EXPECTED: dict[str, tuple[str, ...]] = {
    # Columns as CALLERS: nobody, other tenant, read, write, write 2, tenant admin,
    # cluster admin, client cert, store cert, master cert.
    # A store may register and heartbeat only as itself (the request names store0).
    "Master/RegisterStore":           (P, P, P, P, P, P, P, P, P, P),
    "Master/StoreHeartbeat":          (P, P, P, P, P, P, P, P, P, P),
    "Master/CreateTenant":            (P, P, P, P, P, P, OK, P, P, P),
    "Master/ListTenants":             (P, OK, OK, OK, OK, OK, OK, P, OK, OK),
    # victim/data as it is: the same stream again, answered as it stands.
    "Master/CreateStream":            (P, P, P, P, P, OK, OK, P, P, P),
    "Master/CreateStreams":           (P, P, P, P, P, OK, OK, P, P, P),
    "Master/ListStreams":             (P, OK, OK, OK, OK, OK, OK, P, OK, OK),
    "Master/DescribeStream":          (P, P, N, N, N, N, N, P, N, N),
    "Master/DeleteStream":            (P, P, P, P, P, N, N, P, P, P),
    "Master/UndeleteStream":          (P, P, P, P, P, N, N, P, P, P),
    "Master/UpdateStream":            (P, P, P, P, P, N, N, P, P, P),
    "Master/TrimStream":              (P, P, P, P, P, N, N, P, P, P),
    "Master/WriterHeartbeat":         (P, P, P, N, N, N, N, P, P, P),
    "Master/ReleaseLease":            (P, P, P, N, N, N, N, P, P, P),
    # A streaming call refuses a caller it cannot name at once (UNAUTHENTICATED).
    "Master/HoldLease":               (U, P, P, N, N, N, N, U, P, P),
    # Each entry is authorized as a WriterHeartbeat is (the cell: the entry's answer).
    "Master/LeaseHeartbeat":          (P, P, P, N, N, N, N, P, P, P),
    # A session holds nothing by itself: any caller it can name may open one.
    "Master/HoldLeaseSession":        (U, OK, OK, OK, OK, OK, OK, U, OK, OK),
    "Master/RollSegment":             (P, P, P, N, N, N, N, P, P, P),
    # Each entry is authorized as a RollSegment is (the cell: the entry's answer).
    "Master/RollSegments":            (P, P, P, N, N, N, N, P, P, P),
    "Master/ListSegments":            (P, P, N, N, N, N, N, P, N, N),
    "Master/SealSegment":             (P, P, P, N, N, N, N, P, P, P),
    # Each entry is authorized as a SealSegment is (the cell: the entry's answer).
    "Master/SealSegments":            (P, P, P, N, N, N, N, P, P, P),
    "Master/ReportReplica":           (P, P, N, N, N, N, N, P, N, N),
    "Master/GetClusterStatus":        (P, OK, OK, OK, OK, OK, OK, P, OK, OK),
    "Master/DrainStore":              (P, P, P, P, P, P, N, P, P, P),
    "Master/Rebalance":               (P, P, P, P, P, P, OK, P, P, P),
    "Master/RequestRoll":             (P, P, P, N, N, N, N, P, P, P),
    # A lifetime of 1 ms is refused once the caller may create tokens.
    "Master/CreateToken":             (P, P, P, P, P, P, B, P, P, P),
    "Master/RevokeToken":             (P, P, P, P, P, P, OK, P, P, P),
    "Master/RotateSigningKey":        (P, P, P, P, P, P, OK, P, P, P),
    "Master/ListSigningKeys":         (P, P, P, P, P, P, OK, P, P, P),
    "Master/RevokeCertificate":       (P, P, P, P, P, P, B, P, P, P),
    "Master/ListRevokedCertificates": (P, P, P, P, P, P, OK, P, P, P),
    # Without a grant of the master's, nobody writes or seals (a cluster admin neither).
    # Write, on the data port: a Write stream answers each request (the cell: the
    # request's answer, as a refused one says it); a caller it cannot name is refused
    # at the connection's hello (UNAUTHENTICATED).
    "SegmentStore/Write":             (U, P, P, P, P, P, P, U, P, P),
    "SegmentStore/Seal":              (P, P, P, P, P, P, P, P, P, P),
    # Read, on the data port: a caller it cannot name is refused at the hello.
    "SegmentStore/Read":              (U, P, OK, OK, OK, OK, OK, U, OK, OK),
    # Subscribe, on the data port: a call of one tail and a multiplexed call's tail
    # answer alike (the cell: the first reply, or the call's or the tail's end).
    "SegmentStore/Subscribe":         (U, P, OK, OK, OK, OK, OK, U, OK, OK),
    # The master alone copies and deletes (an empty source is refused as bad input).
    "SegmentStore/CopySegment":       (P, P, P, P, P, P, P, P, P, B),
    "SegmentStore/Digest":            (P, P, OK, OK, OK, OK, OK, P, OK, OK),
    "SegmentStore/Delete":            (P, P, P, P, P, P, P, P, P, OK),
    "SegmentStore/GetSegmentState":   (P, P, OK, OK, OK, OK, OK, P, OK, OK),
    "SegmentStore/ListSegmentRecords": (P, P, P, P, P, P, P, P, P, OK),
}
# The data port itself: who gets past the hello of a connection.
DATA_PORT_EXPECTED: dict[str, tuple[str, ...]] = {
    "data port/Hello":                (U, OK, OK, OK, OK, OK, OK, U, OK, OK),
}
# fmt: on
DATA_PORT_RPCS = ("SegmentStore/Write", "SegmentStore/Read", "SegmentStore/Subscribe")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("authority-table")
    with running_cluster(root, stores=3, master_args=["--lease-ms", "1000"], tls=True) as running:
        yield running


@pytest.fixture(scope="module")
def transports(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Transport]:
    """How each caller reaches the servers."""
    local = cluster.certs
    assert local is not None
    admin = cluster.client_transport
    ca = (local.tenant_dir / CA_CERT).read_bytes()
    analyst_dir = tmp_path_factory.mktemp("analyst")
    (analyst_dir / CA_CERT).write_bytes(ca)
    certs.create_client(analyst_dir, "analyst", ca_key_path=local.ca_dir / certs.CA_KEY)
    cert_path, key_path = client_cert_paths(analyst_dir, "analyst")

    def token(tenant: str, role: m.TokenRole.ValueType) -> Transport:
        return Transport(ca, token=create_token_as(admin, cluster.master_address, tenant, role))

    return {
        "nobody": Transport(ca),
        "other tenant": token("evil", m.TOKEN_ROLE_ADMIN),
        "read": token("victim", m.TOKEN_ROLE_READ),
        "write": token("victim", m.TOKEN_ROLE_WRITE),
        "write 2": token("victim", m.TOKEN_ROLE_WRITE),
        "tenant admin": token("victim", m.TOKEN_ROLE_ADMIN),
        "cluster admin": admin,
        "client cert": Transport(ca, cert_path.read_bytes(), key_path.read_bytes()),
        "store cert": Transport.for_node(local.node_dir("store1")),
        "master cert": Transport.for_node(local.node_dir("master")),
    }


@pytest.fixture(scope="module")
def sealed(cluster: Cluster) -> entry_pb2.Segment:
    """A sealed segment of victim/data, written by a cluster admin."""

    async def write() -> None:
        async with StreamClient(cluster.master_address, certs_dir=cluster.admin_certs_dir) as c:
            await c.create_stream("victim/data", replicas=3, write_quorum=2)
            async with c.writer("victim/data") as writer:
                await writer.append_batch([b"a", b"b"])
            await c.seal("victim/data")

    asyncio.run(write())
    with cluster.client_transport.channel(cluster.master_address) as channel:
        reply = master_pb2_grpc.MasterStub(channel).ListSegments(
            m.ListSegmentsRequest(stream="victim/data"), timeout=TIMEOUT_S
        )
    return reply.segments[0]


def calls(cluster: Cluster, sealed: entry_pb2.Segment) -> dict[str, Callable[[Any], object]]:
    """Each RPC as a function of a channel to the right server."""
    nope = "victim/nope"
    segment = sealed.id
    unknown = entry_pb2.SegmentId(stream_id=1 << 40, epoch=1)
    write = codec.write_request(
        [StoredEntry.make(sealed.final_index + 1, EntryKind.EVENT, segment.epoch, b"x")],
        segment=segment,
        writer_epoch=segment.epoch,
    )

    def master(method: str, request: Any, streamed: bool = False) -> Callable[[Any], object]:
        def call(channel: Any) -> object:
            reply = getattr(master_pb2_grpc.MasterStub(channel), method)(request, timeout=TIMEOUT_S)
            return next(iter(reply)) if streamed else reply

        return call

    def store(method: str, request: Any) -> Callable[[Any], object]:
        def call(channel: Any) -> object:
            stub = store_grpc.SegmentStoreStub(channel)
            return getattr(stub, method)(request, timeout=TIMEOUT_S)

        return call

    def hold_lease_session(channel: Any) -> object:
        # A session of its own per caller: one already held open is refused as such.
        request = m.HoldLeaseSessionRequest(session=os.urandom(16))
        reply = master_pb2_grpc.MasterStub(channel).HoldLeaseSession(request, timeout=TIMEOUT_S)
        return next(iter(reply))

    return {
        "Master/RegisterStore": master("RegisterStore", m.RegisterStoreRequest(store_id="store0")),
        "Master/StoreHeartbeat": master(
            "StoreHeartbeat", m.StoreHeartbeatRequest(store_id="store0")
        ),
        "Master/CreateTenant": master("CreateTenant", m.CreateTenantRequest(tenant="victim")),
        "Master/ListTenants": master("ListTenants", m.ListTenantsRequest()),
        "Master/CreateStream": master(
            "CreateStream",
            m.CreateStreamRequest(
                name="victim/data", policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2)
            ),
        ),
        "Master/CreateStreams": master(
            "CreateStreams",
            m.CreateStreamsRequest(
                streams=[
                    m.CreateStreamRequest(
                        name="victim/data",
                        policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
                    )
                ]
            ),
        ),
        "Master/ListStreams": master("ListStreams", m.ListStreamsRequest()),
        "Master/DescribeStream": master("DescribeStream", m.DescribeStreamRequest(name=nope)),
        "Master/DeleteStream": master("DeleteStream", m.DeleteStreamRequest(name=nope)),
        "Master/UndeleteStream": master("UndeleteStream", m.UndeleteStreamRequest(name=nope)),
        "Master/UpdateStream": master("UpdateStream", m.UpdateStreamRequest(name=nope)),
        "Master/TrimStream": master("TrimStream", m.TrimStreamRequest(name=nope)),
        "Master/WriterHeartbeat": master(
            "WriterHeartbeat", m.WriterHeartbeatRequest(stream=nope, client_id="table")
        ),
        "Master/ReleaseLease": master(
            "ReleaseLease", m.ReleaseLeaseRequest(stream=nope, client_id="table", epoch=1)
        ),
        "Master/HoldLease": master(
            "HoldLease", m.HoldLeaseRequest(stream=nope, client_id="table", epoch=1), True
        ),
        # One entry for a stream nobody has: its answer's code is the row's cell.
        "Master/LeaseHeartbeat": master(
            "LeaseHeartbeat",
            m.LeaseHeartbeatRequest(
                leases=[m.WriterHeartbeatRequest(stream=nope, client_id="table")]
            ),
        ),
        "Master/HoldLeaseSession": hold_lease_session,
        "Master/RollSegment": master(
            "RollSegment", m.RollSegmentRequest(stream=nope, client_id="table", epoch=1)
        ),
        "Master/RollSegments": master(
            "RollSegments",
            m.RollSegmentsRequest(
                rolls=[m.RollSegmentRequest(stream=nope, client_id="table", epoch=1)]
            ),
        ),
        "Master/ListSegments": master("ListSegments", m.ListSegmentsRequest(stream=nope)),
        "Master/SealSegment": master(
            "SealSegment",
            m.SealSegmentRequest(stream=nope, segment_epoch=1, writer_epoch=2, client_id="table"),
        ),
        "Master/SealSegments": master(
            "SealSegments",
            m.SealSegmentsRequest(
                seals=[
                    m.SealSegmentRequest(
                        stream=nope, segment_epoch=1, writer_epoch=2, client_id="table"
                    )
                ]
            ),
        ),
        "Master/ReportReplica": master(
            "ReportReplica", m.ReportReplicaRequest(stream=nope, segment_epoch=1)
        ),
        "Master/GetClusterStatus": master("GetClusterStatus", m.GetClusterStatusRequest()),
        "Master/DrainStore": master("DrainStore", m.DrainStoreRequest(store_id="nope")),
        "Master/Rebalance": master("Rebalance", m.RebalanceRequest(dry_run=True)),
        "Master/RequestRoll": master("RequestRoll", m.RequestRollRequest(stream=nope)),
        "Master/CreateToken": master(
            "CreateToken", m.CreateTokenRequest(tenant="victim", role=m.TOKEN_ROLE_ADMIN, ttl_ms=1)
        ),
        "Master/RevokeToken": master("RevokeToken", m.RevokeTokenRequest(token_id="0" * 15)),
        # A cluster admin rotates once per run: harmless (the old key verifies on).
        "Master/RotateSigningKey": master("RotateSigningKey", m.RotateSigningKeyRequest()),
        "Master/ListSigningKeys": master("ListSigningKeys", m.ListSigningKeysRequest()),
        # No serial: bad input once the caller may revoke.
        "Master/RevokeCertificate": master(
            "RevokeCertificate", m.RevokeCertificateRequest(certificate=m.RevokedCertificate())
        ),
        "Master/ListRevokedCertificates": master(
            "ListRevokedCertificates", m.ListRevokedCertificatesRequest()
        ),
        "SegmentStore/Write": lambda _: write,  # the request: on the data port
        "SegmentStore/Seal": store(
            "Seal", s.SealRequest(segment=segment, new_epoch=segment.epoch + 1)
        ),
        "SegmentStore/Read": lambda _: s.ReadRequest(segment=segment, from_index=1),
        "SegmentStore/Subscribe": lambda _: s.SubscribeRequest(  # on the data port
            start=s.SubscribeStart(segment=segment, from_index=1)
        ),
        "SegmentStore/CopySegment": store(
            "CopySegment",
            s.CopySegmentRequest(segment=unknown, source_address="", final_index=1, fence=2),
        ),
        "SegmentStore/Digest": store("Digest", s.DigestRequest(segment=segment)),
        "SegmentStore/Delete": store("Delete", s.DeleteRequest(segment=unknown)),
        "SegmentStore/GetSegmentState": store(
            "GetSegmentState", s.GetSegmentStateRequest(segment=segment)
        ),
        "SegmentStore/ListSegmentRecords": store(
            "ListSegmentRecords", s.ListSegmentRecordsRequest()
        ),
    }


STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def data_port_status(transport: Transport, data_address: str, request: Any) -> str:
    """The answer of a store's data port to a Write stream of `request`, a Read of it
    (its replies all read) or a Subscribe of it, or (None) a connection's hello alone."""

    async def write() -> str:
        async with framed.connect(data_address, transport) as connection:
            if request is None:
                return OK
            if isinstance(request, s.SubscribeRequest):
                return await _subscribe_status(connection, request)
            if isinstance(request, s.ReadRequest):
                read = await connection.call(framing.READ)
                await read.send(request)
                await read.end()
                while await read.receive() is not None:
                    pass
                return OK
            call = await connection.call(framing.WRITE)
            await call.send(request)
            await call.end()
            reply = await call.receive()
            assert isinstance(reply, s.WriteReply)
            return STATUS_NAMES[reply.error.code] if reply.status == s.REFUSED else OK

    try:
        return asyncio.run(write())
    except CallError as error:
        return error.code.name


async def _subscribe_status(connection: framed.DataConnection, request: s.SubscribeRequest) -> str:
    """How a Subscribe answers `request`, checked to be how a multiplexed call answers
    the same start as its tail 1 (in a `TailEnded`, the call going on)."""
    many = s.SubscribeRequest()
    many.CopyFrom(request)
    many.start.tail = 1
    single = await _first_answer(connection, request)
    multiplexed = await _first_answer(connection, many)
    assert multiplexed == single, f"a multiplexed tail answered {multiplexed}, not {single}"
    return single


async def _first_answer(connection: framed.DataConnection, request: s.SubscribeRequest) -> str:
    """The status of a Subscribe's first reply (OK for a position), or of its end."""
    call = await connection.call(framing.SUBSCRIBE)
    try:
        await call.send(request)
        reply = await call.receive()
    except CallError as error:
        return error.code.name
    finally:
        call.cancel()
    assert isinstance(reply, s.SubscribeReply), "a Subscribe ended without a word"
    if reply.WhichOneof("message") == "ended":
        assert reply.tail == 1
        return STATUS_NAMES[reply.ended.code]
    return OK


def status_of(call: Callable[[Any], object], channel: Any) -> str:
    try:
        answer = call(channel)
    except grpc.RpcError as error:
        return str(error.code().name)
    if isinstance(answer, m.LeaseHeartbeatReply):  # a batch answers per entry
        return STATUS_NAMES[answer.leases[0].code]
    if isinstance(answer, m.RollSegmentsReply):
        return STATUS_NAMES[answer.rolls[0].code]
    if isinstance(answer, m.SealSegmentsReply):
        return STATUS_NAMES[answer.seals[0].code]
    if isinstance(answer, list) and answer and isinstance(answer[0], s.WriteReply):
        # A Write stream answers per request.
        reply = answer[0]
        return STATUS_NAMES[reply.error.code] if reply.status == s.REFUSED else OK
    return OK


def test_every_rpc_answers_every_caller_as_the_table_says(
    cluster: Cluster, transports: dict[str, Transport], sealed: entry_pb2.Segment
) -> None:
    table = calls(cluster, sealed)
    assert set(table) == set(RPC_NEEDS), "every RPC is called"
    store_address = sealed.copy_set[0].address
    store_data_address = sealed.copy_set[0].data_address
    seen: dict[str, tuple[str, ...]] = {}
    for caller in CALLERS:
        transport = transports[caller]
        with (
            transport.channel(cluster.master_address) as master,
            transport.channel(store_address) as store,
        ):
            for rpc, call in sorted(table.items()):
                if rpc in DATA_PORT_RPCS:
                    answer = data_port_status(transport, store_data_address, call(None))
                else:
                    channel = master if rpc.startswith("Master/") else store
                    answer = status_of(call, channel)
                seen[rpc] = (*seen.get(rpc, ()), answer)
        hello = data_port_status(transport, store_data_address, None)
        seen["data port/Hello"] = (*seen.get("data port/Hello", ()), hello)
    expected = EXPECTED | DATA_PORT_EXPECTED
    wrong = [rpc for rpc in sorted(seen) if seen[rpc] != expected.get(rpc)]
    # The rows as they are, to paste where a change is meant (and reviewed).
    assert not wrong, "\n".join(
        f"    {rpc!r}: ({', '.join(SHORT.get(c, repr(c)) for c in seen[rpc])})," for rpc in wrong
    )
    assert set(EXPECTED) == set(RPC_NEEDS), "every RPC is in the table"
