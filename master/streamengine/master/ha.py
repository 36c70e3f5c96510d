"""The life of a master whose metadata is in etcd: lease, join, stand by, serve, and over.

    grant a lease ─► join the election ─► poll who is oldest ─┬─► ours: load, serve
          ▲                  ▲                  ▲              │
          │                  │                  └──────────────┴─◄ someone else's: stand by
          │                  └── our key gone (deleted, or a commit found it gone)
          └── etcd says the lease is gone (we were paused or cut off past its TTL)

Serving is `role.activate` with a `MasterState` loaded from etcd (the restart rule
applies: no grant for one lease period) and a repairer. A master started with
`--rebuild` that finds the metadata empty when it first serves rebuilds it from the
stores first (`RebuildFromStores`), serving only them meanwhile; metadata a rebuild left
unfinished is never served (`RebuildUnfinished` ends the process). It ends when the election shows
another master as the oldest, when a commit finds the key gone (`NotActive`) or the
records changed (`MetadataChanged`: loaded again while the key is still the oldest), or
when the lease is lost. A deposed master is a standby; it never exits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

from grpc_health.v1 import health, health_pb2

from streamengine.master.catalog import Catalog
from streamengine.master.election import POLL_S, Election, LeaseLost, Member, Term
from streamengine.master.etcd_metadata import EtcdMetadata, MetadataChanged
from streamengine.master.metadata import MetadataError, NotActive
from streamengine.master.repair import Repairer
from streamengine.master.role import MasterRole
from streamengine.master.state import MasterState
from streamengine.protocol.backoff import ETCD_CALL
from streamengine.protocol.waiting import wait_set

log = logging.getLogger("streamengine.master")

MASTER_SERVICE = "streamengine.v1.Master"

# The catalog and whether it is to be rebuilt (empty, and this master rebuilds).
LoadState = Callable[[Catalog, bool], MasterState]
NewRepairer = Callable[[MasterState], Repairer]
# Rebuild the (empty) catalog from the stores, serving them with `state` meanwhile, and
# hand the rebuilt state to the activation given.
RebuildFromStores = Callable[
    [Catalog, MasterState, Callable[[MasterState], None]], Awaitable[None]
]


class ElectedMaster:
    def __init__(
        self,
        role: MasterRole,
        election: Election,
        metadata: EtcdMetadata,
        health_servicer: health.aio.HealthServicer,
        load_state: LoadState,
        new_repairer: NewRepairer,
        rebuild: RebuildFromStores | None = None,
    ) -> None:
        self.role = role
        self.election = election
        self.metadata = metadata
        self.health = health_servicer
        self.load_state = load_state
        self.new_repairer = new_repairer
        self.rebuild = rebuild
        # Set when a commit says this master must stop serving (or reload): the poll
        # loop wakes at once instead of at its next tick.
        self.commit_failed = asyncio.Event()
        self.changed = False
        self.repairs: asyncio.Task[None] | None = None
        metadata.on_failure = self._metadata_failed

    def _metadata_failed(self, error: MetadataError) -> None:
        # A commit etcd merely did not answer changes nothing: the writer key makes the
        # next commit fail if it lands late, and that failure counts.
        if isinstance(error, NotActive | MetadataChanged):
            self.changed = self.changed or isinstance(error, MetadataChanged)
            self.commit_failed.set()

    async def run(self) -> NoReturn:
        while True:
            lease_id = await self.election.grant()
            log.info("joining the election as %s (lease %x)", self.role.address, lease_id)
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self.election.keep_alive(lease_id, self.role.confirmed))
                    while True:
                        term = await self.election.join(lease_id)
                        await self._follow(term, group)
            except* LeaseLost as lost:
                log.warning("election lease lost: %s", lost.exceptions[0])
            finally:
                await self._stop_serving()
                self.role.lease_lost()

    async def _follow(self, term: Term, group: asyncio.TaskGroup) -> None:
        """Stand by or serve, as the election says, while this term's key exists."""
        while True:
            # Taken before the read: a failure while it runs is handled next round.
            failed, changed = self.commit_failed.is_set(), self.changed
            self.commit_failed.clear()
            self.changed = False
            members = await self.election.members()
            oldest = members[0] if members else None
            self._name_active(oldest)
            leading = oldest is not None and oldest.key == term.key
            if self.serving and (not leading or failed):
                await self._stop_serving()
                if leading and changed:
                    log.warning("etcd's records changed under this master: loading them again")
            if not any(m.key == term.key and m.revision == term.revision for m in members):
                log.warning("deposed: the election key of this master is gone")
                return
            if leading and not self.serving:
                await self._start_serving(term, group)
            await wait_set(self.commit_failed, POLL_S)

    @property
    def serving(self) -> bool:
        return self.repairs is not None

    def _name_active(self, oldest: Member | None) -> None:
        address = oldest.address if oldest is not None else ""
        self.role.active_address = address
        self.metadata.active_address = address

    def _load(self, term: Term) -> tuple[Catalog, MasterState, bool]:
        self.metadata.activate(term.key, term.revision)
        catalog = Catalog(self.metadata)
        rebuilding = self.rebuild is not None and not self.metadata.read_all()
        return catalog, self.load_state(catalog, rebuilding), rebuilding

    async def _start_serving(self, term: Term, group: asyncio.TaskGroup) -> None:
        try:
            # In a worker thread: a large catalog takes a while to read and decode, and
            # the keepalive of the election lease runs on this loop meanwhile. Nothing
            # else touches the metadata or the state until `role.activate`.
            catalog, state, rebuilding = await asyncio.to_thread(self._load, term)
        except MetadataError as error:
            log.warning("cannot load the metadata from etcd: %s", error)
            self.metadata.deactivate()
            await asyncio.sleep(ETCD_CALL.first_ms / 1000)
            return
        state.registry.count_silence_from(self.election.clock_ms())
        if not rebuilding:
            self._activate(state, group)
            await self.health.set(MASTER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            return
        assert self.rebuild is not None
        # The stores register and answer while the catalog is rebuilt; nothing repairs.
        self.role.activate(state, self.new_repairer(state))
        await self.health.set(MASTER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        try:
            await self.rebuild(catalog, state, lambda rebuilt: self._activate(rebuilt, group))
        except MetadataError as error:
            # Deposed or cut off midway: the next master to load it refuses the
            # unfinished rebuild.
            log.error("the rebuild from the stores stopped: %s", error)
            await self._stop_serving()
            return
        self.rebuild = None  # once: a later term serves what was rebuilt

    def _activate(self, state: MasterState, group: asyncio.TaskGroup) -> None:
        repairer = self.new_repairer(state)
        self.role.activate(state, repairer)
        self.repairs = group.create_task(repairer.run())
        log.info("active master (%d streams, %d stores)", len(state.streams), len(state.stores))

    async def _stop_serving(self) -> None:
        # Memory first, synchronously: no request is answered from it after this line.
        self.role.step_down()
        self.metadata.deactivate()
        if self.repairs is not None:
            self.repairs.cancel()
            self.repairs = None
            log.info("standing by")
            await self.health.set(MASTER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
