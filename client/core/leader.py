"""A writer's election loop and the open segment it leads, as one state machine.

Theory of operation. A writer starts FOLLOWING: it heartbeats the master every
lease/3 (`SendHeartbeat`, on schedule even while earlier ones are unanswered, up to a
lease worth in flight; the shell answers each with `HeartbeatAnswered` carrying the
time the request was *sent*, or `HeartbeatFailed`). When an answer makes
it LEADER for an epoch, it counts its lease from that send time, so it always believes
the lease ends before the master does, and it starts replicating the new segment
(`BecameLeader` opens the Write streams; the `Replicator` does the rest).

Leading, every answer for the same epoch renews the lease from its send time. The
writer steps down, for good, when the lease runs out before a renewal (checked first
on every event, so nothing arriving at or after that moment is acked), when the master
answers FOLLOWER or another epoch, or when a store reports a fence above its epoch.
Stepping down stops the replicator at once: nothing more is acked or sent, and
`SteppedDown` tells the shell how far any store may hold entries (`sent_through`):
pending appends at or below it are in doubt (they may be durable and then appear
after the next leader's recovery), those above it definitely failed (no store ever
received them). `Release` (the user leaves) steps down the same way and
gives the lease back.

The gate. The grant lists every earlier segment not yet sealed; each must be sealed
and recovered (`RecoverSegment`, carried out by a `SegmentRecovery` operation
in the shell) before anything of the new segment is acked, because recovery may add
in-doubt events of an earlier segment that sort before the new ones. The new segment
takes and replicates appends meanwhile, but its acked index is neither told to users
nor broadcast to stores until `SegmentSealed` has arrived for each of them. A leader
built without recovery support gives the lease back and fails clearly instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from client.core.limits import HEARTBEATS_PER_LEASE, LEASE_MS_DEFAULT
from client.core.policy import ReplicationPolicy
from client.core.replicator import (
    AllowAcking,
    Append,
    Flush,
    Replicator,
    ReplicatorAction,
    ReplicatorLimits,
    ReplicatorStatistics,
    SegmentRef,
    Stop,
    StoreConnected,
    StoreDisconnected,
    Tick,
    WriteReplied,
)

# Heartbeats in flight at once. A slow answer still renews the lease from its send time,
# so a slow master is not waited out: the next heartbeat goes on schedule, up to one
# lease worth of them.
HEARTBEATS_IN_FLIGHT_MAX = HEARTBEATS_PER_LEASE


@dataclass(frozen=True, slots=True)
class Replica:
    store_id: str
    address: str
    zone: str = ""


@dataclass(frozen=True, slots=True)
class SegmentGrant:
    """A segment as the master grants or lists it, with its copy set."""

    segment: SegmentRef
    copy_set: tuple[Replica, ...]

    @property
    def epoch(self) -> int:
        return self.segment.epoch


# ---- events ----


@dataclass(frozen=True, slots=True)
class HeartbeatAnswered:
    """The master's `WriterHeartbeatReply` to the heartbeat sent at `sent_at_ms`."""

    sent_at_ms: int
    leader: bool
    epoch: int
    lease_ms: int
    leader_id: str = ""
    segment: SegmentGrant | None = None
    unsealed: tuple[SegmentGrant, ...] = ()
    policy: ReplicationPolicy | None = None
    roll_requested: bool = False
    roll_reason: str = ""


@dataclass(frozen=True, slots=True)
class HeartbeatFailed:
    """The heartbeat sent at `sent_at_ms` got no answer (timeout, master down)."""

    sent_at_ms: int
    message: str


@dataclass(frozen=True, slots=True)
class StoreFenced:
    """A store ended a Write stream with FAILED_PRECONDITION: its fence is `fence`."""

    store: str
    fence: int


@dataclass(frozen=True, slots=True)
class SegmentSealed:
    """An earlier segment listed in the grant is sealed and recovered."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Release:
    """The user leaves the writer: give the lease back now."""


LeaderEvent = (
    HeartbeatAnswered
    | HeartbeatFailed
    | StoreFenced
    | SegmentSealed
    | Release
    | Append
    | WriteReplied
    | StoreConnected
    | StoreDisconnected
    | Tick
    | Flush
)

# ---- actions ----


@dataclass(frozen=True, slots=True)
class SendHeartbeat:
    """Send `WriterHeartbeatRequest` now; give up on it after `timeout_ms` (a lease:
    later than that the answer renews nothing)."""

    epoch: int
    acked_index: int
    segment_bytes: int
    timeout_ms: int


@dataclass(frozen=True, slots=True)
class BecameLeader:
    """Leading `segment` under `epoch`: open a Write stream to each copy-set store."""

    epoch: int
    lease_ms: int
    segment: SegmentGrant
    policy: ReplicationPolicy


@dataclass(frozen=True, slots=True)
class RecoverSegment:
    """Seal and recover an earlier segment under `new_epoch`; then `SegmentSealed`."""

    segment: SegmentGrant
    new_epoch: int
    policy: ReplicationPolicy


class StepDownReason(enum.Enum):
    LEASE_EXPIRED = "lease expired before it was renewed"
    DEPOSED = "the master granted the lease to another writer or epoch"
    FENCED = "a store holds a fence above this writer's epoch"
    RELEASED = "the writer was closed"
    UNSUPPORTED = "the grant needs work this writer cannot do"


@dataclass(frozen=True, slots=True)
class SteppedDown:
    """This writer leads no more. Pending appends at or below `sent_through` are in
    doubt, those above it failed; nothing above `acked_index` will be acked."""

    reason: StepDownReason
    message: str
    epoch: int
    sent_through: int
    acked_index: int


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    epoch: int


LeaderAction = (
    SendHeartbeat | BecameLeader | RecoverSegment | SteppedDown | ReleaseLease | ReplicatorAction
)


class Role(enum.Enum):
    FOLLOWING = "following"
    LEADING = "leading"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class LeaderStatistics:
    role: Role
    epoch: int
    lease_until_ms: int
    leader_id: str
    unsealed_epochs: tuple[int, ...]
    roll_requested: bool
    replication: ReplicatorStatistics | None


class Leader:
    """See the module docstring."""

    def __init__(
        self,
        now_ms: int,
        limits: ReplicatorLimits | None = None,
        recovery_supported: bool = False,
    ) -> None:
        self.role = Role.FOLLOWING
        self.epoch = 0
        self.replicator: Replicator | None = None
        self.finish: SteppedDown | None = None
        self._limits = limits
        self._recovery_supported = recovery_supported
        self._lease_ms = LEASE_MS_DEFAULT
        self._lease_until_ms = 0
        self._leader_id = ""
        self._heartbeats_in_flight = 0
        self._grant_sent_at_ms = 0
        self._next_heartbeat_ms = now_ms
        self._unsealed: list[int] = []
        self._roll_requested = False

    # ---- queries ----

    @property
    def heartbeat_interval_ms(self) -> int:
        return max(1, self._lease_ms // HEARTBEATS_PER_LEASE)

    def deadline_ms(self, now_ms: int) -> int | None:
        if self.role is Role.FINISHED:
            return None
        deadlines = []
        if self._heartbeats_in_flight < HEARTBEATS_IN_FLIGHT_MAX:
            deadlines.append(self._next_heartbeat_ms)
        if self.role is Role.LEADING:
            deadlines.append(self._lease_until_ms)
            assert self.replicator is not None
            replicating = self.replicator.deadline_ms(now_ms)
            if replicating is not None:
                deadlines.append(replicating)
        return min(deadlines) if deadlines else None

    def statistics(self) -> LeaderStatistics:
        return LeaderStatistics(
            role=self.role,
            epoch=self.epoch,
            lease_until_ms=self._lease_until_ms,
            leader_id=self._leader_id,
            unsealed_epochs=tuple(self._unsealed),
            roll_requested=self._roll_requested,
            replication=self.replicator.statistics() if self.replicator else None,
        )

    # ---- the step function ----

    def step(self, now_ms: int, event: LeaderEvent) -> list[LeaderAction]:
        if self.role is Role.FINISHED:
            return self._step_finished(event)
        actions: list[LeaderAction] = []
        if self.role is Role.LEADING and now_ms >= self._lease_until_ms:
            # Before anything else: a store's answer arriving now must not be acked.
            self._lease_expired(actions)
            return actions
        stepped_replicator = False
        if isinstance(event, HeartbeatAnswered):
            self._heartbeats_in_flight = max(0, self._heartbeats_in_flight - 1)
            if self.role is Role.FOLLOWING:
                self._answered_following(now_ms, event, actions)
            else:
                self._answered_leading(event, actions)
        elif isinstance(event, HeartbeatFailed):
            self._heartbeats_in_flight = max(0, self._heartbeats_in_flight - 1)
        elif isinstance(event, StoreFenced):
            if self.role is Role.LEADING and event.fence > self.epoch:
                self._step_down(
                    StepDownReason.FENCED, f"{event.store} is fenced at {event.fence}", actions
                )
        elif isinstance(event, SegmentSealed):
            self._sealed(now_ms, event.epoch, actions)
        elif isinstance(event, Release):
            if self.role is Role.LEADING:
                self._step_down(StepDownReason.RELEASED, "released", actions)
                actions.append(ReleaseLease(self.epoch))
            self.role = Role.FINISHED
            return actions
        elif isinstance(event, Append):
            if self.role is not Role.LEADING:
                raise RuntimeError("append while not leading")
            assert self.replicator is not None
            actions.extend(self.replicator.step(now_ms, event))
            stepped_replicator = True
        elif isinstance(event, WriteReplied | StoreConnected | StoreDisconnected | Flush):
            if self.replicator is not None and self.role is Role.LEADING:
                actions.extend(self.replicator.step(now_ms, event))
                stepped_replicator = True
        elif not isinstance(event, Tick):
            raise TypeError(f"unknown event {event!r}")
        self._on_time(now_ms, actions, stepped_replicator)
        return actions

    # ---- internals ----

    def _step_finished(self, event: LeaderEvent) -> list[LeaderAction]:
        # A grant that arrives after the writer finished is given straight back, so the
        # next writer does not wait out a lease nobody uses.
        if isinstance(event, HeartbeatAnswered) and event.leader:
            return [ReleaseLease(event.epoch)]
        return []

    def _lease_expired(self, actions: list[LeaderAction]) -> None:
        self._step_down(
            StepDownReason.LEASE_EXPIRED, f"lease expired at {self._lease_until_ms}", actions
        )

    def _on_time(self, now_ms: int, actions: list[LeaderAction], stepped_replicator: bool) -> None:
        if self.role is Role.LEADING and now_ms >= self._lease_until_ms:
            self._lease_expired(actions)
            return
        if self.role is Role.LEADING and not stepped_replicator:
            assert self.replicator is not None
            actions.extend(self.replicator.step(now_ms, Tick()))
        in_flight = self._heartbeats_in_flight
        if in_flight < HEARTBEATS_IN_FLIGHT_MAX and now_ms >= self._next_heartbeat_ms:
            interval = self.heartbeat_interval_ms
            self._heartbeats_in_flight += 1
            self._next_heartbeat_ms = now_ms + interval
            replication = self.replicator
            actions.append(
                SendHeartbeat(
                    epoch=self.epoch if self.role is Role.LEADING else 0,
                    acked_index=replication.acked_index if replication else 0,
                    segment_bytes=replication.payload_bytes if replication else 0,
                    timeout_ms=self._lease_ms,
                )
            )

    def _answered_following(
        self, now_ms: int, answer: HeartbeatAnswered, actions: list[LeaderAction]
    ) -> None:
        self._lease_ms = answer.lease_ms or self._lease_ms
        self._leader_id = answer.leader_id
        self._next_heartbeat_ms = min(
            self._next_heartbeat_ms, answer.sent_at_ms + self.heartbeat_interval_ms
        )
        if not answer.leader:
            return
        self.epoch = answer.epoch
        self._grant_sent_at_ms = answer.sent_at_ms
        self._lease_until_ms = answer.sent_at_ms + answer.lease_ms
        self._next_heartbeat_ms = answer.sent_at_ms + self.heartbeat_interval_ms
        problem = self._cannot_lead(answer)
        if problem:
            self.role = Role.LEADING  # so that stepping down reports the epoch
            self._step_down(StepDownReason.UNSUPPORTED, problem, actions)
            actions.append(ReleaseLease(answer.epoch))
            return
        assert answer.segment is not None and answer.policy is not None
        self._unsealed = [grant.epoch for grant in answer.unsealed]
        self.replicator = Replicator(
            answer.segment.segment,
            answer.epoch,
            answer.policy,
            [replica.store_id for replica in answer.segment.copy_set],
            self._limits,
            acking=not self._unsealed,
        )
        self.role = Role.LEADING
        self._roll_requested = answer.roll_requested
        actions.append(BecameLeader(answer.epoch, answer.lease_ms, answer.segment, answer.policy))
        actions.extend(
            RecoverSegment(grant, answer.epoch, answer.policy) for grant in answer.unsealed
        )

    def _cannot_lead(self, answer: HeartbeatAnswered) -> str:
        if answer.segment is None:
            return (
                f"epoch {answer.epoch} came without a segment: two earlier segments are "
                "unsealed and must be sealed before a roll, which this writer cannot do"
            )
        if answer.policy is None:
            return "the grant carries no replication policy"
        if answer.segment.epoch != answer.epoch:
            return f"granted epoch {answer.epoch} with segment {answer.segment.epoch}"
        if answer.unsealed and not self._recovery_supported:
            epochs = ", ".join(str(grant.epoch) for grant in answer.unsealed)
            return (
                f"earlier segment(s) {epochs} are unsealed and this writer cannot seal and "
                "recover them; nothing of the new segment may be acked before they are"
            )
        return ""

    def _answered_leading(self, answer: HeartbeatAnswered, actions: list[LeaderAction]) -> None:
        if answer.sent_at_ms < self._grant_sent_at_ms:
            return  # sent before the grant: it says nothing about this epoch
        if not answer.leader or answer.epoch != self.epoch:
            self._leader_id = answer.leader_id
            self._step_down(
                StepDownReason.DEPOSED,
                f"the master answered {'LEADER' if answer.leader else 'FOLLOWER'} "
                f"for epoch {answer.epoch} while this writer leads epoch {self.epoch}",
                actions,
            )
            if answer.leader:
                # A new epoch granted to this writer (its old lease ran out on the master):
                # it cannot continue the old segment in it, so it gives the lease back.
                actions.append(ReleaseLease(answer.epoch))
            return
        self._lease_ms = answer.lease_ms or self._lease_ms
        self._lease_until_ms = max(self._lease_until_ms, answer.sent_at_ms + answer.lease_ms)
        self._roll_requested = self._roll_requested or answer.roll_requested

    def _sealed(self, now_ms: int, epoch: int, actions: list[LeaderAction]) -> None:
        if self.role is not Role.LEADING or epoch not in self._unsealed:
            return
        self._unsealed.remove(epoch)
        if not self._unsealed:
            assert self.replicator is not None
            actions.extend(self.replicator.step(now_ms, AllowAcking()))

    def _step_down(self, reason: StepDownReason, message: str, actions: list[LeaderAction]) -> None:
        replication = self.replicator
        if replication is not None:
            replication.step(0, Stop())
        self.finish = SteppedDown(
            reason,
            message,
            self.epoch,
            sent_through=replication.sent_through if replication else 0,
            acked_index=replication.acked_index if replication else 0,
        )
        self.role = Role.FINISHED
        actions.append(self.finish)
