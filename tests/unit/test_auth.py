"""The permission table: every RPC, every kind of caller."""

from __future__ import annotations

import pytest

from streamengine.protocol import framing
from streamengine.protocol.auth import (
    ANONYMOUS,
    INSECURE,
    RPC_NEEDS,
    Principal,
    PrincipalKind,
    Role,
    authorize,
    identity_from_auth_context,
    visible_tenant,
)
from streamengine.v1 import master_pb2, segment_store_pb2

MASTER = Principal(PrincipalKind.MASTER, "master")
STORE = Principal(PrincipalKind.STORE, "s1")
ADMIN = Principal(PrincipalKind.CLUSTER_ADMIN, "root")


def tenant(role: Role, name: str = "t1") -> Principal:
    return Principal(PrincipalKind.TENANT, "tok", tenant=name, role=role, token_id="id1")


def test_every_rpc_of_both_services_and_the_data_plane_has_a_rule() -> None:
    services = {
        "Master": master_pb2.DESCRIPTOR.services_by_name["Master"],
        "SegmentStore": segment_store_pb2.DESCRIPTOR.services_by_name["SegmentStore"],
    }
    rpcs = {f"{name}/{m.name}" for name, svc in services.items() for m in svc.methods}
    data_plane = {method.name for method in framing.METHODS.values()}
    assert not rpcs & data_plane, "a method is served on one transport"
    assert rpcs | data_plane == set(RPC_NEEDS)


@pytest.mark.parametrize(
    ("principal", "rpc", "tenant_name", "allowed"),
    [
        (INSECURE, "SegmentStore/Delete", "", True),
        (ANONYMOUS, "Master/ListStreams", "", False),
        (STORE, "Master/RegisterStore", "", True),
        (ADMIN, "Master/RegisterStore", "", False),
        (tenant(Role.ADMIN), "Master/StoreHeartbeat", "", False),
        (MASTER, "SegmentStore/Delete", "", True),
        (STORE, "SegmentStore/Delete", "", False),
        (ADMIN, "SegmentStore/Delete", "", False),
        (MASTER, "SegmentStore/CopySegment", "", True),
        (STORE, "SegmentStore/Read", "t1", True),
        (STORE, "SegmentStore/Write", "t1", False),
        (MASTER, "SegmentStore/Seal", "t1", False),
        (ADMIN, "Master/DrainStore", "", True),
        (tenant(Role.ADMIN), "Master/DrainStore", "", False),
        (tenant(Role.ADMIN), "Master/CreateTenant", "", False),
        (ADMIN, "SegmentStore/Write", "t1", True),
        (tenant(Role.READ), "SegmentStore/Read", "t1", True),
        (tenant(Role.READ), "SegmentStore/Write", "t1", False),
        (tenant(Role.READ), "Master/WriterHeartbeat", "t1", False),
        (tenant(Role.WRITE), "Master/WriterHeartbeat", "t1", True),
        (tenant(Role.WRITE), "Master/CreateStream", "t1", False),
        (tenant(Role.ADMIN), "Master/CreateStream", "t1", True),
        (tenant(Role.ADMIN), "Master/DeleteStream", "t2", False),
        (tenant(Role.WRITE), "Master/TrimStream", "t1", False),
        (tenant(Role.ADMIN), "Master/TrimStream", "t1", True),
        (tenant(Role.WRITE), "Master/UndeleteStream", "t1", False),
        (tenant(Role.ADMIN), "Master/UpdateStream", "t1", True),
        (tenant(Role.READ), "SegmentStore/Read", "t2", False),
        (tenant(Role.READ), "Master/ListStreams", "", True),
    ],
)
def test_authorize(principal: Principal, rpc: str, tenant_name: str, allowed: bool) -> None:
    denial = authorize(principal, rpc, tenant_name)
    assert (denial is None) == allowed, denial


def test_a_denial_on_another_tenant_does_not_name_it() -> None:
    denial = authorize(tenant(Role.ADMIN, "alpha"), "Master/DescribeStream", "bravo")
    assert denial is not None and "bravo" not in denial.reason


def test_listings_show_a_tenant_token_only_its_own_tenant() -> None:
    assert visible_tenant(tenant(Role.READ, "alpha"), "alpha")
    assert not visible_tenant(tenant(Role.READ, "alpha"), "bravo")
    assert visible_tenant(ADMIN, "bravo")
    assert not visible_tenant(ANONYMOUS, "bravo")


def test_a_tenant_principal_needs_a_tenant_and_a_role() -> None:
    with pytest.raises(AssertionError):
        Principal(PrincipalKind.TENANT, "tok")
    with pytest.raises(AssertionError):
        Principal(PrincipalKind.STORE)


def ssl_context(
    *uris: str, common_name: str = "x", dns: tuple[str, ...] = ()
) -> dict[str, list[bytes]]:
    """What grpcio 1.85 shows of a verified client certificate: every SAN untyped in
    `x509_subject_alternative_name`, the URI ones again in `peer_uri`."""
    return {
        "transport_security_type": [b"ssl"],
        "x509_common_name": [common_name.encode()],
        "x509_subject_alternative_name": [san.encode() for san in (*dns, *uris)],
        "peer_uri": [uri.encode() for uri in uris],
        "peer_dns": [name.encode() for name in dns],
    }


@pytest.mark.parametrize(
    ("auth_context", "expected"),
    [
        ({"transport_security_type": [b"insecure"]}, INSECURE),
        ({}, INSECURE),
        (ssl_context("urn:streamengine:master", dns=("localhost",)), MASTER),
        (ssl_context("urn:streamengine:store:s1", dns=("localhost",)), STORE),
        # A DNS name spelled like an identity is no identity.
        (ssl_context(dns=("urn:streamengine:admin",), common_name="root"), ANONYMOUS),
        (ssl_context("urn:streamengine:store:"), ANONYMOUS),
        (ssl_context("urn:streamengine:admin", common_name="root"), ADMIN),
        (ssl_context(dns=("localhost",), common_name="root"), ANONYMOUS),
        (ssl_context("urn:streamengine:master", "urn:streamengine:admin"), ANONYMOUS),
        (ssl_context(), ANONYMOUS),
    ],
)
def test_identity_from_auth_context(
    auth_context: dict[str, list[bytes]], expected: Principal
) -> None:
    assert identity_from_auth_context(auth_context) == expected


LIMITED = Principal(
    PrincipalKind.TENANT, "tok", tenant="t1", role=Role.READ, token_id="id2", stream_ids=(5, 9)
)


@pytest.mark.parametrize(
    ("rpc", "stream_id", "refusal"),
    [
        ("SegmentStore/Read", 5, None),
        ("Master/ListSegments", 9, None),
        ("SegmentStore/Read", 6, "limited to streams 5, 9; this call touches stream 6"),
        ("Master/DescribeStream", 0, "this call touches no one stream"),
        ("Master/ListStreams", 0, "limited to streams"),  # a listing shows the others
        ("Master/GetClusterStatus", 0, "limited to streams"),
        ("SegmentStore/Write", 5, "needs role write"),  # its role still holds
    ],
)
def test_a_token_limited_to_streams_touches_them_alone(
    rpc: str, stream_id: int, refusal: str | None
) -> None:
    denial = authorize(LIMITED, rpc, "t1", stream_id)
    if refusal is None:
        assert denial is None
    else:
        assert denial is not None and refusal in denial.reason
