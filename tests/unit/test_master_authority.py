"""The master's authority: the grants it gives, who holds an epoch, its signing key,
tokens and quotas. Pure decisions as tables; the state over a real catalog."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from streamengine.master.core.authority import (
    check_grant_ms,
    check_holder,
    grant_expiry,
    grant_of,
    stream_tenant,
    visible_status,
)
from streamengine.master.core.errors import InvalidArgument, PermissionDenied, QuotaExceeded
from streamengine.master.core.model import SegmentRecord, SegmentState, StreamRecord
from streamengine.protocol.auth import ANONYMOUS, INSECURE, Principal, PrincipalKind, Role
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner, open_grant
from streamengine.protocol.signing import SigningKey, Verifier
from streamengine.protocol.tokens import mint_token, open_token
from streamengine.v1 import entry_pb2, master_pb2
from tests.metadata_backends import MetadataPlace, RocksDBPlace
from tests.unit.test_master_state import LEASE, Master, beat

STREAM = StreamRecord("acme/orders", 7, 3, 2, 1 << 20, 60_000, 9, "w1", 0)


def segment(epoch: int, copy_set: tuple[str, ...], state: SegmentState) -> SegmentRecord:
    return SegmentRecord(7, "acme/orders", epoch, copy_set, state, 0, 0, 0, 0)


def test_a_grant_lists_the_unsealed_segments_then_its_own_with_their_copy_sets() -> None:
    own = segment(9, ("a", "b", "c"), SegmentState.OPEN)
    earlier = [segment(5, ("d", "e", "f"), SegmentState.SEALING)]
    assert grant_of(STREAM, 9, "w1", own, earlier, 5000) == Grant(
        7,
        9,
        "acme",
        "w1",
        (GrantSegment(5, ("d", "e", "f")), GrantSegment(9, ("a", "b", "c"))),
        5000,
        "acme/orders",
        2,
    )
    without_segment = grant_of(STREAM, 9, "w1", None, earlier, 5000)
    assert without_segment.segment(9) is None and without_segment.segment(5) is not None


@pytest.mark.parametrize(
    ("case", "now", "handed", "expires"),
    [
        ("the first grant of a stream", 1000, None, 11_000),
        ("more than half left: the same expiry", 1000, (9, 6001), 6001),
        ("half left: renewed", 1000, (9, 6000), 11_000),
        ("expired already: renewed", 7000, (9, 6001), 17_000),
        ("another epoch's grant: a fresh one", 1000, (8, 9000), 11_000),
    ],
)
def test_a_grant_is_renewed_once_half_of_it_is_left(
    case: str, now: int, handed: tuple[int, int] | None, expires: int
) -> None:
    assert grant_expiry(now, 9, handed, 10_000) == expires, case


def test_a_grant_must_outlast_leases_between_its_renewals() -> None:
    check_grant_ms(8000, 2000)
    with pytest.raises(InvalidArgument, match="at least 8000 ms"):
        check_grant_ms(7999, 2000)


def test_a_leader_renewing_its_lease_gets_a_grant_renewed_before_it_expires(
    master: Master,
) -> None:
    grant_ms = master.state.grant_ms
    first = beat(master, "w1").grant()
    assert first.expires_at_ms == master.now + grant_ms
    master.now += grant_ms // 2 - 1
    assert beat(master, "w1", first.epoch).grant() == first  # nothing new to sign
    master.now += 1
    renewed = beat(master, "w1", first.epoch).grant()
    assert renewed.expires_at_ms == master.now + grant_ms and renewed.epoch == first.epoch


def test_a_sealed_segment_is_never_given_to_seal_again() -> None:
    with pytest.raises(AssertionError):
        grant_of(STREAM, 9, "w1", None, [segment(5, ("d",), SegmentState.SEALED)], 5000)


KEY = SigningKey(bytes(range(32)))
GRANT = GrantSigner(KEY).sign(
    Grant(7, 9, "acme", "w1", (GrantSegment(5, ("d",)), GrantSegment(9, ("a",))), 5000)
)
FORGED = GrantSigner(SigningKey(bytes(32))).sign(Grant(7, 9, "acme", "w1", (), 5000))


@pytest.mark.parametrize(
    ("signed", "admin", "epoch", "client", "segment_epoch", "refusal"),
    [
        (GRANT, False, 9, "w1", None, None),
        (GRANT, False, 9, "w1", 5, None),
        (b"", True, 9, "anyone", 5, None),  # a cluster admin goes without
        (GRANT, True, 9, "w2", None, "another client"),  # but a grant shown must fit
        (b"", False, 9, "w1", None, "needs the master's grant"),
        (FORGED, False, 9, "w1", None, "a key this cluster does not hold"),
        (GRANT[:-1], False, 9, "w1", None, "the grant shown"),
        (GRANT, False, 9, "w2", None, "another client"),  # a published client id
        (GRANT, False, 10, "w1", None, "not of epoch 10"),
        (GRANT, False, 9, "w1", 7, "does not list segment 7"),
        (
            GrantSigner(KEY).sign(Grant(8, 9, "acme", "w1", (), 5000)),
            False,
            9,
            "w1",
            None,
            "stream 8",
        ),
    ],
)
def test_check_holder(
    signed: bytes,
    admin: bool,
    epoch: int,
    client: str,
    segment_epoch: int | None,
    refusal: str | None,
) -> None:
    verifier = Verifier([KEY.public_key])
    if refusal is None:
        check_holder(verifier, signed, admin, STREAM, epoch, client, segment_epoch)
        return
    with pytest.raises(PermissionDenied, match=refusal):
        check_holder(verifier, signed, admin, STREAM, epoch, client, segment_epoch)


@pytest.mark.parametrize(
    ("name", "tenant"), [("acme/orders", "acme"), ("acme", "acme"), ("", ""), ("a/b/c", "a")]
)
def test_stream_tenant(name: str, tenant: str) -> None:
    assert stream_tenant(name) == tenant


# ---- the state: key, grants, tokens, quotas ----


@pytest.fixture
def master(metadata_place: MetadataPlace) -> Iterator[Master]:
    """Four stores and the stream t/s, past the start-up window, over each back end."""
    started = Master(metadata_place)
    started.stores("a", "b", "c", "d")
    started.state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, started.now)
    started.now += LEASE
    yield started


def test_the_signing_key_is_made_once_and_kept_across_restarts(
    metadata_place: MetadataPlace, tmp_path: Path
) -> None:
    """A restart, or a standby becoming active on the same metadata, signs with the
    same key; another cluster's metadata holds another one."""
    first = Master(metadata_place)
    key = first.state.keys.signing(first.now).public_key
    assert first.restart().keys.signing(first.now).public_key == key
    other = RocksDBPlace(tmp_path / "other")
    try:
        assert Master(other).state.keys.signing(0).public_key != key
    finally:
        other.close()


def test_a_leader_view_grants_its_epoch_with_what_it_must_seal(master: Master) -> None:
    first = beat(master, "w1")
    grant = first.grant()
    assert (grant.epoch, grant.client_id, grant.tenant) == (1, "w1", "t")
    assert [s.epoch for s in grant.segments] == [1]
    master.now += LEASE + 1
    second = beat(master, "w2")
    grant = second.grant()
    assert [s.epoch for s in grant.segments] == [1, 2]
    assert grant.segments[0].copy_set == first.grant().segments[0].copy_set
    key = master.state.keys.signing(master.now)
    signed = GrantSigner(key).sign(grant)
    assert open_grant(Verifier([key.public_key]), signed) == grant


def test_tokens_are_signed_kept_revoked_and_forgotten_once_expired(master: Master) -> None:
    state = master.state
    now = master.now
    claims = state.issuer.create_token("0123456789abcdef", "fresh", int(Role.READ), 10_000, now)
    assert "fresh" in state.tenants  # a token for a new tenant creates it
    assert (claims.role, claims.expires_at_ms) == (Role.READ, now + 10_000)
    assert state.issuer.revoke_token("0123456789abcdef", now + 1)
    assert not state.issuer.revoke_token("0123456789abcdef", now + 2)  # once
    assert not state.issuer.revoke_token("ffffffffffffffff", now + 2)  # never issued
    version = state.issuer.current_revocations(now + 2).version
    assert version == 1 and "0123456789abcdef" in state.issuer.current_revocations(now + 2)
    restarted = master.restart()
    assert "0123456789abcdef" in restarted.issuer.current_revocations(now + 2)
    assert restarted.issuer.current_revocations(now + 2).version == version
    # Expired: refused as expired anyway; the revocation and the record go.
    assert "0123456789abcdef" not in restarted.issuer.current_revocations(now + 10_000)
    restarted.issuer.create_token("fedcba9876543210", "fresh", int(Role.WRITE), 0, now + 10_001)
    assert "0123456789abcdef" not in master.restart().tokens


def test_a_token_the_master_mints_verifies_with_its_key(master: Master) -> None:
    claims = master.state.issuer.create_token(
        "0123456789abcdef", "t", int(Role.ADMIN), 0, master.now
    )
    key = master.state.keys.signing(master.now)
    token = mint_token(key, claims)
    assert open_token(Verifier([key.public_key]), token) == claims


@pytest.mark.parametrize(
    ("role", "ttl_ms"), [(0, 1000), (4, 1000), (1, 10), (1, 400 * 24 * 3600 * 1000)]
)
def test_tokens_with_an_unknown_role_or_lifetime_are_refused(
    master: Master, role: int, ttl_ms: int
) -> None:
    with pytest.raises(InvalidArgument):
        master.state.issuer.create_token("0123456789abcdef", "t", role, ttl_ms, master.now)
    assert "0123456789abcdef" not in master.state.tokens


def test_a_token_limited_to_streams_reads_only_those_of_its_tenant_and_is_kept(
    master: Master,
) -> None:
    state = master.state
    own = state.streams["t/s"].stream_id
    state.tenancy.create_stream("u/other", 1, 1, 0, 0, True, master.now)
    other = state.streams["u/other"].stream_id
    refusals = [
        (int(Role.WRITE), [own], "only a read token"),
        (int(Role.READ), [own, other], f"no stream {other} in tenant t"),
        (int(Role.READ), list(range(1, 66)), "at most 64 streams"),
    ]
    for role, streams, refusal in refusals:
        with pytest.raises(InvalidArgument, match=refusal):
            state.issuer.create_token("0123456789abcdef", "t", role, 0, master.now, streams)
        assert "0123456789abcdef" not in state.tokens
    claims = state.issuer.create_token(
        "0123456789abcdef", "t", int(Role.READ), 0, master.now, [own, own]
    )
    assert claims.stream_ids == (own,)
    assert master.restart().tokens["0123456789abcdef"].stream_ids == (own,)


def test_a_tenant_at_its_stream_quota_creates_no_more(master: Master) -> None:
    state = master.state
    state.tenant_streams_max = 2
    for name in ("a/one", "a/two", "b/one"):
        state.tenancy.create_stream(name, 1, 1, 0, 0, True, master.now)
    with pytest.raises(QuotaExceeded, match="tenant 'a' holds 2 streams"):
        state.tenancy.create_stream("a/three", 1, 1, 0, 0, True, master.now)
    assert "a/three" not in state.streams
    # The same stream again is no new stream.
    assert state.tenancy.create_stream("a/one", 1, 1, 0, 0, True, master.now).name == "a/one"


# ---- what a caller sees of the cluster's status (GetClusterStatus and the console) ----


def _full_status() -> master_pb2.ClusterStatus:
    def segment(stream: str) -> entry_pb2.SegmentId:
        return entry_pb2.SegmentId(stream_id=1, epoch=1, stream=stream)

    return master_pb2.ClusterStatus(
        cluster_id="cluster-test",
        stores=[master_pb2.StoreStatus(store_id="store0")],
        streams=[master_pb2.StreamInfo(name=n) for n in ("acme/a", "globex/b")],
        under_replicated=[entry_pb2.Segment(id=segment(n)) for n in ("acme/a", "globex/b")],
        verifying=[entry_pb2.Segment(id=segment(n)) for n in ("acme/a", "globex/b")],
        tasks=[master_pb2.RepairTask(segment=segment(n)) for n in ("acme/a", "globex/b", "")],
        granting_leases=True,
        durability_debt=[
            master_pb2.SegmentDebt(segment=segment(n)) for n in ("acme/a", "globex/b")
        ],
        bytes_below_n=7,
        bytes_below_w=3,
        pending_deletes=[master_pb2.PendingDelete(stream=n) for n in ("acme/a", "globex/b")],
        replica_verification=master_pb2.ReplicaVerification(matched=4, unmatched=2, bad=1),
        tenant_streams=[master_pb2.TenantStreams(tenant=t, streams=1) for t in ("acme", "globex")],
    )


@pytest.mark.parametrize(
    ("principal", "streams", "sums"),
    [
        (Principal(PrincipalKind.CLUSTER_ADMIN, "root"), {"acme/a", "globex/b"}, (7, 3)),
        (INSECURE, {"acme/a", "globex/b"}, (7, 3)),
        (Principal(PrincipalKind.STORE, "store0"), {"acme/a", "globex/b"}, (7, 3)),
        (Principal(PrincipalKind.TENANT, "t", "acme", Role.READ), {"acme/a"}, (0, 0)),
        (ANONYMOUS, set(), (0, 0)),  # refused before it sees anything (authorize)
    ],
)
def test_a_caller_sees_the_status_of_its_tenants_only(
    principal: Principal, streams: set[str], sums: tuple[int, int]
) -> None:
    seen = visible_status(_full_status(), principal)
    assert [s.store_id for s in seen.stores] == ["store0"]  # stores are everyone's
    assert {s.name for s in seen.streams} == streams
    assert {s.id.stream for s in seen.under_replicated} == streams
    assert {s.id.stream for s in seen.verifying} == streams
    assert {t.segment.stream for t in seen.tasks} == streams  # a task of no stream: nobody's
    assert {d.segment.stream for d in seen.durability_debt} == streams
    assert {p.stream for p in seen.pending_deletes} == streams
    assert {f"{t.tenant}/{'ab'[t.tenant == 'globex']}" for t in seen.tenant_streams} == streams
    assert seen.granting_leases
    assert seen.cluster_id == "cluster-test"  # everyone's, as the stores are
    # A field added to the status is shown to nobody until it is filtered here.
    assert [f.name for f in master_pb2.ClusterStatus.DESCRIPTOR.fields] == [
        "stores",
        "streams",
        "under_replicated",
        "tasks",
        "granting_leases",
        "durability_debt",
        "bytes_below_n",
        "bytes_below_w",
        "pending_deletes",
        "cluster_id",
        "replica_verification",
        "verifying",
        "tenant_streams",
    ]
    assert (seen.bytes_below_n, seen.bytes_below_w) == sums
    checked = seen.replica_verification
    assert (checked.matched, checked.unmatched, checked.bad) == (
        (4, 2, 1) if sums != (0, 0) else (0, 0, 0)
    )
