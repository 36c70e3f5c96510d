"""Leases: one leader per stream, as a pure state machine over `now_ms`.

Theory of operation. Per stream the master keeps `Lease(epoch, holder, expires_ms)`:
`epoch` is the latest epoch granted, `holder` the client it was granted to (empty when
released), `expires_ms` when the holder's lease ends on the master's clock.

Who is the holder. A client id names the holder but proves nothing: it is published as
the stream's leader to every reader. Each writer draws a random lease secret and shows
it with every heartbeat, before it leads as after; the heartbeat that wins the lease
has the lease keep that secret's SHA-256 and the principal (token, certificate) the
holder called as, across its rolls (a heartbeat sent just before a roll and answered
after it still proves the holder). A caller is the holder (`Claim`) only when it names
the holder's client id, shows that secret and calls as that principal: only then does
it renew, roll, release, hold or end the lease, or get the epoch's grant. Anyone else,
whatever client id it names, is a follower. Since the winner drew the secret, a grant
whose answer was lost is not lost with it: the winner's next heartbeat proves it holds
the lease, and is answered with the grant (a stuttering master lost every grant's
answer of 300 streams, each then granted again, before: `test_lease_churn.py`). A
client that shows no secret until granted (an older one) is handed one the master drew.

- A heartbeat from the holder renews the lease at its latest epoch, before
  `expires_ms` or after it (nobody else was granted: the secret would have changed),
  whatever epoch it names, never one above the latest: a leader no master answered for
  a while goes on leading its open segment (docs/design.md, "Why safety never rests on
  the lease"), and when a master answers again nothing has changed that would make it
  give the segment up. A heartbeat the holder sent before it learned of its grant or of
  its roll names an earlier epoch (0 before the grant); granting it the next epoch would
  only depose the holder (issue #38: 14,072 grants in 70 s for 1,000 streams).
- Any other heartbeat before `expires_ms` learns who leads (FOLLOW).
- So does, even after `expires_ms`, a heartbeat naming the holder's client id without
  its secret that says it saw an epoch below the lease's (`seen_epoch`): the holder sent
  it before its grant's answer reached it. Decided after the lease ran out (a master
  too loaded, or paused, to renew it in time), each such heartbeat used to win the next
  epoch, with a secret the holder never saw, and the holder's renewals then proved
  nothing either. A holder whose grant's answer was lost learns the epoch from that
  FOLLOW answer, and its next heartbeat is granted. A caller that says nothing of the
  epochs it saw (None: a client from before `seen_epoch`) is granted as any other.
- At or after `expires_ms`, the first other heartbeat wins: the epoch goes up by one
  and the lease is the caller's (GRANT). The caller persists the new epoch before
  answering.
- A heartbeat decided at or after the instant its caller stopped waiting for the answer
  (`answer_by_ms`, its deadline) decides nothing (`CallerGaveUp`). Its answer reaches
  nobody: a grant would open an epoch whose secret nobody learns, and when the holder
  itself sent it (asking as a follower, before the answer that granted it arrived), an
  epoch that deposes the holder the moment the answer of another heartbeat shows it.
  A master so loaded that heartbeats wait in its queue past their deadline let leases
  run out and then granted those stale heartbeats (issue #38, 1,000 streams).
- A roll is a grant to the current holder, asked for while its lease runs.
- A client process's lease session renews every lease bound to it in one step
  (`session_renewed`): a lease is bound when a heartbeat of a batch naming the session
  renewed or won it; a renewal renews it as the holder's heartbeat would, while it is
  still that grant. So a client leading ten thousand streams renews them with one call
  per interval, and each writer heartbeats on its own only to report, to renew its
  grant, or when the master has something to tell it (docs/design.md, "Lease
  sessions").
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
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, replace

from streamengine.master.core.errors import CallerGaveUp, InvalidArgument, NotLeader
from streamengine.protocol.limits import (
    CLIENT_ID_CHARS_MAX,
    EPOCH_MAX,
    HEARTBEATS_PER_LEASE,
    LEASE_SECRET_BYTES,
    LEASE_SECRET_BYTES_MAX,
    LEASE_SECRET_BYTES_MIN,
)


def secret_digest(secret: bytes) -> bytes:
    """What a lease keeps of its secret (and what the master persists of it)."""
    return hashlib.sha256(secret).digest()


def has_producers(recorded: bool, granted: bool, to_producer: bool) -> bool:
    """Whether the stream is marked as having producers after a heartbeat: once a lease
    is granted to a writer that declares a producer id, for good.

    Why a stream never marked holds no PRODUCER mark: a mark is written only by a leader
    with a producer id (the client writes one ahead of a producer's batch, never for a
    plain append), every leader won its lease with a heartbeat, and the heartbeat that
    won it declared the producer id (a writer's id is fixed for its life). That grant
    persists the mark with the epoch, in the same commit, before the answer leaves: so
    every epoch whose leader could write a mark is at or after the flag, and recovery of
    a stream without it need not read a segment whole to find marks. A renewal or a
    roll keeps the lease's holder, and so its declaration."""
    return recorded or (granted and to_producer)


@dataclass(frozen=True, slots=True)
class Claim:
    """Who a writer's request says it is: its client id, the lease secret it shows
    (empty when it has none) and the principal it calls as (`authority.principal_key`)."""

    client_id: str
    secret: bytes = b""
    principal: str = ""

    def __post_init__(self) -> None:
        if self.secret and not (
            LEASE_SECRET_BYTES_MIN <= len(self.secret) <= LEASE_SECRET_BYTES_MAX
        ):
            raise InvalidArgument(
                f"lease_secret of {len(self.secret)} bytes (from {LEASE_SECRET_BYTES_MIN} "
                f"to {LEASE_SECRET_BYTES_MAX}; writers draw {LEASE_SECRET_BYTES})"
            )


@dataclass(frozen=True, slots=True)
class Lease:
    epoch: int
    holder: str
    expires_ms: int
    # SHA-256 of the secret handed with the grant, and the principal that acquired it:
    # together with `holder` they prove a caller holds the lease. Empty: nobody can.
    secret_sha256: bytes = b""
    principal: str = ""
    # The epoch the holder won the lease at (its rolls keep it; 0: not known, as after a
    # master restart, taken as `epoch`). A holder naming an earlier epoch never heard
    # of this grant: the grant's answer goes to it again.
    granted_epoch: int = 0

    def unheard_grant(self, caller_epoch: int) -> bool:
        """The holder naming `caller_epoch` did not hear of its grant."""
        return caller_epoch < (self.granted_epoch or self.epoch)

    def proven_by(self, claim: Claim) -> bool:
        """The caller is the holder: its client id, its secret and its principal."""
        return (
            bool(self.holder)
            and self.holder == claim.client_id
            and bool(self.secret_sha256)
            and bool(claim.secret)
            and hmac.compare_digest(secret_digest(claim.secret), self.secret_sha256)
            and self.principal == claim.principal
        )

    def running(self, now_ms: int) -> bool:
        return now_ms < self.expires_ms

    def sent_before_grant(self, claim: Claim, seen_epoch: int | None) -> bool:
        """A heartbeat naming the holder's client id, sent before it saw the holder's
        epoch: the holder's own, sent before its grant's answer reached it."""
        return (
            bool(self.holder)
            and self.holder == claim.client_id
            and seen_epoch is not None
            and seen_epoch < self.epoch
        )

    def still_holds(self, claim: Claim, caller_epoch: int) -> bool:
        """The caller leads the latest epoch and nobody was granted anything since, even
        if its lease ran out: it may renew, roll or release it."""
        return caller_epoch == self.epoch and self.proven_by(claim)


class Outcome(enum.Enum):
    RENEWED = "renewed"
    GRANTED = "granted"
    FOLLOW = "follow"


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    lease: Lease
    # The secret the lease was granted with, when the answer is the grant's (GRANTED:
    # the caller drew it or, from a client that showed none, the master did; RENEWED
    # for a holder naming no epoch: the grant's answer again). Empty otherwise.
    secret: bytes = b""

    @property
    def leads(self) -> bool:
        return self.outcome is not Outcome.FOLLOW


def recovered_lease(
    epoch: int, holder: str, secret_sha256: bytes, principal: str, now_ms: int, lease_ms: int
) -> Lease:
    """The lease of a stream when the master (re)starts: no grant for one lease period;
    the holder proves itself with the secret it was handed (persisted as its digest)."""
    return Lease(epoch, holder, now_ms + lease_ms, secret_sha256, principal)


def _granted(epoch: int, claim: Claim, now_ms: int, lease_ms: int, secret: bytes) -> Lease:
    assert LEASE_SECRET_BYTES_MIN <= len(secret) <= LEASE_SECRET_BYTES_MAX, len(secret)
    return Lease(
        epoch, claim.client_id, now_ms + lease_ms, secret_digest(secret), claim.principal, epoch
    )


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
    lease: Lease,
    claim: Claim,
    caller_epoch: int,
    now_ms: int,
    lease_ms: int,
    fresh_secret: bytes,
    answer_by_ms: int | None = None,
    seen_epoch: int | None = None,
) -> Decision:
    """A writer's heartbeat: renew, follow, or grant the next epoch, with the secret the
    caller showed, or `fresh_secret` when it showed none (an older client), which the
    shell hands to the caller only then. Raises CallerGaveUp
    at or after `answer_by_ms` (the caller's deadline; None: it waits forever).
    `seen_epoch`: the latest epoch the caller was answered with (None: not said)."""
    if answer_by_ms is not None and now_ms >= answer_by_ms:
        raise CallerGaveUp(f"decided {now_ms - answer_by_ms} ms after the caller's deadline")
    client_id = claim.client_id
    if not client_id:
        raise InvalidArgument("client_id is required")
    if len(client_id.encode()) > CLIENT_ID_CHARS_MAX:
        # It is named in every grant of the epoch.
        raise InvalidArgument(f"client_id longer than {CLIENT_ID_CHARS_MAX} bytes")
    if caller_epoch > lease.epoch:
        raise InvalidArgument(f"epoch {caller_epoch} was never granted (latest {lease.epoch})")
    if lease.proven_by(claim):
        renewed = replace(lease, expires_ms=now_ms + lease_ms)
        # The holder naming an epoch before its grant sent this before the grant's answer
        # reached it, or that answer was lost: this one is the grant's answer again,
        # secret and all. One naming an epoch since missed a roll's answer at most.
        secret = claim.secret if lease.unheard_grant(caller_epoch) else b""
        return Decision(Outcome.RENEWED, renewed, secret)
    if lease.running(now_ms) or lease.sent_before_grant(claim, seen_epoch):
        return Decision(Outcome.FOLLOW, lease)
    secret = claim.secret or fresh_secret
    granted = _granted(_next_epoch(lease.epoch), claim, now_ms, lease_ms, secret)
    assert granted.proven_by(replace(claim, secret=secret))
    return Decision(Outcome.GRANTED, granted, secret)


def roll(lease: Lease, claim: Claim, caller_epoch: int, now_ms: int, lease_ms: int) -> Lease:
    """The leader asks for the next epoch, which it holds with the same secret; raises
    NotLeader unless it holds the latest."""
    if caller_epoch != lease.epoch:
        raise NotLeader(f"epoch {caller_epoch} is not the latest ({lease.epoch})")
    if not lease.still_holds(claim, caller_epoch):
        raise NotLeader(f"{claim.client_id!r} does not hold the lease (or not its secret)")
    rolled = replace(lease, epoch=_next_epoch(lease.epoch), expires_ms=now_ms + lease_ms)
    assert rolled.still_holds(claim, rolled.epoch)
    return rolled


def release(lease: Lease, claim: Claim, caller_epoch: int, now_ms: int) -> Lease | None:
    """The holder leaves: the lease ends now. None when the caller did not hold it."""
    if not lease.still_holds(claim, caller_epoch):
        return None
    return Lease(lease.epoch, "", now_ms)


def undeleted(lease: Lease) -> Lease:
    """The lease of a stream just undeleted: no holder, so the next heartbeat that may
    be granted anything is granted a new epoch, above the one the stores still fence
    as deleted until they hear of the undelete. Its expiry stays (after a master start
    nobody is granted anything for one lease period)."""
    return replace(lease, holder="", secret_sha256=b"", principal="")


def _same_grant(lease: Lease, bound: Lease) -> bool:
    """`lease` is still the grant `bound` was (the same holder, secret and principal; a
    roll keeps them, a grant to anyone or a release does not)."""
    return lease is bound or (
        bool(lease.holder)
        and lease.holder == bound.holder
        and bool(lease.secret_sha256)
        and lease.secret_sha256 == bound.secret_sha256
        and lease.principal == bound.principal
    )


def session_gone(lease: Lease, bound: Lease, now_ms: int) -> Lease | None:
    """The lease session that renewed or won `bound` (the lease as it was then) ended:
    as `holder_gone`, the lease ends now, its holder kept, when it is still that grant.
    None otherwise: granted since to anyone, or released."""
    if not _same_grant(lease, bound):
        return None
    return replace(lease, expires_ms=min(lease.expires_ms, now_ms))


def session_renewed(
    current: Mapping[str, Lease], bound: Mapping[str, Lease], now_ms: int, lease_ms: int
) -> tuple[dict[str, Lease], list[str]]:
    """A lease session renews every lease bound to it (`bound`: each as it was when
    bound or last renewed) in one call (`LeaseHeartbeatRequest.renew_session`): as its
    holder's own heartbeat would, a lease runs `lease_ms` from now while it is still
    that grant, even if it ran out meanwhile (nobody else was granted). Returns the
    leases built anew, and the streams whose lease is no longer that grant (the session
    no longer holds them: their holder must heartbeat on its own).

    A lease with more than `session_lease_ms(lease_ms)` left is kept as it is: the
    renewal promises its writers only that much (`SessionRenewal.lease_ms`), so each
    lease is built anew every other renewal, not at each one, and most are passed over
    at the cost of two comparisons (ten thousand leases a renewal, every third of a
    lease)."""
    keep_until_ms = now_ms + session_lease_ms(lease_ms)
    renewed: dict[str, Lease] = {}
    ended: list[str] = []
    for name, was in bound.items():
        lease = current.get(name)
        if lease is was and lease.expires_ms >= keep_until_ms:
            continue
        if lease is None or not _same_grant(lease, was):
            ended.append(name)
        elif lease.expires_ms >= keep_until_ms:
            renewed[name] = lease  # the same grant, changed since (a roll): bound anew
        else:
            # Built whole rather than by `replace`: thousands at a time.
            renewed[name] = Lease(
                lease.epoch,
                lease.holder,
                now_ms + lease_ms,
                lease.secret_sha256,
                lease.principal,
                lease.granted_epoch,
            )
    return renewed, ended


def session_lease_ms(lease_ms: int) -> int:
    """How long past its renewal every lease a session renewal renewed runs at least: a
    writer counts its lease that long from the renewal's send time. A third of a lease
    short of a whole one: renewals come every third of a lease."""
    return lease_ms - lease_ms // HEARTBEATS_PER_LEASE


def holder_gone(lease: Lease, claim: Claim, caller_epoch: int, now_ms: int) -> Lease | None:
    """The call the holder of `caller_epoch` held open ended (its process died, as far
    as the master can tell): the lease ends now, the holder kept. None when the caller
    does not hold the latest epoch (a call of an earlier epoch, after a roll or a new
    grant), which changes nothing."""
    if not lease.still_holds(claim, caller_epoch):
        return None
    ended = replace(lease, expires_ms=min(lease.expires_ms, now_ms))
    assert not ended.running(now_ms) and ended.still_holds(claim, caller_epoch)
    return ended
