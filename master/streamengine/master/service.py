"""The Master gRPC service: one servicer composed of its RPC groups.

Each group is one module and one object over the shared call path
(`service_calls.MasterCalls`, which also holds the one table from domain errors to gRPC
statuses): `service_stores` (registration, heartbeats), `service_streams` (tenants,
streams, trims, the retention pass), `service_leases` (writer heartbeats, leases,
rolls), `service_segments` (list, seal, report), `service_admin` (cluster status,
drains, rebalances, the console's view) and `service_tokens`. gRPC wants one servicer
per service: `add_to_server` hands the generated registration each RPC from the group
that serves it, and refuses to start unless every RPC of the .proto is served once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import grpc

from streamengine.master.metrics import Metrics
from streamengine.master.role import MasterRole
from streamengine.master.service_admin import AdminHandlers
from streamengine.master.service_calls import Handlers, MasterCalls
from streamengine.master.service_leases import LeaseHandlers
from streamengine.master.service_segments import SegmentHandlers
from streamengine.master.service_stores import StoreHandlers
from streamengine.master.service_streams import StreamHandlers
from streamengine.master.service_tokens import TokenHandlers
from streamengine.protocol import identity
from streamengine.protocol.limits import TENANT_APPEND_BYTES_PER_S_DEFAULT
from streamengine.v1 import master_pb2, master_pb2_grpc


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

    def groups(self) -> tuple[Handlers, ...]:
        return (self.stores, self.streams, self.leases, self.segments, self.admin, self.tokens)

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """Each RPC of the Master service, by name, from the group that serves it."""
        out: dict[str, Callable[..., Any]] = {}
        for group in self.groups():
            for name in group.RPCS:
                assert name not in out, f"{name} is served by two groups"
                out[name] = getattr(group, name)
        declared = {m.name for m in master_pb2.DESCRIPTOR.services_by_name["Master"].methods}
        assert set(out) == declared, f"RPCs not served: {sorted(declared - set(out))}"
        return out

    def add_to_server(self, server: grpc.aio.Server) -> None:
        # The generated registration reads one attribute per RPC off its servicer.
        servicer = cast(master_pb2_grpc.MasterServicer, SimpleNamespace(**self.handlers()))
        master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
