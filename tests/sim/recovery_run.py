"""One earlier segment's recovery in a simulated writer: the real `SegmentRecovery`.

The shell feeds the virtual time and the stores' answers in, wakes the core at its
`deadline_ms()`, and carries its actions out as messages. Retransmits, stores counted
as lost and their probes are the core's decisions, on `SIMULATED_TIMING`.

A segment the operator seals accepting loss (`World.accepts_loss`: more of its
replicas were destroyed than its quorums can spare) is recovered with `accept_loss`,
as `streamengine seal --accept-loss` leads it. Two flaws bring back how that went
wrong (issue #35, defect 2): `trust_any_bridge` declares nothing lost whenever the plan
found a bridge, wherever it was; `ack_before_loss` raises the holders' acked index to
the bridge before the master records the loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.client.core import recovery as sr
from streamengine.client.core.replicator import Tick
from streamengine.client.core.writer import (
    FencedByStore,
    RecoverSegment,
    SegmentSealed,
)
from streamengine.master.core.model import SegmentRecord, SegmentState
from streamengine.segment_store.core.commands import SealResult, SegmentKey, WriteResult
from streamengine.segment_store.core.errors import StoreError
from tests.sim import messages as m

if TYPE_CHECKING:
    from tests.sim.writer_node import WriterNode

from tests.sim.nodes import MASTER


class RecoveryRun:
    """Carries one `SegmentRecovery`'s actions out and its answers back."""

    def __init__(self, writer: WriterNode, action: RecoverSegment) -> None:
        self.writer = writer
        grant = action.segment
        self.segment = SegmentKey(grant.segment.stream_id, grant.segment.epoch)
        self.epoch = action.new_epoch
        self.grant = action.grant  # the signed grant of `epoch`
        self.op = sr.SegmentRecovery(
            action.policy,
            grant.epoch,
            action.new_epoch,
            [r.store_id for r in grant.copy_set],
            writer.world.config.recovery_batch,
            sr.SIMULATED_TIMING,
            action.known,
            accept_loss=writer.world.accepts_loss(self.segment),
            producers=action.producers,
        )
        self.matched: dict[str, int] = {}  # from seal answers, for the flaw only
        self.raised: set[str] = set()  # raised before the master knew: `ack_before_loss`
        self.counted = False
        self._wake_at: int | None = None  # when the pending wake-up timer fires

    def start(self) -> None:
        self.send(self.op.start(self.writer.world.now))

    def active(self) -> bool:
        return self.writer.leading and not self.op.deposed

    def send(self, actions: list[sr.Action]) -> None:
        for action in actions:
            if not self.active():
                return
            self._send(action)
        self._wake_later()

    def _wake_later(self) -> None:
        """A timer for the core's next deadline, unless one fires earlier already."""
        deadline = self.op.deadline_ms()
        if deadline is None or not self.active():
            return
        if self._wake_at is not None and self._wake_at <= deadline:
            return
        self._wake_at = deadline

        def wake() -> None:
            if self._wake_at != deadline:
                return  # replaced by an earlier one
            self._wake_at = None
            self._feed(Tick())

        self.writer.timer(deadline - self.writer.world.now, "recovery wakes", wake)

    def _send(self, action: sr.Action) -> None:
        writer = self.writer
        seg = self.segment
        if isinstance(action, sr.Done):
            writer.world.note(f"{writer.client_id} sealed {seg.epoch} at {action.final_index}")
            writer.step(SegmentSealed(seg.epoch, action.runs))
            return
        if isinstance(action, sr.Deposed):
            writer.step(FencedByStore(f"recovery of {seg.epoch}", action.fence))
            return
        if isinstance(action, sr.SealAtMaster):
            self._seal_at_master(action)
            return
        request: object
        if isinstance(action, sr.SendSeal):
            if not writer.world.probe_lost and action.store in self.op.lost():
                return  # `--no-probe`: a lost store is never asked again
            request = m.Seal(seg, action.new_epoch, self.grant)
        elif isinstance(action, sr.SendRead):
            request = m.Read(seg, action.from_index, action.to_index)
        elif isinstance(action, sr.SendRewrite):
            if self._skip_by_matched(action):
                return
            request = m.RecoveryWrite(
                seg, self.epoch, action.acked_index, action.entries, self.grant
            )
        else:
            assert isinstance(action, sr.SendAcked)
            request = m.RecoveryWrite(seg, self.epoch, action.acked_index, (), self.grant)
        store = action.store
        writer.call(store, request, lambda r: self._answered(store, action, r), once=False)

    def _seal_at_master(self, action: sr.SealAtMaster) -> None:
        writer = self.writer
        flaws = writer.world.config.flaws
        lost_from = action.lost_from_index
        plan = self.op.plan
        if "trust_any_bridge" in flaws and plan is not None and plan.existing_bridge:
            lost_from = 0  # the flaw: any bridge found taken as proof that nothing was lost
        if lost_from and self._raise_before_the_master(action):
            return
        if lost_from:
            writer.world.stats["seals declaring loss"] += 1
        request = m.SealSegment(
            writer.world.config.stream,
            self.segment.epoch,
            self.epoch,
            action.final_index,
            writer.client_id,
            self.grant,
            action.certificate,
            lost_from,
            action.producers,
        )
        writer.call(MASTER, request, self._master_answered, once=False)

    def _raise_before_the_master(self, action: sr.SealAtMaster) -> bool:
        """The flaw `ack_before_loss` (the order a recovery accepting loss once had):
        raise the acked index of every store holding the bridge, and seal at the master
        only once they all answered raised. True while that is under way."""
        if "ack_before_loss" not in self.writer.world.config.flaws:
            return False
        holders = [s for s in self.op.holding() if s not in self.raised]
        for store in holders:
            request = m.RecoveryWrite(self.segment, self.epoch, action.final_index, (), self.grant)

            def raised(result: object, store: str = store) -> None:
                if isinstance(result, WriteResult) and result.acked_index >= action.final_index:
                    self.raised.add(store)

            self.writer.call(store, request, raised, once=False)
        return bool(holders)

    def _skip_by_matched(self, action: sr.SendRewrite) -> bool:
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
        if self.op.accept_loss:
            self.writer.world.interrupt_recovery(self.writer)

    def _feed(self, event: sr.Event) -> None:
        if self.active():
            self.send(self.op.step(self.writer.world.now, event))

    def _answered(self, store: str, action: sr.Action, result: object) -> None:
        if not self.active():
            return
        event = self._event(store, action, result)
        if event is None:
            return
        self._feed(event)
        self._decided()

    def _event(self, store: str, action: sr.Action, result: object) -> sr.Event | None:
        if isinstance(result, m.Refused):
            return sr.RecoveryFenced(store, result.fence)
        if isinstance(result, StoreError | m.Denied):
            return None  # no answer: the recovery asks again when it decides to
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
        if isinstance(action, sr.SendRewrite):
            first, last = action.entries[0].index, action.entries[-1].index
            return sr.WriteAnswered(store, first, last, result.held_epochs, result.acked_index)
        return sr.WriteAnswered(store, 0, 0, (), result.acked_index)

    def _master_answered(self, result: object) -> None:
        if not self.active():
            return
        if isinstance(result, SegmentRecord) and result.state == SegmentState.SEALED:
            self._feed(sr.MasterSealed(result.final_index))
