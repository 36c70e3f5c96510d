"""The shipped segment store on the runtime: its service (`StoreContext` and the call
groups of `segment_store.service`) and core over a `MemoryKV` (or, given a `disk`, the
shipped `RocksKV` in that directory), with its group committer,
served by a `SimServer` built as `server.serve` builds the real one (the same
interceptors, the same `add_to_server`), and, given a master, its `MasterLink`. Its
core (`ObservedCore`) tells `command_observers` of each plan's commands with their
outcomes, as the plan is made.

A store given a master joins its cluster and takes the master's keys from it, as a
real one does; a store without trusts the keys it is given (`--trust-signing-key`).

Crashes: each `serve()` is one incarnation of the process, over the same KV. Cancelling
it is the process dying (its calls break, nothing is flushed); `power_loss()` then takes
from the KV what was written without a sync (`MemoryKV.crash`), which with
`fsync=False` is every write since the last sync (`--fsync never`), with `fsync=True`
nothing that was answered. The next `serve()` starts from what the KV kept, with a new
incarnation, as a restarted store does. On a `disk`, the next `serve()` reopens the
database first (`RocksKV.recover`: what its log holds is replayed), and a power loss
loses nothing (a synced store's answered writes are in its log; the log of a store on
tmpfs keeps the rest too, which a real one may or may not).

Given `scrub_recheck_ms`, the store's `Scrubber` runs beside its master link, as
`server.serve` runs it (its reads through `StoreContext.in_thread`, which the loop runs
inline), its reports going with the link's heartbeats; a replica is read back again
once `scrub_recheck_ms` passed since its last read.

A store under pressure: given a small `queue_bytes_max` (`--queue-bytes-max`), its
committer refuses a write batch that finds the queue full (REFUSED_BUSY), and its
`CallerShares` give each authenticated caller a quarter of it.

A full disk: while `disk_full` is set, every write the store's process makes fails as
on a full disk (nothing written), and so does the KV's recovery, which the store tries
before it takes writes again (`FullDisk`).
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import cast

from streamengine.protocol import identity, transport
from streamengine.protocol.clock import monotonic_ms
from streamengine.protocol.parsing import RequestParsing
from streamengine.segment_store.core.authority import StoreAuthority
from streamengine.segment_store.core.commands import Command, Joined, Outcome, Plan, SegmentKey
from streamengine.segment_store.core.kv import KV, KVOp
from streamengine.segment_store.core.scrub import SCRUB_MB_PER_S_DEFAULT, ScrubSchedule
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.data_plane import data_server
from streamengine.segment_store.group_commit import (
    STORE_QUEUE_BYTES_MAX,
    GroupCommitter,
    SegmentWatch,
)
from streamengine.segment_store.kv import MemoryKV, RocksKV
from streamengine.segment_store.master_link import MasterLink, StoreIdentity
from streamengine.segment_store.scrub import Scrubber
from streamengine.segment_store.service import add_to_server
from streamengine.segment_store.store_context import ServiceConfig, StoreContext
from tests.sim.runtime.transport import SimNetwork, SimServer


class FullDisk:
    """The store's KV as its process sees it: its writes and its recovery fail with
    ENOSPC while the store's disk is full, and go to `SimStore.kv` (the KV of the
    moment: a wipe replaces it) otherwise."""

    def __init__(self, store: SimStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> object:
        return getattr(self._store.kv, name)

    def _fail_if_full(self) -> None:
        if self._store.disk_full:
            raise OSError(errno.ENOSPC, "No space left on device")

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        self._fail_if_full()
        self._store.kv.write(ops, sync)

    def recover(self) -> None:
        self._fail_if_full()
        self._store.kv.recover()


class ObservedCore(SegmentStoreCore):
    """The shipped core, each plan's commands told with their outcomes, in order, to
    `observers` as it is made (the world's fencing check): a plan is made only to be
    written and published, and a command it takes is taken then."""

    def __init__(
        self,
        kv: KV,
        observers: Sequence[Callable[[Sequence[Command], Sequence[Outcome]], None]],
        joins_cluster: bool,
    ) -> None:
        super().__init__(kv, joins_cluster=joins_cluster)
        self.observers = observers

    def plan(self, commands: Iterable[Command]) -> Plan:
        commands = list(commands)
        plan = super().plan(commands)
        for observer in self.observers:
            observer(commands, plan.outcomes)
        return plan


def loop_clock_s() -> float:
    """`time.monotonic`, read at each call: the simulated loop's clock while it runs."""
    return time.monotonic()


class SimStore:
    """One store node: `serve()` runs it (in a task of its node's context, see
    `transport.node_context`) until cancelled; its KV outlives it. `data_dir` is where
    the master link measures free space (the KV itself is in memory)."""

    def __init__(
        self,
        network: SimNetwork,
        store_id: str,
        trusted_keys: Sequence[bytes] = (),
        config: ServiceConfig | None = None,
        master_address: str | None = None,
        data_dir: Path | None = None,
        fsync: bool = True,
        scrub_recheck_ms: int = 0,
        disk: Path | None = None,
        certs_dir: Path | None = None,
        queue_bytes_max: int = STORE_QUEUE_BYTES_MAX,
    ) -> None:
        assert master_address is None or data_dir is not None, "a master link needs a dir"
        self.network = network
        self.store_id = store_id
        self.address = f"{store_id}:1"
        self.data_address = f"{store_id}:2"  # the data plane's port (Write, Read)
        self.trusted_keys = tuple(trusted_keys)
        self.config = config or ServiceConfig()
        self.master_address = master_address
        self.data_dir = data_dir
        self.fsync = fsync
        # With a master, its `Scrubber` runs unless 0: each sealed replica is read back
        # again this often (a run lasts seconds, not the shipped minutes).
        self.scrub_recheck_ms = scrub_recheck_ms
        self.scrubber: Scrubber | None = None
        self.disk = disk
        # Given: it serves TLS with the node certificate of this dir and calls the
        # other members with it (`--certs-dir`); its server identity while it runs.
        self.certs_dir = certs_dir
        self.members = (
            transport.PLAINTEXT if certs_dir is None else transport.Transport.for_node(certs_dir)
        )
        # Payload bytes of write batches its committer queues before it refuses one as
        # busy (`--queue-bytes-max`); a quarter of it is each caller's share.
        self.queue_bytes_max = queue_bytes_max
        self.server_identity: identity.ServerIdentity | None = None
        self.kv: KV = MemoryKV() if disk is None else RocksKV(disk)
        # Its writes fail while set (`FullDisk`).
        self.disk_full = False
        self._served_once = False
        self.serving = asyncio.Event()
        self.server: SimServer | None = None
        self.core: SegmentStoreCore | None = None
        self.context: StoreContext | None = None
        # Told once the store joined its cluster (its registration answered), with the
        # replicas the master said its earlier incarnation lost.
        self.join_observers: list[Callable[[SegmentStoreCore, Sequence[SegmentKey]], None]] = []
        # Told of each plan its core makes: its commands and their outcomes.
        self.command_observers: list[Callable[[Sequence[Command], Sequence[Outcome]], None]] = []

    async def serve(self) -> None:
        if isinstance(self.kv, RocksKV) and self._served_once:
            self.kv.recover()  # the process started again: the database opened anew
        self._served_once = True
        disk = cast(KV, FullDisk(self))
        core = ObservedCore(disk, self.command_observers, self.master_address is not None)
        core.catalog.keep_incarnation(self.network.rng.getrandbits(63) + 1)
        watch = SegmentWatch()

        def published(plan: Plan) -> None:
            watch.changed(list(plan.metas))

        # Syncs timed on the loop's clock, not the machine's: whether the next one runs
        # inline turns on how long the last took, and a seed must replay.
        committer = GroupCommitter(
            core, self.fsync, published, self.queue_bytes_max, sync_clock_s=loop_clock_s
        )
        authority = StoreAuthority(self.store_id, None, self.trusted_keys)
        self.core = core
        self.context = context = StoreContext(
            core, committer, watch, self.config, authority, self.members
        )
        self.scrubber = None
        if self.scrub_recheck_ms and self.master_address is not None:
            self.scrubber = Scrubber(core, context.in_thread, SCRUB_MB_PER_S_DEFAULT)
            self.scrubber.schedule = ScrubSchedule(
                SCRUB_MB_PER_S_DEFAULT * 1_000_000, monotonic_ms(), self.scrub_recheck_ms
            )
        self.server = SimServer(self.network, self.store_id, [RequestParsing()])
        add_to_server(context, self.server)
        ssl_context = None
        if self.certs_dir is None:
            self.server.add_insecure_port(self.address)
        else:
            # As `server.serve`: this process's identity, then the data plane's TLS.
            identity.install(transport.add_server_port(self.server, self.address, self.certs_dir))
            self.server_identity = identity.server_identity()
            ssl_context = transport.server_ssl_context(self.certs_dir)
        await self.server.start()
        data = data_server(context)
        port = await data.start(self.data_address, ssl_context)
        assert self.data_address.endswith(f":{port}"), (self.data_address, port)
        self.serving.set()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(committer.run())
                if self.master_address is not None:
                    tasks.create_task(self._link(core, context).run())
                if self.scrubber is not None:
                    tasks.create_task(self.scrubber.run())
        finally:
            self.serving.clear()
            await data.stop()
            await self.server.stop(None)
            context.close()

    def power_loss(self) -> None:
        """The machine lost power while the store was down: unsynced writes are gone."""
        assert not self.serving.is_set(), "cancel `serve()` first: the process died"
        if isinstance(self.kv, MemoryKV):
            self.kv.crash()

    def wipe(self) -> None:
        """The store's disk is replaced by an empty one while it is down."""
        assert not self.serving.is_set(), "cancel `serve()` first: the process died"
        if isinstance(self.kv, RocksKV):
            self.kv.close()
            assert self.disk is not None
            shutil.rmtree(self.disk)
            self.kv = RocksKV(self.disk)
            self._served_once = False
        else:
            self.kv = MemoryKV()

    def close_disk(self) -> None:
        """The run is over: a database on disk is closed."""
        if isinstance(self.kv, RocksKV):
            self.kv.close()

    def _link(self, core: SegmentStoreCore, context: StoreContext) -> MasterLink:
        assert self.master_address is not None and self.data_dir is not None
        identity = StoreIdentity(
            self.store_id, self.address, "", self.data_dir, data_address=self.data_address
        )
        return MasterLink(
            self.master_address,
            identity,
            core,
            context.delete,
            context.authority,
            context.keep_authority,
            context.quota,
            self.members,
            self.server_identity,
            scrubber=self.scrubber,
            keep_records=context.keep_records,
            join=self._joining(core, context),
            keep_cluster_view=context.keep_cluster_view,
            raise_acked=context.raise_acked,
        )

    def _joining(
        self, core: SegmentStoreCore, context: StoreContext
    ) -> Callable[[str, Sequence[SegmentKey]], Awaitable[Joined]]:
        """The store context's `join`, its observers told once it is done."""

        async def join(cluster_id: str, lost: Sequence[SegmentKey]) -> Joined:
            joined = await context.join(cluster_id, lost)
            for observer in self.join_observers:
                observer(core, lost)
            return joined

        return join
