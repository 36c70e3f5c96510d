"""The master's authority decisions, pure: what a grant says, and who holds an epoch.

- `grant_of`: the grant of an epoch, built from what the master answers its holder:
  the epoch's own segment (when it has one) and every earlier segment not yet sealed,
  each with its copy set. The master's service signs it (`protocol.grants`); the
  simulated master builds it here too.
- `grant_expiry`: when the grant handed with an answer expires, the one rule of grant
  renewal: the expiry handed before while more than half of it is left (so renewals
  sign nothing new), else `grant_ms` from now (so the leader, which heartbeats several
  times a lease, holds a renewed grant long before the old one expires).
- `check_holder`: `SealSegment`, `ReleaseLease` and `RollSegment` are taken only from
  the holder of the epoch they act under, proved by the master's own grant of that
  epoch to that client (a client id alone proves nothing: it is published as the
  stream's leader), or from a cluster admin. A `SealSegment` must also name a segment
  the grant lists: the holder of an epoch may seal only what the master gave it to
  seal.
- `principal_key`: the principal a lease was acquired as, kept with it: its holder
  must call as the same one (`core.leadership.Claim`).
- `stream_tenant`: the tenant a request naming a stream touches, for authorization
  before the name is validated (a malformed name is refused afterwards, as before).
- `visible_status`: the cluster status a caller may see, for GetClusterStatus and the
  console alike: other tenants' streams, segments, repairs and debts left out, and the
  cluster-wide sums zero for a tenant (every tenant's bytes are in them).
"""

from __future__ import annotations

from collections.abc import Sequence

from streamengine.master.core.errors import InvalidArgument, PermissionDenied
from streamengine.master.core.model import SegmentRecord, SegmentState, StreamRecord
from streamengine.protocol.auth import Principal, PrincipalKind, visible_tenant
from streamengine.protocol.grants import GRANT_MS_MIN_LEASES, Grant, GrantSegment, open_grant
from streamengine.protocol.signing import SignatureRefused, Verifier
from streamengine.v1 import master_pb2

# Lease holds (HoldLease, open for as long as a lease) one principal may keep open at
# once: a writer holds one per stream it leads, and a tenant has at most
# TENANT_STREAMS_MAX_DEFAULT (1000) streams. At most a quarter of the master's calls
# (`server.CONCURRENT_RPCS_MAX` asserts it), so that one caller holding all it may
# leaves the rest to the other writers, the stores and the admins.
LEASE_HOLDS_PER_PRINCIPAL_MAX = 1024


def check_grant_ms(grant_ms: int, lease_ms: int) -> None:
    """Raise InvalidArgument unless grants of `grant_ms` are renewed in time for leases
    of `lease_ms` (`protocol.grants.GRANT_MS_MIN_LEASES`)."""
    if grant_ms < GRANT_MS_MIN_LEASES * lease_ms:
        raise InvalidArgument(
            f"a grant of {grant_ms} ms is renewed with half of it left, which must outlast "
            f"{GRANT_MS_MIN_LEASES // 2} leases of {lease_ms} ms: at least "
            f"{GRANT_MS_MIN_LEASES * lease_ms} ms"
        )


def grant_expiry(now_ms: int, epoch: int, handed: tuple[int, int] | None, grant_ms: int) -> int:
    """When the grant of `epoch` answered now expires; `handed` is (epoch, expiry) of
    the grant last handed for the stream (see the module doc)."""
    assert grant_ms > 0
    if handed is not None and handed[0] == epoch and handed[1] - now_ms > grant_ms // 2:
        return handed[1]
    return now_ms + grant_ms


def grant_of(
    stream: StreamRecord,
    epoch: int,
    holder: str,
    segment: SegmentRecord | None,
    unsealed: Sequence[SegmentRecord],
    expires_at_ms: int,
) -> Grant:
    """The grant of `epoch` to `holder` until `expires_at_ms`: its segment, if any, and
    the earlier unsealed ones (the `WriterView` of a LEADER answer)."""
    assert holder and 0 < epoch <= stream.epoch, (stream, epoch, holder)
    listed = [s for s in unsealed if s.epoch < epoch and s.state != SegmentState.SEALED]
    assert len(listed) == len(unsealed), "a leader is given only unsealed earlier segments"
    if segment is not None:
        assert segment.epoch == epoch and segment.stream_id == stream.stream_id, segment
        listed.append(segment)
    return Grant(
        stream_id=stream.stream_id,
        epoch=epoch,
        tenant=stream.tenant,
        client_id=holder,
        segments=tuple(GrantSegment(s.epoch, s.copy_set) for s in sorted(listed, key=_epoch)),
        expires_at_ms=expires_at_ms,
        stream_name=stream.name,
        write_quorum=stream.write_quorum,
    )


def _epoch(segment: SegmentRecord) -> int:
    return segment.epoch


def check_holder(
    verifier: Verifier,
    signed: bytes,
    admin: bool,
    stream: StreamRecord,
    epoch: int,
    client_id: str,
    segment_epoch: int | None = None,
) -> None:
    """Raise PermissionDenied unless the caller holds `epoch` of `stream` as `client_id`
    by `signed`, the master's grant (verified with `verifier`), or is a cluster admin
    (`admin`) showing none."""
    if not signed:
        if admin:
            return
        raise PermissionDenied(
            f"{stream.name}: acting under epoch {epoch} needs the master's grant of it"
        )
    try:
        grant = open_grant(verifier, signed)
    except SignatureRefused as error:
        raise PermissionDenied(f"{stream.name}: the grant shown: {error}") from None
    if grant.stream_id != stream.stream_id or grant.epoch != epoch:
        raise PermissionDenied(
            f"{stream.name}: the grant shown is of stream {grant.stream_id} epoch "
            f"{grant.epoch}, not of epoch {epoch}"
        )
    if grant.client_id != client_id:
        raise PermissionDenied(
            f"{stream.name}: epoch {epoch} was granted to another client than {client_id!r}"
        )
    if segment_epoch is not None and grant.segment(segment_epoch) is None:
        raise PermissionDenied(
            f"{stream.name}: the grant of epoch {epoch} does not list segment {segment_epoch}"
        )


def principal_key(principal: Principal) -> str:
    """One string per caller identity: a token by its id, a certificate by its name."""
    return f"{principal.kind.value}:{principal.token_id or principal.name}"


def stream_tenant(name: str) -> str:
    """The tenant part of `tenant/stream` (the whole name when it has no '/')."""
    return name.split("/", 1)[0]


def visible_status(
    status: master_pb2.ClusterStatus, principal: Principal
) -> master_pb2.ClusterStatus:
    """`status` as `principal` may see it (see the module doc). Stores are everyone's."""

    def shown(stream: str) -> bool:
        return bool(stream) and visible_tenant(principal, stream_tenant(stream))

    # The sums hold every tenant's bytes: only a caller who sees every tenant sees them.
    partial = principal.kind in (PrincipalKind.TENANT, PrincipalKind.ANONYMOUS)
    return master_pb2.ClusterStatus(
        cluster_id=status.cluster_id,
        stores=status.stores,
        streams=[s for s in status.streams if visible_tenant(principal, stream_tenant(s.name))],
        under_replicated=[s for s in status.under_replicated if shown(s.id.stream)],
        verifying=[s for s in status.verifying if shown(s.id.stream)],
        tasks=[t for t in status.tasks if shown(t.segment.stream)],
        granting_leases=status.granting_leases,
        durability_debt=[
            d
            for d in status.durability_debt
            if visible_tenant(principal, stream_tenant(d.segment.stream))
        ],
        bytes_below_n=0 if partial else status.bytes_below_n,
        bytes_below_w=0 if partial else status.bytes_below_w,
        replica_verification=(
            master_pb2.ReplicaVerification() if partial else status.replica_verification
        ),
        pending_deletes=[
            p for p in status.pending_deletes if visible_tenant(principal, stream_tenant(p.stream))
        ],
        tenant_streams=[t for t in status.tenant_streams if visible_tenant(principal, t.tenant)],
    )
