"""The Master gRPC service: one servicer composed of its RPC groups.

Each group is one module and one object over the shared call path
(`service_calls.MasterCalls`, which also holds the one table from domain errors to gRPC
statuses): `service_stores` (registration, heartbeats), `service_streams` (tenants,
streams, trims, the retention pass), `service_leases` (writer heartbeats, leases,
rolls), `service_segments` (list, seal, report), `service_admin` (cluster status,
drains, rebalances, the console's view) and `service_tokens`. gRPC wants one servicer
per service: `add_to_server` hands the generated registration each RPC from the group
that serves it, and refuses to start unless every RPC of the .proto is served once.

A call held open (the reply-streaming HoldLease) is admitted before its group sees it
(`_held_per_caller`): its caller proven from the call's metadata, an anonymous one
refused UNAUTHENTICATED, and counted against `LEASE_HOLDS_PER_PRINCIPAL_MAX` (beyond:
RESOURCE_EXHAUSTED naming it), so that no one caller takes all the master's calls. The
group then authorizes the request as every call's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any, cast

import grpc

from streamengine.master.core import errors
from streamengine.master.core.authority import LEASE_HOLDS_PER_PRINCIPAL_MAX
from streamengine.master.metrics import Metrics
from streamengine.master.role import MasterRole
from streamengine.master.service_admin import AdminHandlers
from streamengine.master.service_calls import Handlers, MasterCalls
from streamengine.master.service_leases import LeaseHandlers
from streamengine.master.service_revocations import RevocationHandlers
from streamengine.master.service_segments import SegmentHandlers
from streamengine.master.service_stores import StoreHandlers
from streamengine.master.service_streams import StreamHandlers
from streamengine.master.service_tokens import TokenHandlers
from streamengine.protocol import identity
from streamengine.protocol.auth import Principal, PrincipalKind, describe
from streamengine.protocol.limits import TENANT_APPEND_BYTES_PER_S_DEFAULT
from streamengine.protocol.open_calls import OpenCalls
from streamengine.v1 import master_pb2, master_pb2_grpc

SERVICE = master_pb2.DESCRIPTOR.services_by_name["Master"]


class MasterService:
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
        self.calls = MasterCalls(
            role, clock_ms, metrics, signer, tenant_append_bytes_per_s=tenant_append_bytes_per_s
        )
        self.stores = StoreHandlers(self.calls)
        self.streams = StreamHandlers(self.calls)
        self.leases = LeaseHandlers(self.calls)
        self.segments = SegmentHandlers(self.calls)
        self.admin = AdminHandlers(self.calls)
        self.tokens = TokenHandlers(self.calls)
        self.revocations = RevocationHandlers(self.calls)
        self.holds = OpenCalls(LEASE_HOLDS_PER_PRINCIPAL_MAX)

    def groups(self) -> tuple[Handlers, ...]:
        return (
            self.stores,
            self.streams,
            self.leases,
            self.segments,
            self.admin,
            self.tokens,
            self.revocations,
        )

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """Each RPC of the Master service, by name, from the group that serves it."""
        out: dict[str, Callable[..., Any]] = {}
        for group in self.groups():
            for name in group.RPCS:
                assert name not in out, f"{name} is served by two groups"
                out[name] = getattr(group, name)
                if SERVICE.methods_by_name[name].server_streaming:
                    out[name] = self._held_per_caller(name, out[name])
        declared = set(SERVICE.methods_by_name)
        assert set(out) == declared, f"RPCs not served: {sorted(declared - set(out))}"
        return out

    def _held_per_caller(
        self, method: str, behaviour: Callable[..., AsyncIterator[Any]]
    ) -> Callable[..., AsyncIterator[Any]]:
        """`behaviour`, a reply-streaming RPC, admitted at open (module doc)."""
        calls, holds = self.calls, self.holds

        async def held(request: Any, context: Any) -> AsyncIterator[Any]:
            def admit(now_ms: int) -> Principal:
                principal = calls.caller(context, method)
                if principal.kind is PrincipalKind.ANONYMOUS:
                    raise errors.Unauthenticated(
                        f"{method}: a held call must show a certificate proof or a token"
                    )
                if not holds.open(principal):
                    raise errors.ResourceExhausted(
                        f"{method}: {describe(principal)} holds {holds.held(principal)} "
                        "calls here, the most one caller may (LEASE_HOLDS_PER_PRINCIPAL_MAX "
                        f"{holds.calls_max})"
                    )
                return principal

            # Its own name in the request metrics: the call's outcome is counted apart.
            principal = await calls.call(context, f"{method}/open", admit)
            try:
                async for reply in behaviour(request, context):
                    yield reply
            finally:
                holds.close(principal)

        return held

    def add_to_server(self, server: grpc.aio.Server) -> None:
        # The generated registration reads one attribute per RPC off its servicer.
        servicer = cast(master_pb2_grpc.MasterServicer, SimpleNamespace(**self.handlers()))
        master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
