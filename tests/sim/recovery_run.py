"""One earlier segment's recovery in a simulated writer: the real `SegmentRecovery`.

The shell feeds the virtual time and the stores' answers in, wakes the core at its
`deadline_ms()`, and carries its actions out as messages. Retransmits, stores counted
as lost and their probes are the core's decisions, on `SIMULATED_TIMING`.
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
        )
        self.matched: dict[str, int] = {}  # from seal answers, for the flaw only
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
            writer.step(SegmentSealed(seg.epoch))
            return
        if isinstance(action, sr.Deposed):
            writer.step(FencedByStore(f"recovery of {seg.epoch}", action.fence))
            return
        if isinstance(action, sr.SealAtMaster):
            request: object = m.SealSegment(
                writer.world.config.stream,
                seg.epoch,
                self.epoch,
                action.final_index,
                writer.client_id,
                self.grant,
                action.certificate,
            )
            writer.call(MASTER, request, self._master_answered, once=False)
            return
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
