"""A simulated segment store: the real `SegmentStoreCore` over an in-memory KV, taking
writes and seals only under the master's grants (the real `segment_store.authority`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from streamengine.master.core.model import Held
from streamengine.master.stores import Registered
from streamengine.protocol.auth import INSECURE
from streamengine.protocol.entry import PackedEntries, StoredEntry
from streamengine.protocol.grants import Grant
from streamengine.segment_store.copy import CopySourceUnavailable
from streamengine.segment_store.core import copy as copy_rules
from streamengine.segment_store.core.authority import (
    AuthorityRecord,
    StoreAuthority,
    WriteStreamGrants,
)
from streamengine.segment_store.core.catalog import SegmentStateInfo
from streamengine.segment_store.core.commands import (
    Command,
    DeleteResult,
    DropCopiesCommand,
    JoinCommand,
    Joined,
    KeepAuthorityCommand,
    Outcome,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.errors import BelowFence as StoreRefused
from streamengine.segment_store.core.errors import (
    CopyRefused,
    NotJoined,
    ReplicaLost,
    SegmentNotFound,
    StoreError,
)
from streamengine.segment_store.core.kv import KVOp
from streamengine.segment_store.core.reads import DigestInfo
from streamengine.segment_store.core.scrub import ScrubSchedule
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.kv import MemoryKV
from tests.sim import messages as m
from tests.sim.master_node import sim_signing_key
from tests.sim.network import Message
from tests.sim.subscribe import TailServer

if TYPE_CHECKING:
    from tests.sim.world import World

from tests.sim.nodes import MASTER, STORE_HEARTBEAT_MS, Node

# The scrub in virtual time: a replica read again at most this often; one replica per
# heartbeat (the real scrub's rate bounds bytes per second; here a read is instant).
SCRUB_RECHECK_MS = 1500

# ---- stores ----

# CopySegment: entries per copied batch, the simulated transport's granularity (small,
# so a copy spans several steps and other writes interleave).
COPY_BATCH_ENTRIES = 16
# A store with fsync never: how often the system writes its dirty pages back.
UNSYNCED_FLUSH_MS = 500
# Write streams whose grants a store keeps before it forgets those of closed streams.
STREAM_GRANTS_KEPT = 64
# A registration unanswered this long is sent again (the real store's call timeout,
# scaled to virtual time as the lease is).
REGISTER_TIMEOUT_MS = 300


class SyncedMemoryKV(MemoryKV):
    """The store syncs every write it answers, so nothing is lost in a crash; keeping a
    second, durable copy of the whole KV per write (as `MemoryKV` does to model unsynced
    writes) would make a run quadratic in its length."""

    def _checkpoint(self) -> None:
        pass

    def crash(self) -> None:
        pass


class UnsyncedMemoryKV(MemoryKV):
    """A store running with `--fsync never`: no write is synced when it is answered;
    the system writes dirty pages back now and then (`flush`). A crash loses what was
    written since."""

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        super().write(ops, False)

    def flush(self) -> None:
        super().sync()


class StoreNode(Node):
    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        self.fsync_never = name in world.config.fsync_never
        # Disks wiped so far; one wiped at the next start (`SimConfig.wipes`).
        self.wipes = 0
        self.wipe_at_restart = False
        self.kv: MemoryKV
        self.core: SegmentStoreCore
        # The store registered once before the run: it keeps the master's key, as a
        # real store keeps what its registration answered.
        self._fresh_disk()
        self._load_authority()
        self.tails = TailServer(self)
        self.scrub = ScrubSchedule[SegmentKey](1 << 30, world.now, SCRUB_RECHECK_MS)
        self.heartbeat()
        if self.fsync_never:
            self.timer(UNSYNCED_FLUSH_MS, "write-back", self.write_back)

    def _fresh_disk(self, joins_cluster: bool = False) -> None:
        """An empty database holding the master's key; written back at once. A store
        whose disk was wiped is a new incarnation: it takes part in no write or seal
        before it joined with its registration's answer (the real store takes the key
        from that answer too; it takes no write before it joined either way)."""
        self.kv = UnsyncedMemoryKV() if self.fsync_never else SyncedMemoryKV()
        self.core = SegmentStoreCore(self.kv, joins_cluster=joins_cluster)
        if joins_cluster:
            self.core.catalog.keep_incarnation(self.wipes + 1)
        record = AuthorityRecord((sim_signing_key(self.world.config.seed).public_key,))
        self.core.execute(KeepAuthorityCommand(record.encode()))
        if isinstance(self.kv, UnsyncedMemoryKV):
            self.kv.flush()

    def _load_authority(self) -> None:
        kept = self.core.catalog.authority_record()
        assert kept is not None, "the master's key is kept from the store's first start"
        self.authority = StoreAuthority(self.name, AuthorityRecord.decode(kept))
        # Write stream number -> the grants shown on it (a restart breaks every stream).
        self.stream_grants: dict[int, WriteStreamGrants] = {}

    def write_back(self) -> None:
        assert isinstance(self.kv, UnsyncedMemoryKV)
        self.kv.flush()
        self.timer(UNSYNCED_FLUSH_MS, "write-back", self.write_back)

    def heartbeat(self) -> None:
        held = tuple(
            (
                (segment.stream_id, segment.epoch),
                Held(meta.fence, meta.acked_index, meta.last_index, meta.payload_bytes),
            )
            for segment, meta in sorted(self.core.catalog.metas().items())
        )
        scrubbed = self.scrub_one()
        self.world.net.send(self.name, MASTER, m.StoreHeartbeat(self.name, held, scrubbed))
        self.timer(STORE_HEARTBEAT_MS, "heartbeat", self.heartbeat)

    def scrub_one(self) -> tuple[m.ScrubReport, ...]:
        """Read the next due sealed replica back (the real scrub's schedule and scan)."""
        now = self.world.now
        targets = self.core.catalog.scrub_targets()
        replica = self.scrub.next_replica(now, targets)
        if replica is None:
            return ()
        result = self.core.reader.certify(replica, targets[replica])
        self.scrub.checked(replica, now)
        self.world.stats["replicas scrubbed"] += 1
        key = (replica.stream_id, replica.epoch)
        return (m.ScrubReport(key, result.final_index, result.certificate, result.detail),)

    def delete(self, segment: SegmentKey) -> bool:
        existed = self.core.delete(segment)
        self.world.checker.store_deleted(self.name, segment)
        return existed

    def destroy(self, segment: SegmentKey, cluster_id: str) -> None:
        """Lose this replica of `segment` for good, as a lost disk loses it: gone, and
        marked lost as a new incarnation marks what its earlier one held, so the store
        never stands for it again (UNAVAILABLE to its writer and recoveries)."""
        self.delete(segment)
        joined = self.core.execute(JoinCommand(cluster_id, (segment,)))
        assert isinstance(joined, Joined) and joined.lost == (segment,), joined
        if isinstance(self.kv, UnsyncedMemoryKV):
            self.kv.flush()
        self.tails.pump_all()

    def restart(self) -> None:
        super().restart()
        if self.wipe_at_restart:
            self.wipe_at_restart = False
            self.wipes += 1
            self._fresh_disk(joins_cluster=True)
            self.world.checker.store_wiped(self.name)
            self.world.stats["stores wiped"] += 1
        else:
            metas = self.core.catalog.metas()
            matched = {segment: meta.matched_index for segment, meta in metas.items()}
            served = self.world.checker.served_copies(self.core) if self.fsync_never else {}
            self.kv.crash()  # loses nothing unless the store runs with fsync never
            self.core = SegmentStoreCore(self.kv, joins_cluster=self.wipes > 0)
            self.world.checker.store_restarted(
                self.name, self.core, self.fsync_never, matched, served
            )
        self._load_authority()
        self.tails = TailServer(self)
        self.scrub = ScrubSchedule[SegmentKey](1 << 30, self.world.now, SCRUB_RECHECK_MS)
        if self.core.joins_cluster:
            self.register()
        else:
            self.heartbeat()
        if self.fsync_never:
            self.timer(UNSYNCED_FLUSH_MS, "write-back", self.write_back)

    # ---- registration: stores whose disk was wiped ----

    def register(self) -> None:
        """As the real store at every start: register with its incarnation, join with
        the answer (marking the replicas it lost), then heartbeat. Unanswered, it asks
        again."""
        catalog = self.core.catalog
        request = m.RegisterStore(self.name, catalog.incarnation(), catalog.cluster_id())
        self.call(
            MASTER,
            request,
            self._registered,
            timeout_ms=REGISTER_TIMEOUT_MS,
            on_timeout=self._register_again,
        )

    def _register_again(self) -> None:
        self.world.stats["registrations retried"] += 1
        self.register()

    def _registered(self, answer: object) -> None:
        if not isinstance(answer, Registered) or not answer.cluster_id:
            self.timer(REGISTER_TIMEOUT_MS, "register again", self._register_again)
            return
        if self.world.crash_before_join(self):
            return
        lost = tuple(SegmentKey(*key) for key in answer.lost)
        joined = self.core.execute(JoinCommand(answer.cluster_id, lost))
        assert isinstance(joined, Joined), joined
        self.world.stats["lost replicas marked"] += len(joined.lost)
        self.world.note(f"{self.name} joined, {len(joined.lost)} replicas marked lost")
        self.heartbeat()

    def takes_part(self, segment: SegmentKey) -> StoreError | None:
        """Why this store takes no part in a writer's write or seal of `segment` (not
        joined yet, or its replica lost with a wiped disk): UNAVAILABLE, as the real
        service answers."""
        try:
            self.core.check_takes_part(segment)
        except (NotJoined, ReplicaLost) as refusal:
            return refusal
        return None

    def fence(self, segment: SegmentKey) -> int:
        meta = self.core.catalog.meta(segment)
        return meta.fence if meta else 0

    def granted(
        self, check: Callable[[], Grant], segment: SegmentKey, epoch: int, from_writer: bool
    ) -> str | m.Denied:
        """The tenant of the grant a write or seal goes under (`check`: the real
        `authority` check), or the refusal: as the real service, before anything else."""
        if "ignore_grant" in self.world.config.flaws:
            return ""  # the flaw: a store that takes writes and seals without a grant
        try:
            return check().tenant
        except StoreError as error:
            if from_writer:
                self.world.checker.grant_refused(self.name, segment, epoch, str(error))
            return m.Denied(str(error))

    def stream_grants_of(self, stream: int) -> WriteStreamGrants:
        grants = self.stream_grants.get(stream)
        if grants is None:
            if len(self.stream_grants) >= STREAM_GRANTS_KEPT:
                net = self.world.net
                self.stream_grants = {
                    n: g for n, g in self.stream_grants.items() if net.stream_open(n)
                }
            grants = self.stream_grants[stream] = WriteStreamGrants(self.authority, INSECURE)
        return grants

    def seal(
        self, segment: SegmentKey, new_epoch: int, signed: bytes, from_writer: bool
    ) -> SealResult | m.Refused | m.Denied | StoreError:
        """A Seal, its grant checked first (invariants 3 and 8)."""
        tenant = self.granted(
            lambda: self.authority.grant_for(
                INSECURE, "SegmentStore/Seal", signed, segment, new_epoch, self.world.now
            ),
            segment,
            new_epoch,
            from_writer,
        )
        if isinstance(tenant, m.Denied):
            return tenant
        refusal = self.takes_part(segment)
        if refusal is not None:
            return refusal
        fence = self.fence(segment)
        try:
            result = self.core.seal(segment, new_epoch, tenant)
        except StoreRefused as refused:
            return m.Refused(refused.fence)
        checker = self.world.checker
        checker.write_attempted(self.name, segment, new_epoch, fence, True)
        checker.change_granted(self.name, segment, new_epoch)
        checker.store_changed(self.name, self.core, segment, (1, 0))
        return result

    def write(
        self,
        segment: SegmentKey,
        epoch: int,
        acked: int,
        entries: tuple[StoredEntry, ...],
        tenant: str = "",
    ) -> WriteResult | m.Refused:
        """The store's write rule, with the checks around it (invariants 2, 3, 4); the
        grant, when the write has one, was checked before (`granted`)."""
        fence = self.fence(segment)
        applied = epoch
        if "ignore_fence" in self.world.config.flaws and epoch < fence:
            applied = fence  # the flaw: a store that lets a stale writer through
        try:
            result = self.core.write(segment, applied, acked, entries, tenant)
        except StoreRefused as refused:
            self.world.checker.write_attempted(self.name, segment, epoch, fence, False)
            return m.Refused(refused.fence)
        self.world.checker.write_attempted(self.name, segment, epoch, fence, True)
        touched = (entries[0].index, entries[-1].index) if entries else (1, 0)
        self.world.checker.store_changed(self.name, self.core, segment, touched)
        return result

    def handle(self, message: Message) -> None:
        self._handle(message)
        self.tails.pump_all()  # Subscribe: what changed may be pushed now

    def _handle(self, message: Message) -> None:
        body = message.body
        if message.stream and self.tails.handle(message):
            return
        if isinstance(body, m.WriteRequest):
            self._stream_write(message, body)
            return
        if isinstance(body, m.StoreHeartbeatReply):
            for stream_id, epoch in body.deletes:
                self.delete(SegmentKey(stream_id, epoch))
            for stream_id, epoch in body.scrub_first:
                self.scrub.check_first(SegmentKey(stream_id, epoch))
            return
        assert isinstance(body, m.Call)
        if isinstance(body.request, m.CopySegment):
            _SegmentCopy(self, message, body.request).start()
            return
        self.answer(message, self._serve(body.request, message.src))

    def _stream_write(self, message: Message, request: m.WriteRequest) -> None:
        net = self.world.net
        grants = self.stream_grants_of(message.stream)
        segment, epoch = request.segment, request.writer_epoch
        tenant = self.granted(
            lambda: grants.admit(request.grant, segment, epoch, self.world.now),
            segment,
            epoch,
            True,
        )
        if isinstance(tenant, m.Denied):
            # PERMISSION_DENIED ends the stream: the status is its last message.
            net.stream_send(message.stream, self.name, message.src, tenant)
            return
        if self.takes_part(segment) is not None:
            net.break_stream(message.stream)  # UNAVAILABLE ends the stream
            return
        if request.entries and self.world.rng.random() < self.world.config.busy:
            command = WriteCommand(
                request.segment,
                request.writer_epoch,
                request.acked_index,
                PackedEntries.of(request.entries),
            )
            busy = self.core.refused_busy(command)
            if isinstance(busy, StoreRefused):
                net.stream_send(message.stream, self.name, message.src, m.Refused(busy.fence))
                return
            reply = m.WriteReply(
                request.request_id,
                True,
                busy.matched_index,
                busy.acked_index,
                request.entries[0].index,
                request.entries[-1].index,
            )
            net.stream_send(message.stream, self.name, message.src, reply)
            return
        result = self.write(segment, epoch, request.acked_index, request.entries, tenant)
        if isinstance(result, m.Refused):
            # FAILED_PRECONDITION ends the stream: the status is its last message.
            net.stream_send(message.stream, self.name, message.src, result)
            return
        self.world.checker.change_granted(self.name, segment, epoch)
        first = request.entries[0].index if request.entries else 0
        last = request.entries[-1].index if request.entries else 0
        reply = m.WriteReply(
            request.request_id, False, result.matched_index, result.acked_index, first, last
        )
        net.stream_send(message.stream, self.name, message.src, reply)

    def _serve(self, request: object, src: str) -> object:
        core = self.core
        from_writer = src in self.world.writer_names
        try:
            if isinstance(request, m.Seal):
                return self.seal(request.segment, request.new_epoch, request.grant, from_writer)
            if isinstance(request, m.Read):
                entries = core.reader.read(request.segment, request.from_index, request.to_index)
                return m.ReadReply(tuple(entries), self.fence(request.segment))
            if isinstance(request, m.RecoveryWrite):
                # A one-request Write stream, as the real recovery sends.
                grants = WriteStreamGrants(self.authority, INSECURE)
                segment, epoch = request.segment, request.writer_epoch
                tenant = self.granted(
                    lambda: grants.admit(request.grant, segment, epoch, self.world.now),
                    segment,
                    epoch,
                    from_writer,
                )
                if isinstance(tenant, m.Denied):
                    return tenant
                refusal = self.takes_part(segment)
                if refusal is not None:
                    return refusal
                result = self.write(segment, epoch, request.acked_index, request.entries, tenant)
                if not isinstance(result, m.Refused):
                    self.world.checker.change_granted(self.name, segment, epoch)
                return result
            if isinstance(request, m.GetSegmentState):
                return core.catalog.state(request.segment)
            if isinstance(request, m.Digest):
                return core.reader.digest(request.segment, request.up_to_index)
            if isinstance(request, m.Delete):
                return self.delete(request.segment)
        except SegmentNotFound as error:
            return error
        raise AssertionError(f"unknown request {request!r}")


class _SegmentCopy:
    """CopySegment on a simulated store: the real `copy_rules.CopyOp`, with calls to the
    source over the simulated network; a batch per timer tick, so other writes
    interleave."""

    def __init__(self, store: StoreNode, message: Message, request: m.CopySegment) -> None:
        self.store = store
        self.message = message
        self.request = request
        self.segment = request.segment
        self.flawed = "copy_unfenced" in store.world.config.flaws

    def start(self) -> None:
        try:
            self.op = copy_rules.CopyOp(
                self.segment,
                self.request.source,
                self.request.final_index,
                self.request.fence,
                self.request.tenant,
                self.request.certificate,
                self.request.replace_held,
            )
        except StoreError as error:
            self._end(error)
            return
        self._carry_out(self.op.start())

    def _carry_out(self, action: copy_rules.CopyAction | None) -> None:
        """The op's actions until one waits for the source."""
        try:
            while action is not None:
                if isinstance(action, copy_rules.Finished):
                    self._end(m.CopyReply(action.entries_copied, action.digest, action.acked_index))
                    return
                if isinstance(action, copy_rules.AskSourceState):
                    self._ask(m.GetSegmentState(self.segment), self._on_state)
                    return
                if isinstance(action, copy_rules.ReadSource):
                    request = m.Read(self.segment, action.from_index, action.to_index)
                    self._ask(request, self._on_read)
                    return
                if isinstance(action, copy_rules.AskDigests):
                    self._ask(m.Digest(self.segment, action.up_to_index), self._on_digest)
                    return
                if isinstance(action, copy_rules.ReadBack):
                    action = self.op.read_back(
                        self.store.core.reader.certify(self.segment, action.final_index)
                    )
                    continue
                assert isinstance(action, copy_rules.Submit), action
                action = self.op.submitted(self._apply(action.command))
        except StoreError as error:
            self._end(error)

    def _ask(self, request: object, on_answer: Callable[[object], None]) -> None:
        self.store.call(
            self.request.source,
            request,
            on_answer,
            timeout_ms=copy_rules.SIMULATED_TIMEOUTS.call_ms,
            on_timeout=lambda: self._end(CopySourceUnavailable("the source did not answer")),
        )

    def _end(self, result: object) -> None:
        self.store.answer(self.message, result)

    def _refused(self, answer: object) -> None:
        self._end(answer if isinstance(answer, StoreError) else CopyRefused(f"{answer}"))

    def _apply(self, command: Command) -> Outcome:
        """One command through the core, with the checks every store mutation gets; a
        refusal is raised."""
        if self.flawed and isinstance(command, SealCommand):
            # The flaw (CopySegment as it was): drop the copy and its fence instead, then
            # write every batch with acked index = final before the digest is compared.
            self.store.core.delete(self.segment)
            return DeleteResult(True)
        if self.flawed and isinstance(command, WriteCommand) and command.acked_index == 0:
            command = replace(command, acked_index=self.request.final_index)
        store = self.store
        fence = store.fence(self.segment)
        if isinstance(command, DropCopiesCommand):
            # As a delete: what the replica served stays true, its refill starts anew.
            store.world.checker.store_deleted(store.name, self.segment)
        outcome = store.core.execute(command)
        epoch = command.writer_epoch if isinstance(command, WriteCommand) else fence
        if isinstance(command, SealCommand):
            epoch = command.new_epoch
        store.world.checker.write_attempted(store.name, self.segment, epoch, fence, True)
        touched = (1, 0)
        if isinstance(command, WriteCommand):
            touched = (command.batch.first_index, command.batch.last_index)
        store.world.checker.store_changed(store.name, store.core, self.segment, touched)
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome

    def _on_state(self, answer: object) -> None:
        if not isinstance(answer, SegmentStateInfo):
            self._refused(answer)
            return
        local = self.store.core.catalog.meta(self.segment)
        local_fence = local.fence if local is not None else 0
        try:
            action = self.op.source_state(answer.fence, answer.acked_index, local_fence)
        except StoreError as error:
            self._end(error)
            return
        self._carry_out(action)

    def _on_read(self, answer: object) -> None:
        if not isinstance(answer, m.ReadReply):
            self._refused(answer)
            return
        batches = [
            answer.entries[i : i + COPY_BATCH_ENTRIES]
            for i in range(0, len(answer.entries), COPY_BATCH_ENTRIES)
        ]
        self._write_next(batches)

    def _write_next(self, batches: list[tuple[StoredEntry, ...]]) -> None:
        if not batches:
            self._carry_out(self.op.source_read_ended())
            return
        write = self.op.source_entries(PackedEntries.of(batches[0]))
        try:
            if write is not None:
                assert isinstance(write, copy_rules.Submit)
                assert self.op.submitted(self._apply(write.command)) is None
        except StoreError as error:
            self._end(error)
            return
        rest = batches[1:]
        self.store.timer(1, "copy batch", lambda: self._write_next(rest))

    def _on_digest(self, answer: object) -> None:
        if not isinstance(answer, DigestInfo):
            self._refused(answer)
            return
        try:
            local = self.store.core.reader.digest(self.segment, self.request.final_index)
            action = self.op.digests(local, answer.digest)
        except StoreError as error:
            self._end(error)
            return
        self._carry_out(action)
