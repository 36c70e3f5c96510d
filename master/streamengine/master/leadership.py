"""Leases and epochs: the shell of `core/leadership.py` over the master's records.

A writer's heartbeat, roll, release and end of call go through the pure lease rules;
a new epoch is persisted with its segment (placed by `core/placement.py`) and the
digest of its lease secret before it is answered. The secret itself is drawn here, for
each heartbeat that wins the lease, and leaves the master only in that answer
(`WriterView.secret`); a roll keeps it.
A section of the master's state (`master.state`).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch
from streamengine.master.core import authority, leadership, placement, repair
from streamengine.master.core.errors import NotEnoughStores, PermissionDenied, TooManyUnsealed
from streamengine.master.core.leadership import LEASE_SECRET_BYTES, Claim, Lease, Outcome
from streamengine.master.core.model import SegmentRecord, SegmentState, StreamRecord
from streamengine.protocol.grants import Grant
from streamengine.protocol.limits import UNSEALED_SEGMENTS_MAX

if TYPE_CHECKING:
    from streamengine.master.state import MasterState


@dataclass(frozen=True, slots=True)
class LeaderReport:
    """What a stream's leader last said of its open segment (the segment of `epoch`).
    Kept after the lease ends: it stays true of that segment."""

    epoch: int
    acked_index: int
    segment_bytes: int


@dataclass(frozen=True, slots=True)
class WriterView:
    """The answer to a writer heartbeat or a roll."""

    stream: StreamRecord
    leads: bool
    lease: Lease
    segment: SegmentRecord | None
    unsealed: tuple[SegmentRecord, ...]
    roll_reason: str
    # The lease secret, when this very answer is the heartbeat that won the lease; empty
    # on a renewal, a roll or to a follower. Handed to the caller, kept nowhere.
    secret: bytes = field(default=b"", repr=False)
    # When the grant of a LEADER answer expires (`core.authority.grant_expiry`).
    grant_expires_at_ms: int = 0

    def grant(self) -> Grant:
        """The grant of the epoch this view makes its holder lead (LEADER only)."""
        assert self.leads and self.grant_expires_at_ms
        return authority.grant_of(
            self.stream,
            self.lease.epoch,
            self.lease.holder,
            self.segment,
            self.unsealed,
            self.grant_expires_at_ms,
        )


class Leadership:
    """Writers' leases, the epochs they open and the rolls operators ask for."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        # Where each lease's secret comes from (the simulator draws from its seed).
        self.draw_secret: Callable[[], bytes] = functools.partial(
            secrets.token_bytes, LEASE_SECRET_BYTES
        )
        # stream -> (epoch, expiry) of the grant last handed to its leader. Memory only:
        # a master that restarts hands fresh ones.
        self.grants_handed: dict[str, tuple[int, int]] = {}

    def writer_heartbeat(
        self,
        name: str,
        claim: Claim,
        epoch: int,
        acked_index: int,
        segment_bytes: int,
        now_ms: int,
    ) -> WriterView:
        record = self.state.usable_stream(name)
        secret = self.draw_secret()
        decision = leadership.heartbeat(
            self.state.leases[name], claim, epoch, now_ms, self.state.lease_ms, secret
        )
        if decision.outcome is Outcome.GRANTED:
            record = self._open_epoch(record, decision.lease, (), now_ms, allow_no_segment=True)
        else:
            secret = b""
        self.state.leases[name] = decision.lease
        if decision.leads and epoch == decision.lease.epoch:
            self.state.leader_reports[name] = LeaderReport(epoch, acked_index, segment_bytes)
        view = self._writer_view(record, decision.leads, decision.lease, now_ms)
        return replace(view, secret=secret)

    def roll_segment(
        self, name: str, claim: Claim, epoch: int, exclude: Iterable[str], now_ms: int
    ) -> WriterView:
        record = self.state.usable_stream(name)
        lease = leadership.roll(self.state.leases[name], claim, epoch, now_ms, self.state.lease_ms)
        if len(self.state.unsealed(record.stream_id)) >= UNSEALED_SEGMENTS_MAX:
            raise TooManyUnsealed(
                f"{name}: {UNSEALED_SEGMENTS_MAX} segments unsealed; seal them before rolling"
            )
        record = self._open_epoch(record, lease, tuple(exclude), now_ms, allow_no_segment=False)
        self.state.leases[name] = lease
        return self._writer_view(record, True, lease, now_ms)

    def check_holds(self, name: str, claim: Claim, epoch: int) -> None:
        """Raise PermissionDenied unless `claim` holds the lease of `epoch` (`HoldLease`)."""
        lease = self.state.leases.get(name)
        if lease is None or not lease.still_holds(claim, epoch):
            raise PermissionDenied(
                f"{name}: {claim.client_id!r} does not hold the lease of epoch {epoch} "
                "(its holder shows the secret it was granted with)"
            )

    def release_lease(self, name: str, claim: Claim, epoch: int, now_ms: int) -> bool:
        self.state.stream(name)
        released = leadership.release(self.state.leases[name], claim, epoch, now_ms)
        if released is None:
            return False
        self.state.leases[name] = released
        return True

    def holder_gone(self, name: str, claim: Claim, epoch: int, now_ms: int) -> bool:
        """The call the holder of `epoch` held open ended: whether its lease ended now
        (`leadership.holder_gone`)."""
        lease = self.state.leases.get(name)
        ended = None if lease is None else leadership.holder_gone(lease, claim, epoch, now_ms)
        if ended is None:
            return False
        self.state.leases[name] = ended
        return True

    def request_roll(self, name: str, now_ms: int) -> tuple[str, int]:
        """Ask the leader of `name` to roll its open segment; returns (leader, epoch of
        that segment). With no running lease nothing is asked: ("", open epoch)."""
        record = self.state.usable_stream(name)
        open_epochs = [
            s.epoch for s in self.state.unsealed(record.stream_id) if s.state == SegmentState.OPEN
        ]
        open_epoch = max(open_epochs, default=0)
        lease = self.state.leases.get(name)
        if lease is None or not lease.holder or not lease.running(now_ms):
            return "", open_epoch
        if open_epoch:
            self.state.roll_requests[record.stream_id] = open_epoch
        return lease.holder, open_epoch

    def _open_epoch(
        self,
        record: StreamRecord,
        lease: Lease,
        exclude: tuple[str, ...],
        now_ms: int,
        allow_no_segment: bool,
    ) -> StreamRecord:
        """Persist the new epoch and its segment: none when two are unsealed already,
        nor when too few stores are usable to place one while something is left to
        seal (the new leader seals and recovers it, which needs only R stores of its own
        copy set, and asks for a segment once stores allow: a stream whose stores are
        too few to place a copy set still gets its last segment sealed and read)."""
        assert lease.epoch == record.epoch + 1
        unsealed = self.state.unsealed(record.stream_id)
        segment = None
        copy_set: tuple[str, ...] | None = None
        if len(unsealed) < UNSEALED_SEGMENTS_MAX or not allow_no_segment:
            try:
                copy_set = placement.choose_copy_set(
                    self.state.store_views(now_ms).values(), record.replicas, exclude
                )
            except NotEnoughStores:
                if not (allow_no_segment and unsealed):
                    raise
        if copy_set is not None:
            segment = SegmentRecord(
                stream_id=record.stream_id,
                stream=record.name,
                epoch=lease.epoch,
                copy_set=copy_set,
                state=SegmentState.OPEN,
                final_index=0,
                created_at_ms=now_ms,
                sealed_at_ms=0,
                settled_at_ms=now_ms,
            )
        updated = replace(
            record,
            epoch=lease.epoch,
            leader_id=lease.holder,
            leader_secret_sha256=lease.secret_sha256.hex(),
            leader_principal=lease.principal,
        )
        sealing = [
            replace(s, state=SegmentState.SEALING) for s in unsealed if s.state == SegmentState.OPEN
        ]
        batch = Batch().stream(updated)
        for s in [*sealing, *([segment] if segment else [])]:
            batch.segment(s)
        self.state.catalog.commit(batch)
        self.state.streams[record.name] = updated
        for s in [*sealing, *([segment] if segment else [])]:
            self.state.put_segment(s)
        return updated

    def _writer_view(
        self, record: StreamRecord, leads: bool, lease: Lease, now_ms: int
    ) -> WriterView:
        if not leads:
            return WriterView(record, False, lease, None, (), "")
        segment = self.state.segments.get((record.stream_id, lease.epoch))
        unsealed = tuple(s for s in self.state.unsealed(record.stream_id) if s.epoch < lease.epoch)
        reason = ""
        if segment is not None and segment.state == SegmentState.OPEN:
            reason = repair.roll_reason(segment.copy_set, self.state.store_views(now_ms))
            if not reason and self.state.roll_requests.get(record.stream_id) == segment.epoch:
                reason = "an operator asked for a roll"
            lost = sorted(self.state.lost_members.get(segment.key, ()))
            if not reason and lost:
                reason = f"{', '.join(lost)} lost its replica (a new incarnation)"
        expires_at_ms = authority.grant_expiry(
            now_ms, lease.epoch, self.grants_handed.get(record.name), self.state.grant_ms
        )
        self.grants_handed[record.name] = (lease.epoch, expires_at_ms)
        return WriterView(
            record, True, lease, segment, unsealed, reason, grant_expires_at_ms=expires_at_ms
        )
