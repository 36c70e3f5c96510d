"""The simulated processes: the master, the stores, the writers and the followers.

Each node is the thin shell the real process is, around the real core: `MasterState`
(over an in-memory catalog), `SegmentStoreCore` (over `MemoryKV`), `Leader` with its
`SegmentRecovery` operations, and `Cursor`. Shells carry actions out as messages over
the simulated network and feed answers back as events, as `client/writer.py`,
`segment_store/service.py` and `master/service.py` do over gRPC.

A node has an incarnation: a crash bumps it, and every timer or message meant for an
earlier incarnation is dropped. A paused node (SIGSTOP) keeps what arrives and runs it,
in order, when it resumes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from streamengine.client.core import segment_recovery as sr
from streamengine.client.core.cursor import (
    Cursor,
    DataLoss,
    ReadFrom,
    SegmentView,
    WaitForSegments,
)
from streamengine.client.core.leader import (
    AskRoll,
    BecameLeader,
    HeartbeatAnswered,
    HeartbeatFailed,
    Leader,
    LeaderAction,
    LeaderEvent,
    RecoverSegment,
    Replica,
    Role,
    RollAnswered,
    RollFailed,
    SegmentGrant,
    SegmentSealed,
    SendHeartbeat,
    StepDownReason,
    SteppedDown,
    StoreFenced,
)
from streamengine.client.core.leader import ReleaseLease as ReleaseLeaseAction
from streamengine.client.core.replicator import (
    Acked,
    Append,
    Assigned,
    ReplicatorLimits,
    SegmentRef,
    SendWrite,
    StoreConnected,
    StoreDetached,
    StoreDisconnected,
    Tick,
    WriteReplied,
)
from streamengine.client.subscription import FAILED_REPLICA_RETRY_ROUNDS
from streamengine.master.catalog import Batch, Catalog
from streamengine.master.errors import MasterError, SealConflict
from streamengine.master.model import SegmentRecord, SegmentState
from streamengine.master.state import MasterState, WriterView
from streamengine.protocol.entry import StoredEntry
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.segment_store.kv import MemoryKV
from streamengine.segment_store.store import (
    SealResult,
    SegmentKey,
    SegmentNotFound,
    SegmentStoreCore,
    StoreError,
    WriteResult,
)
from streamengine.segment_store.store import StoreFenced as StoreRefused
from tests.sim import messages as m
from tests.sim.network import Message

if TYPE_CHECKING:
    from tests.sim.world import World

MASTER = "master"

# A recovery re-sends what is still unanswered after this long without an answer.
RETRANSMIT_MS = 60
# A store silent this long is reported lost to the recovery (it then decides from
# another sealed store).
STORE_LOST_MS = 250
RECONNECT_MS = 40
FOLLOWER_POLL_MS = 25
FOLLOWER_READ_TIMEOUT_MS = 200
SEGMENT_LIST_REFRESH_MS = 150
TAIL_ENTRIES_MAX = 64
STORE_HEARTBEAT_MS = 100


class Node:
    def __init__(self, name: str, world: World) -> None:
        self.name = name
        self.world = world
        self.up = True
        self.paused = False
        self.incarnation = 0
        self.deferred: list[Callable[[], None]] = []
        self._calls: dict[int, tuple[Callable[[object], None], bool]] = {}

    def receive(self, message: Message) -> None:
        body = message.body
        if isinstance(body, m.Answer):
            found = self._calls.get(body.call_id)
            if found is not None:
                on_answer, once = found
                if once:
                    del self._calls[body.call_id]
                on_answer(body.result)
        else:
            self.handle(message)

    def handle(self, message: Message) -> None:
        raise NotImplementedError

    def timer(self, delay_ms: int, label: str, callback: Callable[[], None]) -> None:
        incarnation = self.incarnation
        self.world.sched.after(
            delay_ms,
            f"{self.name}: {label}",
            lambda: self.world.run_on(self, incarnation, callback),
        )

    def call(
        self,
        dst: str,
        request: object,
        on_answer: Callable[[object], None],
        once: bool = True,
        timeout_ms: int = 0,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        """Send a unary request. With `once`, only the first answer counts (a gRPC call
        completes once); without, every copy that arrives is handed on, so operations
        that must be idempotent see duplicates."""
        call_id = self.world.next_id()
        self._calls[call_id] = (on_answer, once)
        self.world.net.send(self.name, dst, m.Call(call_id, request))
        if timeout_ms and on_timeout is not None:

            def expire() -> None:
                if self._calls.pop(call_id, None) is not None:
                    on_timeout()

            self.timer(timeout_ms, f"call #{call_id} times out", expire)

    def answer(self, message: Message, result: object) -> None:
        assert isinstance(message.body, m.Call)
        self.world.net.send(self.name, message.src, m.Answer(message.body.call_id, result))

    def crash(self) -> None:
        self.up = False
        self.paused = False
        self.incarnation += 1
        self.deferred.clear()
        self._calls.clear()
        self.world.net.break_streams_of(self.name)

    def restart(self) -> None:
        self.up = True


# ---- master ----


class MemoryCatalog(Catalog):
    """The real catalog's encoding and loading over a sorted dict instead of RocksDB
    (every commit is durable at once, as a synced RocksDB write is)."""

    def __init__(self) -> None:  # no RocksDB
        self.data: dict[bytes, bytes] = {}
        self._db = cast(Any, self)  # get/items: all the loading code needs

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def items(self, from_key: bytes) -> list[tuple[bytes, bytes]]:
        return sorted((k, v) for k, v in self.data.items() if k >= from_key)

    def commit(self, batch: Batch) -> None:
        for key in batch.deletes:
            self.data.pop(key, None)
        for key, value in batch.puts:
            self.data[key] = value

    def close(self) -> None:
        pass


def grant_of(record: SegmentRecord) -> SegmentGrant:
    return SegmentGrant(
        SegmentRef(record.stream_id, record.epoch, record.stream),
        tuple(Replica(store, f"{store}:1") for store in record.copy_set),
    )


class MasterNode(Node):
    def __init__(self, world: World) -> None:
        super().__init__(MASTER, world)
        self.catalog = MemoryCatalog()
        self.state = self._load()
        cfg = world.config
        self.stream = self.state.create_stream(
            cfg.stream,
            cfg.policy.replicas,
            cfg.policy.write_quorum,
            cfg.segment_bytes,
            cfg.segment_age_ms,
            True,
            0,
        )
        for store in world.store_names:
            self.state.register_store(store, f"{store}:1", "", 1 << 40, 0)

    def _load(self) -> MasterState:
        cfg = self.world.config
        return MasterState(self.catalog, self.world.now, cfg.lease_ms, cfg.store_timeout_ms)

    def restart(self) -> None:
        super().restart()
        self.state = self._load()
        self.world.checker.master_changed(self.state)

    def handle(self, message: Message) -> None:
        body = message.body
        if isinstance(body, m.StoreHeartbeat):
            now = self.world.now
            if self.state.store_heartbeat(body.store, 0, 1 << 40, {}, now) is None:
                self.state.register_store(body.store, f"{body.store}:1", "", 1 << 40, now)
            return
        assert isinstance(body, m.Call)
        try:
            result = self._serve(body.request)
        except MasterError as error:
            result = error
        self.answer(message, result)

    def _serve(self, request: object) -> object:
        now = self.world.now
        state = self.state
        if isinstance(request, m.WriterHeartbeat):
            before = state.leases[request.stream].epoch
            view = state.writer_heartbeat(
                request.stream,
                request.client_id,
                request.epoch,
                request.acked_index,
                request.segment_bytes,
                now,
            )
            return self._view(view, before, request.client_id)
        if isinstance(request, m.RollSegment):
            # Ready for the leader's roll: a shell action for it maps here.
            before = state.leases[request.stream].epoch
            view = state.roll_segment(
                request.stream, request.client_id, request.epoch, request.exclude, now
            )
            return self._view(view, before, request.client_id)
        if isinstance(request, m.ReleaseLease):
            return state.release_lease(request.stream, request.client_id, request.epoch, now)
        if isinstance(request, m.SealSegment):
            return self._seal(request)
        if isinstance(request, m.ListSegments):
            _, segments = state.list_segments(request.stream, 0)
            return tuple(segments)
        raise AssertionError(f"unknown request {request!r}")

    def _view(self, view: WriterView, before: int, client_id: str) -> HeartbeatAnswered:
        """The reply to a heartbeat or a roll, as the master's service builds it."""
        state = self.state
        now = self.world.now
        granted = view.lease.epoch if view.lease.epoch != before else 0
        self.world.checker.master_changed(state, granted)
        if granted:
            self.world.note(f"master grants epoch {granted} to {client_id}")
        record = view.stream
        return HeartbeatAnswered(
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
        )

    def _seal(self, request: m.SealSegment) -> object:
        key = SegmentKey(self.stream.stream_id, request.segment_epoch)
        try:
            sealed = self.state.seal_segment(
                request.stream,
                request.segment_epoch,
                request.writer_epoch,
                request.final_index,
                self.world.now,
            )
        except SealConflict as conflict:
            self.world.checker.seal_conflict(key, str(conflict))
            raise
        self.world.checker.master_changed(self.state)
        cores = {n: s.core for n, s in self.world.stores.items()}
        self.world.checker.sealed_at_master(key, sealed.final_index, cores)
        return sealed


# ---- stores ----


class SyncedMemoryKV(MemoryKV):
    """The store syncs every write it answers, so nothing is lost in a crash; keeping a
    second, durable copy of the whole KV per write (as `MemoryKV` does to model unsynced
    writes) would make a run quadratic in its length."""

    def _checkpoint(self) -> None:
        pass

    def crash(self) -> None:
        pass


class StoreNode(Node):
    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        self.kv = SyncedMemoryKV()
        self.core = SegmentStoreCore(self.kv)
        self.heartbeat()

    def heartbeat(self) -> None:
        self.world.net.send(self.name, MASTER, m.StoreHeartbeat(self.name))
        self.timer(STORE_HEARTBEAT_MS, "heartbeat", self.heartbeat)

    def restart(self) -> None:
        super().restart()
        self.kv.crash()  # loses nothing: every write was synced
        self.core = SegmentStoreCore(self.kv)
        self.world.checker.store_restarted(self.name, self.core)
        self.heartbeat()

    def fence(self, segment: SegmentKey) -> int:
        meta = self.core.meta(segment)
        return meta.fence if meta else 0

    def write(
        self, segment: SegmentKey, epoch: int, acked: int, entries: tuple[StoredEntry, ...]
    ) -> WriteResult | m.Refused:
        """The store's write rule, with the checks around it (invariants 2, 3, 4)."""
        fence = self.fence(segment)
        applied = epoch
        if "ignore_fence" in self.world.config.flaws and epoch < fence:
            applied = fence  # the flaw: a store that lets a stale writer through
        try:
            result = self.core.write(segment, applied, acked, entries)
        except StoreRefused as refused:
            self.world.checker.write_attempted(self.name, segment, epoch, fence, False)
            return m.Refused(refused.fence)
        self.world.checker.write_attempted(self.name, segment, epoch, fence, True)
        touched = (entries[0].index, entries[-1].index) if entries else (1, 0)
        self.world.checker.store_changed(self.name, self.core, segment, touched)
        return result

    def handle(self, message: Message) -> None:
        body = message.body
        if isinstance(body, m.WriteRequest):
            self._stream_write(message, body)
            return
        assert isinstance(body, m.Call)
        self.answer(message, self._serve(body.request))

    def _stream_write(self, message: Message, request: m.WriteRequest) -> None:
        net = self.world.net
        if request.entries and self.world.rng.random() < self.world.config.busy:
            meta = self.core.meta(request.segment)
            reply = m.WriteReply(
                request.request_id,
                True,
                meta.matched_index if meta else 0,
                meta.acked_index if meta else 0,
                request.entries[0].index,
                request.entries[-1].index,
            )
            net.stream_send(message.stream, self.name, message.src, reply)
            return
        result = self.write(
            request.segment, request.writer_epoch, request.acked_index, request.entries
        )
        if isinstance(result, m.Refused):
            # FAILED_PRECONDITION ends the stream: the status is its last message.
            net.stream_send(message.stream, self.name, message.src, result)
            return
        first = request.entries[0].index if request.entries else 0
        last = request.entries[-1].index if request.entries else 0
        reply = m.WriteReply(
            request.request_id, False, result.matched_index, result.acked_index, first, last
        )
        net.stream_send(message.stream, self.name, message.src, reply)

    def _serve(self, request: object) -> object:
        core = self.core
        checker = self.world.checker
        try:
            if isinstance(request, m.Seal):
                fence = self.fence(request.segment)
                try:
                    result = core.seal(request.segment, request.new_epoch)
                except StoreRefused as refused:
                    return m.Refused(refused.fence)
                checker.write_attempted(self.name, request.segment, request.new_epoch, fence, True)
                checker.store_changed(self.name, core, request.segment, (1, 0))
                return result
            if isinstance(request, m.Read):
                entries = core.read(request.segment, request.from_index, request.to_index)
                return m.ReadReply(tuple(entries), self.fence(request.segment))
            if isinstance(request, m.RecoveryWrite):
                return self.write(
                    request.segment, request.writer_epoch, request.acked_index, request.entries
                )
            if isinstance(request, m.Tail):
                return self._tail(request)
        except SegmentNotFound as error:
            return error
        raise AssertionError(f"unknown request {request!r}")

    def _tail(self, request: m.Tail) -> m.TailReply:
        meta = self.core.meta(request.segment)
        if meta is None:
            raise SegmentNotFound(f"{request.segment}")
        if "serve_matched" in self.world.config.flaws:
            # The flaw: a store that trusts its matched index when serving readers.
            upto = meta.matched_index
            entries = self.core.read(request.segment, request.from_index, upto, limit=request.limit)
            return m.TailReply(tuple(entries) if upto else (), upto)
        entries = self.core.read(
            request.segment, request.from_index, 0, acked_only=True, limit=request.limit
        )
        return m.TailReply(tuple(entries), meta.acked_index)


# ---- writers ----


@dataclasses.dataclass
class _Pending:
    first_index: int
    payloads: tuple[bytes, ...]


class WriterNode(Node):
    """A user process holding one `Writer`: when it stops leading (or crashes), a new
    writer with a new client id takes its place and competes again."""

    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        self.generation = 0
        self.new_writer()

    # ---- lifecycle ----

    def new_writer(self) -> None:
        self.generation += 1
        self.client_id = f"{self.name}.{self.generation}"
        cfg = self.world.config
        limits = ReplicatorLimits(idle_ack_ms=cfg.idle_ack_ms, window_batches=cfg.window)
        self.leader = Leader(
            self.world.now, limits, recovery_supported=True, rolling_supported=True
        )
        self.links: dict[str, int] = {}
        self.fenced_links: set[str] = set()
        self.copy_set: tuple[str, ...] = ()
        self.recoveries: dict[int, RecoveryRun] = {}
        self.pending: list[_Pending] = []
        self.segment: SegmentRef | None = None
        self._timer_token = 0
        self._timer_at: int | None = None
        self._replacing = False
        self.gap_epoch = 0
        self.gap_runs: list[RecoveryRun] = []
        self.step(Tick())

    def crash(self) -> None:
        super().crash()
        self.world.note(f"{self.client_id} crashes (leading: {self.leading})")

    def restart(self) -> None:
        super().restart()
        self.new_writer()

    def _replace_later(self) -> None:
        if self._replacing:
            return
        self._replacing = True

        def replace() -> None:
            # The old writer object is gone: nothing addressed to it is handled.
            self.incarnation += 1
            self._calls.clear()
            self.deferred.clear()
            self.world.net.break_streams_of(self.name)
            self.new_writer()

        self.timer(self.world.rng.randint(10, 200), "a new writer", replace)

    @property
    def leading(self) -> bool:
        return self.leader.role is Role.LEADING

    def can_append(self) -> bool:
        replicator = self.leader.replicator
        return (
            self.up
            and not self.paused
            and self.leading
            and self.leader.accepting_appends
            and replicator is not None
            and replicator.room_for(64)
            and self.leader.statistics().lease_until_ms > self.world.now
        )

    # ---- the core ----

    def step(self, event: LeaderEvent) -> list[LeaderAction]:
        actions = self.leader.step(self.world.now, event)
        self.apply(actions)
        self._arm_timer()
        return actions

    def append(self, payloads: tuple[bytes, ...]) -> None:
        actions = self.step(Append(payloads))
        for action in actions:
            if isinstance(action, Assigned):
                self.pending.append(_Pending(action.first_index, payloads))

    def _arm_timer(self) -> None:
        deadline = self.leader.deadline_ms(self.world.now)
        if deadline is None:
            return
        deadline = max(deadline, self.world.now + 1)
        if self._timer_at is not None and self._timer_at <= deadline:
            return
        self._timer_token += 1
        token = self._timer_token
        self._timer_at = deadline

        def fire() -> None:
            if token == self._timer_token:
                self._timer_at = None
                self.step(Tick())

        self.timer(deadline - self.world.now, "tick", fire)

    def apply(self, actions: list[LeaderAction]) -> None:
        for action in actions:
            if isinstance(action, SendWrite):
                link = self.links.get(action.store)
                if link is not None:
                    request = m.WriteRequest(
                        SegmentKey(action.segment.stream_id, action.segment.epoch),
                        action.writer_epoch,
                        action.request_id,
                        action.acked_index,
                        action.entries,
                    )
                    self.world.net.stream_send(link, self.name, action.store, request)
            elif isinstance(action, Acked):
                self._acked(action.segment_epoch, action.acked_index)
            elif isinstance(action, SendHeartbeat):
                self._heartbeat(action)
            elif isinstance(action, BecameLeader):
                self._became_leader(action)
            elif isinstance(action, RecoverSegment):
                self._recover(action)
            elif isinstance(action, AskRoll):
                self._roll(action)
            elif isinstance(action, SteppedDown):
                self.world.note(f"{self.client_id} steps down: {action.reason.name}")
                if action.reason is StepDownReason.UNSUPPORTED:
                    self.world.unsupported.append(f"{self.client_id}: {action.message}")
                self._report_failed(action.sent_through)
                self._replace_later()
            elif isinstance(action, ReleaseLeaseAction):
                release = m.ReleaseLease(self.world.config.stream, self.client_id, action.epoch)
                self.call(MASTER, release, lambda _: None)
            elif isinstance(action, StoreDetached):
                self.world.note(f"{self.client_id} detached {action.store}: {action.reason}")
            elif not isinstance(action, Assigned):
                raise AssertionError(f"unknown action {action!r}")

    def _report_failed(self, sent_through: int) -> None:
        """Appends above `sent_through` reached no store: users hear they failed."""
        if "fail_in_doubt" in self.world.config.flaws:
            sent_through = 0  # the flaw: a shell that calls every pending append failed
        failed = []
        for item in self.pending:
            failed += [
                payload
                for offset, payload in enumerate(item.payloads)
                if item.first_index + offset > sent_through
            ]
        in_doubt = sum(len(item.payloads) for item in self.pending) - len(failed)
        self.pending = []
        self.world.stats["appends reported failed"] += len(failed)
        self.world.stats["appends in doubt"] += in_doubt
        self.world.checker.appends_failed(failed)

    def _heartbeat(self, action: SendHeartbeat) -> None:
        sent_at = self.world.now
        request = m.WriterHeartbeat(
            self.world.config.stream,
            self.client_id,
            action.epoch,
            action.acked_index,
            action.segment_bytes,
        )

        def answered(result: object) -> None:
            if isinstance(result, HeartbeatAnswered) and self._gap(result):
                self._close_gap(result)
                self.step(HeartbeatFailed(sent_at, "a grant without a segment"))
            elif isinstance(result, HeartbeatAnswered):
                self.step(dataclasses.replace(result, sent_at_ms=sent_at))
            else:
                self.step(HeartbeatFailed(sent_at, str(result)))

        def timed_out() -> None:
            self.step(HeartbeatFailed(sent_at, "deadline exceeded"))

        self.call(MASTER, request, answered, True, action.timeout_ms, timed_out)

    # ---- grants without a segment ----

    def _gap(self, answer: HeartbeatAnswered) -> bool:
        return (
            self.world.close_gap
            and answer.leader
            and answer.segment is None
            and self.leader.role is Role.FOLLOWING
        )

    def _close_gap(self, answer: HeartbeatAnswered) -> None:
        """Two earlier segments are unsealed, so the master granted an epoch without a
        segment, which the leader core refuses (it steps down and the stream livelocks;
        `--no-close-gap` shows it). Until the core does it, the shell seals and recovers
        both under the granted epoch, then gives the lease back: the next grant has a
        segment. Safety does not rest on this lease (stores fence by epoch)."""
        if answer.epoch == self.gap_epoch:
            return  # a renewal while closing
        assert answer.policy is not None
        self.gap_epoch = answer.epoch
        self.world.stats["grants without a segment closed by the shell"] += 1
        self.world.note(f"{self.client_id} closes {[g.epoch for g in answer.unsealed]}")
        self.gap_runs = [
            RecoveryRun(self, RecoverSegment(grant, answer.epoch, answer.policy), True)
            for grant in answer.unsealed
        ]
        for run in self.gap_runs:
            run.start()

    def gap_closed(self) -> None:
        """Both sealed: roll for the next epoch, whose grant (with a segment, nothing
        unsealed) the core leads, as `client/writer.py` does."""
        if not all(run.op.done for run in self.gap_runs):
            return
        sent_at = self.world.now
        request = m.RollSegment(self.world.config.stream, self.client_id, self.gap_epoch)

        def answered(result: object) -> None:
            if not isinstance(result, HeartbeatAnswered):
                self.gap_epoch = 0  # a later grant starts over
            elif self.leader.role is Role.FOLLOWING:
                self.step(dataclasses.replace(result, sent_at_ms=sent_at))

        self.call(MASTER, request, answered)

    def _roll(self, action: AskRoll) -> None:
        self.world.note(f"{self.client_id} rolls epoch {action.epoch}: {action.reason}")
        self.world.stats["rolls asked"] += 1
        sent_at = self.world.now
        request = m.RollSegment(
            self.world.config.stream, self.client_id, action.epoch, action.exclude_stores
        )

        def answered(result: object) -> None:
            if isinstance(result, HeartbeatAnswered):
                self.step(RollAnswered(dataclasses.replace(result, sent_at_ms=sent_at)))
            else:
                self.step(RollFailed(str(result)))

        def timed_out() -> None:
            self.step(RollFailed("deadline exceeded"))

        lease_ms = self.leader.heartbeat_interval_ms * 3
        self.call(MASTER, request, answered, True, lease_ms, timed_out)

    def _became_leader(self, action: BecameLeader) -> None:
        self.world.note(f"{self.client_id} leads epoch {action.epoch}")
        self.segment = action.segment.segment
        # A new segment (a grant or a roll) gets new Write streams: replies on the old
        # ones belong to the old segment's replicator.
        for store, number in sorted(self.links.items()):
            del self.links[store]
            self.world.net.break_stream(number)
        self.fenced_links.clear()
        self.copy_set = tuple(r.store_id for r in action.segment.copy_set)
        for replica in action.segment.copy_set:
            self._connect(replica.store_id)

    def _acked(self, epoch: int, acked_index: int) -> None:
        state = self.world.master.state
        while self.pending and self.pending[0].first_index <= acked_index:
            item = self.pending[0]
            done = 0
            for offset, payload in enumerate(item.payloads):
                index = item.first_index + offset
                if index > acked_index:
                    break
                self.world.checker.user_acked(epoch, index, payload, state)
                done += 1
            if done < len(item.payloads):
                item.first_index += done
                item.payloads = item.payloads[done:]
                break
            self.pending.pop(0)

    # ---- Write streams ----

    def _connect(self, store: str) -> None:
        def attempt() -> None:
            if not self.leading or store in self.links or store in self.fenced_links:
                return
            if store not in self.copy_set:
                return  # a store of a segment rolled away from
            target = self.world.stores[store]
            if not target.up or self.world.net.partitioned(self.name, store):
                self.timer(RECONNECT_MS, f"reconnect {store}", attempt)
                return
            incarnation = self.incarnation
            number = 0

            def broken() -> None:
                self.world.run_on(self, incarnation, lambda: self._disconnected(store, number))

            number = self.world.net.open_stream(self.name, store, broken, lambda: None)
            self.links[store] = number
            self.step(StoreConnected(store))

        self.timer(self.world.rng.randint(1, 10), f"connect {store}", attempt)

    def _disconnected(self, store: str, number: int) -> None:
        if self.links.get(store) != number:
            return
        del self.links[store]
        self.step(StoreDisconnected(store))
        self.timer(RECONNECT_MS, f"reconnect {store}", lambda: self._connect(store))

    def handle(self, message: Message) -> None:
        body = message.body
        store = message.src
        if self.links.get(store) != message.stream:
            return
        if isinstance(body, m.WriteReply):
            self.step(
                WriteReplied(
                    store,
                    body.request_id,
                    body.busy,
                    body.matched_index,
                    body.acked_index,
                    body.first_index,
                    body.last_index,
                )
            )
        elif isinstance(body, m.Refused):
            del self.links[store]
            self.fenced_links.add(store)
            self.world.net.break_stream(message.stream)
            self.step(StoreDisconnected(store))
            self.step(StoreFenced(store, body.fence))

    # ---- recovery ----

    def _recover(self, action: RecoverSegment) -> None:
        epoch = action.segment.epoch
        self.world.note(f"{self.client_id} recovers segment {epoch} under {action.new_epoch}")
        run = RecoveryRun(self, action)
        self.recoveries[epoch] = run
        if "ack_before_seal" in self.world.config.flaws:
            # The flaw: a shell that lets the new segment ack before recovery ends.
            def sealed_at_once() -> None:
                self.step(SegmentSealed(epoch))

            self.timer(1, "flaw: sealed at once", sealed_at_once)
        run.start()


class RecoveryRun:
    """Carries one `SegmentRecovery`'s actions out and its answers back."""

    def __init__(
        self, writer: WriterNode, action: RecoverSegment, standalone: bool = False
    ) -> None:
        """`standalone`: run by the shell for a grant without a segment, not for the
        core (see `WriterNode._close_gap`)."""
        self.writer = writer
        self.standalone = standalone
        grant = action.segment
        self.segment = SegmentKey(grant.segment.stream_id, grant.segment.epoch)
        self.epoch = action.new_epoch
        stores = [r.store_id for r in grant.copy_set]
        self.op = sr.SegmentRecovery(
            action.policy,
            grant.epoch,
            action.new_epoch,
            stores,
            writer.world.config.recovery_batch,
        )
        self.stores = stores
        # Per store, since when a request to it has gone unanswered.
        self.waiting_since: dict[str, int] = {}
        self.lost: list[str] = []
        self.matched: dict[str, int] = {}  # from seal answers, for the flaw only
        self.counted = False
        self.last_progress_ms = writer.world.now

    def start(self) -> None:
        self.send(self.op.start())
        self.writer.timer(RETRANSMIT_MS, "recovery retransmit", self.retransmit)

    def active(self) -> bool:
        return (self.standalone or self.writer.leading) and not self.op.deposed

    def retransmit(self) -> None:
        if not self.active():
            return
        now = self.writer.world.now
        for store in self.stores:
            since = self.waiting_since.get(store)
            if since is not None and now - since >= STORE_LOST_MS and store not in self.lost:
                # As a shell whose channel to the store is down: decide without it.
                self.lost.append(store)
                self.send(self.op.step(sr.StoreLost(store)))
            elif store in self.lost and self.writer.world.probe_lost:
                self._probe(store)
        if now - self.last_progress_ms >= RETRANSMIT_MS:
            outstanding = self.op.outstanding()
            if not outstanding and self.op.done:
                return
            self.send(outstanding)
        self.writer.timer(RETRANSMIT_MS, "recovery retransmit", self.retransmit)

    def send(self, actions: list[sr.Action]) -> None:
        for action in actions:
            if not self.active():
                return
            self._send(action)

    def _send(self, action: sr.Action) -> None:
        writer = self.writer
        seg = self.segment
        if isinstance(action, sr.Done):
            writer.world.note(f"{writer.client_id} sealed {seg.epoch} at {action.final_index}")
            if self.standalone:
                writer.gap_closed()
            else:
                writer.step(SegmentSealed(seg.epoch))
            return
        if isinstance(action, sr.Deposed):
            if not self.standalone:
                writer.step(StoreFenced(f"recovery of {seg.epoch}", action.fence))
            return
        if isinstance(action, sr.SealAtMaster):
            request: object = m.SealSegment(
                writer.world.config.stream, seg.epoch, self.epoch, action.final_index
            )
            writer.call(MASTER, request, self._master_answered, once=False)
            return
        if isinstance(action, sr.SendSeal):
            request = m.Seal(seg, action.new_epoch)
        elif isinstance(action, sr.SendRead):
            request = m.Read(seg, action.from_index, action.to_index)
        elif isinstance(action, sr.SendWrite):
            if self._skip_by_matched(action):
                return
            request = m.RecoveryWrite(seg, self.epoch, action.acked_index, action.entries)
        else:
            assert isinstance(action, sr.SendAcked)
            request = m.RecoveryWrite(seg, self.epoch, action.acked_index, ())
        store = action.store
        self.waiting_since.setdefault(store, writer.world.now)
        writer.call(store, request, lambda r: self._answered(store, action, r), once=False)

    def _probe(self, store: str) -> None:
        """`outstanding()` leaves out every request to a store given up on, and only an
        answer from it brings it back: without a probe, a store lost before it answered
        its seal is never asked again (recovery then hangs when it is needed, e.g.
        N = 1). The seal is idempotent, so the shell asks it again."""
        self._send(sr.SendSeal(store, self.epoch))

    def _skip_by_matched(self, action: sr.SendWrite) -> bool:
        """The flaw `skip_by_matched`: a shell that trusts a store's matched index and
        skips rewriting indexes the store already holds (a stale copy, or what lies
        where the bridge goes), answering for it."""
        if "skip_by_matched" not in self.writer.world.config.flaws:
            return False
        matched = self.matched.get(action.store, 0)
        last = action.entries[-1].index
        if last > matched:
            return False
        held = tuple(e.epoch for e in action.entries)
        answer = sr.WriteAnswered(action.store, action.entries[0].index, last, held, 0)
        self.writer.timer(1, "flaw: skipped rewrite", lambda: self._feed(answer))
        return True

    def _decided(self) -> None:
        plan = self.op.plan
        if plan is None or self.counted:
            return
        self.counted = True
        stats = self.writer.world.stats
        stats["recoveries decided"] += 1
        stats["indexes chosen above a"] += plan.final_index - 1 - plan.acked_index
        stats["holes"] += len(plan.holes)
        stats["already bridged"] += plan.existing_bridge

    def _feed(self, event: sr.Event) -> None:
        if self.active():
            self.send(self.op.step(event))

    def _answered(self, store: str, action: sr.Action, result: object) -> None:
        if not self.active():
            return
        event = self._event(store, action, result)
        if event is None:
            return
        self.waiting_since.pop(store, None)
        self.last_progress_ms = self.writer.world.now
        if store in self.lost:
            self.lost.remove(store)
        self.send(self.op.step(event))
        self._decided()

    def _event(self, store: str, action: sr.Action, result: object) -> sr.Event | None:
        if isinstance(result, m.Refused):
            return sr.StoreFenced(store, result.fence)
        if isinstance(result, StoreError):
            return None
        if isinstance(action, sr.SendSeal):
            assert isinstance(result, SealResult)
            self.matched[store] = result.matched_index
            return sr.SealAnswered(
                store, result.fence, result.acked_index, result.matched_index, result.last_index
            )
        if isinstance(action, sr.SendRead):
            assert isinstance(result, m.ReadReply)
            return sr.ReadAnswered(
                store, action.from_index, action.to_index, result.entries, result.fence
            )
        assert isinstance(result, WriteResult)
        if isinstance(action, sr.SendWrite):
            first, last = action.entries[0].index, action.entries[-1].index
            return sr.WriteAnswered(store, first, last, result.held_epochs, result.acked_index)
        return sr.WriteAnswered(store, 0, 0, (), result.acked_index)

    def _master_answered(self, result: object) -> None:
        if not self.active():
            return
        if isinstance(result, SegmentRecord) and result.state == SegmentState.SEALED:
            self.last_progress_ms = self.writer.world.now
            self.send(self.op.step(sr.MasterSealed(result.final_index)))


# ---- followers ----


class FollowerNode(Node):
    """A subscriber from the start of the stream: the real `Cursor` decides what to read
    next; reads go to stores, which serve acked entries only."""

    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        self.cursor = Cursor(0)
        self.resume_at = 0
        self.idle_rounds = 0
        self.tailing: tuple[int, str] | None = None
        self.segments: dict[int, SegmentKey] = {}
        self.data_loss: DataLoss | None = None
        self.reading = False
        self.refresh()

    def restart(self) -> None:
        super().restart()
        # A restarted subscriber resumes after the last sequence it yielded (its token).
        self.cursor = Cursor(self.resume_at)
        self.tailing = None
        self.reading = False
        self.refresh()

    def refresh(self) -> None:
        def listed(result: object) -> None:
            if isinstance(result, tuple):
                views = []
                for s in result:
                    assert isinstance(s, SegmentRecord)
                    self.segments[s.epoch] = SegmentKey(s.stream_id, s.epoch)
                    sealed = s.state == SegmentState.SEALED
                    views.append(SegmentView(s.epoch, s.copy_set, sealed, s.final_index))
                self.cursor.on_segments(views)
            self.pump()

        self.call(
            MASTER,
            m.ListSegments(self.world.config.stream),
            listed,
            True,
            FOLLOWER_READ_TIMEOUT_MS,
            self.pump,
        )
        self.timer(SEGMENT_LIST_REFRESH_MS, "refresh segments", self._periodic)

    def _periodic(self) -> None:
        self.refresh()

    def pump(self) -> None:
        if self.reading:
            return
        now = self.world.now
        decision = self.cursor.next(now)
        if isinstance(decision, ReadFrom):
            self.idle_rounds = 0
            self._read(decision)
            return
        # As the subscription does: failed replicas get another chance after a few
        # rounds with nothing to read (not sooner: a replica that missed a bridge would
        # be chosen again and again).
        self.idle_rounds += 1
        if self.idle_rounds % FAILED_REPLICA_RETRY_ROUNDS == 0:
            self.cursor.forget_failures()
        if isinstance(decision, DataLoss):
            self.data_loss = decision
        elif isinstance(decision, WaitForSegments):
            self.data_loss = None

    def _read(self, decision: ReadFrom) -> None:
        segment = self.segments[decision.epoch]
        self.reading = True
        self.data_loss = None

        def answered(result: object) -> None:
            self.reading = False
            now = self.world.now
            if not isinstance(result, m.TailReply):
                self.tailing = None
                self.cursor.on_replica_failed(decision.epoch, decision.replica)
                self.timer(FOLLOWER_POLL_MS, "retry", self.pump)
                return
            if self.tailing != (decision.epoch, decision.replica):
                # A subscription reports its position once, when it starts (as the
                # store's Subscribe does); polls stand in for its pushes.
                self.tailing = (decision.epoch, decision.replica)
                self.cursor.on_position(decision.epoch, decision.replica, result.acked_index, now)
            for event in self.cursor.on_entries(decision.epoch, result.entries, now):
                self.world.checker.follower_event(self.name, event.sequence, event.payload)
                self.resume_at = event.sequence + 1
            delay = 1 if result.entries else FOLLOWER_POLL_MS
            self.timer(delay, "read on", self.pump)

        def timed_out() -> None:
            self.reading = False
            self.tailing = None
            self.cursor.on_replica_failed(decision.epoch, decision.replica)
            self.pump()

        request = m.Tail(segment, decision.from_index, TAIL_ENTRIES_MAX)
        self.call(decision.replica, request, answered, True, FOLLOWER_READ_TIMEOUT_MS, timed_out)
