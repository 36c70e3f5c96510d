"""A writer's election loop and the open segment it leads, as one state machine.

Driving it (etcd-io/raft's Ready): `step(now_ms, event)` queues the actions the event
leads to in an outbox; `take_actions()` hands them over. The shell drains the outbox
in one loop, carries each action out, and feeds what comes back with `step` once that
loop is done, never from inside a step.

Theory of operation. A writer starts FOLLOWING: it heartbeats the master every
lease/3 (`SendHeartbeat`, on schedule even while earlier ones are unanswered, up to a
lease worth in flight; the shell answers each with `HeartbeatAnswered` carrying the
time the request was *sent*, or `HeartbeatFailed` with the status code name, and the
table `HEARTBEAT_FAILURES` decides which failures end the writer and which are
retried). When an answer makes it LEADER for an epoch, it counts its lease from that
send time, so it always believes the lease ends before the master does, and it starts
replicating the new segment (`BecameLeader` opens the Write streams; the `Replicator`
does the rest).

Leading, every answer for the same epoch renews the lease from its send time. A writer
built with its client's lease session (`SessionLease`) whose answer says the lease is
bound to it counts the session's renewals too (those sent after that answer, under the
same incarnation), and heartbeats on its own only every `SESSION_BOUND_HEARTBEAT_MS`,
or at once when told `SessionAttention`; told `SessionUnbound`, or once the session
renews under another incarnation, its own heartbeats alone count again, every lease/3. The
writer steps down, for good, when the master answers FOLLOWER or another epoch, or when
a store reports a fence above its epoch. A lease that runs out unrenewed (no master
answers) does not step it down: safety rests on epochs and fencing, not on the lease
(docs/design.md, "Why safety never rests on the lease"). A newer epoch can only come
from a master; if one is granted through a master this writer cannot reach, the new
leader's seal fences this one at its next write. So the writer goes on appending to its
open segment, and renews as soon as a master answers (the master renews a holder that
names its epoch while nobody else was granted). What it cannot do meanwhile is roll
(no new epoch, no new copy set): a roll starts only while the lease runs.

Appends that wait. An append not acked `append_timeout_ms` after the core took it (too
few stores of the copy set answer, and no roll away from them is possible) is answered
`AppendsTimedOut`, in doubt: it stays in the segment and is written if the stores come
back, so the writer cannot say it failed. While such appends stay unacked the answer is
repeated every `append_timeout_ms`, so that appends the shell holds back for room end
too. Appends the shell holds back before the core takes them (no room, a roll drains, or
the epoch has no segment yet) are counted in (`AppendHeld`, `HeldAppendLeft`): one held
`append_timeout_ms` is answered `HeldAppendsTimedOut`, failed (never sent), even while
no segment exists whose appends could time out; one taken later keeps the deadline it
had, so every append is answered `append_timeout_ms` after the user made it at the
latest. The writer goes on leading.
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

Rolling (built with `rolling_supported`). The open segment is rolled when its payload
passes the grant's `segment_bytes_max`, when it is older than `segment_age_ms_max` and
holds something, when the master asks (`roll_requested`: a copy-set store died or is
draining, or an operator wants the segment sealed), when the replicator detached a
store, or when a store stayed disconnected for `STORE_LOST_MS`. Drain, then roll: the
writer stops taking appends (`accepting_appends` turns false; the shell makes them
wait), waits until everything assigned is acked, then asks the master for the next
epoch (`AskRoll`, excluding lost and detached stores). Every append to the old
segment is then acked and in it exactly once, and its recovery (the same
`RecoverSegment` as after a takeover, under the new epoch) only adds the bridge. The
answer (`RollAnswered`) opens the new segment at once, held back from acking by the
gate until the old one is sealed. Only one earlier segment may be unsealed: no roll
starts before the previous one is sealed. A roll the master refuses (`RollFailed`),
or a drain not done within `DRAIN_MS_MAX`, resumes appends and tries again after
`ROLL_RETRY_MS`. A roll unanswered past its `timeout_ms` (and a grace) counts as
refused, so a lost answer never leaves the writer waiting for nothing.

A roll that cannot drain. When fewer than W stores of the copy set can still ack the
tail (the others detached, or lost), the drain would never end and the writer would
never roll away from them: it asks for the roll at once, with the tail unacked. The
old segment is then sealed and recovered as after a takeover (no known content: the
recovery decides from R stores, and the unacked tail may or may not survive), and the
answer ends the old segment's unacked appends for good (`AppendsLeftUnacked`): those
some store may hold are in doubt, the others failed. Nothing of the old segment is
acked after the answer, so none is both answered and acked. Once such a roll is
refused, the next attempt excludes only the stores this writer cannot reach, not the
detached ones: with no spare store (N stores for N replicas) the master can never place
a copy set without them, and the writer cannot go on without a new one. Refused again,
the attempts after exclude nothing, and the master places from the stores it knows
live: a store the writer counts as cut off may only refuse this segment's replica (it
lost it to a wiped disk, the runtime world's seed 5204) and take a new segment well.
A roll the writer can do without keeps excluding them (it stays on a copy set that still
acks rather than take back a store that fell behind).

A grant without a segment. When two earlier segments are unsealed (a leader died
while recovering), or too few stores are usable to place a copy set while a segment
is left to seal, the master grants the epoch without a segment. The writer leads it
all the same: it recovers the earlier segments under the granted epoch (R stores of
each one's own copy set suffice), then asks for the next epoch (`AskRoll`), whose
segment it leads as after any roll. While the granted epoch has no segment the writer
takes no appends (they wait, as during a drain). A leader holding an epoch with no
segment and nothing unsealed always asks for a roll, again after every failure
(`protocol.backoff.ROLL_WITHOUT_SEGMENT`, up to `ROLL_RETRY_MS`), until it has a
segment or loses the lease.

Grants. Every answer that makes the writer LEADER of an epoch (a grant, a roll) carries
the master's signed grant of that epoch, opaque here; so does every renewal of the lease,
the grant renewed before it expires. The writer keeps the latest one of the epoch it
leads and hands it to whatever acts under that epoch: the open segment's
replicator (`BecameLeader`), each recovery (`RecoverSegment`: its seals, writes and the
seal at the master), the roll (`AskRoll`) and the release (`ReleaseLease`). Stores and
the master refuse those without it; an answer making it LEADER without one (a master
too old) is a grant it cannot lead under. A recovery shows the latest grant that lists
every segment still to recover: a renewal lists only the segments unsealed when it was
made, so a renewal by a master that restarted since a rival's seal of one of them (the
master remembers in memory only which grant it handed) leaves it out, and stores
refuse a seal under a grant that does not list its segment, for good (the runtime
world's seed 2082).

Recoveries that fail. A recovery that ends with a transient error (anything but a
fence above this writer's epoch, which is `FencedByStore`) comes back as
`RecoveryFailed`; the same `RecoverSegment` goes out again after
`RECOVERY_RETRY_MS`, for as long as the writer leads.

Closing. A user who closes the writer cleanly (`Closing`) stops its appends and rolls
(a drain not yet asked is given up), but the recoveries it started go on: it gives the
lease back (`Release`) once `ready_to_release`, when none is left or after
`CLOSE_SEALING_MS_MAX`. Otherwise a roll's previous segment would stay SEALING until
the next leader came, and a read to the end of the stream would wait for it.

Producers (exactly once, `streamengine.protocol.producers`). The writer keeps the
stream's producer table (`producers`): from the positions its grant carries (what the
master's seal of the latest sealed segment recorded), then the runs each recovery finds
(`SegmentSealed.runs`), one recovery at a time, oldest first, since each seal records
positions built on the segment before. A batch appended with a PRODUCER mark
(`Append.marked`) counts in the table as soon as it takes its indexes; the shell decides
a producer's batch only while nothing earlier is unsealed (`recovering` false). A roll
that cannot drain forgets the old segment's runs: its recovery hands back those it kept.
Each `RecoverSegment` carries the positions its seal records (`ProducerSeal`): through
the segment when this writer drained it, else as of the segment before (recovery then
reads the segment whole). Only on a stream the grant says has producers
(`stream_has_producers`): on any other no segment holds a mark, so recoveries carry no
positions and read only the tail, as for any plain stream; a producer's writer refuses
a grant without it.

Why one long module: the writer's life (following, granted, the gate, rolling, closing,
stepping down) is one state machine over one set of fields; each stage above reads and
changes the same lease, epoch, segment and pending appends, so its rules are read
together. The replication it drives is apart (`client.core.replicator`), as is each
recovery (`client.core.recovery`).
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from streamengine.client.core.recovery import ProducerSeal
from streamengine.client.core.replicator import (
    Acked,
    AllowAcking,
    Append,
    Assigned,
    Flush,
    Replicator,
    ReplicatorAction,
    ReplicatorLimits,
    ReplicatorStatistics,
    SegmentRef,
    Stop,
    StoreConnected,
    StoreDetached,
    StoreDisconnected,
    Tick,
    WriteReplied,
    WritesReplied,
)
from streamengine.protocol.backoff import ROLL_WITHOUT_SEGMENT, STORE_STREAM_REOPEN
from streamengine.protocol.certificate import ContentDigest
from streamengine.protocol.entry import ProducerMark
from streamengine.protocol.limits import HEARTBEATS_PER_LEASE, INDEX_MAX, LEASE_MS_DEFAULT
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.producers import ProducerPosition, ProducerTable, Run
from streamengine.protocol.sequence import pack_sequence

# A copy-set store disconnected this long is lost for the open segment: roll without it
# (the master also asks for a roll once it declares the store dead, later).
STORE_LOST_MS = 3_000
# Appends wait while a roll drains the old segment; a drain not done in this long (a
# quorum of the copy set is not answering) gives the roll up for now.
DRAIN_MS_MAX = 5_000
# A store's Write stream that failed is reopened after `STORE_STREAM_REOPEN`'s pause.
assert STORE_STREAM_REOPEN.max_ms < STORE_LOST_MS, "a lost store gets more than one attempt"

# After a roll refused or given up, the next attempt waits this long.
ROLL_RETRY_MS = 1_000
# A roll the writer cannot do without, refused this often, is asked excluding no store
# (the module doc): the master places from the stores it knows live.
EXCLUDING_NOTHING_AFTER_REFUSALS = 2
# A leader of an epoch without a segment retries its roll sooner (`ROLL_WITHOUT_SEGMENT`),
# then as any roll.
assert ROLL_WITHOUT_SEGMENT.max_ms == ROLL_RETRY_MS
# A roll not answered this long after its own timeout counts as refused: the shell
# answers every `AskRoll`, and this keeps a lost answer from stalling the writer if not.
ROLL_ANSWER_GRACE_MS = ROLL_RETRY_MS
# After a recovery failed with a transient error, it starts again after this long.
RECOVERY_RETRY_MS = 1_000
# While leading, the writer holds a `HoldLease` call open at the master, so that its
# death ends the lease at once (`streamengine.master.core.leadership.holder_gone`). A
# call that ends with the writer alive (a master restarted, a connection lost) is opened again after
# this long, on the master then known active. It only shortens a takeover; safety and
# the lease itself never depend on it.
HOLD_LEASE_REOPEN_MS = 1_000
# An append not acked this long after the core took it is answered in doubt
# (`AppendsTimedOut`): long enough to ride out a store restart and a roll; short enough
# that a user waiting on a stalled copy set hears about it.
APPEND_TIMEOUT_MS = 10_000
# A writer closed cleanly (`Closing`) first lets the recoveries it started finish, so it
# leaves no earlier segment SEALING behind it (readers to the end of the stream would
# wait for the next leader); it gives the lease back after this long at the latest.
CLOSE_SEALING_MS_MAX = 5_000


# The failure name of a heartbeat the master refused because the stream is deleted.
STREAM_DELETED = "STREAM_DELETED"


@dataclass(frozen=True, slots=True)
class HeartbeatFailurePolicy:
    """What a failed heartbeat (by its gRPC status code name) does to the writer."""

    ends_following: bool  # a writer not leading gives up: the request can never succeed
    ends_leading: bool  # a leader steps down at once rather than when its lease runs out
    why: str


_RETRIED = HeartbeatFailurePolicy(False, False, "the master is down, slow or restarting")
_NEVER_GRANTED = HeartbeatFailurePolicy(
    True,
    False,
    "the master will never grant this request; a leader keeps its open segment (its "
    "heartbeats renew nothing) until the stores refuse it or a new leader fences it",
)
_DELETED = HeartbeatFailurePolicy(
    True,
    True,
    "the stream is deleted: nothing more is appended until it is undeleted (the stores "
    "refuse its writes too), so a leader steps down at once and its appends end honestly",
)
# Which heartbeat failures end the writer and which are retried on schedule. A code not
# listed is retried: only an answer that can never change ends anything.
HEARTBEAT_FAILURES: dict[str, HeartbeatFailurePolicy] = {
    "NOT_FOUND": _NEVER_GRANTED,  # no such stream (or tenant)
    "INVALID_ARGUMENT": _NEVER_GRANTED,  # a malformed stream name or request
    # The caller's token may not lead the stream (or is expired or revoked): a new
    # token makes a new writer.
    "PERMISSION_DENIED": _NEVER_GRANTED,
    "UNAUTHENTICATED": _NEVER_GRANTED,
    # Not a gRPC code: the shell's name for a FAILED_PRECONDITION that says the stream
    # is deleted (`se-deleted-until`); other FAILED_PRECONDITIONs are retried.
    STREAM_DELETED: _DELETED,
    "UNAVAILABLE": _RETRIED,  # unreachable, or restarted and not granting yet
    "DEADLINE_EXCEEDED": _RETRIED,
    "CANCELLED": _RETRIED,
    "RESOURCE_EXHAUSTED": _RETRIED,
    "INTERNAL": _RETRIED,
    "UNKNOWN": _RETRIED,
}


def heartbeat_failure_policy(code: str) -> HeartbeatFailurePolicy:
    return HEARTBEAT_FAILURES.get(code, _RETRIED)


# Heartbeats in flight at once. A slow answer still renews the lease from its send time,
# so a slow master is not waited out: the next heartbeat goes on schedule, up to one
# lease worth of them.
HEARTBEATS_IN_FLIGHT_MAX = HEARTBEATS_PER_LEASE
# A writer waiting to lead asks at least this often, whatever the lease: a leader whose
# process died ends its lease at once (`HoldLease`), and the standby's next question is
# then all a takeover waits for. Ten questions a second per waiting writer is little
# for the master.
FOLLOWER_HEARTBEAT_MS_MAX = 100
# A leader whose lease its client's lease session renews heartbeats on its own this
# often, whatever the lease: to report its acked index and segment bytes (status; the
# stores report theirs too). The master asks for a heartbeat through the session's
# renewals when it has something to say (a roll, a grant due for renewal). Ten thousand
# idle leaders then send under a hundred heartbeats a second, rather than one each per
# lease/3.
SESSION_BOUND_HEARTBEAT_MS = 120_000


@dataclass(slots=True)
class SessionLease:
    """The client process's lease session as its bound writers see it: one per client,
    written by the session's shell (`client.leases`) as each renewal is answered, read
    by every bound writer's core for its lease (`Leader.lease_until_ms`). A renewal of
    `incarnation` sent at `renewal_sent_at_ms` and answered at `renewal_answered_at_ms`
    renewed every lease bound under it, but those it then told unbound
    (`SessionUnbound`), until `renewed_until_ms`."""

    incarnation: bytes = b""
    renewal_sent_at_ms: int = 0
    renewed_until_ms: int = 0
    renewal_answered_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class Replica:
    store_id: str
    address: str  # gRPC: Seal, segment state
    zone: str = ""
    data_address: str = ""  # the data plane: Write, and Read (reads, recovery)


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
    segment_bytes_max: int = 0  # 0: no roll by size
    segment_age_ms_max: int = 0  # 0: no roll by age
    # LEADER: the master's signed grant of `epoch` (opaque to the writer).
    grant: bytes = b""
    # LEADER: each producer's last event through the latest sealed segment; None when
    # they came malformed (a grant this writer cannot lead under).
    producers: tuple[ProducerPosition, ...] | None = ()
    # LEADER: some lease of the stream went to a producer, so its segments may hold
    # PRODUCER marks (`master.core.leadership.has_producers`).
    stream_has_producers: bool = False
    # The answer won the lease (it carried a fresh lease secret); a renewal or a roll
    # keeps the secret the writer holds.
    lease_won: bool = False
    # LEADER: the lease is bound to the client's lease session under this incarnation
    # (empty: not bound); the session's renewals renew it from then on.
    session_incarnation: bytes = b""


@dataclass(frozen=True, slots=True)
class HeartbeatFailed:
    """The heartbeat sent at `sent_at_ms` got no answer (timeout, master down) or an
    error: `code` is the gRPC status code name (`HEARTBEAT_FAILURES` says what it
    does), "" when no status came back."""

    sent_at_ms: int
    code: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class FencedByStore:
    """A store ended a Write stream with FAILED_PRECONDITION: its fence is `fence`."""

    store: str
    fence: int


@dataclass(frozen=True, slots=True)
class SegmentSealed:
    """An earlier segment listed in the grant is sealed and recovered; `runs`: the
    producer runs its recovery found in it (`Done.runs`)."""

    epoch: int
    runs: tuple[tuple[str, Run], ...] = ()


@dataclass(frozen=True, slots=True)
class RecoveryFailed:
    """Sealing and recovering the earlier segment `epoch` ended with a transient error
    (a store or the master unreachable, a broken answer; not a later fence)."""

    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class AppendHeld:
    """The shell holds one more append back (it does not go to the core yet). `due_ms`:
    when its caller's append timeout runs out, if it counts from before now (a
    producer's batch that waited for its turn); by default from now."""

    due_ms: int | None = None


@dataclass(frozen=True, slots=True)
class HeldAppendLeft:
    """The oldest append the shell held back left that queue: `taken`, given to the
    core (its `Append` follows, and its timeout still counts from when it was held), or
    else cancelled by its caller."""

    taken: bool


@dataclass(frozen=True, slots=True)
class Closing:
    """The user closes the writer cleanly: take no more appends and start no roll, but
    let the recoveries already started finish (`ready_to_release`), then `Release`."""


@dataclass(frozen=True, slots=True)
class Release:
    """The user leaves the writer: give the lease back now."""


@dataclass(frozen=True, slots=True)
class RollAnswered:
    """The master's `RollSegment` answer to `AskRoll` (sent at `answer.sent_at_ms`)."""

    answer: HeartbeatAnswered


@dataclass(frozen=True, slots=True)
class SessionUnbound:
    """The lease session no longer renews this writer's lease (the master said so, or
    holds the session under another incarnation, or none): it heartbeats on its own."""


@dataclass(frozen=True, slots=True)
class SessionAttention:
    """The master has something to tell this writer (a roll it asks for), said in a
    session renewal: it heartbeats now."""


@dataclass(frozen=True, slots=True)
class RollFailed:
    """`RollSegment` failed or was refused (no stores to place a new copy set, ...)."""

    message: str


LeaderEvent = (
    HeartbeatAnswered
    | HeartbeatFailed
    | RollAnswered
    | RollFailed
    | FencedByStore
    | SegmentSealed
    | RecoveryFailed
    | Closing
    | Release
    | Append
    | AppendHeld
    | HeldAppendLeft
    | WriteReplied
    | WritesReplied
    | StoreConnected
    | StoreDisconnected
    | Tick
    | Flush
    | SessionUnbound
    | SessionAttention
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
    # The latest epoch the master answered with: a heartbeat sent before this writer's
    # grant reached it names one below the grant's, so the master never grants it the
    # next epoch, which would depose this writer (`core.leadership`, master side).
    seen_epoch: int = 0


@dataclass(frozen=True, slots=True)
class BecameLeader:
    """Leading `segment` under `epoch`: open a Write stream to each copy-set store."""

    epoch: int
    lease_ms: int
    segment: SegmentGrant
    policy: ReplicationPolicy
    grant: bytes = b""


@dataclass(frozen=True, slots=True)
class RecoverSegment:
    """Seal and recover an earlier segment under `new_epoch`; then `SegmentSealed`.
    `known`: the digest of the segment's content up to its last index, when this writer
    wrote all of it (a roll after a drain): its recovery seals it with a certificate."""

    segment: SegmentGrant
    new_epoch: int
    policy: ReplicationPolicy
    grant: bytes = b""  # the signed grant of `new_epoch`
    known: ContentDigest | None = field(default=None, compare=False)
    # The producer positions its seal records (`SegmentRecovery`'s `producers`).
    producers: ProducerSeal | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class AskRoll:
    """Ask the master for the next epoch and segment (`RollSegment`); the old segment
    is drained (everything assigned is acked), or cannot be (fewer than W stores of its
    copy set can ack), or the epoch has none. Give up on the call after `timeout_ms`
    (then `RollFailed`)."""

    epoch: int
    exclude_stores: tuple[str, ...]
    reason: str
    timeout_ms: int
    grant: bytes = b""  # the signed grant of `epoch`


@dataclass(frozen=True, slots=True)
class AppendsLeftUnacked:
    """A roll that could not drain was answered: the appends to the segment of
    `segment_epoch` above `acked_index` (through `last_index`) will never be acked.
    Those at or below `sent_through` are in doubt (a store may hold them, and the
    segment's recovery may keep them); those above it failed (no store ever got them)."""

    segment_epoch: int
    acked_index: int
    sent_through: int
    last_index: int

    def __post_init__(self) -> None:
        assert self.acked_index < self.last_index, self
        assert self.acked_index <= self.sent_through <= self.last_index, self


@dataclass(frozen=True, slots=True)
class AppendsTimedOut:
    """Appends to the segment of `segment_epoch` up to `last_index` were not acked within
    `append_timeout_ms`: answer them in doubt (they stay in the segment and are written
    if its stores come back), and fail the appends held back for room, which were never
    sent. The writer still leads."""

    segment_epoch: int
    last_index: int


@dataclass(frozen=True, slots=True)
class HeldAppendsTimedOut:
    """The `count` oldest appends the shell holds back waited `append_timeout_ms`
    without the core taking them (no room, or no segment: a roll refused again and
    again): fail them, they were never sent. The writer still leads."""

    count: int

    def __post_init__(self) -> None:
        assert self.count > 0, self


class StepDownReason(enum.Enum):
    DEPOSED = "the master granted the lease to another writer or epoch"
    FENCED = "a store holds a fence above this writer's epoch"
    RELEASED = "the writer was closed"
    REFUSED = "the master refused the heartbeat for good"
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
    grant: bytes = b""  # the signed grant of `epoch`
    # The acked index of the segment of `epoch` as the writer lets go (0: none): the
    # master passes it on to stores the writer could not tell (a closing writer's
    # flush gives up on a store that is down).
    acked_index: int = 0


LeaderAction = (
    SendHeartbeat
    | BecameLeader
    | RecoverSegment
    | AskRoll
    | SteppedDown
    | ReleaseLease
    | AppendsTimedOut
    | HeldAppendsTimedOut
    | AppendsLeftUnacked
    | ReplicatorAction
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
    # When a master last answered this writer (its clock; 0: never).
    master_answered_ms: int
    leader_id: str
    unsealed_epochs: tuple[int, ...]
    roll_requested: bool
    replication: ReplicatorStatistics | None
    rolling: str = ""  # why the open segment is being drained for a roll


class Leader:
    """See the module docstring."""

    def __init__(
        self,
        now_ms: int,
        limits: ReplicatorLimits | None = None,
        recovery_supported: bool = False,
        rolling_supported: bool = False,
        append_timeout_ms: int = APPEND_TIMEOUT_MS,
        producer: bool = False,
        session: SessionLease | None = None,
    ) -> None:
        """`producer`: this writer appends with a producer id (its heartbeats say so).
        `session`: its client's lease session (None: its heartbeats alone renew)."""
        assert append_timeout_ms > 0
        self.role = Role.FOLLOWING
        self.epoch = 0
        self._seen_epoch = 0  # the latest epoch any answer named (`SendHeartbeat`)
        self._grant = b""  # the signed grant of `epoch` while leading
        # The latest of them that lists every segment in `_unsealed` (`RecoverSegment`).
        self._recovery_grant = b""
        self.replicator: Replicator | None = None
        self.finish: SteppedDown | None = None
        self._limits = limits
        self._recovery_supported = recovery_supported
        self._lease_ms = LEASE_MS_DEFAULT
        self._lease_until_ms = 0
        self._session = session
        # The session incarnation the lease is bound under (empty: not bound), and when
        # the answer that said so came: a renewal sent before then renewed nothing of it.
        self._bound_incarnation = b""
        self._bound_at_ms = 0
        self._leader_id = ""
        self._heartbeats_in_flight = 0
        self._grant_sent_at_ms = 0
        self._next_heartbeat_ms = now_ms
        # Earlier segments not yet sealed and recovered, by epoch.
        self._unsealed: dict[int, SegmentGrant] = {}
        # Recoveries that failed, by epoch: when they start again.
        self._recovery_retry_ms: dict[int, int] = {}
        # Digests of the content of segments this writer drained and rolled away from,
        # by epoch, until they are sealed (`RecoverSegment.known`).
        self._known_content: dict[int, ContentDigest] = {}
        # Which producer sequences the stream holds (`streamengine.protocol.producers`):
        # from the grant's positions, the runs recovery found, and this writer's own.
        self.producers = ProducerTable()
        self.producer = producer
        # Whether the stream's segments may hold marks (the grant's word): if not,
        # recoveries keep no producer positions and read no segment whole.
        self._stream_has_producers = False
        self._roll_requested = False
        self._roll_reason_master = ""
        self._rolling_supported = rolling_supported
        # The open segment; None while leading an epoch granted without one.
        self._segment: SegmentGrant | None = None
        self._policy: ReplicationPolicy | None = None
        self._bytes_max = 0
        self._age_ms_max = 0
        self._opened_ms = 0
        self._rolling = ""  # non-empty while draining for a roll: why
        # Set by `Closing`: when the lease goes back even if recoveries still run.
        self._closing_until_ms: int | None = None
        self._drain_started_ms = 0
        self._roll_asked = False
        # The roll asked leaves the old segment's tail unacked (`_drain_blocked`).
        self._roll_undrained = False
        # Rolls of the open segment refused (or unanswered): once one is, a roll the
        # writer cannot do without lets its detached stores back in.
        self._roll_refusals = 0
        self._roll_answer_by_ms = 0
        self._roll_retry_ms = 0
        # Rolls refused in a row while the epoch has no segment (their backoff).
        self._segmentless_roll_failures = 0
        self._detached: set[str] = set()
        self._disconnected_since: dict[str, int] = {}
        # Stores connected again that have not served a write since: when they were
        # lost. One that refuses the segment at once (a replica its store lost with a
        # wipe, UNAVAILABLE each time) is lost since then, not since its last refusal:
        # counted afresh, it never was, and the writer waited on it for good (the
        # runtime world's seed 138).
        self._reconnected_since: dict[str, int] = {}
        self._outbox: list[LeaderAction] = []
        self._master_answered_ms = 0
        # When its own latest heartbeat went (0: none yet).
        self.heartbeat_sent_ms = 0
        self._append_timeout_ms = append_timeout_ms
        # Appends taken and not yet acked, oldest first: (last index, answer-by time).
        self._unacked_appends: collections.deque[tuple[int, int]] = collections.deque()
        # The last index answered `AppendsTimedOut` while it stays unacked, and when
        # that answer is repeated.
        self._timed_out_through = 0
        self._timed_out_again_ms = 0
        # Appends the shell holds back, oldest first: when each is answered; and the
        # deadline of the one just taken, for its `Assigned`.
        self._held_appends: collections.deque[int] = collections.deque()
        self._taken_deadline_ms: int | None = None

    # ---- queries ----

    @property
    def limits(self) -> ReplicatorLimits:
        """The bounds of every segment this writer leads (before it leads one, too)."""
        return self._limits or ReplicatorLimits()

    @property
    def accepting_appends(self) -> bool:
        """False while a roll drains the open segment, or the epoch has no segment yet:
        appends wait. False for good once closing."""
        return (
            self.role is Role.LEADING
            and self.replicator is not None
            and not self._rolling
            and self._closing_until_ms is None
        )

    @property
    def recovering(self) -> bool:
        """Leading with an earlier segment not yet sealed and recovered (the gate is
        shut: its producer table is not rebuilt yet)."""
        return bool(self._unsealed)

    def ready_to_release(self, now_ms: int) -> bool:
        """After `Closing`: no recovery this writer started (nor a roll it asked for)
        is left, or `CLOSE_SEALING_MS_MAX` has passed, or it no longer leads."""
        if self.role is not Role.LEADING or self._closing_until_ms is None:
            return True
        if now_ms >= self._closing_until_ms:
            return True
        return not self._unsealed and not self._roll_asked

    @property
    def lease_until_ms(self) -> int:
        """When this writer's lease ends by its own count (leading only): from the send
        time of its latest renewal, its own heartbeat's or, while bound, its session's
        (sent after the answer that bound it, under the same incarnation)."""
        session = self._renewing_session()
        if session is not None:
            return max(self._lease_until_ms, session.renewed_until_ms)
        return self._lease_until_ms

    def _renewing_session(self) -> SessionLease | None:
        """The client's session, when its latest renewal renewed this writer's lease."""
        session = self._session
        if (
            session is not None
            and self._bound_incarnation
            and session.incarnation == self._bound_incarnation
            and session.renewal_sent_at_ms >= self._bound_at_ms
        ):
            return session
        return None

    @property
    def session_incarnation(self) -> bytes:
        """The session incarnation this writer's lease is bound under (empty: none)."""
        return self._bound_incarnation

    @property
    def heartbeat_interval_ms(self) -> int:
        every = max(1, self._lease_ms // HEARTBEATS_PER_LEASE)
        if self.role is Role.FOLLOWING:
            return min(every, FOLLOWER_HEARTBEAT_MS_MAX)
        if self._bound_under_current_session():
            return max(every, SESSION_BOUND_HEARTBEAT_MS)
        return every

    def _bound_under_current_session(self) -> bool:
        """Bound, and under the incarnation the session's renewals renew (or before any
        renewal was answered). An answer that bound this writer under an incarnation
        the session has left (decided before the session's call was opened again,
        answered after the renewal that told the rest to leave it) binds it to nothing:
        it heartbeats on its own then, as an unbound writer does, until an answer binds
        it under the current one. Renewed by nothing and heartbeating every two minutes,
        it had its lease run out on both sides, and neither rolled nor heard of a roll
        for two minutes."""
        session = self._session
        return bool(self._bound_incarnation) and (
            session is None
            or not session.incarnation
            or session.incarnation == self._bound_incarnation
        )

    def deadline_ms(self, now_ms: int) -> int | None:
        if self.role is Role.FINISHED:
            return None
        deadlines = []
        if self._heartbeats_in_flight < HEARTBEATS_IN_FLIGHT_MAX:
            deadlines.append(self._next_heartbeat_ms)
        if self.role is Role.LEADING:
            deadlines.extend(self._recovery_retry_ms.values())
            closing = self._closing_until_ms
            # Only the moment the close stops waiting for its recoveries (the shell then
            # looks at `ready_to_release`); once past, a Tick changes nothing, and a
            # deadline left in the past woke the writer again and again without letting
            # time pass (runtime seed 311: a close flushing after it, for good).
            if closing is not None and now_ms < closing:
                deadlines.append(closing)
            if self._unacked_appends:
                deadlines.append(self._unacked_appends[0][1])
            if self._held_appends:
                deadlines.append(self._held_appends[0])
            if self._timed_out_through:
                deadlines.append(self._timed_out_again_ms)
            if self._roll_asked:
                deadlines.append(self._roll_answer_by_ms)
            elif self._segment is None and not self._unsealed and closing is None:
                # Closing starts no roll (`_maybe_roll_without_segment`).
                deadlines.append(self._roll_retry_ms)
            if self.replicator is not None:
                replicating = self.replicator.deadline_ms(now_ms)
                if replicating is not None:
                    deadlines.append(replicating)
        return min(deadlines) if deadlines else None

    def _master_answered(self) -> int:
        """When the master last answered for this writer's lease: its own heartbeat's
        answer, or, while bound, its session's renewal."""
        session = self._renewing_session()
        if session is None:
            return self._master_answered_ms
        return max(self._master_answered_ms, session.renewal_answered_at_ms)

    def statistics(self) -> LeaderStatistics:
        return LeaderStatistics(
            role=self.role,
            epoch=self.epoch,
            lease_until_ms=self.lease_until_ms,
            master_answered_ms=self._master_answered(),
            leader_id=self._leader_id,
            unsealed_epochs=tuple(sorted(self._unsealed)),
            roll_requested=self._roll_requested,
            replication=self.replicator.statistics() if self.replicator else None,
            rolling=self._rolling,
        )

    # ---- the step function and the outbox ----

    def step(self, now_ms: int, event: LeaderEvent) -> None:
        """Take one event; the actions it leads to wait in the outbox (`take_actions`).
        The shell drains the outbox and carries the actions out before it steps again
        for what they bring back, so no step ever runs inside another."""
        self._outbox.extend(self._step(now_ms, event))

    def take_actions(self) -> list[LeaderAction]:
        """Everything queued since the last call, in order; the outbox is then empty."""
        actions, self._outbox = self._outbox, []
        return actions

    def _step(self, now_ms: int, event: LeaderEvent) -> list[LeaderAction]:
        if self.role is Role.FINISHED:
            return self._step_finished(event)
        actions: list[LeaderAction] = []
        stepped_replicator = False
        if isinstance(event, HeartbeatAnswered):
            self._heartbeats_in_flight = max(0, self._heartbeats_in_flight - 1)
            self._master_answered_ms = max(self._master_answered_ms, now_ms)
            self._seen_epoch = max(self._seen_epoch, event.epoch)
            if self.role is Role.FOLLOWING:
                self._answered_following(now_ms, event, actions)
            else:
                self._answered_leading(now_ms, event, actions)
        elif isinstance(event, HeartbeatFailed):
            self._heartbeats_in_flight = max(0, self._heartbeats_in_flight - 1)
            if self._heartbeat_failure_ends(event):
                self._step_down(
                    now_ms, StepDownReason.REFUSED, f"{event.code}: {event.message}", actions
                )
                return actions
            # A bound writer's next own heartbeat is two minutes away; the one that
            # failed was maybe asked for by its session (a roll to hear of).
            retry_ms = now_ms + max(1, self._lease_ms // HEARTBEATS_PER_LEASE)
            self._next_heartbeat_ms = min(self._next_heartbeat_ms, retry_ms)
        elif isinstance(event, FencedByStore):
            if self.role is Role.LEADING and event.fence > self.epoch:
                self._step_down(
                    now_ms,
                    StepDownReason.FENCED,
                    f"{event.store} is fenced at {event.fence}",
                    actions,
                )
        elif isinstance(event, SegmentSealed):
            self._sealed(now_ms, event.epoch, event.runs, actions)
        elif isinstance(event, RecoveryFailed):
            if self.role is Role.LEADING and event.epoch in self._unsealed:
                self._recovery_retry_ms[event.epoch] = now_ms + RECOVERY_RETRY_MS
        elif isinstance(event, Closing):
            if self.role is Role.LEADING and self._closing_until_ms is None:
                self._closing_until_ms = now_ms + CLOSE_SEALING_MS_MAX
                if self._rolling and not self._roll_asked:
                    self._roll_given_up(now_ms)  # a drain not asked yet: the next leader rolls
        elif isinstance(event, Release):
            if self.role is Role.LEADING:
                acked = self._released_acked()
                self._step_down(now_ms, StepDownReason.RELEASED, "released", actions)
                actions.append(ReleaseLease(self.epoch, self._grant, acked))
            self.role = Role.FINISHED
            return actions
        elif isinstance(event, RollAnswered):
            self._master_answered_ms = max(self._master_answered_ms, now_ms)
            self._seen_epoch = max(self._seen_epoch, event.answer.epoch)
            self._roll_answered(now_ms, event.answer, actions)
        elif isinstance(event, RollFailed):
            if self._roll_asked:
                self._roll_given_up(now_ms)
        elif isinstance(event, SessionUnbound):
            if self._bound_incarnation:
                self._bound_incarnation = b""
                self._next_heartbeat_ms = min(self._next_heartbeat_ms, now_ms)
        elif isinstance(event, SessionAttention):
            if self.role is Role.LEADING:
                self._next_heartbeat_ms = min(self._next_heartbeat_ms, now_ms)
        elif isinstance(event, Append):
            assert self.accepting_appends, "an append while not accepting appends"
            assert self.replicator is not None
            if event.due_ms is not None:
                self._taken_deadline_ms = min(event.due_ms, self._taken_deadline_ms or event.due_ms)
            replicated = self.replicator.step(now_ms, event)
            if event.marked:
                self._producer_assigned(event, replicated)
            actions.extend(replicated)
            stepped_replicator = True
        elif isinstance(event, AppendHeld):
            self._append_held(now_ms, event.due_ms)
        elif isinstance(event, HeldAppendLeft):
            if self._held_appends:
                deadline_ms = self._held_appends.popleft()
                self._taken_deadline_ms = deadline_ms if event.taken else None
        elif isinstance(
            event, WriteReplied | WritesReplied | StoreConnected | StoreDisconnected | Flush
        ):
            if self.replicator is not None and self.role is Role.LEADING:
                actions.extend(self.replicator.step(now_ms, event))
                stepped_replicator = True
                self._track_connection(now_ms, event)
        elif not isinstance(event, Tick):
            raise TypeError(f"unknown event {event!r}")
        self._on_time(now_ms, actions, stepped_replicator)
        return actions

    # ---- internals ----

    def _step_finished(self, event: LeaderEvent) -> list[LeaderAction]:
        # A grant that arrives after the writer finished is given straight back, so the
        # next writer does not wait out a lease nobody uses.
        if isinstance(event, RollAnswered):
            event = event.answer
        if isinstance(event, HeartbeatAnswered) and event.leader:
            return [ReleaseLease(event.epoch, event.grant)]
        return []

    def _heartbeat_failure_ends(self, failure: HeartbeatFailed) -> bool:
        policy = heartbeat_failure_policy(failure.code)
        if self.role is Role.LEADING:
            return policy.ends_leading
        return policy.ends_following

    def _on_time(self, now_ms: int, actions: list[LeaderAction], stepped_replicator: bool) -> None:
        if self.role is Role.LEADING:
            self._on_time_leading(now_ms, actions, stepped_replicator)
            self._track_appends(now_ms, actions)
        in_flight = self._heartbeats_in_flight
        if in_flight < HEARTBEATS_IN_FLIGHT_MAX and now_ms >= self._next_heartbeat_ms:
            interval = self.heartbeat_interval_ms
            self._heartbeats_in_flight += 1
            self._next_heartbeat_ms = now_ms + interval
            self.heartbeat_sent_ms = now_ms
            replication = self.replicator
            actions.append(
                SendHeartbeat(
                    epoch=self.epoch if self.role is Role.LEADING else 0,
                    acked_index=replication.acked_index if replication else 0,
                    segment_bytes=replication.payload_bytes if replication else 0,
                    timeout_ms=self._lease_ms,
                    seen_epoch=self._seen_epoch,
                )
            )

    def _on_time_leading(
        self, now_ms: int, actions: list[LeaderAction], stepped_replicator: bool
    ) -> None:
        assert self._policy is not None
        for epoch, retry_ms in sorted(self._recovery_retry_ms.items()):
            if now_ms >= retry_ms:
                del self._recovery_retry_ms[epoch]
                actions.append(self._recover(self._unsealed[epoch]))
        if self._roll_asked and now_ms >= self._roll_answer_by_ms:
            self._roll_given_up(now_ms)  # the answer was lost: ask again later
        if self.replicator is None:
            self._maybe_roll_without_segment(now_ms, actions)
            return
        if not stepped_replicator:
            actions.extend(self.replicator.step(now_ms, Tick()))
        if self._rolling_supported:
            for action in actions:
                if isinstance(action, StoreDetached):
                    self._detached.add(action.store)
            self._maybe_roll(now_ms, actions)

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
        assert answer.epoch > self.epoch, f"granted epoch {answer.epoch} after {self.epoch}"
        self.epoch = answer.epoch
        self._grant = answer.grant
        self._grant_sent_at_ms = answer.sent_at_ms
        self._lease_until_ms = answer.sent_at_ms + answer.lease_ms
        self._bind(now_ms, answer)
        self._next_heartbeat_ms = answer.sent_at_ms + self.heartbeat_interval_ms
        problem = self._cannot_lead(answer)
        if problem:
            self.role = Role.LEADING  # so that stepping down reports the epoch
            self._step_down(now_ms, StepDownReason.UNSUPPORTED, problem, actions)
            actions.append(ReleaseLease(answer.epoch, answer.grant))
            return
        assert answer.policy is not None
        self.role = Role.LEADING
        self._policy = answer.policy
        self._unsealed = {grant.epoch: grant for grant in answer.unsealed}
        self._recovery_grant = answer.grant
        self.producers = ProducerTable(answer.producers or ())
        self._stream_has_producers = answer.stream_has_producers
        self._start_recoveries(actions)
        if answer.segment is None:
            # Nothing to replicate until the roll after the recoveries (`_on_time`).
            self._segment = None
            self._roll_retry_ms = now_ms
            self._segmentless_roll_failures = 0
            return
        self._open(now_ms, answer, actions)

    def _cannot_lead(self, answer: HeartbeatAnswered) -> str:
        if answer.policy is None:
            return "the grant carries no replication policy"
        if not answer.grant:
            return "the answer carries no signed grant (a master older than its stores)"
        if answer.producers is None:
            return "the grant's producer positions do not parse"
        if self.producer and not answer.stream_has_producers:
            return (
                "a producer's grant without the stream marked as having producers (a master "
                "older than this client): a later leader would not look for its marks"
            )
        if answer.segment is not None and answer.segment.epoch != answer.epoch:
            return f"granted epoch {answer.epoch} with segment {answer.segment.epoch}"
        if answer.unsealed and not self._recovery_supported:
            epochs = ", ".join(str(grant.epoch) for grant in answer.unsealed)
            return (
                f"earlier segment(s) {epochs} are unsealed and this writer cannot seal and "
                "recover them; nothing of the new segment may be acked before they are"
            )
        return ""

    def _answered_leading(
        self, now_ms: int, answer: HeartbeatAnswered, actions: list[LeaderAction]
    ) -> None:
        if answer.sent_at_ms < self._grant_sent_at_ms:
            return  # sent before the grant: it says nothing about this epoch
        if answer.leader and answer.epoch < self.epoch:
            return  # answered before a roll the master granted this writer since
        if answer.leader and answer.epoch > self.epoch and self._roll_asked:
            # The roll this writer asked for, decided before this renewal and heard of
            # here first (the answers of two calls arrive in either order): the roll's
            # own answer opens its segment.
            return
        if self._lost_roll_answered(now_ms, answer, actions):
            return
        if not answer.leader or answer.epoch != self.epoch:
            self._leader_id = answer.leader_id
            self._step_down(
                now_ms,
                StepDownReason.DEPOSED,
                f"the master answered {'LEADER' if answer.leader else 'FOLLOWER'} "
                f"for epoch {answer.epoch} while this writer leads epoch {self.epoch}",
                actions,
            )
            if answer.leader:
                # A new epoch granted to this writer (its old lease ran out on the master):
                # it cannot continue the old segment in it, so it gives the lease back.
                actions.append(ReleaseLease(answer.epoch, answer.grant))
            return
        self._lease_ms = answer.lease_ms or self._lease_ms
        self._lease_until_ms = max(self._lease_until_ms, answer.sent_at_ms + answer.lease_ms)
        self._bind(now_ms, answer)
        if answer.grant and answer.grant != self._grant:
            # Renewed before it expires (`protocol.grants`); answers sent earlier carry
            # older ones and were ignored above.
            self._grant = answer.grant
            self._grant_sent_at_ms = answer.sent_at_ms
            if self.replicator is not None:
                self.replicator.renew_grant(answer.grant)
            if self._unsealed.keys() <= {grant.epoch for grant in answer.unsealed}:
                self._recovery_grant = answer.grant
        self._roll_requested = self._roll_requested or answer.roll_requested
        if answer.roll_requested:
            self._roll_reason_master = answer.roll_reason
        self._bytes_max = answer.segment_bytes_max
        self._age_ms_max = answer.segment_age_ms_max

    def _bind(self, now_ms: int, answer: HeartbeatAnswered) -> None:
        """A LEADER answer of this writer's epoch says whether the lease is bound to the
        client's lease session now; a writer built without one never is."""
        incarnation = answer.session_incarnation if self._session is not None else b""
        if incarnation != self._bound_incarnation:
            self._bound_incarnation = incarnation
            self._bound_at_ms = now_ms
            if incarnation:  # its own heartbeats go at the bound interval from now on
                self._next_heartbeat_ms = max(
                    self._next_heartbeat_ms, answer.sent_at_ms + self.heartbeat_interval_ms
                )

    # ---- rolling ----

    def _open(self, now_ms: int, answer: HeartbeatAnswered, actions: list[LeaderAction]) -> None:
        """Lead the granted segment of `answer` (a grant, or a roll's answer)."""
        assert answer.segment is not None and answer.policy is not None
        # A roll drains first, or ends what it left unacked (`_leave_segment`): nothing
        # of the old segment is left waiting for its ack.
        assert not self._unacked_appends, self._unacked_appends
        self._timed_out_through = 0
        self.replicator = Replicator(
            answer.segment.segment,
            answer.epoch,
            answer.policy,
            [replica.store_id for replica in answer.segment.copy_set],
            self._limits,
            acking=not self._unsealed,
            grant=self._grant,
        )
        self._segment = answer.segment
        self._policy = answer.policy
        self._roll_requested = answer.roll_requested
        self._roll_reason_master = answer.roll_reason
        self._bytes_max = answer.segment_bytes_max
        self._age_ms_max = answer.segment_age_ms_max
        self._opened_ms = now_ms
        self._rolling = ""
        self._roll_asked = False
        self._roll_undrained = False
        self._roll_refusals = 0
        self._detached = set()
        self._disconnected_since = {}
        self._reconnected_since = {}
        actions.append(
            BecameLeader(answer.epoch, answer.lease_ms, answer.segment, answer.policy, self._grant)
        )

    def _roll_wanted(self, now_ms: int) -> str:
        replication = self.replicator
        assert replication is not None
        if self._unsealed or now_ms < self._roll_retry_ms:
            return ""  # at most one earlier segment unsealed; or a pause after a failure
        if self._roll_requested:
            return f"the master asked: {self._roll_reason_master or 'roll requested'}"
        if self._bytes_max and replication.payload_bytes >= self._bytes_max:
            return f"{replication.payload_bytes} bytes >= {self._bytes_max}"
        if (
            self._age_ms_max
            and replication.last_index > 0
            and now_ms - self._opened_ms >= self._age_ms_max
        ):
            return f"older than {self._age_ms_max} ms"
        if self._detached:
            return f"store(s) {', '.join(sorted(self._detached))} detached"
        lost = self._lost_stores(now_ms)
        if lost:
            return f"store(s) {', '.join(lost)} lost"
        return ""

    def _track_connection(
        self,
        now_ms: int,
        event: WriteReplied | WritesReplied | StoreConnected | StoreDisconnected | Flush,
    ) -> None:
        """When each store of the segment was lost, if it is (`_lost_stores`)."""
        if isinstance(event, WritesReplied):
            for reply in event.replies:
                self._track_connection(now_ms, reply)
            return
        if isinstance(event, StoreDisconnected):
            since = self._reconnected_since.pop(event.store, now_ms)
            self._disconnected_since.setdefault(event.store, since)
        elif isinstance(event, StoreConnected):
            if event.store in self._disconnected_since:
                self._reconnected_since[event.store] = self._disconnected_since.pop(event.store)
        elif isinstance(event, WriteReplied) and not event.busy:
            self._reconnected_since.pop(event.store, None)
        assert not self._disconnected_since.keys() & self._reconnected_since.keys()

    def _lost_stores(self, now_ms: int) -> list[str]:
        return sorted(
            store
            for store, since in self._disconnected_since.items()
            if now_ms - since >= STORE_LOST_MS
        )

    def _drain_blocked(self, now_ms: int) -> str:
        """Why the open segment's tail can never be acked ("" if it still may be):
        fewer than W stores of the copy set are attached and not lost."""
        replication = self.replicator
        assert replication is not None and self._policy is not None
        unable = self._detached.union(self._lost_stores(now_ms))
        able = [store for store in replication.copy_set if store not in unable]
        if len(able) >= self._policy.write_quorum:
            return ""
        return (
            f"undrained: {len(able)} store(s) of the copy set can ack, "
            f"{self._policy.write_quorum} needed"
        )

    def _maybe_roll(self, now_ms: int, actions: list[LeaderAction]) -> None:
        if self._closing_until_ms is not None:
            return
        if now_ms >= self.lease_until_ms and not self._roll_asked:
            # No master answers: no new epoch to roll to. Appends go on in the open
            # segment; a drain begun for a roll is given up until a master answers.
            if self._rolling:
                self._roll_given_up(now_ms)
            return
        if not self._rolling:
            self._rolling = self._roll_wanted(now_ms)
            self._drain_started_ms = now_ms
        if not self._rolling or self._roll_asked:
            return
        replication = self.replicator
        assert replication is not None
        reason = self._rolling
        undrained = replication.acked_index < replication.last_index
        blocked = self._drain_blocked(now_ms)
        if undrained:
            if not blocked:
                if now_ms - self._drain_started_ms >= DRAIN_MS_MAX:
                    self._roll_given_up(now_ms)
                return
            reason = f"{reason}; {blocked}"
        exclude: set[str] = set()
        if not (blocked and self._roll_refusals >= EXCLUDING_NOTHING_AFTER_REFUSALS):
            exclude |= self._disconnected_since.keys()
        if not (blocked and self._roll_refusals):
            exclude |= self._detached
        self._ask_roll(now_ms, tuple(sorted(exclude)), reason, actions)
        self._roll_undrained = undrained

    def _maybe_roll_without_segment(self, now_ms: int, actions: list[LeaderAction]) -> None:
        """An epoch without a segment: once nothing earlier is unsealed, always ask."""
        if self._closing_until_ms is not None:
            return
        if self._unsealed or self._roll_asked or now_ms < self._roll_retry_ms:
            return
        self._ask_roll(now_ms, (), f"epoch {self.epoch} was granted without a segment", actions)

    def _ask_roll(
        self, now_ms: int, exclude: tuple[str, ...], reason: str, actions: list[LeaderAction]
    ) -> None:
        assert not self._roll_asked and not self._unsealed
        timeout_ms = self._lease_ms
        self._roll_asked = True
        self._roll_answer_by_ms = now_ms + timeout_ms + ROLL_ANSWER_GRACE_MS
        actions.append(AskRoll(self.epoch, exclude, reason, timeout_ms, self._grant))

    def _roll_given_up(self, now_ms: int) -> None:
        if self._roll_asked:
            self._roll_refusals += 1
            # A roll refused or unanswered may have been granted after all (its answer
            # lost): the master then holds this writer at the next epoch, refuses every
            # roll from this one, and only a heartbeat's answer says so
            # (`_lost_roll_answered`). A writer its session renews heartbeats rarely on
            # its own: it asks now (the runtime world's seed 1014 waited 60 s).
            self._next_heartbeat_ms = min(self._next_heartbeat_ms, now_ms)
        self._rolling = ""
        self._roll_asked = False
        self._roll_undrained = False
        delay = ROLL_RETRY_MS
        if self._segment is None:
            failures = self._segmentless_roll_failures = self._segmentless_roll_failures + 1
            delay = ROLL_WITHOUT_SEGMENT.delay_ms(failures)
        self._roll_retry_ms = now_ms + delay

    def _roll_answered(
        self, now_ms: int, answer: HeartbeatAnswered, actions: list[LeaderAction]
    ) -> None:
        if not self._roll_asked:
            return  # an answer given up on (late): the next ask is already planned
        if (
            self.role is not Role.LEADING
            or not answer.leader
            or answer.segment is None
            or answer.policy is None
            or not answer.grant
            or answer.epoch <= self.epoch
            or answer.segment.epoch != answer.epoch
        ):
            self._roll_given_up(now_ms)
            return
        old = self.replicator
        if old is not None:
            old.step(now_ms, Stop())
            self._leave_segment(old, actions)
        assert answer.epoch > self.epoch
        self.epoch = answer.epoch
        self._grant = answer.grant
        self._grant_sent_at_ms = answer.sent_at_ms
        self._lease_ms = answer.lease_ms or self._lease_ms
        self._lease_until_ms = max(self._lease_until_ms, answer.sent_at_ms + answer.lease_ms)
        self._unsealed = {grant.epoch: grant for grant in answer.unsealed}
        self._recovery_grant = answer.grant
        self._recovery_retry_ms = {}
        self._open(now_ms, answer, actions)
        self._start_recoveries(actions)

    def _lost_roll_answered(
        self, now_ms: int, answer: HeartbeatAnswered, actions: list[LeaderAction]
    ) -> bool:
        """A renewal at a later epoch, the lease not won anew: only a roll of this
        writer's moves the epoch while its secret holds, so it is a roll whose own answer
        was lost (given up on before the master, too loaded to answer in time, decided
        it). Taken as that roll's answer, not as a deposition that would give the new
        epoch back; True when it was."""
        if not (
            answer.leader
            and answer.epoch > self.epoch
            and not answer.lease_won
            and self._rolling_supported
            and self.replicator is not None
            and not self._unsealed
        ):
            return False
        self._roll_asked = True
        self._roll_undrained = self.replicator.content_digest() is None
        epoch = self.epoch
        self._roll_answered(now_ms, answer, actions)
        # Unchanged: not a roll's answer after all (no segment of its epoch).
        return self.epoch != epoch

    def _leave_segment(self, old: Replicator, actions: list[LeaderAction]) -> None:
        """The roll away from `old` (stopped) was answered: a drained segment hands its
        content to its recovery; an undrained one ends its unacked appends."""
        known = old.content_digest()
        if known is not None:
            # Drained: every index of the old segment is this writer's and acked.
            self._known_content[old.segment.epoch] = known
            assert not self._unacked_appends, self._unacked_appends
            return
        assert self._roll_undrained, "a roll asked drained left appends unacked"
        # Recovered as after a takeover: from R stores, the tail in doubt. Its producer
        # runs come back from what that recovery keeps (`SegmentSealed.runs`).
        self.producers.forget_from(pack_sequence(old.segment.epoch, 0))
        unacked = [last for last, _ in self._unacked_appends]
        assert all(old.acked_index < last <= old.last_index for last in unacked), unacked
        self._unacked_appends.clear()
        actions.append(
            AppendsLeftUnacked(old.segment.epoch, old.acked_index, old.sent_through, old.last_index)
        )

    def _sealed(
        self,
        now_ms: int,
        epoch: int,
        runs: tuple[tuple[str, Run], ...],
        actions: list[LeaderAction],
    ) -> None:
        if self.role is not Role.LEADING or epoch not in self._unsealed:
            return
        producers = self._stream_has_producers
        assert not producers or epoch == min(self._unsealed), "recoveries run oldest first"
        del self._unsealed[epoch]
        self._recovery_retry_ms.pop(epoch, None)
        self._known_content.pop(epoch, None)
        for producer_id, run in runs:
            self.producers.add_run(producer_id, run)
        if producers:
            self._start_recoveries(actions)  # the next oldest
        if not self._unsealed and self.replicator is not None:
            actions.extend(self.replicator.step(now_ms, AllowAcking()))

    def _start_recoveries(self, actions: list[LeaderAction]) -> None:
        """Start recovering the unsealed segments: on a stream with producers one at a
        time, oldest first (the producer positions a seal records build on those of the
        segment before it; `_sealed` starts the next), else all at once."""
        if not self._unsealed:
            return
        if self._stream_has_producers:
            actions.append(self._recover(self._unsealed[min(self._unsealed)]))
        else:
            actions.extend(self._recover(grant) for grant in self._unsealed.values())

    def _recover(self, grant: SegmentGrant) -> RecoverSegment:
        assert self._policy is not None
        epoch = grant.epoch
        known = self._known_content.get(epoch)
        seal: ProducerSeal | None
        if not self._stream_has_producers:
            # No leader of the stream wrote a mark (`has_producers`): recovered as
            # before producers existed, from the segment's tail.
            seal = None
        elif known is not None:
            # Drained: this writer appended all of it, its table holds every run.
            through = self.producers.positions(pack_sequence(epoch, INDEX_MAX) + 1)
            seal = ProducerSeal(through, through_segment=True)
        else:
            seal = ProducerSeal(
                self.producers.positions(pack_sequence(epoch, 0)), through_segment=False
            )
        return RecoverSegment(grant, self.epoch, self._policy, self._recovery_grant, known, seal)

    def _producer_assigned(self, append: Append, replicated: list[ReplicatorAction]) -> None:
        """A batch with a producer took its indexes: its run counts from now on (a retry
        of it is answered with these sequences once they are acked)."""
        assert not self._unsealed, "a producer's batch before the table is rebuilt"
        [assigned] = [action for action in replicated if isinstance(action, Assigned)]
        mark = ProducerMark.decode(append.payloads[0])
        assert mark.count == len(append.payloads) - 1, mark
        first = pack_sequence(assigned.segment_epoch, assigned.first_index + 1)
        self.producers.add_run(mark.producer_id, Run(mark.first_sequence, mark.count, first))

    # ---- appends that wait ----

    def _track_appends(self, now_ms: int, actions: list[LeaderAction]) -> None:
        """Follow the appends taken and acked in this step, and answer those not acked
        within the append timeout, and those held back as long."""
        self._time_out_held(now_ms, actions)
        unacked = self._unacked_appends
        for action in actions:
            if isinstance(action, Assigned):
                deadline_ms = now_ms + self._append_timeout_ms
                if self._taken_deadline_ms is not None:
                    deadline_ms = min(deadline_ms, self._taken_deadline_ms)
                    self._taken_deadline_ms = None
                # Timed out as a prefix (`AppendsTimedOut` answers every append through
                # an index): the appends taken before it that would end later end with
                # it, so that each ends within its own timeout (a producer's batch
                # counts it from the call, before its turn: the runtime world's seed
                # 109 had one open 59 ms past it, behind a plain append taken first).
                later: list[int] = []
                while unacked and unacked[-1][1] > deadline_ms:
                    later.append(unacked.pop()[0])
                unacked.extend((index, deadline_ms) for index in reversed(later))
                unacked.append((action.last_index, deadline_ms))
            elif isinstance(action, Acked):
                while unacked and unacked[0][0] <= action.acked_index:
                    unacked.popleft()
                if action.acked_index >= self._timed_out_through:
                    self._timed_out_through = 0
        replication = self.replicator
        if replication is None:
            return
        through = 0
        while unacked and unacked[0][1] <= now_ms:
            through = unacked.popleft()[0]
        if through:
            self._timed_out_through = through
        elif self._timed_out_through and now_ms >= self._timed_out_again_ms:
            through = self._timed_out_through
        if through:
            self._timed_out_again_ms = now_ms + self._append_timeout_ms
            actions.append(AppendsTimedOut(replication.segment.epoch, through))
            # The shell fails every append it holds back with these.
            self._held_appends.clear()

    def _append_held(self, now_ms: int, due_ms: int | None) -> None:
        if self.role is Role.LEADING:
            deadline_ms = now_ms + self._append_timeout_ms if due_ms is None else due_ms
            held = self._held_appends
            # Answered oldest first: those held ahead of it that would end later (a
            # producer's batch counts its timeout from the call, before its turn) end
            # with it, so that it ends within its own.
            later = 0
            while held and held[-1] > deadline_ms:
                held.pop()
                later += 1
            held.extend([deadline_ms] * (later + 1))

    def _time_out_held(self, now_ms: int, actions: list[LeaderAction]) -> None:
        """Answer the appends held back `append_timeout_ms`: whether or not a segment
        exists (an epoch granted without one waits for a roll the master may refuse
        for as long as too few stores are usable)."""
        held = self._held_appends
        count = 0
        while held and held[0] <= now_ms:
            held.popleft()
            count += 1
        if count:
            actions.append(HeldAppendsTimedOut(count))

    def _released_acked(self) -> int:
        """The acked index the master must pass on to the stores (0: none): some
        store of the segment never said it knows it (a flush gave up on a store that
        is down), and it may be the one followers read from next."""
        replication = self.replicator
        if (
            replication is None
            or replication.segment.epoch != self.epoch
            or replication.acked_known_everywhere()
        ):
            return 0
        return replication.acked_index

    def _step_down(
        self, now_ms: int, reason: StepDownReason, message: str, actions: list[LeaderAction]
    ) -> None:
        replication = self.replicator
        if replication is not None:
            if self.role is Role.LEADING:
                # What is acked goes to the stores now, as the idle broadcast would have
                # within `idle_ack_ms`: followers read up to their acked index, and a
                # stream nobody leads next would hide its last acked events until some
                # leader seals the segment (runtime seed 130: deposed 2 ms after its
                # marker was acked, a writer left it unread for good).
                actions.extend(replication.step(now_ms, Flush()))
            replication.step(now_ms, Stop())
        self.finish = SteppedDown(
            reason,
            message,
            self.epoch,
            sent_through=replication.sent_through if replication else 0,
            acked_index=replication.acked_index if replication else 0,
        )
        self.role = Role.FINISHED
        self._bound_incarnation = b""
        actions.append(self.finish)
