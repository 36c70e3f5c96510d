"""The shipped master on the runtime: `MasterService` with its role activated over
`MasterState` on in-memory metadata, and its repair loop, served by a `SimServer` built
as `server._serve` builds the real one (the same interceptors, the health service).

One master without an election (the embedded master of `server._embedded_master`);
election and HA over an in-memory etcd are the next steps (README.md).
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from streamengine.master.catalog import Catalog
from streamengine.master.core.repair import REPAIR_CONCURRENCY_DEFAULT
from streamengine.master.ha import MASTER_SERVICE
from streamengine.master.metadata import MemoryMetadata
from streamengine.master.metrics import Metrics
from streamengine.master.repair import Repairer
from streamengine.master.role import FOREVER_MS, MasterRole
from streamengine.master.server import STORE_TIMEOUT_MS_DEFAULT
from streamengine.master.service import MasterService
from streamengine.master.state import MasterState
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.limits import LEASE_MS_DEFAULT
from streamengine.protocol.parsing import RequestParsing
from tests.sim.master_node import sim_signing_key
from tests.sim.runtime.transport import SimNetwork, SimServer


class SimMaster:
    """The master node: `serve()` runs it (in a task of its node's context) until
    cancelled; its metadata outlives it."""

    def __init__(
        self,
        network: SimNetwork,
        name: str = "master",
        lease_ms: int = LEASE_MS_DEFAULT,
        store_timeout_ms: int = STORE_TIMEOUT_MS_DEFAULT,
    ) -> None:
        self.network = network
        self.name = name
        self.address = f"{name}:1"
        self.lease_ms = lease_ms
        self.store_timeout_ms = store_timeout_ms
        self.metadata = MemoryMetadata()
        self.serving = asyncio.Event()
        self.state: MasterState | None = None

    async def serve(self) -> None:
        seed = self.network.loop.seed
        state = MasterState(
            Catalog(self.metadata),
            wall_ms(),
            self.lease_ms,
            self.store_timeout_ms,
            # The seed's key, as the world's master has it (it moves here when that goes).
            make_signing_key=lambda: sim_signing_key(seed),
            make_cluster_id=lambda: f"sim-cluster-{seed}",
        )
        self.state = state
        role = MasterRole(self.address)
        service = MasterService(role, wall_ms, Metrics.create())
        server = SimServer(self.network, self.name, [RequestParsing()])
        service.add_to_server(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        server.add_insecure_port(self.address)
        await server.start()
        repairer = Repairer(state, REPAIR_CONCURRENCY_DEFAULT, wall_ms)
        role.activate(state, repairer, until_ms=FOREVER_MS)
        for name in ("", MASTER_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.serving.set()
        try:
            await repairer.run()
        finally:
            self.serving.clear()
            role.step_down()
            await server.stop(None)
