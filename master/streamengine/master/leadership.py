"""Leases and epochs: the shell of `core/leadership.py` over the master's records.

A writer's heartbeat, roll, release and end of call go through the pure lease rules;
a new epoch is persisted with its segment (placed by `core/placement.py`) and the
digest of its lease secret before it is answered (`master.epochs`). Heartbeats come in
batches, one per client process and interval (`writer_heartbeats`; a lone
`WriterHeartbeat` is the batch of one), and so do rolls (`roll_segments`; a lone
`RollSegment` is the batch of one): each is decided on its own, and the epochs the
batch opens are persisted in one commit (or the few the metadata's bound on a
transaction makes), before any of it is answered. The leases a batch renews or grants are
bound to the client's lease session when it holds one open (`open_session`): when
that call ends, each of them ends as `holder_gone` says. The lease secret is the one the
winning heartbeat showed (drawn here for a client that showed none), and leaves the
master only in the grant's answer (`WriterView.secret`); a roll keeps it.
A section of the master's state (`master.state`).
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from streamengine.master.batches import rounds_by_stream
from streamengine.master.catalog import Batch
from streamengine.master.core import authority, leadership, model, repair
from streamengine.master.core.errors import (
    MasterError,
    PermissionDenied,
    TooManyUnsealed,
)
from streamengine.master.core.leadership import Claim, Lease, Outcome
from streamengine.master.core.model import SegmentRecord, SegmentState, StoreView, StreamRecord
from streamengine.master.epochs import Epochs, NewEpoch
from streamengine.protocol.grants import Grant
from streamengine.protocol.limits import (
    HEARTBEATS_PER_LEASE,
    LEASE_SECRET_BYTES,
    UNSEALED_SEGMENTS_MAX,
)
from streamengine.protocol.producers import ProducerPosition

if TYPE_CHECKING:
    from streamengine.master.state import MasterState


# Bytes naming a lease session's incarnation: a new one each time its call is opened.
SESSION_INCARNATION_BYTES = 16
# Bound leases whose grant is due for renewal named in one session renewal at least (at
# most this many, or enough to name them all in half the renewals that come in the half
# of a grant left to renew it, `grants_due_per_renewal`): the grants of leases bound
# together fall due together, and their holders' heartbeats then come a few hundred a
# renewal rather than all at once.
GRANTS_DUE_PER_RENEWAL_MIN = 256


def grants_due_per_renewal(bound: int, lease_ms: int, grant_ms: int) -> int:
    """How many bound leases with a grant due one session renewal names at most: with
    renewals every lease/3, every one of `bound` is named within half of the renewals
    that come while half of its grant is left."""
    renewals = max(1, (grant_ms // 2) * HEARTBEATS_PER_LEASE // lease_ms)
    return max(GRANTS_DUE_PER_RENEWAL_MIN, -(-2 * bound // renewals))


@dataclass(frozen=True, slots=True)
class LeaderReport:
    """What a stream's leader last said of its open segment (the segment of `epoch`).
    Kept after the lease ends: it stays true of that segment."""

    epoch: int
    acked_index: int
    segment_bytes: int


@dataclass(frozen=True, slots=True)
class Beat:
    """One writer's heartbeat in a batch: the stream, who it claims to be, the epoch it
    leads (0: none) and what it reports of its open segment."""

    stream: str
    claim: Claim
    epoch: int
    acked_index: int = 0
    segment_bytes: int = 0
    # The writer appends with a producer id (`core.leadership.has_producers`).
    producer: bool = False
    # The latest epoch the writer was answered with (None: it does not say).
    seen_epoch: int | None = None


@dataclass(frozen=True, slots=True)
class Roll:
    """One leader's roll in a batch: the stream, who it claims to be, the epoch it leads
    and the stores to keep out of the new copy set."""

    stream: str
    claim: Claim
    epoch: int
    exclude: tuple[str, ...] = ()


@dataclass(slots=True)
class LeaseSession:
    """A client process's lease session: the principal that opened it, the incarnation
    its call was opened under, and each lease a batch naming it renewed or granted, as
    it was then (a grant's answer carries the secret, the heartbeat that won it did
    not: the grant itself is what is bound)."""

    principal: str
    incarnation: bytes
    leases: dict[str, Lease] = field(default_factory=dict)
    # Those of `leases` whose holder proved it holds them since (a heartbeat showing the
    # lease secret): the session's renewals renew these alone. A grant whose answer was
    # lost reached no writer; renewed by the session, it would outlive its lease for
    # good, with a holder that never leads.
    renewing: dict[str, Lease] = field(default_factory=dict)
    # What the master's roll reasons rested on at the session's last renewal
    # (`Leadership.roll_signature`): while it stays, no leader has a new one to hear.
    roll_signature: object = None
    # The streams a renewal named in its `attention` whose holder has not heartbeated
    # since: every renewal names them again. Named once, a stream whose renewal's
    # answer was lost was never named again (nothing changed the signature), and its
    # leader heard of its roll with its own heartbeat, two minutes later.
    unheard: set[str] = field(default_factory=set)
    # No bound lease's grant is due for renewal before this (`Leadership._grants_due`).
    grants_due_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class SessionRenewal:
    """The answer to a session's renewal (`Leadership.renew_session`)."""

    incarnation: bytes
    ended: tuple[str, ...]
    attention: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WriterView:
    """The answer to a writer heartbeat or a roll."""

    stream: StreamRecord
    leads: bool
    lease: Lease
    segment: SegmentRecord | None
    unsealed: tuple[SegmentRecord, ...]
    roll_reason: str
    # The lease secret, when this answer is the grant's (to the heartbeat that won the
    # lease, or again to its holder that did not hear of it); empty on a renewal, a
    # roll or to a follower. Handed to the caller, kept nowhere.
    secret: bytes = field(default=b"", repr=False)
    # This very answer's heartbeat won the lease, at a new epoch.
    won: bool = False
    # When the grant of a LEADER answer expires (`core.authority.grant_expiry`).
    grant_expires_at_ms: int = 0
    # The incarnation of the lease session the lease is bound to (empty: none).
    session_incarnation: bytes = b""

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
        self.epochs = Epochs(state)
        # Where each lease's secret comes from (the simulator draws from its seed).
        self.draw_secret: Callable[[], bytes] = functools.partial(
            secrets.token_bytes, LEASE_SECRET_BYTES
        )
        # stream -> (epoch, expiry) of the grant last handed to its leader. Memory only:
        # a master that restarts hands fresh ones.
        self.grants_handed: dict[str, tuple[int, int]] = {}
        # Lease sessions held open, by the session bytes the client drew (memory only:
        # a new active master starts with none, and the next batch binds again).
        self.sessions: dict[bytes, LeaseSession] = {}

    def writer_heartbeats(
        self,
        beats: Sequence[Beat | MasterError],
        now_ms: int,
        answer_by_ms: int | None = None,
        session: bytes = b"",
    ) -> list[WriterView | MasterError]:
        """Decide each heartbeat of a batch in order (an error in the list stays that
        entry's answer): renew, follow or grant. The epochs granted are persisted before
        anything is answered, in one commit (as many as the metadata's bound on a
        transaction needs: `OPS_PER_TRANSACTION_MAX`, each epoch whole in one). A commit
        that fails fails the whole call: what earlier commits granted stands, as for a
        winner whose answer is lost, and nothing else changes. `answer_by_ms`: the
        caller's deadline (`core.leadership`)."""
        decided: dict[str, Lease] = {}
        granted: dict[str, NewEpoch] = {}
        secrets_handed: dict[int, bytes] = {}
        outcomes: list[tuple[Beat, leadership.Decision] | MasterError] = []
        views = self.state.store_views(now_ms) if beats else {}
        for number, beat in enumerate(beats):
            if isinstance(beat, MasterError):
                outcomes.append(beat)
                continue
            try:
                record = self.state.usable_stream(beat.stream)
                # Drawn only for a client that draws none (an older one).
                secret = b"" if beat.claim.secret else self.draw_secret()
                lease = decided.get(beat.stream) or self.state.leases[beat.stream]
                decision = leadership.heartbeat(
                    lease,
                    beat.claim,
                    beat.epoch,
                    now_ms,
                    self.state.lease_ms,
                    secret,
                    answer_by_ms,
                    beat.seen_epoch,
                )
                if decision.outcome is Outcome.GRANTED:
                    # The lease it grants runs: nothing else in the batch is granted it.
                    assert beat.stream not in granted, beat.stream
                    record = replace(
                        record,
                        has_producers=leadership.has_producers(
                            record.has_producers, True, beat.producer
                        ),
                    )
                    granted[beat.stream] = self.epochs.plan(
                        record, decision.lease, (), now_ms, True, views
                    )
                if decision.secret:
                    secrets_handed[number] = decision.secret
            except MasterError as error:
                outcomes.append(error)
                continue
            decided[beat.stream] = decision.lease
            outcomes.append((beat, decision))
        self.epochs.persist(list(granted.values()))
        self.state.leases.update(decided)
        bound = self.sessions.get(session) if session else None
        answers: list[WriterView | MasterError] = []
        for number, outcome in enumerate(outcomes):
            if isinstance(outcome, MasterError):
                answers.append(outcome)
                continue
            beat, decision = outcome
            lease = decision.lease
            if decision.leads and beat.epoch == lease.epoch:
                self.state.leader_reports[beat.stream] = LeaderReport(
                    beat.epoch, beat.acked_index, beat.segment_bytes
                )
            incarnation = b""
            record = self.state.streams[beat.stream]
            view = self._writer_view(record, decision.leads, lease, now_ms, views)
            if decision.leads and bound is not None and bound.principal == beat.claim.principal:
                bound.leases[beat.stream] = lease
                bound.unheard.discard(beat.stream)  # its answer says what the renewal did
                if decision.outcome is Outcome.RENEWED:
                    bound.renewing[beat.stream] = lease
                    incarnation = bound.incarnation
                    due_at_ms = view.grant_expires_at_ms - self.state.grant_ms // 2
                    bound.grants_due_at_ms = min(bound.grants_due_at_ms, due_at_ms)
                else:
                    bound.renewing.pop(beat.stream, None)
            answers.append(
                replace(
                    view,
                    secret=secrets_handed.get(number, b""),
                    won=decision.outcome is Outcome.GRANTED,
                    session_incarnation=incarnation,
                )
            )
        return answers

    def writer_heartbeat(
        self,
        name: str,
        claim: Claim,
        epoch: int,
        acked_index: int,
        segment_bytes: int,
        now_ms: int,
        answer_by_ms: int | None = None,
        producer: bool = False,
        seen_epoch: int | None = None,
    ) -> WriterView:
        """One heartbeat: the batch of one (raises its error)."""
        beat = Beat(name, claim, epoch, acked_index, segment_bytes, producer, seen_epoch)
        (answer,) = self.writer_heartbeats([beat], now_ms, answer_by_ms)
        if isinstance(answer, MasterError):
            raise answer
        return answer

    def open_session(self, session: bytes, principal: str) -> bool:
        """A client process holds its lease session open (`HoldLeaseSession`); False
        when that session is open already (the caller must draw another)."""
        if session in self.sessions:
            return False
        self.sessions[session] = LeaseSession(
            principal, self.draw_secret()[:SESSION_INCARNATION_BYTES]
        )
        return True

    def renew_session(self, session: bytes, principal: str, now_ms: int) -> SessionRenewal:
        """Renew every lease bound to `session` (`leadership.session_renewed`); those
        the session no longer holds are unbound and named in `ended`. `attention`: the
        bound streams whose leader should heartbeat now: its grant is due for renewal
        (`grants_due_per_renewal` a renewal), or it has a roll to hear of (looked for
        only when what roll reasons rest on changed since the session's last renewal).
        An empty incarnation: no such session is open for `principal`."""
        held = self.sessions.get(session)
        if held is None or held.principal != principal:
            return SessionRenewal(b"", (), ())
        leases = self.state.leases
        lease_ms = self.state.lease_ms
        renewed, ended = leadership.session_renewed(leases, held.renewing, now_ms, lease_ms)
        for name in ended:
            del held.renewing[name]
            held.leases.pop(name, None)
        leases.update(renewed)
        held.renewing.update(renewed)
        held.leases.update(renewed)
        grants_due = self._grants_due(held, now_ms)
        views = self.state.store_views(now_ms)
        signature = self.roll_signature(views)
        attention = set(grants_due) | (held.unheard & held.renewing.keys())
        if signature != held.roll_signature:
            held.roll_signature = signature
            for name, lease in held.renewing.items():
                record = self.state.streams.get(name)
                if record is not None and self._roll_reason(record, lease, views):
                    attention.add(name)
        held.unheard = attention
        return SessionRenewal(held.incarnation, tuple(ended), tuple(sorted(attention)))

    def _grants_due(self, held: LeaseSession, now_ms: int) -> list[str]:
        """The bound streams whose grant has half of it left or less: renewed by their
        holder's next heartbeat (`authority.grant_expiry`), which the renewal asks for,
        `grants_due_per_renewal` at a time. Looked for once the earliest such moment
        came (`LeaseSession.grants_due_at_ms`, lowered as leases are bound)."""
        if now_ms < held.grants_due_at_ms:
            return []
        half_ms = self.state.grant_ms // 2
        due_max = grants_due_per_renewal(
            len(held.renewing), self.state.lease_ms, self.state.grant_ms
        )
        due: list[str] = []
        next_ms = now_ms + half_ms
        for name in held.renewing:
            grant = self.grants_handed.get(name)
            if grant is None:
                continue
            due_at_ms = grant[1] - half_ms
            if due_at_ms > now_ms:
                next_ms = min(next_ms, due_at_ms)
            elif len(due) < due_max:
                due.append(name)
            else:
                next_ms = now_ms  # more are due than one renewal names
        held.grants_due_at_ms = next_ms
        return due

    def roll_signature(self, views: dict[str, StoreView]) -> object:
        """What `_roll_reason` rests on besides each stream's own segment: which stores
        are dead or draining, the rolls operators asked for and the members lost."""
        return (
            frozenset((store, view.alive, view.draining) for store, view in views.items()),
            frozenset(self.state.roll_requests.items()),
            frozenset(
                (key, frozenset(members)) for key, members in self.state.lost_members.items()
            ),
        )

    def session_gone(self, session: bytes, now_ms: int) -> list[tuple[str, int]]:
        """The session's call ended: every lease bound to it ends now, unless granted to
        anyone since (`leadership.session_gone`). Returns the (stream, epoch) ended."""
        held = self.sessions.pop(session, None)
        ended = []
        for name, bound in sorted(held.leases.items()) if held else ():
            lease = self.state.leases.get(name)
            gone = None if lease is None else leadership.session_gone(lease, bound, now_ms)
            if gone is not None:
                self.state.leases[name] = gone
                ended.append((name, gone.epoch))
        return ended

    def roll_segments(
        self, rolls: Sequence[Roll | MasterError], now_ms: int
    ) -> list[WriterView | MasterError]:
        """Decide each roll of a batch (an error in the list stays that entry's answer),
        as if each came alone, one after the other (`batches.rounds_by_stream`): the
        rolls of a round are persisted together in as few commits as
        `epochs.transactions` makes, before any is answered. A commit that fails fails
        the whole call (what earlier commits rolled stands, as a roll whose answer is
        lost)."""
        answers: dict[int, WriterView | MasterError] = {
            number: roll for number, roll in enumerate(rolls) if isinstance(roll, MasterError)
        }
        for rolls_of_round in rounds_by_stream(rolls, lambda roll: roll.stream):
            answers.update(self._roll_round(rolls_of_round, now_ms))
        return [answers[number] for number in range(len(rolls))]

    def _roll_round(
        self, rolls: list[tuple[int, Roll]], now_ms: int
    ) -> dict[int, WriterView | MasterError]:
        """Rolls of distinct streams, decided, persisted together, then answered."""
        views = self.state.store_views(now_ms)
        answers: dict[int, WriterView | MasterError] = {}
        planned: dict[int, NewEpoch] = {}
        for number, roll in rolls:
            try:
                record = self.state.usable_stream(roll.stream)
                lease = leadership.roll(
                    self.state.leases[roll.stream],
                    roll.claim,
                    roll.epoch,
                    now_ms,
                    self.state.lease_ms,
                )
                if len(self.state.unsealed(record.stream_id)) >= UNSEALED_SEGMENTS_MAX:
                    raise TooManyUnsealed(
                        f"{roll.stream}: {UNSEALED_SEGMENTS_MAX} segments unsealed; seal them"
                        " before rolling"
                    )
                plan = self.epochs.plan(record, lease, roll.exclude, now_ms, False, views)
            except MasterError as error:
                answers[number] = error
                continue
            planned[number] = plan
            # What placement would see of the next roll, had this one come alone.
            for store in plan.opened.copy_set if plan.opened else ():
                views[store] = replace(views[store], segments=views[store].segments + 1)
        self.epochs.persist(list(planned.values()))
        for number, plan in planned.items():
            answers[number] = self._writer_view(plan.record, True, plan.lease, now_ms, views)
        return answers

    def roll_segment(
        self, name: str, claim: Claim, epoch: int, exclude: Iterable[str], now_ms: int
    ) -> WriterView:
        """One roll: the batch of one (raises its error)."""
        (answer,) = self.roll_segments([Roll(name, claim, epoch, tuple(exclude))], now_ms)
        if isinstance(answer, MasterError):
            raise answer
        return answer

    def check_holds(self, name: str, claim: Claim, epoch: int) -> None:
        """Raise PermissionDenied unless `claim` holds the lease of `epoch` (`HoldLease`)."""
        lease = self.state.leases.get(name)
        if lease is None or not lease.still_holds(claim, epoch):
            raise PermissionDenied(
                f"{name}: {claim.client_id!r} does not hold the lease of epoch {epoch} "
                "(its holder shows the secret it was granted with)"
            )

    def release_lease(
        self, name: str, claim: Claim, epoch: int, now_ms: int, acked_index: int = 0
    ) -> bool:
        """Give back the lease of `epoch`, whose leader acked `acked_index` in its
        segment: owed to that segment's stores while it is open (`core.leader_acked`;
        the caller proved it held the epoch)."""
        record = self.state.stream(name)
        segment = self.state.segments.get((record.stream_id, epoch))
        if (
            segment is not None
            and segment.state == SegmentState.OPEN
            and acked_index > segment.released_acked_index
        ):
            # Kept, so that the master that serves next still owes it.
            owed = replace(segment, released_acked_index=acked_index)
            self.state.catalog.commit(Batch().segment(owed))
            self.state.put_segment(owed)
            self.state.leader_acked.released(owed.key, owed.copy_set, acked_index)
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

    def _writer_view(
        self,
        record: StreamRecord,
        leads: bool,
        lease: Lease,
        now_ms: int,
        views: dict[str, StoreView],
    ) -> WriterView:
        if not leads:
            return WriterView(record, False, lease, None, (), "")
        segment = self.state.segments.get((record.stream_id, lease.epoch))
        unsealed = tuple(s for s in self.state.unsealed(record.stream_id) if s.epoch < lease.epoch)
        reason = self._roll_reason(record, lease, views)
        expires_at_ms = authority.grant_expiry(
            now_ms, lease.epoch, self.grants_handed.get(record.name), self.state.grant_ms
        )
        self.grants_handed[record.name] = (lease.epoch, expires_at_ms)
        return WriterView(
            record, True, lease, segment, unsealed, reason, grant_expires_at_ms=expires_at_ms
        )

    def owed_rolls(self, now_ms: int) -> dict[str, tuple[int, str]]:
        """Each stream whose running lease's leader should roll its open segment: that
        epoch, and why."""
        views = self.state.store_views(now_ms)
        owed = {}
        for name, lease in self.state.leases.items():
            record = self.state.streams.get(name)
            if record is None or not lease.holder or not lease.running(now_ms):
                continue
            reason = self._roll_reason(record, lease, views)
            if reason:
                owed[name] = (lease.epoch, reason)
        return owed

    def _roll_reason(self, record: StreamRecord, lease: Lease, views: dict[str, StoreView]) -> str:
        """Why the leader of `lease` should roll its open segment, or ""."""
        segment = self.state.segments.get((record.stream_id, lease.epoch))
        if segment is None or segment.state != SegmentState.OPEN:
            return ""
        reason = repair.roll_reason(segment.copy_set, views)
        if not reason and self.state.roll_requests.get(record.stream_id) == segment.epoch:
            reason = "an operator asked for a roll"
        lost = sorted(self.state.lost_members.get(segment.key, ()))
        if not reason and lost:
            reason = f"{', '.join(lost)} lost its replica (a new incarnation)"
        return reason


def grant_producers(
    view: WriterView, segments: list[SegmentRecord]
) -> tuple[ProducerPosition, ...]:
    """The producer positions a LEADER answer carries when it won the lease: those of
    the latest of the stream's `segments` sealed before every segment its leader
    recovers or leads."""
    if not view.leads or not view.secret:
        return ()
    epochs = [s.epoch for s in view.unsealed] + [view.lease.epoch]
    if view.segment is not None:
        epochs.append(view.segment.epoch)
    return model.producers_before(segments, view.stream, min(epochs))
