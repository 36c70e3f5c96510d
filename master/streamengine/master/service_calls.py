"""The call path every Master RPC takes, and the one table from domain errors to gRPC
statuses (`_STATUS`).

Each handler first asks who calls and whether it may (`MasterCalls.require`: the
principal of the call, `protocol.callers`, then `protocol.auth.authorize` with the
tenant the request touches), converts its request, calls one section of the
`MasterState` (or the `Repairer`) and converts the answer. Listings are filtered to the
tenants the caller may see (`auth.visible_tenant`). A domain error raised before the
catalog commit (a denial always is) leaves everything unchanged.

Every handler first asks the role (`master.role`) whether this master is the active
one now, in the same synchronous step as its state change (`MasterCalls.call`): a
standby (or an active master that cannot confirm its election lease) answers
UNAVAILABLE, naming the active master in the trailing metadata when it knows it
(`ACTIVE_MASTER_METADATA_KEY`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from streamengine.master.core import authority, errors
from streamengine.master.core.model import StreamRecord
from streamengine.master.metadata import MetadataError, NotActive
from streamengine.master.metrics import Metrics
from streamengine.master.repair import Repairer
from streamengine.master.role import MasterRole
from streamengine.master.state import MasterState
from streamengine.protocol import identity
from streamengine.protocol.auth import Denial, Principal, PrincipalKind, authorize
from streamengine.protocol.callers import Callers
from streamengine.protocol.limits import TENANT_APPEND_BYTES_PER_S_DEFAULT
from streamengine.protocol.status import ACTIVE_MASTER_METADATA_KEY, DELETED_UNTIL_METADATA_KEY

log = logging.getLogger("streamengine.master")

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]

_STATUS: dict[type[errors.MasterError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.NotLeader: grpc.StatusCode.FAILED_PRECONDITION,
    errors.TooManyUnsealed: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotEnoughStores: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SealConflict: grpc.StatusCode.ABORTED,
    errors.NotReady: grpc.StatusCode.UNAVAILABLE,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotTrimmable: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StreamDeleted: grpc.StatusCode.FAILED_PRECONDITION,
    errors.WrongCluster: grpc.StatusCode.FAILED_PRECONDITION,
    errors.CallerGaveUp: grpc.StatusCode.DEADLINE_EXCEEDED,
    # A standby, a deposed master, or etcd not answering: another master (or a retry)
    # will.
    MetadataError: grpc.StatusCode.UNAVAILABLE,
}

# What a master rebuilding its metadata serves: the stores (they register and report),
# and the cluster's status.
SERVED_WHILE_REBUILDING = frozenset({"RegisterStore", "StoreHeartbeat", "GetClusterStatus"})


def status_of(error: errors.MasterError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in _STATUS:
            return _STATUS[kind]
    return grpc.StatusCode.INTERNAL


class MasterCalls:
    """What every RPC group shares: the role, the clock, the metrics, and the call
    path (`require*`, `call`)."""

    def __init__(
        self,
        role: MasterRole,
        clock_ms: Callable[[], int],
        metrics: Metrics,
        signer: identity.CertificateProof | None = None,
        *,
        tenant_append_bytes_per_s: int = TENANT_APPEND_BYTES_PER_S_DEFAULT,
    ):
        """`clock_ms` is wall-clock time (token lifetimes are); `signer`, under TLS, the
        master's certificate (it signs replies to stores); `tenant_append_bytes_per_s`
        is told to every store."""
        self.role = role
        self.clock_ms = clock_ms
        self.metrics = metrics
        # Under TLS the master's node certificate: it signs its replies to stores (delete
        # lists, signing keys, revocations), which take them from its certificate only.
        self.signer = signer
        self.tenant_append_bytes_per_s = tenant_append_bytes_per_s
        # While the metadata is rebuilt from the stores (`master --rebuild`), only the
        # stores' calls and the status are served; every other call is UNAVAILABLE.
        self.rebuilding = False

    def require(
        self, context: Context, method: str, tenant: str = "", stream: str = ""
    ) -> Principal:
        """The caller, when it may call `method` on `tenant`'s data (`stream`'s, when
        the call names one: a token limited to streams is held to them); else
        PermissionDenied (raised inside `call`'s action, before anything changes);
        Unauthenticated for a certificate proof that does not hold or a token that is
        not valid (forged, expired, revoked)."""
        principal = self.caller(context, method)
        stream_id = 0
        if principal.stream_ids and stream:
            record = self.state.streams.get(stream)
            stream_id = record.stream_id if record is not None else 0
        denial = authorize(principal, f"Master/{method}", tenant, stream_id)
        if denial is not None:
            log.info("denied %s: %s", method, denial.reason)
            raise errors.PermissionDenied(denial.reason)
        return principal

    def caller(self, context: Context, method: str) -> Principal:
        """Who calls, as its certificate proof and token prove it; Unauthenticated when
        either does not hold."""
        state = self.state  # this activation's key and tokens
        callers = Callers(state.verifier, lambda: state.issuer.current_revocations(self.clock_ms()))
        try:
            principal = callers.principal(context)
        except identity.ProofRefused as refusal:
            raise errors.Unauthenticated(f"{method}: {refusal}") from None
        if isinstance(principal, Denial):
            log.info("refused the token of a %s call: %s", method, principal.reason)
            raise errors.Unauthenticated(f"{method}: {principal.reason}")
        return principal

    def require_store(self, context: Context, method: str, store_id: str) -> None:
        """A store registers and heartbeats only as the store its certificate names."""
        principal = self.require(context, method)
        if principal.kind is PrincipalKind.STORE and principal.name != store_id:
            reason = (
                f"{method} as store {store_id!r}: the caller's certificate is store "
                f"{principal.name!r}"
            )
            log.warning("refused: %s", reason)
            raise errors.PermissionDenied(reason)

    def require_holder(
        self,
        principal: Principal,
        signed_grant: bytes,
        stream: StreamRecord,
        epoch: int,
        client_id: str,
        segment_epoch: int | None = None,
    ) -> None:
        admin = principal.kind is PrincipalKind.CLUSTER_ADMIN
        authority.check_holder(
            self.state.verifier, signed_grant, admin, stream, epoch, client_id, segment_epoch
        )

    @property
    def state(self) -> MasterState:
        """The active state; only inside `call`, after the role said it serves."""
        assert self.role.state is not None, "used only while active"
        return self.role.state

    @property
    def repairer(self) -> Repairer:
        assert self.role.repairer is not None, "used only while active"
        return self.role.repairer

    async def call(self, context: Context, method: str, action: Callable[[int], T]) -> T:
        now_ms = self.clock_ms()
        try:
            self.role.serving(now_ms)
            if self.rebuilding and method not in SERVED_WHILE_REBUILDING:
                raise errors.NotReady(
                    f"{method}: the master is rebuilding its metadata from the stores"
                )
            result = action(now_ms)
        except errors.MasterError as error:
            code = status_of(error)
            self.metrics.requests.labels(method, code.name).inc()
            trailing: tuple[tuple[str, str], ...] = ()
            if isinstance(error, NotActive):
                # The freshest word on who is active: the election's, not the error's.
                active = self.role.active_address or error.active_address
                if active and active != self.role.address:
                    trailing = ((ACTIVE_MASTER_METADATA_KEY, active),)
            if isinstance(error, errors.StreamDeleted):
                trailing = ((DELETED_UNTIL_METADATA_KEY, str(error.deleted_until_ms)),)
            await context.abort(code, str(error), trailing_metadata=trailing)
            raise AssertionError("abort returns only by raising") from None
        self.metrics.requests.labels(method, "OK").inc()
        return result


class Handlers:
    """One group of the Master service's RPCs: `RPCS` names them, each a method of that
    name, all over the one call path."""

    RPCS: tuple[str, ...] = ()

    def __init__(self, calls: MasterCalls) -> None:
        self.calls = calls

    @property
    def state(self) -> MasterState:
        """The active state; only inside `MasterCalls.call`."""
        return self.calls.state
