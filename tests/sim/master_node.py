"""The simulated master: the real `MasterState` over an in-memory catalog."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamengine.client.core.replicator import (
    SegmentRef,
)
from streamengine.client.core.writer import (
    HeartbeatAnswered,
    Replica,
    SegmentGrant,
)
from streamengine.master.catalog import Catalog
from streamengine.master.core import authority, integrity, repair
from streamengine.master.core.errors import MasterError, SealConflict
from streamengine.master.core.leadership import Claim
from streamengine.master.core.model import SegmentRecord
from streamengine.master.leadership import WriterView, grant_producers
from streamengine.master.metadata import MemoryMetadata
from streamengine.master.state import MasterState
from streamengine.master.stores import Registered
from streamengine.protocol.limits import LEASE_SECRET_BYTES
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.signing import SigningKey
from streamengine.segment_store.core.catalog import SegmentStateInfo
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.reads import DigestInfo
from tests.sim import messages as m
from tests.sim.network import Message

if TYPE_CHECKING:
    from tests.sim.world import World

from tests.sim.nodes import MASTER, Node

# ---- master ----


def grant_of(record: SegmentRecord) -> SegmentGrant:
    return SegmentGrant(
        SegmentRef(record.stream_id, record.epoch, record.stream),
        tuple(Replica(store, f"{store}:1") for store in record.copy_set),
    )


def sim_signing_key(seed: int, generation: int = 0) -> SigningKey:
    """The master's key of a run: from the seed, so a run replays, and without drawing
    from the run's random source (which would change every later draw); a master that
    lost its metadata `generation` times makes a new one."""
    label = b"simulated master key %d" % seed
    if generation:
        label += b" generation %d" % generation
    return SigningKey(hashlib.sha256(label).digest())


def sim_lease_secrets(seed: int) -> Callable[[], bytes]:
    """Each grant's lease secret: from the seed and a count (never repeated across
    master restarts), not from the run's random source (see `sim_signing_key`)."""
    count = itertools.count()

    def draw() -> bytes:
        secret = hashlib.sha256(b"simulated lease secret %d/%d" % (seed, next(count))).digest()
        return secret[:LEASE_SECRET_BYTES]

    return draw


class MasterNode(Node):
    def __init__(self, world: World) -> None:
        super().__init__(MASTER, world)
        self.draw_secret = sim_lease_secrets(world.config.seed)
        self.metadata = MemoryMetadata()
        self.catalog = Catalog(self.metadata)
        self.state = self._load()
        cfg = world.config
        self.stream = self.state.tenancy.create_stream(
            cfg.stream,
            cfg.policy.replicas,
            cfg.policy.write_quorum,
            cfg.segment_bytes,
            cfg.segment_age_ms,
            True,
            0,
        )
        for store in world.store_names:
            # Each store's first incarnation; a wiped store comes back as a later one.
            self.state.registry.register_store(store, f"{store}:1", "", 1 << 40, 0, 1)
        self.repairs = repair.RepairQueue(repair.REPAIR_CONCURRENCY_DEFAULT)
        self.timer(repair.REPAIR_TICK_MS, "repair tick", self.repair_tick)

    def _load(self) -> MasterState:
        cfg = self.world.config
        state = MasterState(
            self.catalog,
            self.world.now,
            cfg.lease_ms,
            cfg.store_timeout_ms,
            make_signing_key=lambda: sim_signing_key(cfg.seed),
            make_cluster_id=lambda: f"sim-{cfg.seed}",
        )
        state.leadership.draw_secret = self.draw_secret
        return state

    def restart(self) -> None:
        super().restart()
        self.state = self._load()
        self.world.checker.master_changed(self.state)
        # The repairer's queue and the copies under way are memory only, as in the
        # real master: a restart forgets them and plans again.
        self.repairs = repair.RepairQueue(repair.REPAIR_CONCURRENCY_DEFAULT)
        self.timer(repair.REPAIR_TICK_MS, "repair tick", self.repair_tick)

    def handle(self, message: Message) -> None:
        body = message.body
        if isinstance(body, m.StoreHeartbeat):
            now = self.world.now
            held = dict(body.held)
            deletes = self.state.registry.store_heartbeat(body.store, 0, 1 << 40, held, now)
            if deletes is None:
                self.state.registry.register_store(body.store, f"{body.store}:1", "", 1 << 40, now)
                return
            for scrubbed in body.scrubbed:
                self._replica_reported(body.store, scrubbed)
            first = tuple(self.state.integrity.take_scrub_first(body.store))
            if deletes or first:
                reply = m.StoreHeartbeatReply(tuple(deletes), first)
                self.world.net.send(self.name, body.store, reply)
            return
        if isinstance(body, m.HoldEnded):
            leadership = self.state.leadership
            claim = Claim(body.client_id, body.lease_secret)
            if leadership.holder_gone(body.stream, claim, body.epoch, self.world.now):
                self.world.note(f"{body.client_id}'s call holding epoch {body.epoch} ended")
                self.world.stats["leases ended by their holder's call"] += 1
            return
        assert isinstance(body, m.Call)
        try:
            result = self._serve(body.request)
        except MasterError as error:
            result = error
        if isinstance(body.request, m.RegisterStore) and self.world.crash_after_registering():
            return  # killed after its commit: the answer is never sent
        self.answer(message, result)

    def _serve(self, request: object) -> object:
        now = self.world.now
        state = self.state
        if isinstance(request, m.WriterHeartbeat):
            before = state.leases[request.stream].epoch
            view = state.leadership.writer_heartbeat(
                request.stream,
                Claim(request.client_id, request.lease_secret),
                request.epoch,
                request.acked_index,
                request.segment_bytes,
                now,
                producer=request.producer,
                seen_epoch=request.seen_epoch,
            )
            return self._view(view, before, request.client_id)
        if isinstance(request, m.RollSegment):
            # Ready for the leader's roll: a shell action for it maps here.
            self._holder(request.stream, request.grant, request.epoch, request.client_id)
            before = state.leases[request.stream].epoch
            view = state.leadership.roll_segment(
                request.stream,
                Claim(request.client_id, request.lease_secret),
                request.epoch,
                request.exclude,
                now,
            )
            return self._view(view, before, request.client_id)
        if isinstance(request, m.ReleaseLease):
            self._holder(request.stream, request.grant, request.epoch, request.client_id)
            return state.leadership.release_lease(
                request.stream, Claim(request.client_id, request.lease_secret), request.epoch, now
            )
        if isinstance(request, m.SealSegment):
            self._holder(
                request.stream,
                request.grant,
                request.writer_epoch,
                request.client_id,
                request.segment_epoch,
            )
            return self._seal(request)
        if isinstance(request, m.RegisterStore):
            return self._register(request)
        if isinstance(request, m.ListSegments):
            _, segments = state.list_segments(request.stream, 0)
            return tuple(segments)
        raise AssertionError(f"unknown request {request!r}")

    def _register(self, request: m.RegisterStore) -> Registered:
        """A store's registration, as the master's service answers it."""
        known = self.state.stores[request.store].incarnation
        registered = self.state.registry.register_store(
            request.store,
            f"{request.store}:1",
            "",
            1 << 40,
            self.world.now,
            request.incarnation,
            request.cluster_id,
        )
        self.world.checker.master_changed(self.state)
        if "forget_lost" in self.world.config.flaws and known == request.incarnation:
            # The flaw (registration as it was): the replicas a new incarnation lost are
            # answered only to the registration that found it new; a retry gets none.
            registered = dataclasses.replace(registered, lost=())
        return registered

    def _holder(
        self,
        stream: str,
        signed: bytes,
        epoch: int,
        client_id: str,
        segment_epoch: int | None = None,
    ) -> None:
        """As the master's service: only the holder of the epoch, by its grant (the
        simulated callers are never cluster admins)."""
        record = self.state.stream(stream)
        authority.check_holder(
            self.state.verifier, signed, False, record, epoch, client_id, segment_epoch
        )

    def _view(self, view: WriterView, before: int, client_id: str) -> m.LeaderReply:
        """The reply to a heartbeat or a roll, as the master's service builds it."""
        state = self.state
        now = self.world.now
        granted = view.lease.epoch if view.lease.epoch != before else 0
        self.world.checker.master_changed(state, granted)
        if granted:
            self.world.note(f"master grants epoch {granted} to {client_id}")
        record = view.stream
        signed = b""
        if view.leads:
            grant = view.grant()
            self.world.checker.grant_issued(grant)
            signed = self.state.keys.grant_signer(self.world.now).sign(grant)
        answer = HeartbeatAnswered(
            sent_at_ms=0,
            leader=view.leads,
            epoch=view.lease.epoch,
            lease_ms=state.lease_ms,
            leader_id=view.lease.holder if view.lease.running(now) else "",
            segment=grant_of(view.segment) if view.leads and view.segment else None,
            unsealed=tuple(grant_of(s) for s in view.unsealed) if view.leads else (),
            policy=ReplicationPolicy(record.replicas, record.write_quorum),
            roll_requested=bool(view.roll_reason),
            roll_reason=view.roll_reason,
            segment_bytes_max=record.segment_bytes,
            segment_age_ms_max=record.segment_age_ms,
            grant=signed,
            producers=grant_producers(view, state.stream_segments(view.stream.stream_id)),
            stream_has_producers=record.has_producers,
            lease_won=bool(view.secret),
        )
        return m.LeaderReply(answer, view.secret)

    def _seal(self, request: m.SealSegment) -> object:
        key = SegmentKey(self.stream.stream_id, request.segment_epoch)
        try:
            sealed = self.state.integrity.seal_segment(
                request.stream,
                request.segment_epoch,
                request.writer_epoch,
                request.final_index,
                self.world.now,
                request.certificate,
                request.lost_from_index,
                request.producers,
            )
        except SealConflict as conflict:
            self.world.checker.seal_conflict(key, str(conflict))
            raise
        self.world.checker.master_changed(self.state)
        if sealed.lost_from_index:
            self.world.checker.loss_declared(key, sealed.lost_from_index)
        cores = {n: s.core for n, s in self.world.stores.items()}
        self.world.checker.sealed_at_master(key, sealed.final_index, cores)
        if sealed.certificate is not None:
            self.world.stats["certified by writers"] += request.certificate is not None
            self.world.checker.certificate_recorded(key, sealed.certificate, cores)
        return sealed

    def _replica_reported(self, store: str, scrubbed: m.ScrubReport) -> None:
        """A store's scrub report, judged as the real master does (`integrity.judge`)."""
        report: integrity.Report = (
            integrity.Clean(scrubbed.certificate)
            if scrubbed.certificate is not None
            else integrity.Damaged(scrubbed.detail)
        )
        key = SegmentKey(*scrubbed.segment)
        judgement = self.state.integrity.replica_reported(
            store, scrubbed.segment, report, self.world.now
        )
        cores = {n: s.core for n, s in self.world.stores.items()}
        checker = self.world.checker
        if judgement.certificate is not None:
            self.world.stats["certified by replicas"] += 1
            checker.certificate_recorded(key, judgement.certificate, cores)
        for bad in judgement.bad:
            self.world.stats["replicas found bad"] += 1
            certificate = self.state.segments[scrubbed.segment].certificate
            assert certificate is not None
            checker.replica_condemned(bad, cores.get(bad), key, certificate)

    # ---- repair: the real planning, queue and task steps (master.repair) ----

    def repair_tick(self) -> None:
        now = self.world.now
        state = self.state
        for task in self.repairs.next_tasks(
            now,
            lambda busy, slots: state.replicas.plan_repairs(
                now, busy, slots, self.repairs.failed_sources
            ),
        ):
            self.world.note(
                f"repair {task.reason}: seg{task.segment[1]} {task.replaced} -> {task.target}"
                f" from {task.source}"
            )
            self.world.stats[f"repair {task.reason}"] += 1
            self.world.stats["repairs in place"] += task.target == task.replaced
            _RepairRun(self, task).start()
        self.timer(repair.REPAIR_TICK_MS, "repair tick", self.repair_tick)

    def plan_moves(self, tasks: list[repair.Task]) -> None:
        self.repairs.plan_moves(tasks)


class _RepairRun:
    """Carries one `RepairOp` out over the simulated network, as `Repairer` does over
    gRPC: each action becomes a call (or the swap, on the state), each answer an event."""

    def __init__(self, master: MasterNode, task: repair.Task) -> None:
        self.master = master
        self.state = master.state
        self.task = task
        self.op = repair.RepairOp(task)
        self.segment = SegmentKey(*task.segment)
        self.copying = False
        self.over = False
        self.digests: dict[str, DigestInfo] = {}

    def start(self) -> None:
        self._perform(self.op.start(self.state.segments.get(self.task.segment)))

    def _feed(self, event: repair.RepairEvent) -> None:
        self._perform(self.op.step(event))

    def _call(self, store: str, request: object, on_answer: Callable[[object], None]) -> None:
        timeouts = repair.SIMULATED_TIMEOUTS
        timeout = timeouts.copy_ms if isinstance(request, m.CopySegment) else timeouts.control_ms
        self.master.call(
            store,
            request,
            on_answer,
            timeout_ms=timeout,
            on_timeout=lambda: self._feed(repair.StepFailed(f"{store} did not answer")),
        )

    def _perform(self, action: repair.RepairAction | None) -> None:
        if action is None:
            self._finish()
        elif isinstance(action, repair.AskSourceState):
            self._call(action.source, m.GetSegmentState(self.segment), self._on_state)
        elif isinstance(action, repair.CopyToTarget):
            self.state.replicas.begin_copy(action.target, self.task.segment)
            self.copying = True
            tenant = authority.stream_tenant(self.state.stream_name(self.segment.stream_id))
            request = m.CopySegment(
                self.segment,
                action.source,
                action.final_index,
                action.fence,
                tenant,
                action.certificate,
                action.replace_held,
            )
            self._call(action.target, request, self._on_copied)
        elif isinstance(action, repair.AskDigests):
            for store in (action.source, action.target):
                self._call(
                    store,
                    m.Digest(self.segment, action.final_index),
                    functools.partial(self._on_digest, store),
                )
        elif isinstance(action, repair.SwapReplica):
            try:
                self.state.replicas.swap_replica(
                    self.task.segment, action.replaced, action.target, action.held, self.now
                )
            except MasterError as error:
                self._feed(repair.StepFailed(str(error)))
                return
            self.master.world.checker.master_changed(self.state)
            self._feed(repair.Swapped())
        else:
            self.master.call(action.store, m.Delete(self.segment), lambda answer: None)
            self._finish()

    @property
    def now(self) -> int:
        return self.master.world.now

    def _on_state(self, answer: object) -> None:
        if isinstance(answer, SegmentStateInfo):
            self._feed(repair.SourceState(answer.fence, answer.acked_index, answer.bytes))
        else:
            self._feed(repair.StepFailed(f"{answer!r}"))

    def _on_copied(self, answer: object) -> None:
        if isinstance(answer, m.CopyReply):
            self._feed(repair.Copied(answer.digest))
        else:
            self._feed(repair.StepFailed(f"{answer!r}"))

    def _on_digest(self, store: str, answer: object) -> None:
        if self.op.error:
            return  # the other digest failed already
        if not isinstance(answer, DigestInfo):
            self._feed(repair.StepFailed(f"{answer!r}"))
            return
        self.digests[store] = answer
        source, target = self.task.source, self.task.target
        if source in self.digests and target in self.digests:
            got = self.digests[target]
            self._feed(repair.Digests(self.digests[source].digest, got.digest, got.entries_held))

    def _finish(self) -> None:
        if self.over:
            return  # a late answer after the task failed
        self.over = True
        if self.copying:
            self.state.replicas.end_copy(self.task.target, self.task.segment)
        failed = bool(self.op.error)
        self.master.repairs.finished(self.task, failed, self.now)
        if failed:
            self.state.integrity.ask_scrub_first(self.task.source, self.task.segment)
        outcome = f"failed: {self.op.error}" if failed else "done"
        self.master.world.stats[f"repairs {'failed' if failed else 'done'}"] += 1
        self.master.world.note(f"repair of seg{self.segment.epoch} -> {self.task.target} {outcome}")
