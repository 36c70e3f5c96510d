"""S15, bad input: every RPC of the master and of the stores gets requests it must
refuse, while the normal workload runs (FAULTS.md §6.3, C15).

Three kinds of call, each recorded in the history as a `bad` record (`kind`, `case`,
`server`, `method`, `expected`, `got`, `details`):

- `row`: a table of requests with their exact expected status (`ROWS`): an event one
  byte over the limit, a batch one entry over, an unknown stream or tenant, a stale
  epoch, a write below a sealed segment's fence, and the like, built against the live
  cluster (real stream ids, sealed segments and their fences).
- `random`: random bytes that do not parse as the method's request, to every RPC:
  INVALID_ARGUMENT, exactly.
- `mutated`: a well-formed request of the fuzz namespace (names, ids and epochs no real
  object has) with a few bytes flipped, replaced, cut or repeated, to every RPC that
  cannot be made to disturb the cluster legitimately (`NOT_MUTATED`): if it no longer
  parses, INVALID_ARGUMENT; if it still does, any status a server gives on purpose
  (never UNKNOWN or INTERNAL, and an answer within the deadline).

Before and after, a `digest` record: the master's metadata of the workload's namespace
(tenants, streams and their policies, stores) and, per store, the digest of every sealed
segment of the workload it holds. They must be equal, and every server must still serve
(a `serving` record). The checker's C15 reads these records.

Security rows (issue #14): writes and seals without a grant, under a forged one, at the
last epoch (which would wedge a segment), rolls and seals at the master without the
grant of their epoch: PERMISSION_DENIED, nothing changed. S15 runs on a TLS cluster,
where rows and fuzz call as a tenant (a write token of the stream's tenant), and rows
with a `client` of their own (`Callers`) check who may call at all: plaintext and
wrong-CA clients get no connection, forged and revoked tokens are refused, another
tenant's token reaches nothing of this tenant, a read token writes nothing, and no
tenant may do what only an admin, the master or a store may (drain, rebalance, store
heartbeats, tokens, replica deletes and copies). On a plaintext cluster (S14's S15
package) those rows are skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from streamengine.master.state import STORE_HEARTBEAT_MS_MAX
from streamengine.protocol import codec, framed, framing
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.limits import (
    EPOCH_MAX,
    EVENT_BYTES_MAX,
    LEASE_BATCH_ENTRIES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
    WRITE_REQUEST_PARTS_MAX,
)
from streamengine.protocol.signing import SigningKey
from streamengine.protocol.transport import Transport
from streamengine.testing import is_serving
from streamengine.tools.certs import create_local_certs
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.faults.channels import certs_dir, harness_transport, open_channel

Code = grpc.StatusCode
m, s = master_pb2, segment_store_pb2
CALL_TIMEOUT_S = 5.0
# Ids of the fuzz namespace: no real stream, segment, tenant or store has them, and a
# few flipped bits do not make them one (a real stream id is small; these are not).
FUZZ_STREAM_ID = 987_654_321
FUZZ_EPOCH = 2_000_000_000
FUZZ_STREAM = "fuzzns/none"
FUZZ_STORE = "zz-nobody-7f3"
# Statuses a server never gives on purpose: an unhandled error, or none at all.
UNCLEAR = {"UNKNOWN", "INTERNAL"}


@dataclass(frozen=True)
class Segment:
    """A segment of the workload as the master lists it, with one replica's address."""

    stream: str
    stream_id: int
    epoch: int
    final_index: int
    address: str
    fence: int = 0  # of that replica (sealed segments)
    data_address: str = ""  # where that replica's store serves Write (its data plane)

    @property
    def pb(self) -> entry_pb2.SegmentId:
        return entry_pb2.SegmentId(stream_id=self.stream_id, epoch=self.epoch,
                                   stream=self.stream)


@dataclass(frozen=True)
class Live:
    """What rows are built against: a sealed and an open segment of the workload."""

    sealed: Segment
    open: Segment


@dataclass(frozen=True)
class Row:
    case: str
    server: str  # "master" | "store": a store holding the row's segment
    method: str
    request: Callable[[Live], Message | list[Message]]  # a list: a client stream
    expected: Code
    # Who calls (`Callers`): security rows bring their own.
    client: str = "harness"
    # The store row's target: the sealed or the open segment's replica.
    segment: str = "sealed"
    # On a TLS cluster, where the harness calls as a cluster admin: what an admin gets
    # when it is refused before its request is looked at (member-only RPCs).
    expected_tls: Code | None = None
    # A security row: only a TLS cluster checks who calls.
    tls_only: bool = False

    def expected_on(self, tls: bool) -> Code:
        return self.expected_tls if tls and self.expected_tls is not None else self.expected


# Who makes a row's calls, by name (`Row.client`). "harness": the harness's own transport
# (plaintext, or the cluster's admin over TLS). The others exist on TLS clusters only.
HARNESS = "harness"
TENANT = "tenant"  # a write token of the tenant of the row's stream
PLAINTEXT = "plaintext"  # no TLS at all
WRONG_CA = "wrong-ca"  # TLS trusting another CA (and holding that CA's admin certificate)
FORGED_TOKEN = "forged-token"
REVOKED_TOKEN = "revoked-token"  # a write token of the stream's tenant, revoked
OTHER_TENANT = "other-tenant"  # a write token of another tenant
READ_TOKEN = "read-token"  # a read-only token of the stream's tenant


@dataclass
class Callers:
    """How each client name makes its channels in this run (`callers`)."""

    tls: bool
    # (client name, tenant of the row's stream) -> transport (TLS clusters).
    transports: dict[tuple[str, str], Transport]
    # When the revoked tokens were revoked (monotonic seconds).
    revoked_at: float = 0.0
    opened: dict[tuple[str, str, str], grpc.Channel] = field(default_factory=dict)

    def channel(self, client: str, tenant: str, address: str) -> grpc.Channel:
        key = (client, tenant, address)
        if key not in self.opened:
            if client == HARNESS:
                self.opened[key] = open_channel(address)
            elif not self.tls:
                raise AssertionError(f"{client} calls on TLS clusters only")
            else:
                self.opened[key] = self.transports[(client, tenant)].channel(address)
        return self.opened[key]

    def transport(self, client: str, tenant: str) -> Transport:
        """What `channel` dials with, for a connection of the data plane."""
        if client == HARNESS:
            return harness_transport()
        if not self.tls:
            raise AssertionError(f"{client} calls on TLS clusters only")
        return self.transports[(client, tenant)]

    def close(self) -> None:
        for channel in self.opened.values():
            channel.close()
        self.opened.clear()


def callers(master: str, tenants: list[str], scratch: Path) -> Callers:
    """The run's callers: on a TLS cluster, tokens made by the harness (the cluster's
    admin) for each tenant, one of them revoked at once, and another CA's admin."""
    admin_dir = certs_dir()
    if admin_dir is None:
        return Callers(False, {})
    other_ca = create_local_certs(scratch / "other-ca")
    transports: dict[tuple[str, str], Transport] = {}
    with open_channel(master) as channel:
        stub = master_pb2_grpc.MasterStub(channel)

        def token(tenant: str, role: m.TokenRole.ValueType) -> m.CreateTokenReply:
            reply: m.CreateTokenReply = stub.CreateToken(
                m.CreateTokenRequest(tenant=tenant, role=role), timeout=CALL_TIMEOUT_S)
            return reply

        writes = {tenant: token(tenant, m.TOKEN_ROLE_WRITE).token for tenant in tenants}
        for tenant in tenants:
            other = next(t for t in tenants if t != tenant)
            revoked = token(tenant, m.TOKEN_ROLE_WRITE)
            stub.RevokeToken(m.RevokeTokenRequest(token_id=revoked.token_id),
                             timeout=CALL_TIMEOUT_S)
            made = {
                TENANT: writes[tenant],
                OTHER_TENANT: writes[other],
                READ_TOKEN: token(tenant, m.TOKEN_ROLE_READ).token,
                REVOKED_TOKEN: revoked.token,
                FORGED_TOKEN: "forged." + writes[tenant][::-1],
            }
            for name, value in made.items():
                transports[(name, tenant)] = Transport.for_client(admin_dir, value)
            transports[(PLAINTEXT, tenant)] = Transport()
            transports[(WRONG_CA, tenant)] = Transport.for_client(other_ca.client_dir)
    return Callers(True, transports, revoked_at=time.monotonic())


def entry(index: int, epoch: int, payload: bytes = b"x",
          kind: EntryKind = EntryKind.EVENT) -> StoredEntry:
    return StoredEntry.make(index, kind, epoch, payload)


def below_fence(live: Live, entries: list[StoredEntry]) -> s.WriteRequest:
    """A write one epoch below a sealed replica's fence, past its bridge."""
    sealed = live.sealed
    return codec.write_request(entries, segment=sealed.pb, writer_epoch=sealed.fence - 1,
                               request_id=1)


def _past_bridge(live: Live, count: int = 1, size: int = 1) -> list[StoredEntry]:
    first = live.sealed.final_index + 1
    return [entry(first + n, live.sealed.fence - 1, b"b" * size) for n in range(count)]


P = entry_pb2.ReplicationPolicy

ROWS: list[Row] = [
    # ---- the master ----
    Row("bad stream name", "master", "CreateStream", lambda live: m.CreateStreamRequest(
        name="no-slash", policy=P(replicas=3, write_quorum=2), create_tenant=True),
        Code.INVALID_ARGUMENT),
    Row("unknown tenant", "master", "CreateStream", lambda live: m.CreateStreamRequest(
        name="nobodyhere/x", policy=P(replicas=3, write_quorum=2)), Code.NOT_FOUND),
    Row("existing stream, other policy", "master", "CreateStream",
        lambda live: m.CreateStreamRequest(name=live.open.stream,
                                           policy=P(replicas=3, write_quorum=3)),
        Code.ALREADY_EXISTS),
    Row("W > N", "master", "CreateStream", lambda live: m.CreateStreamRequest(
        name="fuzzns/x", policy=P(replicas=2, write_quorum=3), create_tenant=True),
        Code.INVALID_ARGUMENT),
    Row("bad tenant name", "master", "CreateTenant",
        lambda live: m.CreateTenantRequest(tenant="a/b"), Code.INVALID_ARGUMENT),
    Row("unknown stream", "master", "DescribeStream",
        lambda live: m.DescribeStreamRequest(name=FUZZ_STREAM), Code.NOT_FOUND),
    Row("segments of an unknown stream", "master", "ListSegments",
        lambda live: m.ListSegmentsRequest(stream=FUZZ_STREAM), Code.NOT_FOUND),
    Row("delete an unknown stream", "master", "DeleteStream",
        lambda live: m.DeleteStreamRequest(name=FUZZ_STREAM), Code.NOT_FOUND),
    Row("lease of an unknown stream", "master", "WriterHeartbeat",
        lambda live: m.WriterHeartbeatRequest(stream=FUZZ_STREAM, client_id="bad"),
        Code.NOT_FOUND),
    Row("heartbeat with an epoch never granted", "master", "WriterHeartbeat",
        lambda live: m.WriterHeartbeatRequest(stream=live.open.stream, client_id="bad",
                                              epoch=FUZZ_EPOCH), Code.INVALID_ARGUMENT),
    Row("heartbeat with a lease secret longer than any the master keeps", "master",
        "WriterHeartbeat",
        lambda live: m.WriterHeartbeatRequest(stream=live.open.stream, client_id="bad",
                                              lease_secret=b"x" * 65), Code.INVALID_ARGUMENT),
    # A writer draws its own secret: one too short to stay unguessed wins nothing.
    Row("heartbeat with a lease secret too short to be unguessed", "master",
        "WriterHeartbeat",
        lambda live: m.WriterHeartbeatRequest(stream=live.open.stream, client_id="bad",
                                              lease_secret=b"x" * 8), Code.INVALID_ARGUMENT),
    # Only the holder of an epoch acts under it, proved by the master's grant of it (or
    # a cluster admin, who is then refused the stale epoch itself).
    Row("roll by a stale leader, without its grant", "master", "RollSegment",
        lambda live: m.RollSegmentRequest(stream=live.open.stream, client_id="bad",
                                          epoch=live.sealed.epoch),
        Code.PERMISSION_DENIED, expected_tls=Code.FAILED_PRECONDITION),
    Row("more rolls in one batch than the bound", "master", "RollSegments",
        lambda live: m.RollSegmentsRequest(rolls=[m.RollSegmentRequest(
            stream=live.open.stream, client_id="bad", epoch=live.open.epoch)]
            * (LEASE_BATCH_ENTRIES_MAX + 1)), Code.INVALID_ARGUMENT),
    Row("seal with a stale epoch, without its grant", "master", "SealSegment",
        lambda live: m.SealSegmentRequest(stream=live.sealed.stream,
                                          segment_epoch=live.open.epoch,
                                          writer_epoch=live.sealed.epoch, final_index=1),
        Code.PERMISSION_DENIED, expected_tls=Code.FAILED_PRECONDITION),
    Row("more seals in one batch than the bound", "master", "SealSegments",
        lambda live: m.SealSegmentsRequest(seals=[m.SealSegmentRequest(
            stream=live.sealed.stream, segment_epoch=live.open.epoch,
            writer_epoch=live.sealed.epoch, final_index=1)] * (LEASE_BATCH_ENTRIES_MAX + 1)),
        Code.INVALID_ARGUMENT),
    Row("drain an unknown store", "master", "DrainStore",
        lambda live: m.DrainStoreRequest(store_id=FUZZ_STORE), Code.NOT_FOUND),
    Row("register a store without an id", "master", "RegisterStore",
        lambda live: m.RegisterStoreRequest(address="127.0.0.1:9"), Code.INVALID_ARGUMENT,
        expected_tls=Code.PERMISSION_DENIED),
    Row("register a store without host:port", "master", "RegisterStore",
        lambda live: m.RegisterStoreRequest(store_id=FUZZ_STORE, address="x"),
        Code.INVALID_ARGUMENT, expected_tls=Code.PERMISSION_DENIED),
    # ---- the stores ----
    # A store takes writes and seals only under the master's grant of their epoch: one
    # without a grant is refused before its content is looked at, unless its shape
    # alone is wrong (an epoch no grant can have, too many entries).
    Row("an event one byte over the limit, without a grant", "store", "Write",
        lambda live: [below_fence(live, [entry(live.sealed.final_index + 1,
                                               live.sealed.fence - 1,
                                               b"o" * (EVENT_BYTES_MAX + 1))])],
        Code.PERMISSION_DENIED),
    Row("a batch one entry over the limit", "store", "Write",
        lambda live: [below_fence(live, _past_bridge(live, WRITE_BATCH_ENTRIES_MAX + 1))],
        Code.INVALID_ARGUMENT),
    Row("a message of segments' batches one part over the limit", "store", "Write",
        lambda live: [s.WriteRequest(
            parts=[below_fence(live, [])] * (WRITE_REQUEST_PARTS_MAX + 1))],
        Code.INVALID_ARGUMENT),
    Row("a message of segments' batches one entry over the limit in all", "store", "Write",
        lambda live: [s.WriteRequest(parts=[
            below_fence(live, _past_bridge(live, WRITE_BATCH_ENTRIES_MAX // 2 + 1))] * 2)],
        Code.INVALID_ARGUMENT),
    Row("a part of a message below the fence, without a grant", "store", "Write",
        lambda live: [s.WriteRequest(parts=[below_fence(live, _past_bridge(live))])],
        Code.PERMISSION_DENIED),
    Row("an entry whose crc does not match, without a grant", "store", "Write",
        lambda live: [below_fence(live, [_bad_crc(entry(live.sealed.final_index + 1,
                                                        live.sealed.fence - 1))])],
        Code.PERMISSION_DENIED),
    Row("value lengths that do not add up to the packed values", "store", "Write",
        lambda live: [_lengths_off(below_fence(live, _past_bridge(live, 2)))],
        Code.INVALID_ARGUMENT),
    Row("a write below the fence (stale epoch), without a grant", "store", "Write",
        lambda live: [below_fence(live, _past_bridge(live))], Code.PERMISSION_DENIED),
    Row("a seal below the fence (stale epoch), without a grant", "store", "Seal",
        lambda live: s.SealRequest(segment=live.sealed.pb, new_epoch=live.sealed.fence - 1),
        Code.PERMISSION_DENIED),
    Row("a seal at the last epoch without a grant (it would wedge the segment)", "store",
        "Seal", lambda live: s.SealRequest(segment=live.open.pb, new_epoch=EPOCH_MAX),
        Code.PERMISSION_DENIED, segment="open"),
    Row("a seal at the last epoch under a forged grant", "store", "Seal",
        lambda live: s.SealRequest(segment=live.open.pb, new_epoch=EPOCH_MAX,
                                   grant=_forged_grant(live.open, EPOCH_MAX)),
        Code.PERMISSION_DENIED, segment="open"),
    Row("a write under a forged grant", "store", "Write",
        lambda live: [codec.write_request([entry(1, live.open.epoch, b"forged")],
                                          segment=live.open.pb, writer_epoch=live.open.epoch,
                                          request_id=1,
                                          grant=_forged_grant(live.open, live.open.epoch))],
        Code.PERMISSION_DENIED, segment="open"),
    Row("a seal at epoch 0", "store", "Seal",
        lambda live: s.SealRequest(segment=live.open.pb, new_epoch=0),
        Code.INVALID_ARGUMENT, segment="open"),
    Row("a read of a segment not held", "store", "Read",
        lambda live: s.ReadRequest(segment=_fuzz_segment(), from_index=1), Code.NOT_FOUND),
    Row("a read without a segment id", "store", "Read",
        lambda live: s.ReadRequest(from_index=1), Code.INVALID_ARGUMENT),
    Row("the state of a segment not held", "store", "GetSegmentState",
        lambda live: s.GetSegmentStateRequest(segment=_fuzz_segment()), Code.NOT_FOUND),
    Row("the digest of a segment not held", "store", "Digest",
        lambda live: s.DigestRequest(segment=_fuzz_segment()), Code.NOT_FOUND),
    Row("a copy without a source", "store", "CopySegment",
        lambda live: s.CopySegmentRequest(segment=_fuzz_segment(), final_index=3),
        Code.INVALID_ARGUMENT, expected_tls=Code.PERMISSION_DENIED),
    Row("a subscription without a start", "store", "Subscribe",
        lambda live: [s.SubscribeRequest(keepalive=s.Keepalive(sent_at_ms=1))],
        Code.INVALID_ARGUMENT),
    # ---- who calls (TLS clusters) ----
    # Nobody without the cluster's CA gets a connection; a token is checked before the
    # request; a tenant reaches its own streams only, within its token's role, and
    # never what only the master, a store or an admin may do. Rows that would change
    # the workload's data or metadata if they were not refused are here on purpose:
    # the digests before and after (C15) would show it.
    *(Row(f"{who} calling the {server}", server, method, request, Code.UNAVAILABLE,
          client=client, tls_only=True)
      for who, client in (("a plaintext client", PLAINTEXT),
                          ("a client trusting another CA", WRONG_CA))
      for server, method, request in (
          ("master", "ListStreams", lambda live: m.ListStreamsRequest()),
          ("store", "Read", lambda live: s.ReadRequest(segment=live.sealed.pb,
                                                        from_index=1)))),
    *(Row(f"{who} at the {server}", server, method, request, Code.UNAUTHENTICATED,
          client=client, tls_only=True)
      for who, client in (("a forged token", FORGED_TOKEN), ("a revoked token", REVOKED_TOKEN))
      for server, method, request in (
          ("master", "DescribeStream",
           lambda live: m.DescribeStreamRequest(name=live.sealed.stream)),
          ("store", "Read", lambda live: s.ReadRequest(segment=live.sealed.pb,
                                                        from_index=1)))),
    Row("another tenant's token describing the stream", "master", "DescribeStream",
        lambda live: m.DescribeStreamRequest(name=live.sealed.stream),
        Code.PERMISSION_DENIED, client=OTHER_TENANT, tls_only=True),
    Row("another tenant's token deleting the stream", "master", "DeleteStream",
        lambda live: m.DeleteStreamRequest(name=live.sealed.stream),
        Code.PERMISSION_DENIED, client=OTHER_TENANT, tls_only=True),
    Row("another tenant's token reading a replica", "store", "Read",
        lambda live: s.ReadRequest(segment=live.sealed.pb, from_index=1),
        Code.PERMISSION_DENIED, client=OTHER_TENANT, tls_only=True),
    Row("a read token creating a stream", "master", "CreateStream",
        lambda live: m.CreateStreamRequest(name=live.sealed.stream.split("/")[0] + "/byreader",
                                           policy=P(replicas=3, write_quorum=2)),
        Code.PERMISSION_DENIED, client=READ_TOKEN, tls_only=True),
    Row("a read token taking the lease", "master", "WriterHeartbeat",
        lambda live: m.WriterHeartbeatRequest(stream=live.sealed.stream, client_id="reader"),
        Code.PERMISSION_DENIED, client=READ_TOKEN, tls_only=True),
    Row("a tenant draining a store", "master", "DrainStore",
        lambda live: m.DrainStoreRequest(store_id="store0"), Code.PERMISSION_DENIED,
        client=TENANT, tls_only=True),
    Row("a tenant rebalancing", "master", "Rebalance", lambda live: m.RebalanceRequest(),
        Code.PERMISSION_DENIED, client=TENANT, tls_only=True),
    Row("a tenant registering a store", "master", "RegisterStore",
        lambda live: m.RegisterStoreRequest(store_id="store0", address="127.0.0.1:9"),
        Code.PERMISSION_DENIED, client=TENANT, tls_only=True),
    Row("a tenant heartbeating as a store", "master", "StoreHeartbeat",
        lambda live: m.StoreHeartbeatRequest(store_id="store0"), Code.PERMISSION_DENIED,
        client=TENANT, tls_only=True),
    Row("a tenant making a token", "master", "CreateToken",
        lambda live: m.CreateTokenRequest(tenant=live.sealed.stream.split("/")[0],
                                          role=m.TOKEN_ROLE_ADMIN),
        Code.PERMISSION_DENIED, client=TENANT, tls_only=True),
    Row("a tenant rolling without the grant of the epoch", "master", "RollSegment",
        lambda live: m.RollSegmentRequest(stream=live.open.stream, client_id="bad",
                                          epoch=live.open.epoch),
        Code.PERMISSION_DENIED, client=TENANT, tls_only=True),
    Row("a tenant sealing without the grant of the epoch", "master", "SealSegment",
        lambda live: m.SealSegmentRequest(stream=live.sealed.stream,
                                          segment_epoch=live.sealed.epoch,
                                          writer_epoch=live.open.epoch,
                                          final_index=live.sealed.final_index),
        Code.PERMISSION_DENIED, client=TENANT, tls_only=True),
    Row("a tenant writing without a grant", "store", "Write",
        lambda live: [codec.write_request([entry(1, live.open.epoch, b"tenant")],
                                          segment=live.open.pb, writer_epoch=live.open.epoch,
                                          request_id=1)],
        Code.PERMISSION_DENIED, client=TENANT, segment="open", tls_only=True),
    Row("a tenant deleting a replica", "store", "Delete",
        lambda live: s.DeleteRequest(segment=live.sealed.pb), Code.PERMISSION_DENIED,
        client=TENANT, tls_only=True),
    Row("a tenant copying a segment onto a store", "store", "CopySegment",
        lambda live: s.CopySegmentRequest(segment=live.sealed.pb,
                                          source_address=live.sealed.address,
                                          final_index=live.sealed.final_index),
        Code.PERMISSION_DENIED, client=TENANT, tls_only=True),
]

# Stores hear of a revocation with their next heartbeat reply: within two heartbeats.
REVOCATION_REACHES_STORES_S = 2 * STORE_HEARTBEAT_MS_MAX / 1000


def _forged_grant(segment: Segment, epoch: int) -> bytes:
    """A grant of `epoch` listing `segment` on any store, signed by a key of no master."""
    listed = (GrantSegment(segment.epoch, ("store0", "store1", "store2", "store3")),)
    tenant = segment.stream.split("/")[0]
    grant = Grant(segment.stream_id, epoch, tenant, "forger", listed, expires_at_ms=1 << 62)
    return GrantSigner(SigningKey.generate()).sign(grant)


def _bad_crc(stored: StoredEntry) -> StoredEntry:
    return dataclasses.replace(stored, crc32c=stored.crc32c ^ 1)


def _lengths_off(request: s.WriteRequest) -> s.WriteRequest:
    request.value_lengths[-1] += 1
    return request


def _fuzz_segment() -> entry_pb2.SegmentId:
    return entry_pb2.SegmentId(stream_id=FUZZ_STREAM_ID, epoch=FUZZ_EPOCH, stream=FUZZ_STREAM)


# Well-formed requests of the fuzz namespace, one per RPC, for mutation.
def fuzz_templates() -> dict[str, Message]:
    fuzz = _fuzz_segment()
    return {
        "CreateTenant": m.CreateTenantRequest(tenant="fuzzns"),
        "ListTenants": m.ListTenantsRequest(),
        "CreateStream": m.CreateStreamRequest(name=FUZZ_STREAM, policy=P(replicas=3,
                                                                         write_quorum=2)),
        "CreateStreams": m.CreateStreamsRequest(streams=[
            m.CreateStreamRequest(name=FUZZ_STREAM, policy=P(replicas=3, write_quorum=2))]),
        "ListStreams": m.ListStreamsRequest(tenant="fuzzns"),
        "DescribeStream": m.DescribeStreamRequest(name=FUZZ_STREAM),
        "DeleteStream": m.DeleteStreamRequest(name=FUZZ_STREAM),
        "UndeleteStream": m.UndeleteStreamRequest(name=FUZZ_STREAM),
        "UpdateStream": m.UpdateStreamRequest(name=FUZZ_STREAM, retention_bytes=1),
        "TrimStream": m.TrimStreamRequest(name=FUZZ_STREAM, before_sequence=1 << 32),
        "WriterHeartbeat": m.WriterHeartbeatRequest(stream=FUZZ_STREAM, client_id="fuzz"),
        "ReleaseLease": m.ReleaseLeaseRequest(stream=FUZZ_STREAM, client_id="fuzz", epoch=3),
        "HoldLease": m.HoldLeaseRequest(stream=FUZZ_STREAM, client_id="fuzz", epoch=3),
        "RollSegment": m.RollSegmentRequest(stream=FUZZ_STREAM, client_id="fuzz", epoch=3),
        "RollSegments": m.RollSegmentsRequest(
            rolls=[m.RollSegmentRequest(stream=FUZZ_STREAM, client_id="fuzz", epoch=3)]),
        "ListSegments": m.ListSegmentsRequest(stream=FUZZ_STREAM),
        "SealSegment": m.SealSegmentRequest(stream=FUZZ_STREAM, segment_epoch=2,
                                            writer_epoch=3, final_index=4),
        "SealSegments": m.SealSegmentsRequest(seals=[m.SealSegmentRequest(
            stream=FUZZ_STREAM, segment_epoch=2, writer_epoch=3, final_index=4)]),
        "GetClusterStatus": m.GetClusterStatusRequest(),
        "DrainStore": m.DrainStoreRequest(store_id=FUZZ_STORE),
        "RequestRoll": m.RequestRollRequest(stream=FUZZ_STREAM),
        "Write": codec.write_request([entry(1, 1, b"fuzz")], segment=fuzz, writer_epoch=1,
                                     request_id=1),
        "Seal": s.SealRequest(segment=fuzz, new_epoch=FUZZ_EPOCH),
        "Read": s.ReadRequest(segment=fuzz, from_index=1),
        "Subscribe": s.SubscribeRequest(start=s.SubscribeStart(segment=fuzz, from_index=1)),
        "CopySegment": s.CopySegmentRequest(segment=fuzz, source_address="127.0.0.1:9",
                                            final_index=3),
        "Digest": s.DigestRequest(segment=fuzz),
        "GetSegmentState": s.GetSegmentStateRequest(segment=fuzz),
    }


# RPCs that get no mutated requests on a plaintext cluster (random bytes only, and their
# rows): a request that still parses after mutation could be a legitimate one that
# disturbs the run (a store registered at a bogus address takes new segments; a forged
# heartbeat, rebalance or delete moves or drops replicas). Refusing those from strangers
# takes TLS's member certificates (a plaintext cluster serves loopback only): on a TLS
# cluster, where the fuzz calls as a tenant, every RPC gets mutated requests.
# A Seal is mutated: without the master's grant no bytes of one can fence anything.
NOT_MUTATED = {"RegisterStore", "StoreHeartbeat", "Rebalance", "Delete"}


@dataclass(frozen=True)
class DataMethod:
    """A method of the stores' data plane (docs/data-plane.md), fuzzed beside the gRPC
    ones: what `call` and the fuzz ask of a method descriptor."""

    name: str
    input_type: Any
    output_type: Any
    framed: framing.Method
    client_streaming: bool = True
    server_streaming: bool = True


DATA_WRITE = DataMethod(
    "Write", s.WriteRequest.DESCRIPTOR, s.WriteReply.DESCRIPTOR, framing.WRITE)
# A Read request is one message: the rows and the fuzz send it one payload.
DATA_READ = DataMethod(
    "Read", s.ReadRequest.DESCRIPTOR, s.ReadReply.DESCRIPTOR, framing.READ,
    client_streaming=False)
DATA_SUBSCRIBE = DataMethod(
    "Subscribe", s.SubscribeRequest.DESCRIPTOR, s.SubscribeReply.DESCRIPTOR, framing.SUBSCRIBE)


def methods() -> list[tuple[str, Any]]:
    """(server, method descriptor) of every RPC, and the data plane's methods."""
    out: list[tuple[str, Any]] = []
    for server, module, name in (("master", master_pb2, "Master"),
                                 ("store", segment_store_pb2, "SegmentStore")):
        out.extend((server, method)
                   for method in module.DESCRIPTOR.services_by_name[name].methods)
    out.extend(("store", method) for method in (DATA_WRITE, DATA_READ, DATA_SUBSCRIBE))
    return out


def call_as(callers: Callers, client: str, tenant: str, address: str, data_address: str,
            method: Any, payloads: list[bytes]) -> tuple[str, str]:
    """`call` as `client` of `tenant`: a gRPC method on `address`, the data plane's
    on `data_address`."""
    if isinstance(method, DataMethod):
        return data_call(callers.transport(client, tenant), data_address, method, payloads)
    return call(callers.channel(client, tenant, address), method, payloads)


def data_call(transport: Transport, data_address: str, method: DataMethod,
              payloads: list[bytes]) -> tuple[str, str]:
    """One request on a store's data plane with raw request bytes, as `call` makes a
    gRPC one: the status that ended it, or a Write's first refused reply, else OK."""
    return asyncio.run(data_exchange(transport, data_address, method, payloads))


async def data_exchange(transport: Transport, data_address: str, method: DataMethod,
                        payloads: list[bytes]) -> tuple[str, str]:
    """`data_call` on the running loop (the simulator's runtime world calls it there)."""
    replies: list[bytes] = []
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S), framed.connect(
            data_address, transport
        ) as connection:
            opened = await connection.call(method.framed)
            for payload in payloads if method.client_streaming else payloads[:1]:
                await opened.send_parts([payload])
            await opened.end()
            while (reply := await opened.receive()) is not None:
                replies.append(reply.SerializeToString())
    except framed.CallError as error:
        code = next(c for c in grpc.StatusCode if c.value[0] == error.code)
        return code.name, error.details[:200]
    except TimeoutError:
        return grpc.StatusCode.DEADLINE_EXCEEDED.name, f"the data plane's {method.name} timed out"
    return _write_refusal(replies) if method is DATA_WRITE else ("OK", "")


def request_class(method: Any) -> type[Message]:
    from google.protobuf import message_factory

    cls: type[Message] = message_factory.GetMessageClass(method.input_type)
    return cls


def parses(method: Any, data: bytes) -> bool:
    try:
        request_class(method).FromString(data)
    except DecodeError:
        return False
    return True


def random_bytes(rng: random.Random, method: Any) -> bytes:
    """Bytes that do not parse as the method's request."""
    while True:
        data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 48)))
        if not parses(method, data):
            return data


def fuzzed_request(
    rng: random.Random, method: Any, templates: dict[str, Message], not_mutated: set[str]
) -> tuple[bytes, bool]:
    """Request bytes for `method` and whether they are mutated: half the time a method
    with a template (`fuzz_templates`) outside `not_mutated` gets it mutated, any other
    time bytes that do not parse."""
    if method.name in templates and method.name not in not_mutated and rng.random() < 0.5:
        return mutate(rng, templates[method.name].SerializeToString()), True
    return random_bytes(rng, method), False


def mutate(rng: random.Random, data: bytes) -> bytes:
    """1-3 of: a bit flipped, a byte replaced, the end cut off, a slice repeated."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if not out:
            out.append(rng.randrange(256))
            continue
        where = rng.randrange(len(out))
        kind = rng.randrange(4)
        if kind == 0:
            out[where] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[where] = rng.randrange(256)
        elif kind == 2:
            del out[where:]
        else:
            out[where:where] = out[where:where + rng.randint(1, 8)]
    return bytes(out)


def call(channel: Any, method: Any, payloads: list[bytes]) -> tuple[str, str]:
    """One RPC with raw request bytes; (status name, details), "OK" when it succeeded.
    (`channel` untyped: grpc's stubs type a multicallable without serializers as taking
    nothing.)"""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            requests: Iterator[bytes] = iter(payloads)
            if method.server_streaming:
                replies = list(channel.stream_stream(path)(requests, timeout=CALL_TIMEOUT_S))
                if method.output_type.full_name == s.WriteReply.DESCRIPTOR.full_name:
                    return _write_refusal(replies)
            else:
                channel.stream_unary(path)(requests, timeout=CALL_TIMEOUT_S)
        elif method.server_streaming:
            list(channel.unary_stream(path)(payloads[0], timeout=CALL_TIMEOUT_S))
        else:
            channel.unary_unary(path)(payloads[0], timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return error.code().name, (error.details() or "")[:200]
    return "OK", ""


def _write_refusal(replies: list[bytes]) -> tuple[str, str]:
    """A Write stream answers a refused request in its reply, or a refused part of a
    message in the reply's parts (and goes on): the first refusal, as a call's status,
    else OK."""
    for raw in replies:
        message = s.WriteReply.FromString(raw)
        for reply in message.parts or [message]:
            if reply.status != s.REFUSED:
                continue
            code = next(c for c in grpc.StatusCode if c.value[0] == reply.error.code)
            return code.name, reply.error.details[:200]
    return "OK", ""


def serialized(request: Message | list[Message]) -> list[bytes]:
    return [r.SerializeToString() for r in (request if isinstance(request, list) else [request])]


def live_segments(master: str, streams: list[str]) -> Live | None:
    """A sealed and the open segment of the workload, each with a replica (None before
    the first roll)."""
    with open_channel(master) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        for stream in streams:
            listing = stub.ListSegments(m.ListSegmentsRequest(stream=stream),
                                        timeout=CALL_TIMEOUT_S)
            sealed = [x for x in listing.segments if x.state == entry_pb2.SEALED]
            if not sealed or not listing.segments[-1].copy_set:
                continue
            last_sealed, last = sealed[-1], listing.segments[-1]
            replica = last_sealed.copy_set[0].address
            replica_data = last_sealed.copy_set[0].data_address
            with open_channel(replica) as store:
                state = store_grpc.SegmentStoreStub(store).GetSegmentState(
                    s.GetSegmentStateRequest(segment=entry_pb2.SegmentId(
                        stream_id=listing.stream_id, epoch=last_sealed.id.epoch)),
                    timeout=CALL_TIMEOUT_S)
            return Live(
                Segment(stream, listing.stream_id, last_sealed.id.epoch,
                        last_sealed.final_index, replica, state.fence, replica_data),
                Segment(stream, listing.stream_id, last.id.epoch, 0,
                        last.copy_set[0].address, 0, last.copy_set[0].data_address),
            )
    return None


def master_digest(master: str, streams: list[str], stores: list[str]) -> dict[str, Any]:
    """The master's metadata of the workload's namespace."""
    tenants = sorted({name.split("/")[0] for name in streams})
    with open_channel(master) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        listed = stub.ListTenants(m.ListTenantsRequest(), timeout=CALL_TIMEOUT_S).tenants
        infos = stub.ListStreams(m.ListStreamsRequest(), timeout=CALL_TIMEOUT_S).streams
        status = stub.GetClusterStatus(m.GetClusterStatusRequest(), timeout=CALL_TIMEOUT_S)
    return {
        "tenants": sorted(t for t in listed if t in tenants),
        "streams": sorted([i.name, i.stream_id, i.policy.replicas, i.policy.write_quorum,
                           i.segment_bytes] for i in infos if i.name in streams),
        "stores": sorted([x.store_id, x.address, x.zone, x.draining]
                         for x in status.stores if x.store_id in stores),
        # Outside the namespace: what valid requests of the fuzz created (information).
        "others": sorted([*(t for t in listed if t not in tenants),
                          *(i.name for i in infos if i.name not in streams),
                          *(x.store_id for x in status.stores if x.store_id not in stores)]),
    }


def store_digests(master: str, streams: list[str]) -> dict[str, str]:
    """"store stream/epoch" -> the store's digest of every sealed workload segment it
    holds (up to its final index)."""
    out: dict[str, str] = {}
    with open_channel(master) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        for stream in streams:
            listing = stub.ListSegments(m.ListSegmentsRequest(stream=stream),
                                        timeout=CALL_TIMEOUT_S)
            for segment in listing.segments:
                if segment.state != entry_pb2.SEALED:
                    continue
                for replica in segment.copy_set:
                    key = f"{replica.store_id} {stream}/{segment.id.epoch}"
                    with open_channel(replica.address) as store:
                        try:
                            reply = store_grpc.SegmentStoreStub(store).Digest(
                                s.DigestRequest(segment=entry_pb2.SegmentId(
                                    stream_id=listing.stream_id, epoch=segment.id.epoch),
                                    up_to_index=segment.final_index),
                                timeout=CALL_TIMEOUT_S)
                            out[key] = f"{reply.digest.hex()} fence {reply.fence}"
                        except grpc.RpcError as error:
                            out[key] = error.code().name
    return out


def serving(addresses: dict[str, str]) -> dict[str, bool]:
    transport = harness_transport()
    return {name: is_serving(address, 2.0, transport) for name, address in addresses.items()}
