"""Who may call what: principals, tenant roles, and the permission every RPC needs.

Pure. A server turns a call into a `Principal` (from the TLS peer certificate and the
`authorization` metadata), then asks `authorize(principal, rpc, tenant)`; the answer is a
`Denial` with the reason to send as PERMISSION_DENIED, or None.

Identities in certificates: every certificate the cluster's CA signs carries exactly one
URI SAN naming what it is (`MEMBER_URI_MASTER`, `store_uri(store_id)`, `ADMIN_URI`);
a certificate without one proves nothing beyond being signed by the CA.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Request metadata carrying a tenant token: `authorization: Bearer <token>`.
AUTHORIZATION_METADATA_KEY = "authorization"
BEARER_PREFIX = "Bearer "

URI_PREFIX = "urn:streamengine:"
MEMBER_URI_MASTER = URI_PREFIX + "master"
STORE_URI_PREFIX = URI_PREFIX + "store:"
ADMIN_URI = URI_PREFIX + "admin"


def store_uri(store_id: str) -> str:
    return STORE_URI_PREFIX + store_id


class Role(enum.IntEnum):
    """A tenant token's role; each includes the ones below it."""

    READ = 1  # describe, list, read, subscribe, Spark
    WRITE = 2  # + lead, append, seal the tenant's streams
    ADMIN = 3  # + create, update, trim, delete and undelete the tenant's streams


class PrincipalKind(enum.Enum):
    MASTER = "master"  # a master's node certificate
    STORE = "store"  # a store's node certificate, naming its store id
    CLUSTER_ADMIN = "cluster-admin"  # client.root, or a client certificate marked admin
    TENANT = "tenant"  # a valid, unrevoked tenant token
    # A server started without certificates (loopback, or --insecure): nothing is
    # authenticated, so nothing is refused by identity, as before security existed.
    UNAUTHENTICATED_INSECURE = "insecure"
    ANONYMOUS = "anonymous"  # TLS, but neither a member, an admin nor a token


@dataclass(frozen=True)
class Principal:
    kind: PrincipalKind
    # Store id (STORE), certificate or token name (CLUSTER_ADMIN, TENANT), for logs.
    name: str = ""
    tenant: str = ""  # TENANT only
    role: Role | None = None  # TENANT only
    token_id: str = ""  # TENANT only
    # TENANT only: the streams its token is limited to (empty: all of its tenant's).
    stream_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert (self.kind is PrincipalKind.TENANT) == bool(self.tenant), self
        assert self.kind is PrincipalKind.TENANT or not self.stream_ids, self
        assert (self.kind is PrincipalKind.TENANT) == (self.role is not None), self
        assert self.kind is not PrincipalKind.STORE or self.name, self


INSECURE = Principal(PrincipalKind.UNAUTHENTICATED_INSECURE)
ANONYMOUS = Principal(PrincipalKind.ANONYMOUS)


class Need(enum.Enum):
    """What an RPC requires of its caller."""

    MEMBER_STORE = "a store's certificate"
    MEMBER_MASTER = "the master's certificate"
    CLUSTER_ADMIN = "a cluster admin"
    # Tenant roles: a token of the request's tenant with at least this role, or a
    # cluster admin. Reads are also open to cluster members (copies, repair, scrub).
    TENANT_READ = "role read in the tenant"
    TENANT_WRITE = "role write in the tenant"
    TENANT_ADMIN = "role admin in the tenant"
    # Any authenticated caller; the reply is filtered to what it may see.
    ANY_FILTERED = "an authenticated caller"


RPC_NEEDS: dict[str, Need] = {
    # master
    "Master/RegisterStore": Need.MEMBER_STORE,
    "Master/StoreHeartbeat": Need.MEMBER_STORE,
    "Master/CreateTenant": Need.CLUSTER_ADMIN,
    "Master/ListTenants": Need.ANY_FILTERED,
    "Master/CreateStream": Need.TENANT_ADMIN,
    "Master/CreateStreams": Need.TENANT_ADMIN,
    "Master/ListStreams": Need.ANY_FILTERED,
    "Master/DescribeStream": Need.TENANT_READ,
    "Master/DeleteStream": Need.TENANT_ADMIN,
    "Master/UndeleteStream": Need.TENANT_ADMIN,
    "Master/UpdateStream": Need.TENANT_ADMIN,
    "Master/TrimStream": Need.TENANT_ADMIN,
    "Master/WriterHeartbeat": Need.TENANT_WRITE,
    "Master/ReleaseLease": Need.TENANT_WRITE,
    "Master/HoldLease": Need.TENANT_WRITE,
    # Each entry is authorized on its own (TENANT_WRITE in the stream's tenant).
    "Master/LeaseHeartbeat": Need.TENANT_WRITE,
    # Holds nothing by itself: leases are bound to it by heartbeats that prove them.
    "Master/HoldLeaseSession": Need.ANY_FILTERED,
    "Master/RollSegment": Need.TENANT_WRITE,
    # Each entry is authorized on its own, as a RollSegment.
    "Master/RollSegments": Need.TENANT_WRITE,
    "Master/ListSegments": Need.TENANT_READ,
    "Master/SealSegment": Need.TENANT_WRITE,
    # Each entry is authorized on its own, as a SealSegment.
    "Master/SealSegments": Need.TENANT_WRITE,
    "Master/ReportReplica": Need.TENANT_READ,
    "Master/GetClusterStatus": Need.ANY_FILTERED,
    "Master/DrainStore": Need.CLUSTER_ADMIN,
    "Master/Rebalance": Need.CLUSTER_ADMIN,
    "Master/RequestRoll": Need.TENANT_WRITE,
    "Master/CreateToken": Need.CLUSTER_ADMIN,
    "Master/RevokeToken": Need.CLUSTER_ADMIN,
    "Master/RotateSigningKey": Need.CLUSTER_ADMIN,
    "Master/ListSigningKeys": Need.CLUSTER_ADMIN,
    "Master/RevokeCertificate": Need.CLUSTER_ADMIN,
    "Master/ListRevokedCertificates": Need.CLUSTER_ADMIN,
    # segment store
    "SegmentStore/Write": Need.TENANT_WRITE,
    "SegmentStore/Seal": Need.TENANT_WRITE,
    "SegmentStore/Read": Need.TENANT_READ,
    "SegmentStore/Subscribe": Need.TENANT_READ,
    "SegmentStore/CopySegment": Need.MEMBER_MASTER,
    "SegmentStore/Digest": Need.TENANT_READ,
    "SegmentStore/Delete": Need.MEMBER_MASTER,
    "SegmentStore/GetSegmentState": Need.TENANT_READ,
    "SegmentStore/ListSegmentRecords": Need.MEMBER_MASTER,
}

# The master's console (HTTP, on its metrics port): the status page's data is what
# GetClusterStatus answers, filtered alike; the metrics are cluster-wide sums.
CONSOLE_NEEDS: dict[str, Need] = {
    "/api/status": Need.ANY_FILTERED,
    "/metrics": Need.CLUSTER_ADMIN,
}

_ROLE_OF_NEED = {
    Need.TENANT_READ: Role.READ,
    Need.TENANT_WRITE: Role.WRITE,
    Need.TENANT_ADMIN: Role.ADMIN,
}


@dataclass(frozen=True)
class Denial:
    reason: str


def authorize(
    principal: Principal, rpc: str, tenant: str = "", stream_id: int = 0
) -> Denial | None:
    """None when `principal` may call `rpc` ("Service/Method") on `tenant`'s data.

    `tenant` is the tenant the request touches (empty when it names none), `stream_id`
    the stream (0 when the server does not tell it: a principal limited to streams is
    then refused, `limited_to`). The rules
    that depend on more than identity (the epoch holder for SealSegment, a valid grant
    for Write and Seal, the store id of RegisterStore) are checked by the servers beside
    this one.
    """
    return authorize_need(principal, RPC_NEEDS[rpc], rpc, tenant, stream_id)


def authorize_need(
    principal: Principal, need: Need, rpc: str, tenant: str = "", stream_id: int = 0
) -> Denial | None:
    """`authorize` for a call that needs `need`; `rpc` names it in a denial."""
    kind = principal.kind
    if kind is PrincipalKind.UNAUTHENTICATED_INSECURE:
        return None
    if kind is PrincipalKind.ANONYMOUS:
        return Denial(f"{rpc} needs {need.value}; the caller presented no certificate or token")
    if need is Need.MEMBER_STORE:
        return None if kind is PrincipalKind.STORE else _denied(principal, rpc, need)
    if need is Need.MEMBER_MASTER:
        return None if kind is PrincipalKind.MASTER else _denied(principal, rpc, need)
    if kind is PrincipalKind.CLUSTER_ADMIN:
        return None
    if need is Need.CLUSTER_ADMIN:
        return _denied(principal, rpc, need)
    if principal.stream_ids:
        denial = limited_to(principal, rpc, stream_id)
        if denial is not None:
            return denial
    if need is Need.ANY_FILTERED:
        return None
    if kind in (PrincipalKind.MASTER, PrincipalKind.STORE):
        # Members read each other's replicas (copies, repair, scrub); they never lead,
        # append or administer tenants.
        return None if need is Need.TENANT_READ else _denied(principal, rpc, need)
    assert kind is PrincipalKind.TENANT and principal.role is not None
    if tenant != principal.tenant:
        # Not "permission denied on tenant B": a token learns nothing of other tenants.
        return Denial(f"{rpc}: not found for tenant {principal.tenant}")
    if principal.role < _ROLE_OF_NEED[need]:
        return _denied(principal, rpc, need)
    return None


def limited_to(principal: Principal, rpc: str, stream_id: int) -> Denial | None:
    """A principal limited to streams calls only on one of them, by a call that names it
    (never a listing, which would show the tenant's other streams)."""
    if stream_id in principal.stream_ids:
        return None
    streams = ", ".join(str(s) for s in principal.stream_ids)
    touched = f"stream {stream_id}" if stream_id else "no one stream"
    return Denial(f"{rpc}: the token is limited to streams {streams}; this call touches {touched}")


def identity_from_auth_context(auth_context: Mapping[str, Sequence[bytes]]) -> Principal:
    """The caller as its TLS certificate proves it (`grpc.ServicerContext.auth_context()`).

    A plaintext call is INSECURE: only a server without certificates accepts those. A TLS
    caller without a member or admin certificate is ANONYMOUS until a token says more.
    """
    security = auth_context.get("transport_security_type", [b""])
    if not security or security[0] != b"ssl":
        return INSECURE
    # `peer_uri` lists the URI SANs alone. `x509_subject_alternative_name` lists every
    # SAN without its type (seen with grpcio 1.85): a DNS name spelled like one of our
    # URIs would read as an identity there.
    uris = [value.decode("utf-8", "replace") for value in auth_context.get("peer_uri", [])]
    identities = [uri for uri in uris if uri.startswith(URI_PREFIX)]
    common_name = b"".join(auth_context.get("x509_common_name", [])[:1]).decode("utf-8", "replace")
    if len(identities) > 1:
        return ANONYMOUS  # a certificate naming two identities proves none
    if identities == [MEMBER_URI_MASTER]:
        return Principal(PrincipalKind.MASTER, "master")
    if identities and identities[0].startswith(STORE_URI_PREFIX):
        store_id = identities[0].removeprefix(STORE_URI_PREFIX)
        return Principal(PrincipalKind.STORE, store_id) if store_id else ANONYMOUS
    if identities == [ADMIN_URI]:
        return Principal(PrincipalKind.CLUSTER_ADMIN, common_name or "admin")
    return ANONYMOUS


def visible_tenant(principal: Principal, tenant: str) -> bool:
    """Whether a filtered listing (ListTenants, ListStreams, status) shows `tenant`."""
    if principal.kind is PrincipalKind.TENANT:
        return tenant == principal.tenant
    return principal.kind is not PrincipalKind.ANONYMOUS


def describe(principal: Principal) -> str:
    """The principal in words, for refusals and logs ("tenant acme with role write")."""
    if principal.kind is PrincipalKind.TENANT:
        assert principal.role is not None
        return f"tenant {principal.tenant} with role {principal.role.name.lower()}"
    kind: str = principal.kind.value
    return kind + (f" {principal.name}" if principal.name else "")


def _denied(principal: Principal, rpc: str, need: Need) -> Denial:
    return Denial(f"{rpc} needs {need.value}; the caller is {describe(principal)}")
