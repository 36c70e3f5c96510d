"""Authority against real processes: grants fence nothing without the master's word,
holders alone act under their epochs, tokens are confined to their tenant and role,
expire and are revoked, quotas hold. The cluster runs plaintext: a caller without a
token may do anything (as before security), and a caller with one is held to it.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.segment_driver import CallRefused, Driver, write_stream
from bench.segment_driver import write as write_acked
from streamengine.client import StreamClient
from streamengine.protocol import codec, framed_read
from streamengine.protocol.auth import RPC_NEEDS
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.limits import EPOCH_MAX
from streamengine.protocol.signing import KEY_ID_BYTES, MAGIC_BYTES, SIGNATURE_BYTES, SigningKey
from streamengine.protocol.tokens import token_envelope, token_text
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.testing import (
    Cluster,
    data_address_of,
    free_port,
    metric_value,
    running_cluster,
    wait_for,
)
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.integration.authority_helpers import bearer, create_token
from tests.integration.store_helpers import SubscribeCall, WriteRefused, subscribe_first

pytestmark = pytest.mark.security

Code = grpc.StatusCode
m = master_pb2
s = segment_store_pb2
P = entry_pb2.ReplicationPolicy
# Forges grants: a key of no cluster.
FORGER = GrantSigner(SigningKey(bytes(range(200, 232))))
TIMEOUT_S = 10.0
# Grants as short as leases of 1 s allow, so that one dies within a test.
GRANT_MS = 4000
ENVELOPE_HEAD = MAGIC_BYTES + KEY_ID_BYTES


@pytest.fixture(scope="module")
def store_metrics_ports() -> list[int]:
    return [free_port() for _ in range(3)]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, store_metrics_ports: list[int]
) -> Iterator[Cluster]:
    """Three stores (each with its metrics port); tenants of the tests below each make
    their own streams."""
    root = tmp_path_factory.mktemp("authority")
    with running_cluster(
        root,
        stores=3,
        master_args=["--lease-ms", "1000", "--grant-ms", str(GRANT_MS)],
        store_args_for=lambda number: ["--metrics-port", str(store_metrics_ports[number])],
    ) as running:
        yield running


def master_call(cluster: Cluster, method: str, request: Any, token: str | None = None) -> Any:
    with grpc.insecure_channel(cluster.master_address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        metadata = bearer(token) if token else None
        return getattr(stub, method)(request, timeout=TIMEOUT_S, metadata=metadata)


def store_call(address: str, method: str, request: Any, token: str | None = None) -> Any:
    """A unary store call, or a Read (on the data plane: `store_read`)."""
    if method == "Read":
        return store_read(address, request, token)
    with grpc.insecure_channel(address) as channel:
        stub = store_grpc.SegmentStoreStub(channel)
        metadata = bearer(token) if token else None
        return getattr(stub, method)(request, timeout=TIMEOUT_S, metadata=metadata)


def store_read(
    address: str, request: s.ReadRequest, token: str | None = None
) -> list[s.ReadReply]:
    """The replies of a Read on the data plane of the store at `address` (its gRPC
    address); its end with a status raises as the call's error would (`CallRefused`)."""
    transport = Transport(token=token) if token else PLAINTEXT
    try:
        return list(framed_read.read_sync(data_address_of(address), transport, request, TIMEOUT_S))
    except CallError as error:
        raise CallRefused(error) from None


def store_write(
    address: str, requests: list[segment_store_pb2.WriteRequest], token: str | None = None
) -> list[segment_store_pb2.WriteReply]:
    """The replies of a Write stream on the data plane of the store at `address` (its
    gRPC address); a refused request (answered in its reply, the stream going on)
    raises as the call's error would (`WriteRefused`), and so does the stream's end
    (`CallRefused`)."""
    transport = Transport(token=token) if token else PLAINTEXT
    try:
        replies = asyncio.run(write_stream(data_address_of(address), requests, transport))
    except CallError as error:
        raise CallRefused(error) from None
    for reply in replies:
        if reply.status == segment_store_pb2.REFUSED:
            raise WriteRefused(reply)
    return replies


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def make_stream(cluster: Cluster, name: str, replicas: int = 3, quorum: int = 2) -> int:
    info = master_call(
        cluster,
        "CreateStream",
        m.CreateStreamRequest(
            name=name, policy=P(replicas=replicas, write_quorum=quorum), create_tenant=True
        ),
    )
    return int(info.stream_id)


def append_and_read(cluster: Cluster, name: str, payloads: list[bytes]) -> list[bytes]:
    """Append through the SDK (a new writer) and read the whole stream back."""

    async def run() -> list[bytes]:
        async with StreamClient(cluster.master_address) as client:
            async with client.writer(name, leadership_timeout_s=15) as writer:
                await writer.append_batch(payloads)
            return [event.payload async for event in client.read(name)]

    return asyncio.run(run())


def state_of(address: str, segment: entry_pb2.SegmentId) -> tuple[int, int, int] | None:
    try:
        reply = store_call(address, "GetSegmentState", s.GetSegmentStateRequest(segment=segment))
    except grpc.RpcError as error:
        assert error.code() == Code.NOT_FOUND, error
        return None
    return reply.fence, reply.acked_index, reply.last_index


# ---- grants ----


def test_a_stolen_grant_dies_after_its_bound_while_the_leader_appends_on(
    cluster: Cluster,
) -> None:
    """A copy of the leader's grant (as a thief with the host's token has it) writes
    at first; once its expiry passes every store refuses it, naming the expiry, while
    the leader, renewing its grant with its lease, appends on."""
    name = "steal/orders"
    make_stream(cluster, name)
    store = cluster.stores[0].address

    def thief_writes(grant: bytes, segment: entry_pb2.SegmentId, epoch: int) -> None:
        # An empty write: the store checks the grant and changes nothing.
        write = codec.write_request([], segment=segment, writer_epoch=epoch, grant=grant)
        store_write(store, [write])

    async def run() -> tuple[list[bytes], int, grpc.RpcError]:
        async with StreamClient(cluster.master_address) as client:
            async with client.writer(name, leadership_timeout_s=15) as writer:
                await writer.append_batch([b"before"])
                leader = writer._core
                assert leader.replicator is not None
                stolen, epoch = leader._grant, leader.epoch
                ref = leader.replicator.segment
                segment = entry_pb2.SegmentId(stream_id=ref.stream_id, epoch=ref.epoch)
                expires_at_ms = Grant.decode(stolen[ENVELOPE_HEAD:-SIGNATURE_BYTES]).expires_at_ms
                await asyncio.to_thread(thief_writes, stolen, segment, epoch)
                appended = 1
                deadline = time.monotonic() + 3 * GRANT_MS / 1000
                while time.time() * 1000 < expires_at_ms + 100 and time.monotonic() < deadline:
                    await writer.append_batch([b"%d" % appended])
                    appended += 1
                assert time.monotonic() < deadline, "the grant never expired"
                refusal = await asyncio.to_thread(
                    refused, lambda: thief_writes(stolen, segment, epoch)
                )
                assert leader._grant != stolen, "the leader's grant was renewed"
                await writer.append_batch([b"after"])
            return [event.payload async for event in client.read(name)], appended, refusal

    events, appended, refusal = asyncio.run(run())
    assert refusal.code() == Code.PERMISSION_DENIED
    assert "expired at" in (refusal.details() or "")
    assert events == [b"before", *(b"%d" % i for i in range(1, appended)), b"after"]


def test_a_seal_at_the_last_epoch_without_a_grant_or_forged_is_refused_and_nothing_changes(
    cluster: Cluster,
) -> None:
    name = "fence/orders"
    stream_id = make_stream(cluster, name)
    assert append_and_read(cluster, name, [b"a", b"b"]) == [b"a", b"b"]
    segments = master_call(cluster, "ListSegments", m.ListSegmentsRequest(stream=name)).segments
    segment = segments[-1]
    for replica in segment.copy_set:
        listed = (GrantSegment(segment.id.epoch, (replica.store_id,)),)
        forged = FORGER.sign(Grant(stream_id, EPOCH_MAX, "fence", "intruder", listed, 1 << 62))
        before = state_of(replica.address, segment.id)
        for grant in (b"", forged, b"garbage"):
            request = s.SealRequest(segment=segment.id, new_epoch=EPOCH_MAX, grant=grant)
            error = refused(functools.partial(store_call, replica.address, "Seal", request))
            assert error.code() == Code.PERMISSION_DENIED, error.details()
            assert state_of(replica.address, segment.id) == before
    # Every later leader still seals, recovers and appends: nothing was wedged.
    assert append_and_read(cluster, name, [b"c"]) == [b"a", b"b", b"c"]
    assert append_and_read(cluster, name, [b"d"]) == [b"a", b"b", b"c", b"d"]


def test_writes_under_a_grant_that_does_not_fit_are_refused_and_change_nothing(
    cluster: Cluster,
) -> None:
    make_stream(cluster, "fit/one", replicas=2, quorum=2)
    other_id = make_stream(cluster, "fit/two", replicas=2, quorum=2)
    driver = Driver(cluster.master_address, "fit/one", client_id="fit-driver")
    driver.lead()
    assert driver.segment is not None
    segment, epoch, grant = driver.segment.id, driver.epoch, driver.grant
    members = {r.store_id for r in driver.segment.copy_set}
    outsider = next(p for p in cluster.stores if p.name not in members)
    member = next(p for p in cluster.stores if p.name in members)
    event = StoredEntry.make(1, EntryKind.EVENT, epoch, b"x")
    other_segment = entry_pb2.SegmentId(stream_id=other_id, epoch=epoch)
    listed = (GrantSegment(epoch, tuple(sorted(members))),)
    forged = FORGER.sign(Grant(segment.stream_id, epoch, "fit", "fit-driver", listed, 1 << 62))
    cases = [
        ("a store outside the copy set", outsider.address, segment, epoch, grant),
        ("another epoch than the grant's", member.address, segment, epoch + 1, grant),
        ("another stream than the grant's", member.address, other_segment, epoch, grant),
        ("no grant at all", member.address, segment, epoch, b""),
        ("a forged grant", member.address, segment, epoch, forged),
    ]
    for case, address, target, writer_epoch, shown in cases:
        before = state_of(address, target)
        write = codec.write_request([event], segment=target, writer_epoch=writer_epoch, grant=shown)
        error = refused(functools.partial(store_write, address, [write]))
        assert error.code() == Code.PERMISSION_DENIED, (case, error.details())
        assert state_of(address, target) == before, case
    # The grant fits its own segment on its own stores: the same write goes through.
    write = codec.write_request([event], segment=segment, writer_epoch=epoch, grant=grant)
    assert [r.status for r in store_write(member.address, [write])] == [s.ACCEPTED]


def test_a_second_write_at_the_epoch_with_other_bytes_is_refused_and_readers_keep_the_original(
    cluster: Cluster, store_metrics_ports: list[int]
) -> None:
    """Issue #37, item 3, at the stores: even under the epoch's own grant, an acked
    index held at that epoch is never rewritten with other bytes."""
    make_stream(cluster, "tamper/s")
    driver = Driver(cluster.master_address, "tamper/s", client_id="honest")
    driver.lead()
    assert driver.segment is not None
    segment, epoch, grant = driver.segment.id, driver.epoch, driver.grant
    original = [StoredEntry.make(i, EntryKind.EVENT, epoch, b"event %d" % i) for i in (1, 2)]
    tampered = StoredEntry.make(1, EntryKind.EVENT, epoch, b"TAMPERED")
    conflicts = "streamengine_store_conflicting_copies_total"
    counted_before = sum(metric_value(port, conflicts) for port in store_metrics_ports)
    for replica in driver.segment.copy_set:
        write_acked(replica.data_address, segment, epoch, original, acked=2, grant=grant)
        # A retransmission (identical bytes) is accepted as before.
        write_acked(replica.data_address, segment, epoch, original[:1], acked=2, grant=grant)
        attack = codec.write_request([tampered], segment=segment, writer_epoch=epoch, grant=grant)
        error = refused(functools.partial(store_write, replica.address, [attack]))
        assert error.code() == Code.ALREADY_EXISTS, error.details()
        assert "index 1 is held at epoch" in (error.details() or "")
        assert state_of(replica.address, segment) == (0, 2, 2)
        read = store_call(replica.address, "Read", s.ReadRequest(segment=segment, from_index=1))
        payloads = [e.payload for reply in read for e in reply.entries]
        assert payloads == [b"event 1", b"event 2"], replica.store_id
    counted = sum(metric_value(port, conflicts) for port in store_metrics_ports)
    assert counted == counted_before + len(driver.segment.copy_set)


def test_only_the_holder_of_an_epoch_releases_rolls_and_seals_under_it(cluster: Cluster) -> None:
    stream_id = make_stream(cluster, "holder/s")
    make_stream(cluster, "holder/t")
    holder = Driver(cluster.master_address, "holder/s", client_id="holder")
    holder.lead()
    elsewhere = Driver(cluster.master_address, "holder/t", client_id="other")
    elsewhere.lead()
    epoch = holder.epoch

    def leader() -> tuple[str, int]:
        info = master_call(cluster, "DescribeStream", m.DescribeStreamRequest(name="holder/s"))
        return info.leader_id, info.epoch

    assert leader() == ("holder", epoch)
    published: dict[str, Any] = {"stream": "holder/s", "client_id": "holder", "epoch": epoch}
    attempts = [
        ("ReleaseLease", m.ReleaseLeaseRequest(**published)),
        ("RollSegment", m.RollSegmentRequest(**published)),
        ("ReleaseLease", m.ReleaseLeaseRequest(**published, grant=elsewhere.grant)),
        (
            "RollSegment",
            m.RollSegmentRequest(
                **published,
                grant=FORGER.sign(Grant(stream_id, epoch, "holder", "holder", (), 1 << 62)),
            ),
        ),
        (
            "SealSegment",
            m.SealSegmentRequest(
                stream="holder/s",
                segment_epoch=epoch,
                writer_epoch=epoch,
                client_id="other",
                final_index=1,
                grant=holder.grant,
            ),
        ),
    ]
    for method, request in attempts:
        error = refused(functools.partial(master_call, cluster, method, request))
        assert error.code() == Code.PERMISSION_DENIED, (method, error.details())
        assert leader() == ("holder", epoch), method
    # The grant without the lease secret handed with it releases nothing.
    unproven = master_call(
        cluster, "ReleaseLease", m.ReleaseLeaseRequest(**published, grant=holder.grant)
    )
    assert not unproven.released and leader() == ("holder", epoch)
    released = master_call(
        cluster,
        "ReleaseLease",
        m.ReleaseLeaseRequest(**published, grant=holder.grant, lease_secret=holder.lease_secret),
    )
    assert released.released and leader() == ("", epoch)


def test_a_token_shown_as_a_grant_and_a_grant_as_a_token_are_refused(cluster: Cluster) -> None:
    """Each server has verified both the token and the grant once (they sit in its
    cache of verified envelopes), so the swap reaches the cache, where a token once came
    back as a grant (UNKNOWN: an AttributeError)."""
    make_stream(cluster, "swap/s")
    driver = Driver(cluster.master_address, "swap/s", client_id="swap-driver")
    sealed = driver.fill_and_roll(3, 8)  # the master and the stores verify its grants
    assert driver.segment is not None
    grant, epoch, member = driver.grant, driver.epoch, sealed.copy_set[0].address
    token, _ = create_token(cluster.master_address, "swap", m.TOKEN_ROLE_WRITE)
    master_call(cluster, "ListStreams", m.ListStreamsRequest(tenant="swap"), token)
    store_call(member, "GetSegmentState", s.GetSegmentStateRequest(segment=sealed.id), token)
    as_grant = token_envelope(token)
    published: dict[str, Any] = {"stream": "swap/s", "client_id": "swap-driver", "epoch": epoch}
    event = StoredEntry.make(1, EntryKind.EVENT, epoch, b"x")
    write = codec.write_request(
        [event], segment=driver.segment.id, writer_epoch=epoch, grant=as_grant
    )
    attempts: list[tuple[str, Callable[[], object], grpc.StatusCode]] = [
        (
            "roll under a token",
            functools.partial(
                master_call,
                cluster,
                "RollSegment",
                m.RollSegmentRequest(**published, grant=as_grant),
            ),
            Code.PERMISSION_DENIED,
        ),
        (
            "seal under a token",
            functools.partial(
                store_call,
                member,
                "Seal",
                s.SealRequest(segment=sealed.id, new_epoch=epoch + 1, grant=as_grant),
            ),
            Code.PERMISSION_DENIED,
        ),
        (
            "write under a token",
            functools.partial(store_write, member, [write]),
            Code.PERMISSION_DENIED,
        ),
    ]
    for bearer_text in (token_text(grant), "garbage", token_text(b"garbage")):
        attempts += [
            (
                f"master called with {bearer_text[:12]}",
                functools.partial(
                    master_call, cluster, "ListStreams", m.ListStreamsRequest(), bearer_text
                ),
                Code.UNAUTHENTICATED,
            ),
            (
                f"store called with {bearer_text[:12]}",
                functools.partial(
                    store_call,
                    member,
                    "GetSegmentState",
                    s.GetSegmentStateRequest(segment=sealed.id),
                    bearer_text,
                ),
                Code.UNAUTHENTICATED,
            ),
        ]
    before = state_of(member, sealed.id), state_of(member, driver.segment.id)
    for case, call, code in attempts:
        error = refused(call)
        assert error.code() == code, (case, error.code(), error.details())
    assert (state_of(member, sealed.id), state_of(member, driver.segment.id)) == before
    info = master_call(cluster, "DescribeStream", m.DescribeStreamRequest(name="swap/s"))
    assert (info.leader_id, info.epoch) == ("swap-driver", epoch)
LEASE_S = 1.0  # the module cluster's --lease-ms


def test_a_second_write_token_naming_the_leaders_id_gets_no_grant_and_the_leader_appends_on(
    cluster: Cluster,
) -> None:
    """Issue #37, item 3, at the master: the leader's client id is published, the lease
    secret handed with its grant is not. Another write token of the tenant naming that
    id is a follower: no grant, no secret, no renewal."""
    make_stream(cluster, "usurp/s")
    attacker, _ = create_token(cluster.master_address, "usurp", m.TOKEN_ROLE_WRITE)

    async def attack_while_the_leader_appends() -> list[bytes]:
        appended = []
        async with StreamClient(cluster.master_address) as client:
            async with client.writer("usurp/s", leadership_timeout_s=15) as writer:
                await writer.append_batch([b"before"])
                appended.append(b"before")
                epoch = writer.epoch
                async with grpc.aio.insecure_channel(cluster.master_address) as channel:
                    stub = master_pb2_grpc.MasterStub(channel)
                    info = await stub.DescribeStream(
                        m.DescribeStreamRequest(name="usurp/s"),
                        metadata=bearer(attacker),
                        timeout=TIMEOUT_S,
                    )
                    assert info.leader_id and info.epoch == epoch
                    usurp = m.WriterHeartbeatRequest(
                        stream="usurp/s", client_id=info.leader_id, epoch=epoch
                    )
                    deadline = time.monotonic() + 2 * LEASE_S
                    while time.monotonic() < deadline:
                        reply = await stub.WriterHeartbeat(
                            usurp, metadata=bearer(attacker), timeout=TIMEOUT_S
                        )
                        assert reply.role == m.FOLLOWER, reply
                        assert not reply.grant and not reply.lease_secret
                        payload = b"during %d" % len(appended)
                        await writer.append_batch([payload])
                        appended.append(payload)
                        await asyncio.sleep(0.05)
                await writer.append_batch([b"after"])
                appended.append(b"after")
                assert writer.epoch == epoch, "the honest writer led throughout"
            assert [e.payload async for e in client.read("usurp/s")] == appended
        return appended

    assert len(asyncio.run(attack_while_the_leader_appends())) > 3


def test_a_stolen_lease_secret_under_another_token_proves_nothing_and_renews_nothing(
    cluster: Cluster,
) -> None:
    make_stream(cluster, "usurp/raw")
    holder, _ = create_token(cluster.master_address, "usurp", m.TOKEN_ROLE_WRITE)
    other, _ = create_token(cluster.master_address, "usurp", m.TOKEN_ROLE_WRITE)
    heartbeat = functools.partial(master_call, cluster, "WriterHeartbeat")
    first = heartbeat(m.WriterHeartbeatRequest(stream="usurp/raw", client_id="raw"), holder)
    assert first.role == m.LEADER and len(first.lease_secret) >= 16
    epoch, secret, grant = first.epoch, first.lease_secret, first.grant
    published: dict[str, Any] = {"stream": "usurp/raw", "client_id": "raw", "epoch": epoch}

    stolen = heartbeat(m.WriterHeartbeatRequest(**published, lease_secret=secret), other)
    assert stolen.role == m.FOLLOWER and not stolen.grant and not stolen.lease_secret
    renewed_at = time.monotonic()
    renewed = heartbeat(m.WriterHeartbeatRequest(**published, lease_secret=secret), holder)
    assert (renewed.role, renewed.epoch) == (m.LEADER, epoch) and renewed.grant
    assert not renewed.lease_secret, "the secret is handed only with the grant"

    # Even the epoch's grant moves nothing without the secret.
    release = m.ReleaseLeaseRequest(**published, grant=grant)
    assert not master_call(cluster, "ReleaseLease", release, other).released
    roll = m.RollSegmentRequest(**published, grant=grant)
    error = refused(functools.partial(master_call, cluster, "RollSegment", roll, other))
    assert error.code() == Code.FAILED_PRECONDITION, error.details()
    hold = m.HoldLeaseRequest(**published, grant=grant)
    with grpc.insecure_channel(cluster.master_address) as channel:
        calls = master_pb2_grpc.MasterStub(channel).HoldLease(
            hold, timeout=TIMEOUT_S, metadata=bearer(other)
        )
        error = refused(lambda: list(calls))
    assert error.code() == Code.PERMISSION_DENIED, error.details()

    # The other token's heartbeats renew nothing: the lease runs out on the holder's
    # last renewal, and what the other token then wins is a new epoch of its own.
    while True:
        reply = heartbeat(m.WriterHeartbeatRequest(**published), other)
        if reply.role == m.LEADER:
            break
        assert not reply.grant and not reply.lease_secret
        assert time.monotonic() < renewed_at + 10 * LEASE_S, "the lease never ran out"
        time.sleep(0.05)
    assert time.monotonic() - renewed_at >= LEASE_S
    assert reply.epoch == epoch + 1 and reply.lease_secret not in (b"", secret)


# ---- signing keys ----


def test_a_rotated_key_verifies_what_it_signed_while_the_new_one_signs_once_published(
    cluster: Cluster,
) -> None:
    """`key rotate` adds a key that signs once stores can know it; a token the old key
    signed keeps working at the master and the stores, grants of the new key are taken
    by every store, and new tokens name the new key. (Retirement is table-tested in
    tests/unit/test_master_keys.py: here tokens of a day pin the module's first key.)"""
    from tests.integration.test_cli import run_cli

    name = "rotate/orders"
    make_stream(cluster, name)
    old_token, _ = create_token(cluster.master_address, "rotate", m.TOKEN_ROLE_WRITE)
    rotated = run_cli("key", "rotate", "--master", cluster.master_address)
    assert rotated.returncode == 0, rotated.stderr
    header, new_line, *older = rotated.stdout.splitlines()
    assert header.split() == ["KEY", "CREATED", "STATE"] and older
    new_key_id = new_line.split()[0]
    assert "signs from" in new_line and all("retiring at" in line for line in older)
    assert master_call(cluster, "DescribeStream", m.DescribeStreamRequest(name=name), old_token)

    def new_key_signs() -> bool:
        keys = master_call(cluster, "ListSigningKeys", m.ListSigningKeysRequest()).keys
        return keys[0].key_id == new_key_id and keys[0].signing

    wait_for(new_key_signs, timeout_s=10, message="the new key signs")
    # Every store takes grants of the new key, and the old key's token.
    assert append_and_read(cluster, name, [b"one", b"two"]) == [b"one", b"two"]
    segment = master_call(cluster, "ListSegments", m.ListSegmentsRequest(stream=name)).segments[0]
    for replica in segment.copy_set:
        request = s.GetSegmentStateRequest(segment=segment.id)
        assert store_call(replica.address, "GetSegmentState", request, old_token).acked_index
    new_token, _ = create_token(cluster.master_address, "rotate", m.TOKEN_ROLE_READ)
    assert token_envelope(new_token)[4:12].hex() == new_key_id
    listed = run_cli("key", "list", "--master", cluster.master_address)
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[0] == new_key_id
    assert listed.stdout.splitlines()[1].endswith("signing")


# ---- tokens ----


def test_a_token_limited_to_a_stream_reads_it_and_nothing_else(cluster: Cluster) -> None:
    """`token create --stream` makes a read token of one stream (as a Spark driver
    gives its executors): it reads that stream at the master and the stores, and is
    refused another stream of its tenant and every listing."""
    from tests.integration.test_cli import run_cli

    name, other = "limited/orders", "limited/secret"
    stream_id = make_stream(cluster, name)
    make_stream(cluster, other)
    assert append_and_read(cluster, name, [b"one"]) == [b"one"]
    assert append_and_read(cluster, other, [b"two"]) == [b"two"]
    made = run_cli(
        "token", "create", "--tenant", "limited", "--role", "read", "--stream", name,
        "--master", cluster.master_address,
    )  # fmt: skip
    assert made.returncode == 0 and "streams limited/orders" in made.stderr, made.stderr
    token = made.stdout.strip()
    for stream, allowed in ((name, True), (other, False)):
        listing = m.ListSegmentsRequest(stream=stream)
        segment = master_call(cluster, "ListSegments", listing).segments[0]
        request = s.GetSegmentStateRequest(segment=segment.id)
        calls = [
            functools.partial(master_call, cluster, "ListSegments", listing, token),
            functools.partial(
                store_call, segment.copy_set[0].address, "GetSegmentState", request, token
            ),
        ]
        for call in calls:
            if allowed:
                call()
            else:
                error = refused(call)
                assert error.code() == Code.PERMISSION_DENIED
                assert f"limited to streams {stream_id}" in (error.details() or "")
    error = refused(lambda: master_call(cluster, "ListStreams", m.ListStreamsRequest(), token))
    assert error.code() == Code.PERMISSION_DENIED


@pytest.fixture(scope="module")
def victim(cluster: Cluster) -> dict[str, Any]:
    """Tenant `victim`: a stream with data in sealed and open segments, and a leased
    stream whose holder's grant the tests hold (to show it to stores and the master)."""
    make_stream(cluster, "victim/data")
    make_stream(cluster, "victim/lease")
    append_and_read(cluster, "victim/data", [b"v1"])
    assert append_and_read(cluster, "victim/data", [b"v2"]) == [b"v1", b"v2"]
    driver = Driver(cluster.master_address, "victim/lease", client_id="victim-driver")
    driver.lead()
    segments = master_call(
        cluster, "ListSegments", m.ListSegmentsRequest(stream="victim/data")
    ).segments
    sealed = next(seg for seg in segments if seg.state == entry_pb2.SEALED)
    return {"driver": driver, "sealed": sealed}


def victim_snapshot(cluster: Cluster, victim: dict[str, Any]) -> tuple[Any, ...]:
    """What the victim's data is (as an unrestricted caller sees it)."""
    streams = master_call(cluster, "ListStreams", m.ListStreamsRequest(tenant="victim")).streams
    names = [(i.name, i.stream_id, i.epoch, i.unsealed_segments) for i in streams]
    segments = [
        (seg.id.epoch, seg.state, seg.final_index, tuple(r.store_id for r in seg.copy_set))
        for name, *_ in names
        for seg in master_call(cluster, "ListSegments", m.ListSegmentsRequest(stream=name)).segments
    ]
    sealed = victim["sealed"]
    replicas = [state_of(r.address, sealed.id) for r in sealed.copy_set]
    return tuple(names), tuple(segments), tuple(replicas)


def every_rpc_as(
    cluster: Cluster, victim: dict[str, Any], token: str
) -> dict[str, Callable[[], object]]:
    """One call per RPC of master and stores, each on the victim's data, with `token`."""
    driver: Driver = victim["driver"]
    sealed: entry_pb2.Segment = victim["sealed"]
    assert driver.segment is not None
    lease: dict[str, Any] = {
        "stream": "victim/lease",
        "client_id": "victim-driver",
        "epoch": driver.epoch,
    }
    store = sealed.copy_set[0].address
    own = driver.segment.copy_set[0].address
    write = s.WriteRequest(segment=driver.segment.id, writer_epoch=driver.epoch, grant=driver.grant)

    def master(method: str, request: Any) -> Callable[[], object]:
        return lambda: master_call(cluster, method, request, token)

    def on_store(address: str, method: str, request: Any) -> Callable[[], object]:
        return lambda: store_call(address, method, request, token)

    def hold() -> object:
        request = m.HoldLeaseRequest(**lease, grant=driver.grant)
        with grpc.insecure_channel(cluster.master_address) as channel:
            replies = master_pb2_grpc.MasterStub(channel).HoldLease(
                request, timeout=TIMEOUT_S, metadata=bearer(token)
            )
            first = next(iter(replies))
            replies.cancel()
            return first

    def lease_batch() -> object:
        """A batch of one heartbeat; its entry's refusal raised as `WriterHeartbeat`'s."""
        beat = m.WriterHeartbeatRequest(stream="victim/data", client_id="x")
        request = m.LeaseHeartbeatRequest(leases=[beat])
        (entry,) = master_call(cluster, "LeaseHeartbeat", request, token).leases
        if entry.code:
            code = next(c for c in Code if c.value[0] == entry.code)
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(code, empty, empty, entry.message)
        return entry.reply

    def roll_batch() -> object:
        """A batch of one roll; its entry's refusal raised as `RollSegment`'s."""
        request = m.RollSegmentsRequest(rolls=[m.RollSegmentRequest(**lease, grant=driver.grant)])
        (entry,) = master_call(cluster, "RollSegments", request, token).rolls
        if entry.code:
            code = next(c for c in Code if c.value[0] == entry.code)
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(code, empty, empty, entry.message)
        return entry.reply

    def seal_batch() -> object:
        """A batch of one seal; its entry's refusal raised as `SealSegment`'s."""
        seal = m.SealSegmentRequest(
            stream="victim/lease",
            segment_epoch=driver.epoch,
            writer_epoch=driver.epoch,
            client_id="victim-driver",
            final_index=1,
            grant=driver.grant,
        )
        request = m.SealSegmentsRequest(seals=[seal])
        (entry,) = master_call(cluster, "SealSegments", request, token).seals
        if entry.code:
            code = next(c for c in Code if c.value[0] == entry.code)
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(code, empty, empty, entry.message)
        return entry.segment

    def lease_session() -> object:
        request = m.HoldLeaseSessionRequest(session=secrets.token_bytes(16))
        with grpc.insecure_channel(cluster.master_address) as channel:
            replies = master_pb2_grpc.MasterStub(channel).HoldLeaseSession(
                request, timeout=TIMEOUT_S, metadata=bearer(token)
            )
            first = next(iter(replies))
            replies.cancel()
            return first

    def subscribe() -> object:
        start = s.SubscribeRequest(start=s.SubscribeStart(segment=sealed.id, from_index=1))
        transport = Transport(token=token) if token else PLAINTEXT
        return subscribe_first(data_address_of(store), [start], transport, TIMEOUT_S)

    return {
        "Master/RegisterStore": master(
            "RegisterStore", m.RegisterStoreRequest(store_id="store0", address=store)
        ),
        "Master/StoreHeartbeat": master(
            "StoreHeartbeat", m.StoreHeartbeatRequest(store_id="store0")
        ),
        "Master/CreateTenant": master("CreateTenant", m.CreateTenantRequest(tenant="victim")),
        "Master/ListTenants": master("ListTenants", m.ListTenantsRequest()),
        "Master/CreateStream": master(
            "CreateStream",
            m.CreateStreamRequest(name="victim/more", policy=P(replicas=3, write_quorum=2)),
        ),
        "Master/CreateStreams": master(
            "CreateStreams",
            m.CreateStreamsRequest(
                streams=[
                    m.CreateStreamRequest(name="victim/many", policy=P(replicas=3, write_quorum=2))
                ]
            ),
        ),
        "Master/ListStreams": master("ListStreams", m.ListStreamsRequest(tenant="victim")),
        "Master/DescribeStream": master(
            "DescribeStream", m.DescribeStreamRequest(name="victim/data")
        ),
        "Master/DeleteStream": master("DeleteStream", m.DeleteStreamRequest(name="victim/data")),
        "Master/UndeleteStream": master(
            "UndeleteStream", m.UndeleteStreamRequest(name="victim/data")
        ),
        "Master/UpdateStream": master(
            "UpdateStream", m.UpdateStreamRequest(name="victim/data", retention_bytes=1)
        ),
        "Master/TrimStream": master(
            "TrimStream", m.TrimStreamRequest(name="victim/data", before_sequence=1 << 62)
        ),
        "Master/WriterHeartbeat": master(
            "WriterHeartbeat", m.WriterHeartbeatRequest(stream="victim/data", client_id="x")
        ),
        "Master/ReleaseLease": master(
            "ReleaseLease", m.ReleaseLeaseRequest(**lease, grant=driver.grant)
        ),
        "Master/HoldLease": hold,
        "Master/LeaseHeartbeat": lease_batch,
        "Master/HoldLeaseSession": lease_session,
        "Master/RollSegment": master(
            "RollSegment", m.RollSegmentRequest(**lease, grant=driver.grant)
        ),
        "Master/RollSegments": roll_batch,
        "Master/ListSegments": master("ListSegments", m.ListSegmentsRequest(stream="victim/data")),
        "Master/ReportReplica": master(
            "ReportReplica",
            m.ReportReplicaRequest(
                stream="victim/data", segment_epoch=1, store_address="x", problem="probe"
            ),
        ),
        "Master/SealSegment": master(
            "SealSegment",
            m.SealSegmentRequest(
                stream="victim/lease",
                segment_epoch=driver.epoch,
                writer_epoch=driver.epoch,
                client_id="victim-driver",
                final_index=1,
                grant=driver.grant,
            ),
        ),
        "Master/SealSegments": seal_batch,
        "Master/GetClusterStatus": master("GetClusterStatus", m.GetClusterStatusRequest()),
        "Master/DrainStore": master("DrainStore", m.DrainStoreRequest(store_id="store0")),
        "Master/Rebalance": master("Rebalance", m.RebalanceRequest(dry_run=True)),
        "Master/RequestRoll": master("RequestRoll", m.RequestRollRequest(stream="victim/data")),
        "Master/CreateToken": master(
            "CreateToken", m.CreateTokenRequest(tenant="victim", role=m.TOKEN_ROLE_ADMIN)
        ),
        "Master/RevokeToken": master("RevokeToken", m.RevokeTokenRequest(token_id="0" * 16)),
        "Master/RotateSigningKey": master("RotateSigningKey", m.RotateSigningKeyRequest()),
        "Master/ListSigningKeys": master("ListSigningKeys", m.ListSigningKeysRequest()),
        "Master/RevokeCertificate": master(
            "RevokeCertificate",
            m.RevokeCertificateRequest(
                certificate=m.RevokedCertificate(serial="abc", not_after_ms=1 << 62)
            ),
        ),
        "Master/ListRevokedCertificates": master(
            "ListRevokedCertificates", m.ListRevokedCertificatesRequest()
        ),
        "SegmentStore/Write": lambda: store_write(own, [write], token),
        "SegmentStore/Seal": on_store(
            own,
            "Seal",
            s.SealRequest(segment=driver.segment.id, new_epoch=driver.epoch, grant=driver.grant),
        ),
        "SegmentStore/Read": on_store(store, "Read", s.ReadRequest(segment=sealed.id)),
        "SegmentStore/Subscribe": subscribe,
        "SegmentStore/CopySegment": on_store(
            store,
            "CopySegment",
            s.CopySegmentRequest(
                segment=sealed.id,
                source_address=sealed.copy_set[1].address,
                source_data_address=sealed.copy_set[1].data_address,
                final_index=sealed.final_index,
                fence=sealed.id.epoch + 1,
            ),
        ),
        "SegmentStore/Digest": on_store(store, "Digest", s.DigestRequest(segment=sealed.id)),
        "SegmentStore/Delete": on_store(store, "Delete", s.DeleteRequest(segment=sealed.id)),
        "SegmentStore/GetSegmentState": on_store(
            store, "GetSegmentState", s.GetSegmentStateRequest(segment=sealed.id)
        ),
        "SegmentStore/ListSegmentRecords": on_store(
            store, "ListSegmentRecords", s.ListSegmentRecordsRequest()
        ),
    }


# Listings answer another tenant's token, showing it nothing of the victim.
# Answered to any authenticated caller: filtered to its own, or (a lease session) holding
# nothing until heartbeats that prove their leases bind them to it.
FILTERED = {
    "Master/ListTenants",
    "Master/ListStreams",
    "Master/GetClusterStatus",
    "Master/HoldLeaseSession",
}


def test_a_token_of_another_tenant_touches_and_sees_nothing_on_any_rpc(
    cluster: Cluster, victim: dict[str, Any]
) -> None:
    token, _ = create_token(cluster.master_address, "evil", m.TOKEN_ROLE_ADMIN)
    calls = every_rpc_as(cluster, victim, token)
    assert set(calls) == set(RPC_NEEDS), "every RPC of both services is tried"
    before = victim_snapshot(cluster, victim)
    for rpc, call in sorted(calls.items()):
        if rpc in FILTERED:
            reply = call()
            assert b"victim" not in reply.SerializeToString(), rpc  # type: ignore[attr-defined]
            continue
        error = refused(call)
        assert error.code() == Code.PERMISSION_DENIED, (rpc, error.code(), error.details())
        assert "victim" not in (error.details() or ""), (rpc, error.details())
    assert victim_snapshot(cluster, victim) == before


def test_a_read_token_reads_its_tenant_and_cannot_append_or_administer(
    cluster: Cluster, victim: dict[str, Any]
) -> None:
    token, _ = create_token(cluster.master_address, "victim", m.TOKEN_ROLE_READ)
    calls = every_rpc_as(cluster, victim, token)
    before = victim_snapshot(cluster, victim)
    reads = {
        "Master/ListTenants",
        "Master/ListStreams",
        "Master/DescribeStream",
        "Master/ListSegments",
        "Master/GetClusterStatus",
        "Master/ReportReplica",  # a reader's report: the store checks the replica first
        "Master/HoldLeaseSession",  # holds nothing by itself
        "SegmentStore/Read",
        "SegmentStore/Subscribe",
        "SegmentStore/Digest",
        "SegmentStore/GetSegmentState",
    }
    for rpc in sorted(reads):
        assert calls[rpc]() is not None, rpc
    listed = master_call(cluster, "ListStreams", m.ListStreamsRequest(), token).streams
    assert {info.name for info in listed} == {"victim/data", "victim/lease"}
    read = store_call(
        victim["sealed"].copy_set[0].address,
        "Read",
        s.ReadRequest(segment=victim["sealed"].id),
        token,
    )
    assert [e.payload for r in read for e in r.entries][:1] == [b"v1"]
    for rpc, call in sorted(calls.items()):
        if rpc in reads:
            continue
        error = refused(call)
        assert error.code() == Code.PERMISSION_DENIED, (rpc, error.details())
    assert victim_snapshot(cluster, victim) == before


def test_revoked_and_expired_tokens_are_refused_by_the_master_and_soon_by_stores(
    cluster: Cluster, victim: dict[str, Any]
) -> None:
    sealed: entry_pb2.Segment = victim["sealed"]
    stores = [r.address for r in sealed.copy_set]
    describe = m.DescribeStreamRequest(name="victim/data")
    state = s.GetSegmentStateRequest(segment=sealed.id)

    def store_refuses(token: str, why: str) -> bool:
        for address in stores:
            try:
                store_call(address, "GetSegmentState", state, token)
                return False
            except grpc.RpcError as error:
                assert error.code() == Code.UNAUTHENTICATED, error.details()
                assert why in (error.details() or ""), error.details()
        return True

    revoked, token_id = create_token(cluster.master_address, "victim", m.TOKEN_ROLE_READ)
    assert master_call(cluster, "DescribeStream", describe, revoked).name == "victim/data"
    for address in stores:
        assert store_call(address, "GetSegmentState", state, revoked).acked_index > 0
    # A live tail opened under the token ends once its store hears of the revocation.
    tail_end = asyncio.run(tail_across_revocation(cluster, stores[0], sealed.id, revoked, token_id))
    assert tail_end.code() == Code.UNAUTHENTICATED, tail_end.details()
    assert "revoked" in (tail_end.details() or "")
    error = refused(lambda: master_call(cluster, "DescribeStream", describe, revoked))
    assert error.code() == Code.UNAUTHENTICATED and "revoked" in (error.details() or "")
    # Stores hear of it with their next heartbeat (every store timeout / 4: 1.5 s).
    wait_for(lambda: store_refuses(revoked, "revoked"), 5.0, message="stores refuse it")

    expiring, _ = create_token(cluster.master_address, "victim", m.TOKEN_ROLE_READ, ttl_ms=2000)
    assert master_call(cluster, "DescribeStream", describe, expiring).name == "victim/data"

    def master_refuses() -> bool:
        try:
            master_call(cluster, "DescribeStream", describe, expiring)
        except grpc.RpcError as error:
            assert error.code() == Code.UNAUTHENTICATED and "expired" in (error.details() or "")
            return True
        return False

    wait_for(master_refuses, 5.0, message="the master refuses the expired token")
    assert store_refuses(expiring, "expired")
    # A token of this cluster's format but of no master at all.
    forged = "se1_" + "A" * 120
    error = refused(lambda: master_call(cluster, "DescribeStream", describe, forged))
    assert error.code() == Code.UNAUTHENTICATED
    assert store_refuses(forged, "not valid")


async def tail_across_revocation(
    cluster: Cluster, store: str, segment: entry_pb2.SegmentId, token: str, token_id: str
) -> grpc.aio.AioRpcError:
    """How a live tail under `token` on the store at `store` ends once the token is
    revoked (within the store's next heartbeat and a keepalive interval)."""

    async def requests() -> AsyncIterator[s.SubscribeRequest]:
        yield s.SubscribeRequest(
            start=s.SubscribeStart(segment=segment, from_index=1, keepalive_interval_ms=200)
        )
        while True:
            await asyncio.sleep(0.2)
            yield s.SubscribeRequest(keepalive=s.Keepalive(sent_at_ms=1))

    call = SubscribeCall(data_address_of(store), requests(), Transport(token=token))
    try:
        assert isinstance(await call.read(), s.SubscribeReply)
        revoke = m.RevokeTokenRequest(token_id=token_id)
        assert (await asyncio.to_thread(master_call, cluster, "RevokeToken", revoke)).revoked
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(5.0):
                async for _reply in call:
                    pass
    finally:
        call.cancel()
    return ended.value


def test_the_token_cli_creates_a_token_on_stdout_and_revokes_it(cluster: Cluster) -> None:
    from tests.integration.test_cli import run_cli

    make_stream(cluster, "cli/s")
    master = ["--master", cluster.master_address]
    made = run_cli("token", "create", "--tenant", "cli", "--role", "read", "--ttl", "1h", *master)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert made.stdout == token + "\n" and token.startswith("se1_")
    token_id = made.stderr.split()[1].rstrip(":")
    listed = master_call(cluster, "ListStreams", m.ListStreamsRequest(), token).streams
    assert [info.name for info in listed] == ["cli/s"]
    assert run_cli("token", "revoke", token_id, *master).returncode == 0
    again = run_cli("token", "revoke", token_id, *master)
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
    assert run_cli("token", "create", "--tenant", "cli", "--role", "root", *master).returncode == 2
    bad_ttl = run_cli(
        "token", "create", "--tenant", "cli", "--role", "read", "--ttl", "1y", *master
    )
    assert bad_ttl.returncode == 2


# ---- quotas ----


def test_quotas_refuse_streams_past_the_limit_and_hold_appends_to_the_rate(tmp_path: Path) -> None:
    rate = 100_000
    ports = {}

    def metrics_port(number: int) -> list[str]:
        ports[number] = free_port()
        return ["--metrics-port", str(ports[number])]

    master_args = [
        "--lease-ms",
        "1000",
        "--tenant-streams-max",
        "2",
        "--tenant-append-bytes-per-s",
        str(rate),
    ]
    with running_cluster(
        tmp_path, stores=3, master_args=master_args, store_args_for=metrics_port
    ) as quota_cluster:
        make_stream(quota_cluster, "q/one")
        make_stream(quota_cluster, "q/two")
        error = refused(lambda: make_stream(quota_cluster, "q/three"))
        assert error.code() == Code.RESOURCE_EXHAUSTED and "quota" in (error.details() or "")
        listed = master_call(quota_cluster, "ListStreams", m.ListStreamsRequest(tenant="q"))
        assert [info.name for info in listed.streams] == ["q/one", "q/two"]
        make_stream(quota_cluster, "other/one")  # another tenant has its own count

        # 500 KB in ten appends of 50 KB, one after the other: a second of burst,
        # then the rate; at least 4 s at 100 KB/s.
        batches = [[bytes([b]) * 1000 for _ in range(50)] for b in range(10)]

        async def append() -> None:
            async with (
                StreamClient(quota_cluster.master_address) as client,
                client.writer("q/one", leadership_timeout_s=15) as writer,
            ):
                for batch in batches:
                    await writer.append_batch(batch)

        started = time.monotonic()
        asyncio.run(append())
        elapsed = time.monotonic() - started
        assert elapsed >= 3.5, elapsed
        refusals = [
            metric_value(port, "streamengine_store_refused_quota_total") for port in ports.values()
        ]
        assert sum(refusals) > 0, refusals


# ---- over TLS: tokens through the SDK and the CLI ----


def test_over_tls_a_tenant_is_its_token_through_the_sdk_and_the_cli(tmp_path: Path) -> None:
    """A cluster admin (client.root) makes tokens with the CLI; a tenant holding ca.crt
    and a write token leads and appends through the SDK, one with a read token reads but
    cannot lead, and a caller with neither certificate nor token is refused."""
    from streamengine.client import PermissionDenied
    from tests.integration.test_cli import run_cli

    with running_cluster(tmp_path, stores=3, master_args=["--lease-ms", "1000"], tls=True) as tls:
        assert tls.certs is not None
        admin = ["--master", tls.master_address, "--certs-dir", str(tls.certs.client_dir)]
        assert run_cli("stream", "create", "acme/orders", *admin).returncode == 0
        assert run_cli("stream", "create", "other/secret", *admin).returncode == 0
        tokens = {}
        for role in ("read", "write"):
            made = run_cli("token", "create", "--tenant", "acme", "--role", role, *admin)
            assert made.returncode == 0, made.stderr
            tokens[role] = made.stdout.strip()
        tenant_dir = tls.certs.tenant_dir

        async def as_tenant(token: str | None) -> list[str]:
            async with StreamClient(
                tls.master_address, certs_dir=tenant_dir, token=token
            ) as client:
                if token == tokens["write"]:
                    async with client.writer("acme/orders", leadership_timeout_s=15) as writer:
                        await writer.append_batch([b"one", b"two"])
                events = [e.payload async for e in client.read("acme/orders")]
                info = await client.describe_stream("acme/orders")
                return [info.name, *(p.decode() for p in events)]

        assert asyncio.run(as_tenant(tokens["write"])) == ["acme/orders", "one", "two"]
        assert asyncio.run(as_tenant(tokens["read"])) == ["acme/orders", "one", "two"]

        async def lead_with_read_token() -> None:
            async with (
                StreamClient(
                    tls.master_address, certs_dir=tenant_dir, token=tokens["read"]
                ) as client,
                client.writer("acme/orders", leadership_timeout_s=15),
            ):
                pass

        with pytest.raises(PermissionDenied):
            asyncio.run(lead_with_read_token())
        with pytest.raises(PermissionDenied):
            asyncio.run(as_tenant(None))  # ca.crt alone: anonymous
        reader = ["--master", tls.master_address, "--certs-dir", str(tenant_dir)]
        token_file = tmp_path / "read.token"
        token_file.write_text(tokens["read"] + "\n")
        listed = run_cli("stream", "list", "--json", *reader, "--token-file", str(token_file))
        assert listed.returncode == 0 and listed.stderr == "", listed.stderr
        assert "acme/orders" in listed.stdout and "other" not in listed.stdout
        as_env = {"STREAMENGINE_TOKEN": tokens["read"]}
        refused = run_cli("stream", "create", "acme/more", *reader, env=as_env)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        typed = run_cli("stream", "list", "--json", *reader, "--token", tokens["read"])
        assert typed.returncode == 0 and "acme/orders" in typed.stdout
        assert "visible to other users" in typed.stderr
