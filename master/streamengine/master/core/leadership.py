"""Leases: one leader per stream, as a pure state machine over `now_ms`.

Theory of operation. Per stream the master keeps `Lease(epoch, holder, expires_ms)`:
`epoch` is the latest epoch granted, `holder` the client it was granted to (empty when
released), `expires_ms` when the holder's lease ends on the master's clock.

- A heartbeat from the holder before `expires_ms` renews the lease (same epoch).
- So does the holder's heartbeat after `expires_ms` while nobody else was granted, when
  it names the epoch it holds: a leader no master answered for a while goes on leading
  its open segment (docs/design.md, "Why safety never rests on the lease"), and when a
  master answers again nothing has changed that would make it give the segment up.
- Any other heartbeat before `expires_ms` learns who leads (FOLLOW).
- At or after `expires_ms`, the first heartbeat wins: the epoch goes up by one and the
  lease is the caller's (GRANT). The caller persists the new epoch before answering.
- A roll is a grant to the current holder, asked for while its lease runs.
- The holder keeps a call open while it leads (`HoldLease`); when that call ends
  because the holder's process died (its connection reset), the lease ends at once
  (`holder_gone`): a standby takes over without waiting it out. The holder stays the
  holder, so if it lives after all (a connection lost, not a process), its next
  heartbeat naming its epoch renews the lease as above, unless someone was granted
  meanwhile. A paused or cut-off holder keeps its connection, and its lease runs out.
- After a master restart every stream starts with `recovered_lease`: the last holder
  (persisted with its epoch) keeps leading if it heartbeats, nobody else is granted
  anything for one lease period. A holder from before the restart believes its lease
  ends no later than the master's old clock said, so no two leaders overlap.

Safety does not rest on this: stores fence by epoch. Leases only keep leadership from
flapping.

The master itself holds the same kind of lease when several masters share etcd: an
etcd lease with a TTL, kept alive by the active master, whose expiry lets a standby
win the election. The active master counts it as a writer counts its lease, from the
send time of the last keepalive etcd confirmed (`master_active_until`): etcd renews the
lease only when the keepalive arrives, later, so the master always believes its lease
ends first, and stops serving before a standby can become active. After a failover the
new active master keeps the restart rule above.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from streamengine.master.core.errors import InvalidArgument, NotLeader
from streamengine.protocol.limits import CLIENT_ID_CHARS_MAX, EPOCH_MAX


@dataclass(frozen=True, slots=True)
class Lease:
    epoch: int
    holder: str
    expires_ms: int

    def held_by(self, client_id: str, now_ms: int) -> bool:
        return bool(self.holder) and self.holder == client_id and now_ms < self.expires_ms

    def running(self, now_ms: int) -> bool:
        return now_ms < self.expires_ms

    def still_holds(self, client_id: str, caller_epoch: int) -> bool:
        """The caller leads the latest epoch and nobody was granted anything since, even
        if its lease ran out: it may renew, roll or release it."""
        return bool(self.holder) and self.holder == client_id and caller_epoch == self.epoch


class Outcome(enum.Enum):
    RENEWED = "renewed"
    GRANTED = "granted"
    FOLLOW = "follow"


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    lease: Lease

    @property
    def leads(self) -> bool:
        return self.outcome is not Outcome.FOLLOW


def recovered_lease(epoch: int, holder: str, now_ms: int, lease_ms: int) -> Lease:
    """The lease of a stream when the master (re)starts: no grant for one lease period."""
    return Lease(epoch, holder, now_ms + lease_ms)


def master_active_until(keepalive_sent_ms: int, ttl_ms: int) -> int:
    """Until when a master whose election-lease keepalive, sent at `keepalive_sent_ms`,
    was confirmed with `ttl_ms` may serve as the active master."""
    assert ttl_ms > 0, "etcd confirms a live lease with a positive TTL"
    return keepalive_sent_ms + ttl_ms


def _next_epoch(epoch: int) -> int:
    if epoch >= EPOCH_MAX:
        raise InvalidArgument(f"epoch {epoch} is the last one a stream can have")
    return epoch + 1


def heartbeat(
    lease: Lease, client_id: str, caller_epoch: int, now_ms: int, lease_ms: int
) -> Decision:
    """A writer's heartbeat: renew, follow, or grant the next epoch."""
    if not client_id:
        raise InvalidArgument("client_id is required")
    if len(client_id.encode()) > CLIENT_ID_CHARS_MAX:
        # It is named in every grant of the epoch.
        raise InvalidArgument(f"client_id longer than {CLIENT_ID_CHARS_MAX} bytes")
    if caller_epoch > lease.epoch:
        raise InvalidArgument(f"epoch {caller_epoch} was never granted (latest {lease.epoch})")
    if lease.held_by(client_id, now_ms) or lease.still_holds(client_id, caller_epoch):
        return Decision(Outcome.RENEWED, replace(lease, expires_ms=now_ms + lease_ms))
    if lease.running(now_ms):
        return Decision(Outcome.FOLLOW, lease)
    granted = Lease(_next_epoch(lease.epoch), client_id, now_ms + lease_ms)
    return Decision(Outcome.GRANTED, granted)


def roll(lease: Lease, client_id: str, caller_epoch: int, now_ms: int, lease_ms: int) -> Lease:
    """The leader asks for the next epoch; raises NotLeader unless it holds the latest."""
    if caller_epoch != lease.epoch:
        raise NotLeader(f"epoch {caller_epoch} is not the latest ({lease.epoch})")
    if not lease.still_holds(client_id, caller_epoch):
        raise NotLeader(f"{client_id!r} does not hold the lease")
    return Lease(_next_epoch(lease.epoch), client_id, now_ms + lease_ms)


def release(lease: Lease, client_id: str, caller_epoch: int, now_ms: int) -> Lease | None:
    """The holder leaves: the lease ends now. None when the caller did not hold it."""
    if not lease.still_holds(client_id, caller_epoch):
        return None
    return Lease(lease.epoch, "", now_ms)


def undeleted(lease: Lease) -> Lease:
    """The lease of a stream just undeleted: no holder, so the next heartbeat that may
    be granted anything is granted a new epoch, above the one the stores still fence
    as deleted until they hear of the undelete. Its expiry stays (after a master start
    nobody is granted anything for one lease period)."""
    return replace(lease, holder="")


def holder_gone(lease: Lease, client_id: str, caller_epoch: int, now_ms: int) -> Lease | None:
    """The call the holder of `caller_epoch` held open ended (its process died, as far
    as the master can tell): the lease ends now, the holder kept. None when the caller
    does not hold the latest epoch (a call of an earlier epoch, after a roll or a new
    grant), which changes nothing."""
    if not lease.still_holds(client_id, caller_epoch):
        return None
    ended = replace(lease, expires_ms=min(lease.expires_ms, now_ms))
    assert not ended.running(now_ms) and ended.still_holds(client_id, caller_epoch)
    return ended
