"""The shipped master on the runtime: `MasterService` with its role activated over
`MasterState`, and its repair loop, served by a `SimServer` built as `server._serve`
builds the real one (the same interceptors, the health service).

Both run the master's gauges loop beside the role (`server._update_gauges`, as
`server._serve` does), which also enforces retention and removes what waited out its
`delete_grace_ms`; given `console=True` (the master's `--metrics-port`), it publishes
the console's view to `console` (a `StampedConsole`, new with each incarnation) every
second, which `console.console_reply` answers from, and `registry` holds its metrics.
Both tell the stores each tenant's append quota, `tenant_append_bytes_per_s` (`master
--tenant-append-bytes-per-s`), with their heartbeat replies.

- `SimMaster`: one master on in-memory metadata, without an election (the embedded
  master of `server._embedded_master`). `lose_metadata()` while it is down: its next
  `serve()` is `streamengine master --rebuild` on empty metadata (`_embedded_master`
  with `--rebuild`): it serves the stores only (`MasterCalls.rebuilding`), rebuilds
  the catalog from them with the shipped `Rebuilder` and `rebuild.commit`, as
  `server._rebuild` does, then serves what it rebuilt; cut short, the next `serve()`
  empties the metadata and rebuilds again, as the operator is told to. The rebuilt
  master makes a new signing key (from the seed and the number of losses).
- `SimElectedMaster`: one of several masters on an etcd (`etcd.SimEtcd`), as
  `server._etcd_master` runs it: the shipped `Election`, `EtcdMetadata` and
  `ElectedMaster` (stand by, win, load, serve, be deposed), over `master.etcd`'s client
  on the simulated network. `start(group)` runs it as its node, `crash()` kills the
  process (no lease given back: etcd expires it), `stop()` stops it cleanly (the lease
  revoked, a standby wins at once), `restart()` starts it again; a partition is
  `SimNetwork.cut(master.name, other)`.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from streamengine.master.catalog import Catalog
from streamengine.master.console import ConsoleSnapshot, ConsoleView
from streamengine.master.core.repair import REPAIR_CONCURRENCY_DEFAULT
from streamengine.master.core.retention import DELETE_GRACE_MS_DEFAULT
from streamengine.master.election import ELECTION_TTL_S_DEFAULT, Election
from streamengine.master.etcd import EtcdClient, parse_etcd_url
from streamengine.master.etcd_metadata import EtcdMetadata
from streamengine.master.ha import MASTER_SERVICE, ElectedMaster
from streamengine.master.metadata import MemoryMetadata, Metadata, NotActive
from streamengine.master.metrics import Metrics
from streamengine.master.rebuild import Rebuilder
from streamengine.master.rebuild import commit as commit_rebuilt
from streamengine.master.repair import Repairer
from streamengine.master.rocksdb_metadata import RocksDBMetadata
from streamengine.master.role import FOREVER_MS, MasterRole
from streamengine.master.server import (
    COMMIT_SHARE_OF_TTL,
    REBUILD_WAIT_S_DEFAULT,
    STORE_TIMEOUT_MS_DEFAULT,
    _update_gauges,
)
from streamengine.master.service import MasterService
from streamengine.master.state import MasterState
from streamengine.protocol import identity, transport
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.limits import LEASE_MS_DEFAULT, TENANT_APPEND_BYTES_PER_S_DEFAULT
from streamengine.protocol.parsing import RequestParsing
from streamengine.protocol.signing import SigningKey
from streamengine.protocol.transport import Transport
from tests.sim.runtime.process import SimProcess
from tests.sim.runtime.transport import SimNetwork, SimServer


def sim_signing_key(seed: int, generation: int = 0) -> SigningKey:
    """The master's key of a run: from the seed, so a run replays, and without drawing
    from the run's random source (which would change every later draw); a master that
    lost its metadata `generation` times makes a new one."""
    label = b"simulated master key %d" % seed
    if generation:
        label += b" generation %d" % generation
    return SigningKey(hashlib.sha256(label).digest())


class SimKeys:
    """The keys one master state makes: the seed's (`sim_signing_key`, of its
    metadata's generation) while it starts on metadata with none, and, once it runs
    (`running`), a new one for each `key rotate`, from the seed, the master's name and
    a count (no two masters, nor two rotations, make the same)."""

    def __init__(self, seed: int, name: str, generation: int = 0) -> None:
        self.seed = seed
        self.name = name
        self.generation = generation
        self.running = False
        self.rotations = 0

    def make(self) -> SigningKey:
        if not self.running:
            return sim_signing_key(self.seed, self.generation)
        self.rotations += 1
        label = f"simulated key {self.seed}/{self.generation}, {self.name}'s {self.rotations}"
        return SigningKey(hashlib.sha256(f"{label} at {wall_ms()}".encode()).digest())


class StampedConsole(ConsoleSnapshot):
    """The console's snapshot, knowing when its view was published (wall-clock ms),
    so that what it shows is held to the state of that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.published_ms = 0

    def publish(self, view: ConsoleView) -> None:
        super().publish(view)
        self.published_ms = wall_ms()


class SimMaster:
    """The master node: `serve()` runs it (in a task of its node's context) until
    cancelled; its metadata outlives it."""

    def __init__(
        self,
        network: SimNetwork,
        name: str = "master",
        lease_ms: int = LEASE_MS_DEFAULT,
        store_timeout_ms: int = STORE_TIMEOUT_MS_DEFAULT,
        delete_grace_ms: int = DELETE_GRACE_MS_DEFAULT,
        console: bool = False,
        disk: Path | None = None,
        certs_dir: Path | None = None,
        tenant_append_bytes_per_s: int = TENANT_APPEND_BYTES_PER_S_DEFAULT,
    ) -> None:
        self.network = network
        self.certs_dir = certs_dir  # `--certs-dir`: TLS, and the members' certificate
        self.tenant_append_bytes_per_s = tenant_append_bytes_per_s
        self.name = name
        self.address = f"{name}:1"
        self.lease_ms = lease_ms
        self.store_timeout_ms = store_timeout_ms
        self.delete_grace_ms = delete_grace_ms
        self.serves_console = console
        # The running incarnation's console and metrics (None before its first start).
        self.console: StampedConsole | None = None
        self.registry: CollectorRegistry | None = None
        # On a `disk`, the shipped `RocksDBMetadata` there, opened anew by each `serve()`.
        self.disk = disk
        self.metadata: Metadata = self._empty_metadata()
        self.serving = asyncio.Event()
        self.state: MasterState | None = None
        self.server: SimServer | None = None  # while it serves
        # How many times the metadata was lost, and whether the next `serve()` rebuilds
        # it (until a rebuild was committed whole).
        self.losses = 0
        self.rebuilding = False
        # Told with each state rebuilt from the stores, once it serves it.
        self.rebuild_observers: list[Callable[[MasterState], None]] = []

    def lose_metadata(self) -> None:
        """The master's disk is lost while it is down: it starts again with `--rebuild`."""
        assert not self.serving.is_set(), "cancel `serve()` first: the process died"
        self.close_disk()
        if self.disk is not None:
            shutil.rmtree(self.disk)
        self.metadata = self._empty_metadata()
        self.losses += 1
        self.rebuilding = True

    def _empty_metadata(self) -> Metadata:
        return MemoryMetadata() if self.disk is None else RocksDBMetadata(self.disk)

    def close_disk(self) -> None:
        if isinstance(self.metadata, RocksDBMetadata):
            self.metadata.close()

    def _state(self, catalog: Catalog, rebuilding: bool = False) -> MasterState:
        """As `server._load_state`: while rebuilding, without a cluster id (the rebuild
        adopts the stores')."""
        seed = self.network.loop.seed
        # The seed's key, as the world's master has it (it moves here when that goes).
        keys = SimKeys(seed, self.name, self.losses)
        state = MasterState(
            catalog,
            wall_ms(),
            self.lease_ms,
            self.store_timeout_ms,
            make_signing_key=keys.make,
            delete_grace_ms=self.delete_grace_ms,
            make_cluster_id=None if rebuilding else lambda: f"sim-cluster-{seed}",
        )
        keys.running = True
        return state

    async def serve(self) -> None:
        """One incarnation of the process, as `server._serve` with `_embedded_master`
        (with `--rebuild` after `lose_metadata`)."""
        rebuilding = self.rebuilding
        if rebuilding:
            # A rebuild cut short leaves its mark: the operator empties the metadata
            # and runs `--rebuild` again.
            self.close_disk()
            if self.disk is not None:
                shutil.rmtree(self.disk)
            self.metadata = self._empty_metadata()
        elif isinstance(self.metadata, RocksDBMetadata):
            assert self.disk is not None
            self.metadata.close()  # the process started again: the database opened anew
            self.metadata = RocksDBMetadata(self.disk)
        catalog = Catalog(self.metadata)
        self.state = state = self._state(catalog, rebuilding)
        role = MasterRole(self.address)
        server, health_servicer, service = _served(
            self.network,
            self.name,
            self.address,
            role,
            self.certs_dir,
            self.tenant_append_bytes_per_s,
        )
        self.server = server
        self.console = StampedConsole() if self.serves_console else None
        self.registry = service.calls.metrics.registry
        await server.start()
        members = _members(self.certs_dir)
        repairer = Repairer(state, REPAIR_CONCURRENCY_DEFAULT, wall_ms, members)
        service.calls.rebuilding = rebuilding
        role.activate(state, repairer, until_ms=FOREVER_MS)
        for name in ("", MASTER_SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.serving.set()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(_update_gauges(service, self.console))
                if rebuilding:
                    rebuilt = await Rebuilder(state, members, REBUILD_WAIT_S_DEFAULT, wall_ms).run()
                    commit_rebuilt(catalog, rebuilt)
                    self.state = state = self._state(catalog)
                    repairer = Repairer(state, REPAIR_CONCURRENCY_DEFAULT, wall_ms, members)
                    role.activate(state, repairer, until_ms=FOREVER_MS)
                    service.calls.rebuilding = False
                    self.rebuilding = False
                    for observer in self.rebuild_observers:
                        observer(state)
                await repairer.run()
        finally:
            self.serving.clear()
            role.step_down()
            await server.stop(None)


def _members(certs_dir: Path | None) -> Transport:
    return transport.PLAINTEXT if certs_dir is None else Transport.for_node(certs_dir)


def _served(
    network: SimNetwork,
    name: str,
    address: str,
    role: MasterRole,
    certs_dir: Path | None,
    tenant_append_bytes_per_s: int,
) -> tuple[SimServer, health.aio.HealthServicer, MasterService]:
    """The master's server as `server._serve` builds it, its health service and the
    master's service (TLS given `certs_dir`: its replies to stores signed, its identity
    installed for the calls it serves; each tenant's append quota told to the stores)."""
    members = _members(certs_dir)
    server = SimServer(network, name, [RequestParsing()])
    signer = identity.CertificateProof(members.cert_pem, members.key_pem) if members.tls else None
    service = MasterService(
        role,
        wall_ms,
        Metrics.create(),
        signer,
        tenant_append_bytes_per_s=tenant_append_bytes_per_s,
    )
    service.add_to_server(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if certs_dir is None:
        server.add_insecure_port(address)
    else:
        identity.install(transport.add_server_port(server, address, certs_dir))
    return server, health_servicer, service


class SimElectedMaster(SimProcess):
    """One master of several on an etcd (see the module doc)."""

    def __init__(
        self,
        network: SimNetwork,
        name: str,
        etcd_url: str,
        lease_ms: int = LEASE_MS_DEFAULT,
        store_timeout_ms: int = STORE_TIMEOUT_MS_DEFAULT,
        election_ttl_s: int = ELECTION_TTL_S_DEFAULT,
        delete_grace_ms: int = DELETE_GRACE_MS_DEFAULT,
        console: bool = False,
        certs_dir: Path | None = None,
        tenant_append_bytes_per_s: int = TENANT_APPEND_BYTES_PER_S_DEFAULT,
    ) -> None:
        super().__init__()
        self.certs_dir = certs_dir
        self.tenant_append_bytes_per_s = tenant_append_bytes_per_s
        self.server: SimServer | None = None  # while it serves
        self.network = network
        self.name = name
        self.address = f"{name}:1"
        self.etcd_url = etcd_url
        self.lease_ms = lease_ms
        self.store_timeout_ms = store_timeout_ms
        self.election_ttl_s = election_ttl_s
        self.delete_grace_ms = delete_grace_ms
        self.serves_console = console
        # The running process's role, console and metrics (None before the first start).
        self.role: MasterRole | None = None
        self.console: StampedConsole | None = None
        self.registry: CollectorRegistry | None = None
        self._clean_stop = False

    @property
    def state(self) -> MasterState | None:
        """The state it serves from (None while it stands by or is down)."""
        return None if self.role is None else self.role.state

    def active(self, now_ms: int) -> bool:
        """Whether it would answer a request now as the active master."""
        if self.role is None or not self.running:
            return False
        try:
            self.role.serving(now_ms)
        except NotActive:
            return False
        return True

    def _load_state(self, catalog: Catalog, rebuilding: bool) -> MasterState:
        assert not rebuilding, "no rebuild in the simulator yet"
        seed = self.network.loop.seed
        keys = SimKeys(seed, self.name)
        state = MasterState(
            catalog,
            wall_ms(),
            self.lease_ms,
            self.store_timeout_ms,
            make_signing_key=keys.make,
            delete_grace_ms=self.delete_grace_ms,
            make_cluster_id=lambda: f"sim-cluster-{seed}",
        )
        keys.running = True
        return state

    async def serve(self) -> None:
        """One incarnation of the process, as `server._serve` with `_etcd_master`."""
        self.role = role = MasterRole(self.address)
        server, health_servicer, service = _served(
            self.network,
            self.name,
            self.address,
            role,
            self.certs_dir,
            self.tenant_append_bytes_per_s,
        )
        self.server = server
        members = _members(self.certs_dir)
        self.console = StampedConsole() if self.serves_console else None
        self.registry = service.calls.metrics.registry
        client = EtcdClient(parse_etcd_url(self.etcd_url))
        election = Election(client, role.address, self.election_ttl_s, wall_ms)
        metadata = EtcdMetadata(client, commit_timeout_s=self.election_ttl_s * COMMIT_SHARE_OF_TTL)
        elected = ElectedMaster(
            role,
            election,
            metadata,
            health_servicer,
            self._load_state,
            lambda state: Repairer(state, REPAIR_CONCURRENCY_DEFAULT, wall_ms, members),
        )
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(_update_gauges(service, self.console))
                await elected.run()
        finally:
            role.lease_lost()
            if self._clean_stop:
                await election.revoke()
            # Its connections end with it (a killed process's too).
            await client.aclose()
            await server.stop(None)

    def start(self, group: asyncio.TaskGroup) -> None:
        self._clean_stop = False
        super().start(group)

    async def stop(self) -> None:
        """A clean stop: the election lease given back, so a standby wins at once (a
        `crash()` leaves it to expire)."""
        self._clean_stop = True
        await self.crash()
