"""A simulated user process holding a writer: the real `Leader` core."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

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
from streamengine.client.core.writer import (
    AppendsLeftUnacked,
    AppendsTimedOut,
    AskRoll,
    BecameLeader,
    FencedByStore,
    HeartbeatAnswered,
    HeartbeatFailed,
    Leader,
    LeaderAction,
    LeaderEvent,
    RecoverSegment,
    Role,
    RollAnswered,
    RollFailed,
    SegmentSealed,
    SendHeartbeat,
    StepDownReason,
    SteppedDown,
)
from streamengine.client.core.writer import ReleaseLease as ReleaseLeaseAction
from streamengine.client.wire import LeaseSecret
from streamengine.master.core.errors import MasterError
from streamengine.master.service_calls import status_of
from streamengine.protocol.backoff import STORE_STREAM_REOPEN
from streamengine.protocol.entry import ProducerMark
from streamengine.protocol.sequence import unpack_sequence
from streamengine.segment_store.core.commands import SegmentKey
from tests.sim import messages as m
from tests.sim.network import Message

if TYPE_CHECKING:
    from tests.sim.world import World

from tests.sim.nodes import MASTER, Node
from tests.sim.recovery_run import RecoveryRun

# ---- writers ----


@dataclasses.dataclass
class _Pending:
    first_index: int
    payloads: tuple[bytes, ...]


@dataclasses.dataclass
class ProducerOutbox:
    """What the user process behind a writer produced with its producer id and has not
    yet seen acked: it keeps it across its writers, as an application keeps its events
    until they are confirmed, and resends them through the next writer from the lowest
    (`WriterNode.append_producer`)."""

    # Unconfirmed events by producer sequence; the next sequence to give out.
    events: dict[int, bytes] = dataclasses.field(default_factory=dict)
    next_sequence: int = 0
    # Sequences given to the current writer: not resent while it leads.
    in_flight: set[int] = dataclasses.field(default_factory=set)
    # Batches out at once (the runtime world's pipelined producers), and whether one of
    # them failed: then no new batch goes until none is out, and the next resends
    # every unconfirmed event from the lowest.
    batches_out: int = 0
    resend: bool = False


def producer_sequence(payload: bytes) -> int | None:
    """The producer sequence of a producer's event (`p:NODE:SEQUENCE`), else None."""
    if not payload.startswith(b"p:"):
        return None
    return int(payload.rsplit(b":", 1)[1])


class WriterNode(Node):
    """A user process holding one `Writer`: when it stops leading (or crashes), a new
    writer with a new client id takes its place and competes again."""

    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        self.clock_offset_ms, self.clock_drift_ppm = world.clocks[name]
        self.generation = 0
        # One producer id per user process, kept across its writers.
        self.producer_id = name
        self.outbox = ProducerOutbox()
        # The PRODUCER marks this process appended (not events: never acked to a user).
        self.marks: set[bytes] = set()
        self.new_writer()

    # ---- lifecycle ----

    def new_writer(self) -> None:
        self.generation += 1
        self.client_id = f"{self.name}.{self.generation}"
        cfg = self.world.config
        limits = ReplicatorLimits(idle_ack_ms=cfg.idle_ack_ms, window_batches=cfg.window)
        self.leader = Leader(
            self.clock_ms(),
            limits,
            recovery_supported=True,
            rolling_supported=True,
            append_timeout_ms=cfg.append_timeout_ms,
            producer=self.world.config.producers,
        )
        self.links: dict[str, int] = {}
        self.fenced_links: set[str] = set()
        self.link_failures: dict[str, int] = {}  # failed attempts in a row, per store
        self.copy_set: tuple[str, ...] = ()
        self.recoveries: dict[int, RecoveryRun] = {}
        self.pending: list[_Pending] = []
        self.segment: SegmentRef | None = None
        self._timer_token = 0
        self._timer_at: int | None = None
        self._replacing = False
        self._stepping = False
        self._submitted: list[tuple[bytes, ...]] = []  # stepped, `Assigned` not yet seen
        # A new writer knows nothing of what the last one had in flight: all is resent.
        self.outbox.in_flight.clear()
        # The epoch whose lease this writer holds open at the master (`HoldLease`, as
        # `streamengine.client.writer` does from `BecameLeader` on); 0: none.
        self.holding_epoch = 0
        # The lease secret this writer draws (from the seed: it shows in messages).
        label = b"simulated writer secret %d/%s" % (self.world.config.seed, self.client_id.encode())
        self.lease_secret = LeaseSecret(hashlib.sha256(label).digest())
        self.step(Tick())

    def crash(self) -> None:
        self.world.checker.writer_gone(self.client_id)
        self._end_hold()  # the process died: its connection to the master is reset
        super().crash()
        self.world.note(f"{self.client_id} crashes (leading: {self.leading})")

    def restart(self) -> None:
        super().restart()
        self.new_writer()

    def _end_hold(self) -> None:
        """The master sees the `HoldLease` call end (`master.leadership.holder_gone`)."""
        if self.holding_epoch:
            broken = m.HoldEnded(
                self.world.config.stream,
                self.client_id,
                self.holding_epoch,
                self.lease_secret.shown(),
            )
            self.world.net.send(self.name, MASTER, broken)
            self.holding_epoch = 0

    def _replace_later(self) -> None:
        if self._replacing:
            return
        self._replacing = True

        def replace() -> None:
            # The old writer object is gone: nothing addressed to it is handled, and
            # its call holding the lease ends with it.
            self._end_hold()
            self.incarnation += 1
            self._calls.clear()
            self.deferred.clear()
            self.world.net.break_streams_of(self.name)
            self.new_writer()

        # The user's process opening a new writer: the environment's pace, no decision.
        self.timer(self.world.rng.randint(10, 200), "a new writer", replace)

    def check_running(self) -> None:
        """Invariant 7 while this process runs: see `Checker.writer_running`."""
        if self.up and not self.paused:
            self.world.checker.writer_running(self.client_id, self.clock_ms())

    @property
    def leading(self) -> bool:
        return self.leader.role is Role.LEADING

    def awaits(self, payload: bytes) -> bool:
        """`payload` was appended and its user still waits for the answer."""
        return any(payload in item.payloads for item in self.pending)

    def can_append(self) -> bool:
        replicator = self.leader.replicator
        return (
            self.up
            and not self.paused
            and self.leading
            and self.leader.accepting_appends
            and replicator is not None
            and replicator.room_for(64)
        )

    # ---- the core ----

    def step(self, event: LeaderEvent) -> None:
        """Feed one event and carry out what follows, draining the core's outbox in
        one loop (as `streamengine.client.writer`); nothing steps from inside a step."""
        assert not self._stepping, f"a step inside a step: {event!r}"
        self._stepping = True
        try:
            self.leader.step(self.clock_ms(), event)
            while actions := self.leader.take_actions():
                self.apply(actions)
        finally:
            self._stepping = False
        assert not self._submitted, "an append neither assigned nor failed"
        self._arm_timer()

    def append(self, payloads: tuple[bytes, ...]) -> None:
        self.world.checker.append_started(self.client_id, payloads, self.clock_ms())
        self._submitted.append(payloads)
        self.step(Append(payloads))

    def can_append_producer(self) -> bool:
        """As `streamengine.client.writer` decides a producer's batch: leading a segment
        with room, every earlier segment recovered (the table rebuilt)."""
        return self.can_append() and not self.leader.recovering

    def append_producer(self, count: int) -> None:
        """`count` new events of this process's producer, after every unconfirmed one
        the current writer was not given yet (all of them, after a new writer), as one
        batch from the lowest: the table answers those already in the stream."""
        out = self.outbox
        for _ in range(count):
            out.events[out.next_sequence] = f"p:{self.name}:{out.next_sequence}".encode()
            out.next_sequence += 1
        waiting = [sequence for sequence in sorted(out.events) if sequence not in out.in_flight]
        # From the lowest, as far as the sequences run on: one above an event still in
        # flight waits for it (its fate decides whether it goes again).
        first = waiting[0]
        resend = [
            sequence
            for sequence, expected in itertools.takewhile(
                lambda pair: pair[0] == pair[1], zip(waiting, itertools.count(first))
            )
        ]
        if "resend_without_dedup" in self.world.config.flaws:
            # The flaw: retries at least once, as plain appends the table never sees.
            out.in_flight.update(resend)
            self.append(tuple(out.events[sequence] for sequence in resend))
            return
        decision = self.leader.producers.decide(self.producer_id, first, len(resend))
        for sequence, known in zip(resend, decision.known, strict=False):
            payload = out.events.pop(sequence)
            if known:  # durable: every earlier segment is recovered
                epoch, index = unpack_sequence(known)
                self.world.checker.user_acked(epoch, index, payload, self.world.master.state)
            else:
                self.world.checker.producer_answered_written(payload)
        self.world.stats["producer events answered as known"] += len(decision.known)
        fresh = resend[decision.write_from :]
        if not fresh:
            return
        out.in_flight.update(fresh)
        self.world.stats["producer events sent"] += len(fresh)
        mark = ProducerMark(self.producer_id, fresh[0], len(fresh)).encode()
        self.marks.add(mark)
        payloads = tuple(out.events[sequence] for sequence in fresh)
        self.world.checker.append_started(self.client_id, payloads, self.clock_ms())
        self._submitted.append((mark, *payloads))
        self.step(Append((mark, *payloads), marked=True))

    def _events(self, payloads: Iterable[bytes]) -> list[bytes]:
        """The events among `payloads`, without the PRODUCER marks."""
        return [payload for payload in payloads if payload not in self.marks]

    # ---- this process's clock ----

    def clock_ms(self, world_ms: int | None = None) -> int:
        """This node's clock (offset, drifting) at world time `world_ms` (now)."""
        t = self.world.now if world_ms is None else world_ms
        return self.clock_offset_ms + t + t * self.clock_drift_ppm // 1_000_000

    def world_ms_at(self, clock_ms: int) -> int:
        """The first world time at which this node's clock reads `clock_ms`."""
        t = (clock_ms - self.clock_offset_ms) * 1_000_000 // (1_000_000 + self.clock_drift_ppm)
        while self.clock_ms(t) < clock_ms:
            t += 1
        return t

    def world_delay_ms(self, clock_delay_ms: int) -> int:
        """How long `clock_delay_ms` of this node's clock lasts from now, in world time."""
        return max(1, self.world_ms_at(self.clock_ms() + clock_delay_ms) - self.world.now)

    def _arm_timer(self) -> None:
        local = self.leader.deadline_ms(self.clock_ms())
        if local is None:
            return
        deadline = max(self.world_ms_at(local), self.world.now + 1)
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
                        action.grant,
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
                self.world.checker.leadership_ended(self.client_id, self.world.now)
                if action.reason is StepDownReason.UNSUPPORTED:
                    self.world.unsupported.append(f"{self.client_id}: {action.message}")
                self._report_failed(action.sent_through)
                self._replace_later()
            elif isinstance(action, ReleaseLeaseAction):
                release = m.ReleaseLease(
                    self.world.config.stream,
                    self.client_id,
                    action.epoch,
                    action.grant,
                    self.lease_secret.shown(),
                )
                self.call(MASTER, release, lambda _: None)
            elif isinstance(action, StoreDetached):
                self.world.note(f"{self.client_id} detached {action.store}: {action.reason}")
            elif isinstance(action, AppendsTimedOut):
                self._timed_out(action.last_index)
            elif isinstance(action, AppendsLeftUnacked):
                self._left_unacked(action)
            elif isinstance(action, Assigned):
                # Pending from this moment: a step-down from here on must answer it.
                payloads = self._submitted.pop(0)
                self.pending.append(_Pending(action.first_index, payloads))
            else:
                raise AssertionError(f"unknown action {action!r}")

    def _report_failed(self, sent_through: int) -> None:
        """Appends above `sent_through` reached no store: users hear they failed."""
        if "fail_in_doubt" in self.world.config.flaws:
            sent_through = 0  # the flaw: a shell that calls every pending append failed
        if "forget_pending" in self.world.config.flaws and self.pending:
            # The flaw: a shell that loses an append on stepping down (one admitted but
            # not yet recorded as pending): its user waits forever.
            del self.pending[0]
        never_sent = self._events(payload for payloads in self._submitted for payload in payloads)
        self._submitted = []  # stepped as the lease ran out: never sent
        self._end_pending(sent_through, never_sent)

    def _left_unacked(self, left: AppendsLeftUnacked) -> None:
        """A roll away from a segment that could not drain: every append still pending
        is of that segment (the new one has taken none yet), above its acked index."""
        assert all(item.first_index > left.acked_index for item in self.pending), left
        assert all(
            item.first_index + len(item.payloads) - 1 <= left.last_index for item in self.pending
        ), left
        self.world.note(
            f"{self.client_id}: segment {left.segment_epoch} left unacked above "
            f"{left.acked_index} (sent through {left.sent_through})"
        )
        self.world.stats["undrained rolls"] += 1
        # Its producer's events there go again once the segment is recovered: the table
        # forgot them and takes back what recovery kept.
        for item in self.pending:
            for payload in item.payloads:
                sequence = producer_sequence(payload)
                if sequence is not None:
                    self.outbox.in_flight.discard(sequence)
        self._end_pending(left.sent_through)

    def _end_pending(self, sent_through: int, never_sent: list[bytes] | None = None) -> None:
        """Every pending append ends: those above `sent_through` failed, the others are
        in doubt; `never_sent` (given to the core, never assigned) failed too."""
        failed = []
        for item in self.pending:
            failed += [
                payload
                for offset, payload in enumerate(item.payloads)
                if item.first_index + offset > sent_through
            ]
        failed = self._events(failed)
        in_doubt = len(self._events(p for item in self.pending for p in item.payloads))
        in_doubt -= len(failed)
        failed += never_sent or []
        ended = self._events(p for item in self.pending for p in item.payloads) + failed
        self.pending = []
        self.world.stats["appends reported failed"] += len(failed)
        self.world.stats["appends in doubt"] += in_doubt
        # A producer's events are not given up: the process resends them.
        self.world.checker.appends_failed([p for p in failed if producer_sequence(p) is None])
        self.world.checker.append_ended(self.client_id, ended)

    def _timed_out(self, last_index: int) -> None:
        """Appends through `last_index` answered in doubt: the user hears no more of them,
        whatever happens to them later."""
        ended: list[bytes] = []
        while self.pending and self.pending[0].first_index <= last_index:
            item = self.pending.pop(0)
            assert item.first_index + len(item.payloads) - 1 <= last_index, "a split append"
            ended += self._events(item.payloads)
        self.world.note(f"{self.client_id}: {len(ended)} append(s) timed out, in doubt")
        self.world.stats["appends timed out"] += len(ended)
        self.world.checker.append_ended(self.client_id, ended)

    def _heartbeat(self, action: SendHeartbeat) -> None:
        sent_at = self.clock_ms()
        request = m.WriterHeartbeat(
            self.world.config.stream,
            self.client_id,
            action.epoch,
            action.acked_index,
            action.segment_bytes,
            self.lease_secret.shown(),
            self.leader.producer,
            action.seen_epoch,
        )

        def answered(result: object) -> None:
            result = self._learn_secret(result)
            if isinstance(result, HeartbeatAnswered) and self.lease_secret.answered_without_it(
                request.lease_secret, result.leader
            ):
                self.step(HeartbeatFailed(sent_at, "", "answered before the lease secret came"))
            elif isinstance(result, HeartbeatAnswered):
                if result.leader and result.segment is None and not self.leading:
                    self.world.stats["grants without a segment"] += 1
                    if len(result.unsealed) < 2:  # not two unsealed: too few stores
                        self.world.stats["grants without a segment, too few stores"] += 1
                self.step(dataclasses.replace(result, sent_at_ms=sent_at))
            elif isinstance(result, MasterError):
                self.step(HeartbeatFailed(sent_at, status_of(result).name, str(result)))
            else:
                self.step(HeartbeatFailed(sent_at, "UNKNOWN", str(result)))

        def timed_out() -> None:
            self.step(HeartbeatFailed(sent_at, "DEADLINE_EXCEEDED"))

        timeout = self.world_delay_ms(action.timeout_ms)
        self.call(MASTER, request, answered, True, timeout, timed_out)

    def _roll(self, action: AskRoll) -> None:
        self.world.note(f"{self.client_id} rolls epoch {action.epoch}: {action.reason}")
        self.world.stats["rolls asked"] += 1
        sent_at = self.clock_ms()
        request = m.RollSegment(
            self.world.config.stream,
            self.client_id,
            action.epoch,
            action.exclude_stores,
            action.grant,
            self.lease_secret.shown(),
        )

        def answered(result: object) -> None:
            result = self._learn_secret(result)
            if isinstance(result, HeartbeatAnswered):
                self.step(RollAnswered(dataclasses.replace(result, sent_at_ms=sent_at)))
            else:
                self.step(RollFailed(str(result)))

        def timed_out() -> None:
            self.step(RollFailed("deadline exceeded"))

        timeout = self.world_delay_ms(action.timeout_ms)
        self.call(MASTER, request, answered, True, timeout, timed_out)

    def _learn_secret(self, result: object) -> object:
        """The answer inside a `LeaderReply`, its lease secret kept (as the client's
        shell does before it steps the answer)."""
        if not isinstance(result, m.LeaderReply):
            return result
        self.lease_secret.learn(result.lease_secret)
        return result.answer

    def _became_leader(self, action: BecameLeader) -> None:
        self.world.note(f"{self.client_id} leads epoch {action.epoch}")
        self.holding_epoch = action.epoch
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
                done += 1
                if payload in self.marks:
                    continue
                self.world.checker.user_acked(epoch, index, payload, state)
                self.world.checker.append_ended(self.client_id, (payload,))
                sequence = producer_sequence(payload)
                if sequence is not None:
                    self.outbox.events.pop(sequence, None)
                    self.outbox.in_flight.discard(sequence)
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
                self._reconnect_later(store, attempt)
                return
            incarnation = self.incarnation
            number = 0

            def broken() -> None:
                self.world.run_on(self, incarnation, lambda: self._disconnected(store, number))

            number = self.world.net.open_stream(self.name, store, broken, lambda: None)
            self.links[store] = number
            self.link_failures.pop(store, None)
            self.step(StoreConnected(store))

        # Opening a connection takes the network a moment (drawn, like message delays).
        self.timer(self.world.rng.randint(1, 10), f"connect {store}", attempt)

    def _disconnected(self, store: str, number: int) -> None:
        if self.links.get(store) != number:
            return
        del self.links[store]
        self.step(StoreDisconnected(store))
        self._reconnect_later(store, lambda: self._connect(store))

    def _reconnect_later(self, store: str, attempt: Callable[[], None]) -> None:
        failures = self.link_failures.get(store, 0) + 1
        self.link_failures[store] = failures
        pause = self.world_delay_ms(STORE_STREAM_REOPEN.delay_ms(failures))
        self.timer(pause, f"reconnect {store}", attempt)

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
            self.step(FencedByStore(store, body.fence))
        elif isinstance(body, m.Denied):
            # As a Write stream ended by any other status: opened again after a pause.
            self.world.net.break_stream(message.stream)
            self._disconnected(store, message.stream)

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
