"""SegmentRecovery: the seals, reads and writes that close one earlier segment.

Theory of operation. A new leader owns one `SegmentRecovery` per earlier unsealed
segment. `start(now_ms)` seals every store of the copy set; `step(now_ms, event)` takes
what a store or the master answered (or `Tick`: time passed) and returns the actions to
take next. It never does I/O and never reads a clock: the time is an input, and
`deadline_ms()` says when it next wants a `Tick`. Every event may arrive twice, late or
out of order, and is handled idempotently.

1. Seal. The first R stores that answer the seal are the ones decided from; they are
   read from `read_from_index` to their end. Stores that answer later are bridged too
   (needed whenever R < W, e.g. N = W = 3). A store lost before its read answered is
   replaced by another sealed store.
2. Decide: `plan_recovery` over what the R stores answered and hold.
3. Bridge. Each store X receives the plan's copies of `a_X+1 .. final_index` (its own
   acked index from its seal answer; never its matched index). A store holds a write
   only once its answer to that write says so: the epoch it now holds at every index
   is at least the one sent (only final copies, at or below `a`, are sent with an
   epoch below ours, and a higher copy of a final index carries the same content: an
   earlier recovery chose it). At most `RECOVERY_BATCHES_IN_FLIGHT_MAX` batches per
   store are in flight; each carries the store's own acked index, raising nothing.
4. Raise. Once W stores hold their whole range and the bridge, each of them gets the
   acked index `final_index`; a store that completes later gets it when it does, never
   before (a store whose acked index covered a run a later leader redoes differently
   would have served readers something that changes).
5. Once W stores answer with an acked index at the bridge, `SealAtMaster`, with the
   segment's certificate when this leader knows the whole content (`certificate`):
   the digest of what it wrote itself (`known`, a roll after a drain: the plan then only
   adds the bridge), or a plan that holds every index from 1; when the master confirms
   (`MasterSealed`), `Done`. Stores still catching up keep being
   bridged for `late_stores_ms` afterwards; then the operation is over (`finished`).

Time (`RecoveryTiming`). Silence is decided here, never by a driver:
- a request unanswered for `retransmit_ms` goes out again (requests are idempotent);
- a store that has left a request unanswered for `store_lost_ms`, answering nothing
  meanwhile, is lost: recovery decides from the other sealed stores and stops sending
  it batches. A lost store is probed with its (idempotent) seal every `retransmit_ms`;
  only an answer from it brings it back, and then everything it still owes an answer
  goes out again at once;
- a batch a store refused for now (`StoreBusy`: its queue full, or the tenant over its
  quota) goes out again after `busy_pause_ms`.

A store answering with a fence above this leader's epoch (a seal or read reply, or a
refused request), or a read showing a copy of a later epoch, means a later leader took
over: the operation emits `Deposed` and stops. While fewer than R stores (to decide) or
W stores (to finish) can answer, it keeps probing and waits; how long is the leader's
call (its lease). `step` raises `InconsistentAnswers` when a store answers what no
correct store can hold.

A store's range is empty when its own acked index already covers the bridge: it holds
the run as final, so it counts among the W holders without a write.

Accepting loss (`accept_loss`, only ever an operator's choice: `streamengine seal NAME
--accept-loss`). A segment that lost more than N - W replicas for good can never gather
R seal answers, and its stream is stuck. With `accept_loss`, once every store of the
copy set has either answered the seal or been lost (`store_lost_ms`), recovery decides
from the stores that answered (at least one), bridges them, and finishes once all of
them hold the bridge (W, if that many answered). With R answers, nothing is lost and
the recovery is the ordinary one. Decided from fewer than R, three rules hold
(`lost_from_index`, `_check_request`):
- the plan cannot know what was acked past the largest acked index `a` the deciders
  reported, so the loss runs from `a + 1`. A bridge the plan found is proof of nothing
  unless the acked index reached it (final index = `a`): a bridge above `a` is what an
  interrupted recovery (maybe as blind as this one) left behind;
- the loss runs to the segment's end, past the final index too: the lost replicas may
  have held acked events above it, which no reader can be served either;
- the master records the loss (`SealAtMaster`) before any store's acked index is
  raised: a raised acked index is what a later recovery and every reader take as
  "nothing lost up to here", so an interruption between the two would hide the loss;
- no acked index ever rises into the loss: the holders are raised to `a` only
  (`raised_to`), never to the bridge. A reader tailing the segment from a survivor
  before it learns of the seal would otherwise be handed the lost range, hop the
  bridge and pass what the lost replicas held past it, told nothing. No replica ever
  serves the bridge, so repair has nothing to copy and no certificate is sent.
The raise follows the master's confirmation; `Done` then, as ever, once the master
holds the segment sealed. Readers reaching the lost range get `DataLossError`.

Producers (`producers`, a writer with a producer id). The seal at the master records
each producer's last event through the segment (`SealAtMaster.producers`), so that the
next leader starts from it instead of reading earlier segments. When the leader knows
them (a roll after a drain: it wrote every event), they come with the operation;
otherwise they come as of the segment before, and recovery reads the final copies below
what it decides from (`1 .. copies_from - 1`, from the store that reported the acked
index; once that store is lost, from another sealed store whose own acked index covers
them, as for a late store's final copies) so that it holds the whole content, folds
the segment's marks into them (`streamengine.protocol.producers`), and only then seals
at the master. `Done` hands the segment's runs to the leader's table.

Driving it: `op = SegmentRecovery(policy, segment_epoch, leader_epoch, copy_set)`;
carry out `op.start(now)`; for every reply call `op.step(now, event)`, and at
`op.deadline_ms()` call `op.step(now, Tick())`; carry out what they return (`SendSeal`
-> Seal(segment, new_epoch); `SendRead` -> Read, unacked included; `SendRewrite` -> a
Write at `leader_epoch` with `report_held`; `SendAcked` -> an empty Write carrying the
acked index; `SealAtMaster` -> SealSegment at the master; `Done` / `Deposed` -> the
leader's business). A refused request becomes `RecoveryFenced`, a busy refusal
`StoreBusy`; a request that fails in transport needs no event (it is retransmitted). A
driver may keep one call per `request_key` in flight and drop a repeat meanwhile.

Why one long module: the events and actions above and the one state machine that maps
them are read together (each transition names the messages it takes and gives, as h11
keeps its state table in one file); split, a reader would go back and forth between
the vocabulary and the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from streamengine.client.core.recovery_plan import (
    InconsistentAnswers,
    RecoveryPlan,
    SealAnswer,
    StoreAnswer,
    plan_recovery,
    read_from_index,
)
from streamengine.client.core.replicator import Tick
from streamengine.protocol.certificate import Certificate, ContentDigest
from streamengine.protocol.entry import VALUE_HEADER_BYTES, StoredEntry
from streamengine.protocol.limits import (
    DATA_REPLY_BYTES_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
)
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.producers import ProducerPosition, ProducerTable, Run


@dataclass(frozen=True, slots=True)
class RecoveryTiming:
    """How long a recovery waits on silence before it acts, in ms of the driver's clock."""

    # An unanswered request goes out again after this long (and a lost store is probed
    # this often): long enough that a store busy with a few MB batch answers first.
    retransmit_ms: int = 500
    # A store that leaves a request unanswered this long, answering nothing meanwhile,
    # is lost for now: recovery decides from the other sealed stores (it needs only R of
    # them, and W to finish) instead of waiting on a dead or cut-off store.
    store_lost_ms: int = 2_000
    # A batch a store refused as busy (its write queue is full) goes out again after
    # this pause: the queue drains in milliseconds, and a pause keeps the retry off it.
    busy_pause_ms: int = 20
    # After the master holds the segment as sealed, stores still catching up are bridged
    # this long (so that every live replica reaches the bridge); later, repair does it.
    late_stores_ms: int = 5_000

    def __post_init__(self) -> None:
        # A store is probed at least once before it could be lost again, and a busy
        # pause never outlasts a retransmit.
        if not 0 < self.busy_pause_ms <= self.retransmit_ms < self.store_lost_ms:
            raise ValueError(f"need 0 < busy_pause_ms <= retransmit_ms < store_lost_ms: {self}")
        if self.late_stores_ms <= 0:
            raise ValueError(f"late_stores_ms must be positive: {self}")


# Over gRPC, between processes.
TIMING = RecoveryTiming()

# ---- events (what stores and the master answered) ----


@dataclass(frozen=True, slots=True)
class SealAnswered:
    store: str
    fence: int
    acked_index: int
    matched_index: int
    last_index: int


@dataclass(frozen=True, slots=True)
class ReadAnswered:
    """Everything `store` holds in `from_index..to_index` (`to_index` 0: to its end)."""

    store: str
    from_index: int
    to_index: int
    entries: tuple[StoredEntry, ...]
    fence: int  # the store's fence when it read: above our epoch, a later leader took over


@dataclass(frozen=True, slots=True)
class WriteAnswered:
    """A store's answer to a `SendRewrite` (`first_index..last_index`, `held_epochs` one per
    index) or to a `SendAcked` (`first_index` = `last_index` = 0, no held epochs)."""

    store: str
    first_index: int
    last_index: int
    held_epochs: tuple[int, ...]
    acked_index: int


# `RecoveryFenced.store` when the master refused the seal (another final index).
MASTER = "master"


@dataclass(frozen=True, slots=True)
class RecoveryFenced:
    """A store (or `MASTER`) refused a request: its fence is above the epoch sent."""

    store: str
    fence: int


@dataclass(frozen=True, slots=True)
class StoreBusy:
    """A store refused a write for now (its queue is full, or the tenant is over its
    append quota there): the `SendRewrite` starting at `first_index`, or the `SendAcked`
    with `first_index` 0. It answered, so it lives."""

    store: str
    first_index: int


@dataclass(frozen=True, slots=True)
class MasterSealed:
    final_index: int


Event = (
    SealAnswered | ReadAnswered | WriteAnswered | RecoveryFenced | StoreBusy | MasterSealed | Tick
)

# ---- actions ----


@dataclass(frozen=True, slots=True)
class SendSeal:
    store: str
    new_epoch: int


@dataclass(frozen=True, slots=True)
class SendRead:
    """Read `from_index..to_index` (0: to the end), unacked entries included."""

    store: str
    from_index: int
    to_index: int


@dataclass(frozen=True, slots=True)
class SendRewrite:
    """A recovery write at the leader's epoch; answer with held epochs."""

    store: str
    entries: tuple[StoredEntry, ...]
    acked_index: int
    report_held: bool = True


@dataclass(frozen=True, slots=True)
class SendAcked:
    """An empty write carrying only the acked index."""

    store: str
    acked_index: int


@dataclass(frozen=True, slots=True)
class SealAtMaster:
    final_index: int
    # The certificate of the content (`streamengine.protocol.certificate`), when known.
    certificate: Certificate | None = None
    # Accepting loss with fewer than R deciders: the first index whose acked event may
    # be lost (through the bridge); 0: nothing is lost.
    lost_from_index: int = 0
    # Each producer's last event through the segment (`ProducerSeal`); None: not kept.
    producers: tuple[ProducerPosition, ...] | None = None


@dataclass(frozen=True, slots=True)
class Done:
    final_index: int
    # The producer runs the segment holds, by producer id, in index order (only when
    # recovery folded its content: `ProducerSeal.through_segment` false).
    runs: tuple[tuple[str, Run], ...] = ()


@dataclass(frozen=True, slots=True)
class ProducerSeal:
    """Producer positions for the seal: through the segment's end (`through_segment`,
    the leader wrote all of it), or as of the segment before (recovery folds this one's
    marks into them)."""

    positions: tuple[ProducerPosition, ...]
    through_segment: bool


@dataclass(frozen=True, slots=True)
class Deposed:
    """A later leader fenced this one: stop leading."""

    fence: int


Action = SendSeal | SendRead | SendRewrite | SendAcked | SealAtMaster | Done | Deposed
Request = SendSeal | SendRead | SendRewrite | SendAcked | SealAtMaster

RequestKey = tuple[str, str, int, int]


def request_key(request: Request) -> RequestKey:
    """Which request this is, whatever it carries: its answer and every retransmit of it
    share the key."""
    if isinstance(request, SendSeal):
        return ("seal", request.store, 0, 0)
    if isinstance(request, SendRead):
        return ("read", request.store, request.from_index, request.to_index)
    if isinstance(request, SendRewrite):
        return ("write", request.store, request.entries[0].index, 0)
    if isinstance(request, SendAcked):
        return ("acked", request.store, 0, 0)
    return ("master", "", 0, 0)


def _answered_key(event: Event) -> RequestKey | None:
    """The key of the request `event` answers."""
    if isinstance(event, SealAnswered):
        return ("seal", event.store, 0, 0)
    if isinstance(event, ReadAnswered):
        return ("read", event.store, event.from_index, event.to_index)
    if isinstance(event, WriteAnswered):
        if event.first_index == 0:
            return ("acked", event.store, 0, 0)
        return ("write", event.store, event.first_index, 0)
    if isinstance(event, MasterSealed):
        return ("master", "", 0, 0)
    return None


@dataclass(slots=True)
class _Bridging:
    """One store's rewrite: its batches by first index, which it holds, its acked."""

    seal: SealAnswer
    batches: dict[int, SendRewrite] = field(default_factory=dict)  # in index order
    sent: int = 0  # batches sent so far, in order
    held: set[int] = field(default_factory=set)  # first indexes of batches it holds
    waiting_final_copies: bool = False
    complete: bool = False
    acked_sent: bool = False
    acked_confirmed: bool = False


# Recovery batches in flight per store: a store's write queue is bounded and refuses
# batches when full, so sending a lagging store its whole range at once would only have
# most of it refused and resent.
RECOVERY_BATCHES_IN_FLIGHT_MAX = 4
# A recovery's rewrites ride the client's shared connection to the store (reads and
# tails on it too): each as large as a read's reply at most, so it holds the others'
# frames no longer than a reply does (`limits.DATA_REPLY_BYTES_MAX`), and four in
# flight keep the store's writes going.
RECOVERY_BATCH_BYTES_MAX = DATA_REPLY_BYTES_MAX
assert RECOVERY_BATCH_BYTES_MAX <= WRITE_BATCH_BYTES_MAX, "a rewrite is a store's write"


def split_batches(
    store: str,
    entries: Sequence[StoredEntry],
    acked: int,
    entries_max: int = WRITE_BATCH_ENTRIES_MAX,
) -> list[SendRewrite]:
    """Consecutive entries cut within the store's per-request entries and
    `RECOVERY_BATCH_BYTES_MAX`."""
    out: list[SendRewrite] = []
    batch: list[StoredEntry] = []
    size = 0
    for e in entries:
        cost = VALUE_HEADER_BYTES + len(e.payload)
        if batch and (len(batch) == entries_max or size + cost > RECOVERY_BATCH_BYTES_MAX):
            out.append(SendRewrite(store, tuple(batch), acked))
            batch, size = [], 0
        batch.append(e)
        size += cost
    if batch:
        out.append(SendRewrite(store, tuple(batch), acked))
    return out


class SegmentRecovery:
    """Recovery of one segment by the leader of `leader_epoch`."""

    def __init__(
        self,
        policy: ReplicationPolicy,
        segment_epoch: int,
        leader_epoch: int,
        copy_set: Sequence[str],
        batch_entries_max: int = WRITE_BATCH_ENTRIES_MAX,
        timing: RecoveryTiming = TIMING,
        known: ContentDigest | None = None,
        accept_loss: bool = False,
        producers: ProducerSeal | None = None,
    ) -> None:
        """`batch_entries_max` below the store's limit lets tests and the simulator lose
        or reorder single indexes of a rewrite, as RECOVERY-CASES.md's traces do.
        `known`: the digest of the segment's indexes 1..k as its writer appended them
        (never changed here). `accept_loss`: decide from fewer than R stores once the
        others are lost (module docstring)."""
        if not 1 <= batch_entries_max <= WRITE_BATCH_ENTRIES_MAX:
            raise ValueError(
                f"batch_entries_max {batch_entries_max} not in 1..{WRITE_BATCH_ENTRIES_MAX}"
            )
        # A copy set shorter than N is one a master rebuilt from the stores, whose
        # missing members reported nothing in time (`master.core.rebuild`). They count
        # as members that never answer: R answers of the others still meet every W
        # that acked, and the seal still needs W of them. Counted as answered, or
        # replaced by a store that holds nothing, they could hide acked events.
        if not 1 <= len(copy_set) <= policy.replicas or len(set(copy_set)) != len(copy_set):
            raise ValueError(f"copy set {list(copy_set)} does not match {policy}")
        if leader_epoch <= segment_epoch:
            raise ValueError(f"leader epoch {leader_epoch} must be above {segment_epoch}")
        self.policy = policy
        self.segment_epoch = segment_epoch
        self.leader_epoch = leader_epoch
        self.copy_set = tuple(copy_set)
        self.batch_entries_max = batch_entries_max
        self.timing = timing
        self.known = known
        self.accept_loss = accept_loss
        self.producers = producers
        # The segment's producer runs and the positions through it, once folded.
        self._runs: tuple[tuple[str, Run], ...] = ()
        self._positions: tuple[ProducerPosition, ...] | None = None
        self._sealed: dict[str, SealAnswer] = {}  # in answer order
        self._lost: set[str] = set()
        self._deciders: list[str] = []
        self._full_reads: dict[str, tuple[int, tuple[StoredEntry, ...]]] = {}
        self._reads_sent: dict[str, int] = {}  # store -> lowest from_index asked
        self._final_read: SendRead | None = None
        self._plan: RecoveryPlan | None = None
        self._bridging: dict[str, _Bridging] = {}
        self._seal_at_master_sent = False
        self._sealed_with: Certificate | None = None
        self._seal_request: SealAtMaster | None = None
        self._done = False
        self._deposed_by = 0
        # Time: when each unanswered request goes out again, since when each store has
        # left a request unanswered (answering nothing since), the latest time seen.
        self._now_ms: int | None = None
        self._resend_at: dict[RequestKey, int] = {}
        self._waiting_since: dict[str, int] = {}
        self._done_ms = 0
        self._finished = False
        self._deadline_ms: int | None = None

    # ---- what the leader and the driver look at ----

    @property
    def plan(self) -> RecoveryPlan | None:
        return self._plan

    @property
    def final_index(self) -> int:
        return self._plan.final_index if self._plan else 0

    @property
    def done(self) -> bool:
        return self._done

    @property
    def deposed(self) -> bool:
        return self._deposed_by > 0

    @property
    def finished(self) -> bool:
        """Nothing more to do: deposed, or done and the late stores' window is over."""
        return self.deposed or self._finished

    def lost(self) -> tuple[str, ...]:
        """Stores given up on for now, in copy-set order."""
        return tuple(s for s in self.copy_set if s in self._lost)

    def deadline_ms(self) -> int | None:
        """When `step(now_ms, Tick())` next has something to do (a retransmit, a store
        to count as lost, a lost store to probe, the late stores' window to close); None
        when finished."""
        return self._deadline_ms

    def holding(self) -> tuple[str, ...]:
        """Stores known to hold their whole range and the bridge."""
        return tuple(s for s, b in self._bridging.items() if b.complete)

    def start(self, now_ms: int) -> list[Action]:
        assert self._now_ms is None, "started twice"
        self._now_ms = now_ms
        out = self._outbox(now_ms, [SendSeal(s, self.leader_epoch) for s in self.copy_set])
        self._deadline_ms = self._next_deadline()
        return out

    def outstanding(self) -> list[Request]:
        """Every request still waiting for its answer, and the probe of every lost store."""
        if self.finished:
            return []
        # A lost store is asked to seal again (probed): only its answer brings it back,
        # and without one a recovery that needs it would wait forever. Seals are
        # idempotent, and a repeated answer changes nothing but the store's liveness.
        out: list[Request] = [
            SendSeal(s, self.leader_epoch)
            for s in self.copy_set
            if s not in self._sealed or s in self._lost
        ]
        if self._plan is None:
            out += self._reads_needed()
        elif self._final_read is not None:
            out.append(self._final_read)
        for store, b in self._bridging.items():
            if store in self._lost:
                continue
            out += [
                w for w in list(b.batches.values())[: b.sent] if w.entries[0].index not in b.held
            ]
            if b.acked_sent and not b.acked_confirmed and self._enough_complete():
                out.append(SendAcked(store, self.raised_to()))
        if self._seal_request is not None and not self._done:
            out.append(self._seal_request)  # as first sent: its declared loss included
        return out

    # ---- events ----

    def step(self, now_ms: int, event: Event) -> list[Action]:
        assert self._now_ms is not None, "step before start"
        assert now_ms >= self._now_ms, f"time went back from {self._now_ms} to {now_ms}"
        self._now_ms = now_ms
        if self.finished:
            return []
        store = _store_of(event)
        if store and store not in self.copy_set:
            raise ValueError(f"store {store} is not in copy set {self.copy_set}")
        key = _answered_key(event)
        if key is not None and not (
            isinstance(event, MasterSealed) and event.final_index != self.final_index
        ):
            self._resend_at.pop(key, None)
        if store:
            # It answered: it is waited on again only from now, for what it still owes.
            self._waiting_since.pop(store, None)
        out = self._outbox(now_ms, self._on_event(now_ms, event))
        if not self.finished:
            out += self._outbox(now_ms, self._on_time(now_ms))
        self._deadline_ms = self._next_deadline()
        # Whatever was due at `now_ms` has been done.
        assert self._deadline_ms is None or self._deadline_ms > now_ms, self._deadline_ms
        return out

    def _on_event(self, now_ms: int, event: Event) -> list[Action]:
        if isinstance(event, Tick):
            return []
        if isinstance(event, RecoveryFenced):
            return self._fenced(event.fence)
        if isinstance(event, MasterSealed):
            return self._master_sealed(now_ms, event)
        revived = event.store in self._lost
        self._lost.discard(event.store)
        if isinstance(event, StoreBusy):
            out = self._busy(now_ms, event)
        elif isinstance(event, SealAnswered):
            out = self._seal_answered(event)
        elif isinstance(event, ReadAnswered):
            out = self._read_answered(event)
        else:
            out = self._write_answered(event)
        if revived and self._plan is None and not self.deposed:
            out += self._refill_deciders()
        return out

    # ---- time ----

    def _on_time(self, now_ms: int) -> list[Action]:
        """What time decides at `now_ms`: the late stores' window closing, stores
        becoming lost, requests going out again."""
        if self._done and now_ms >= self._done_ms + self.timing.late_stores_ms:
            self._finished = True  # repair brings the replicas that missed the bridge up
            return []
        out: list[Action] = []
        for store in self.copy_set:
            since = self._waiting_since.get(store)
            if (
                store not in self._lost
                and since is not None
                and now_ms - since >= self.timing.store_lost_ms
            ):
                out += self._store_lost(store)
        if self.deposed:
            return out
        out = self._outbox(now_ms, out)  # timed, so not counted as due again below
        pending = self.outstanding()
        if self._done and not pending:
            self._finished = True  # every store holds the run and its acked index
            return out
        keys = [request_key(r) for r in pending]
        # Forget requests no longer outstanding: a lost store's batches go out again at
        # once when it answers.
        self._resend_at = {k: self._resend_at[k] for k in keys if k in self._resend_at}
        out += [
            r
            for r, k in zip(pending, keys, strict=True)
            if now_ms >= self._resend_at.get(k, now_ms)
        ]
        self._note_waiting(now_ms, pending)
        return out

    def _note_waiting(self, now_ms: int, pending: list[Request]) -> None:
        """A store is waited on while it owes an answer: since its last answer or, if it
        has not answered since, since the request it owes went out."""
        waited_on = {_request_store(r) for r in pending}
        for store in self.copy_set:
            if store in waited_on:
                self._waiting_since.setdefault(store, now_ms)
            else:
                self._waiting_since.pop(store, None)

    def _outbox(self, now_ms: int, actions: list[Action]) -> list[Action]:
        """Every action leaves through here: requests are checked against the invariants
        and timed for their retransmit."""
        for action in actions:
            if isinstance(action, Done | Deposed):
                continue
            self._check_request(action)
            self._resend_at[request_key(action)] = now_ms + self.timing.retransmit_ms
            store = _request_store(action)
            if store:
                self._waiting_since.setdefault(store, now_ms)
        return actions

    def _next_deadline(self) -> int | None:
        if self.finished:
            return None
        deadlines = [
            self._resend_at[request_key(r)]
            for r in self.outstanding()
            if request_key(r) in self._resend_at
        ]
        deadlines += [
            since + self.timing.store_lost_ms
            for store, since in self._waiting_since.items()
            if store not in self._lost
        ]
        if self._done:
            deadlines.append(self._done_ms + self.timing.late_stores_ms)
        return min(deadlines) if deadlines else None

    def _busy(self, now_ms: int, e: StoreBusy) -> list[Action]:
        if e.first_index:
            key: RequestKey = ("write", e.store, e.first_index, 0)
        else:
            key = ("acked", e.store, 0, 0)
        if key in self._resend_at:
            self._resend_at[key] = now_ms + self.timing.busy_pause_ms
        return []

    def _check_request(self, request: Request) -> None:
        """The invariants every request keeps, checked where it leaves."""
        if isinstance(request, SendRewrite):
            plan = self._plan
            assert plan is not None, "a write before the decision"
            # Nothing is written past the chosen bridge.
            assert request.entries[-1].index <= plan.final_index, request
            # A rewrite carries the store's own acked index: it raises nothing.
            assert request.acked_index == self._sealed[request.store].acked_index, request
        elif isinstance(request, SendAcked):
            # The acked index is raised only on a store that holds its whole range, and
            # only once W stores do.
            complete = [s for s, b in self._bridging.items() if b.complete]
            assert request.store in complete, request
            assert len(complete) >= self._holders_needed(), request
            assert request.acked_index == self.raised_to(), request
            # A declared loss is recorded at the master before any acked index rises,
            # and no acked index ever rises into it.
            lost_from = self.lost_from_index()
            assert not lost_from or (self._done and request.acked_index < lost_from), request
        elif isinstance(request, SealAtMaster):
            self._check_seal(request)

    def _check_seal(self, request: SealAtMaster) -> None:
        plan = self._plan
        assert plan is not None and request.final_index == plan.final_index, request
        if request.lost_from_index:
            # Loss is declared only by an operator's recovery that decided from fewer
            # than R stores, from the first index past the acked index it knows, and
            # before any store's acked index was raised.
            assert self.accept_loss and self._decided_from_fewer_than_r(), request
            assert request.lost_from_index == plan.acked_index + 1, request
            assert not any(b.acked_sent for b in self._bridging.values()), request
            return
        # Nothing lost: R stores decided, or a bridge the acked index reached.
        assert not self._decided_from_fewer_than_r() or (
            plan.existing_bridge and plan.final_index == plan.acked_index
        ), request
        confirmed = [s for s, b in self._bridging.items() if b.acked_confirmed]
        assert len(confirmed) >= self._holders_needed(), request

    def _fenced(self, fence: int) -> list[Action]:
        if fence <= self.leader_epoch:
            return []
        self._deposed_by = fence
        return [Deposed(fence)]

    def _seal_answered(self, e: SealAnswered) -> list[Action]:
        if e.fence > self.leader_epoch:
            return self._fenced(e.fence)
        if e.store in self._sealed:
            return []  # a duplicate: the first answer preceded every write to it
        seal = SealAnswer(e.store, e.fence, e.acked_index, e.matched_index, e.last_index)
        self._sealed[e.store] = seal
        if self._plan is not None:
            return self._start_bridging(seal)
        return self._refill_deciders()

    def _deciders_needed(self) -> int:
        """R; accepting loss, as many as answered the seal once every other store of
        the copy set is lost (at least one)."""
        if not self.accept_loss:
            return self.policy.read_quorum
        undecided = [s for s in self.copy_set if s not in self._sealed and s not in self._lost]
        if undecided:
            return self.policy.read_quorum
        answered = sum(1 for s in self._sealed if s not in self._lost)
        return max(1, min(self.policy.read_quorum, answered))

    def _holders_needed(self) -> int:
        """W; accepting loss, every store that answered the seal, if fewer."""
        if not self.accept_loss:
            return self.policy.write_quorum
        answered = sum(1 for s in self._sealed if s not in self._lost)
        return max(1, min(self.policy.write_quorum, answered))

    def _refill_deciders(self) -> list[Action]:
        """Up to R sealed stores to decide from, in the order they answered, skipping
        lost ones; then the reads they still need, or the decision."""
        needed = self._deciders_needed()
        for s in self._sealed:
            if len(self._deciders) >= needed:
                break
            if s not in self._deciders and s not in self._lost:
                self._deciders.append(s)
        assert len(self._deciders) <= self.policy.read_quorum, self._deciders
        return self._send_reads() + self._maybe_decide()

    def _read_from(self) -> int:
        return read_from_index([self._sealed[s] for s in self._deciders])

    def _reads_needed(self) -> list[SendRead]:
        if len(self._deciders) < self._deciders_needed():
            return []
        lo = self._read_from()
        return [
            SendRead(s, lo, 0)
            for s in self._deciders
            if s not in self._full_reads or self._full_reads[s][0] > lo
        ]

    def _send_reads(self) -> list[Action]:
        """The reads not asked yet (a decider replaced, or reads wanted from lower)."""
        out: list[Action] = []
        for read in self._reads_needed():
            if self._reads_sent.get(read.store, read.from_index + 1) > read.from_index:
                self._reads_sent[read.store] = read.from_index
                out.append(read)
        return out

    def _read_answered(self, e: ReadAnswered) -> list[Action]:
        # Copies of a later epoch mean a later leader sealed and wrote the segment.
        later = max([e.fence, *(x.epoch for x in e.entries)])
        if later > self.leader_epoch:
            return self._fenced(later)
        if e.to_index:
            return self._final_copies_answered(e)
        if e.fence < self.leader_epoch and e.store in self._sealed and self._plan is None:
            return self._seal_lost(e.store)
        known = self._full_reads.get(e.store)
        if known is None or known[0] > e.from_index:
            self._full_reads[e.store] = (e.from_index, e.entries)
        return self._maybe_decide()

    def _seal_lost(self, store: str) -> list[Action]:
        """`store` answered a read below the fence it told us it took: it lost that seal
        and what it read with it (a restart without fsync: simulator seed 11951), so
        its seal answer no longer says what it holds. It is sealed again, and decides
        only on its new answer; the plan waits for R stores as ever."""
        del self._sealed[store]
        self._full_reads.pop(store, None)
        self._reads_sent.pop(store, None)
        if store in self._deciders:
            self._deciders.remove(store)
        return [SendSeal(store, self.leader_epoch), *self._refill_deciders()]

    def _maybe_decide(self) -> list[Action]:
        if self._plan is not None or len(self._deciders) < self._deciders_needed():
            return []
        if self._reads_needed():
            return []
        answers = [StoreAnswer(self._sealed[s], self._full_reads[s][1]) for s in self._deciders]
        # A stream with producers ends its run at the first gap (`plan_recovery`).
        gap_ends = self.producers is not None
        self._plan = plan_recovery(
            self.policy, self.leader_epoch, answers, self.accept_loss, end_at_first_gap=gap_ends
        )
        out: list[Action] = []
        for seal in self._sealed.values():
            out += self._start_bridging(seal)
        if self._needs_content() and self._plan.copies_from > 1:
            out += self._request_final_copies((1, self._plan.copies_from - 1))
        return out

    def _needs_content(self) -> bool:
        return self.producers is not None and not self.producers.through_segment

    def _content_pending(self) -> bool:
        """The producer positions need final copies below the decided run, still read."""
        assert self._plan is not None
        return self._needs_content() and self._plan.copies_from != 1

    def _producer_positions(self) -> tuple[ProducerPosition, ...] | None:
        """The positions to seal with (None: none kept), once the content is known."""
        seal = self.producers
        if seal is None:
            return None
        if seal.through_segment:
            return seal.positions
        plan = self._plan
        assert plan is not None and plan.copies_from == 1
        if self._positions is None:
            table = ProducerTable(seal.positions)
            self._runs = table.fold_segment(self.segment_epoch, plan.copies)
            self._positions = table.positions()
        return self._positions

    def _start_bridging(self, seal: SealAnswer) -> list[Action]:
        plan = self._plan
        assert plan is not None
        b = self._bridging.setdefault(seal.store, _Bridging(seal))
        if b.batches or b.complete:
            return []
        rewrite = plan.range_for(seal.store, seal.acked_index)
        if rewrite.empty:
            # Its acked index covers the bridge: it holds the run as final already.
            b.complete = b.acked_confirmed = True
            return self._after_complete()
        needed = plan.needs_final_copies(seal.acked_index)
        if needed is not None:
            b.waiting_final_copies = True
            return self._request_final_copies(needed)
        b.waiting_final_copies = False
        batches = split_batches(
            seal.store, plan.entries_for(rewrite), seal.acked_index, self.batch_entries_max
        )
        for w in batches:
            b.batches[w.entries[0].index] = w
        return self._send_more(b)

    def _send_more(self, b: _Bridging) -> list[Action]:
        """The next batches of a store's rewrite, keeping a window of them in flight."""
        ordered = list(b.batches.values())
        in_flight = b.sent - len(b.held)
        more = ordered[b.sent : b.sent + RECOVERY_BATCHES_IN_FLIGHT_MAX - in_flight]
        b.sent += len(more)
        return list(more)

    def _request_final_copies(self, needed: tuple[int, int]) -> list[Action]:
        assert self._plan is not None
        if self._final_read is not None and self._final_read.from_index <= needed[0]:
            return []
        current = self._final_read.store if self._final_read else self._plan.acked_store
        source = self._final_copies_source(current, needed[1])
        self._final_read = SendRead(source, needed[0], needed[1])
        return [self._final_read]

    def _final_copies_source(self, current: str, through_index: int) -> str:
        """Where the final copies through `through_index` are read: `current` while it
        answers; once it is lost, the first sealed store that is not, and whose own
        acked index covers them (final copies are the same on every store that acked
        them). A wiped store answers a read of a replica it lost never again (runtime
        seed 303): asking it alone left the seal at the master waiting for good. With
        no other store to ask, `current` is asked again (it may come back)."""
        if current not in self._lost:
            return current
        for store, seal in self._sealed.items():
            if store not in self._lost and seal.acked_index >= through_index:
                return store
        return current

    def _reread_final_copies(self) -> list[Action]:
        """The final copies' read again, from another store if its own was lost."""
        read = self._final_read
        if read is None:
            return []
        source = self._final_copies_source(read.store, read.to_index)
        if source == read.store:
            return []
        self._final_read = SendRead(source, read.from_index, read.to_index)
        return [self._final_read]

    def _final_copies_answered(self, e: ReadAnswered) -> list[Action]:
        if self._plan is None:
            return []
        seal = self._sealed.get(e.store)
        covers = seal is not None and seal.acked_index >= e.to_index
        asked = self._final_read is not None and self._final_read.store == e.store
        if not (covers or asked or e.store == self._plan.acked_store):
            return []  # not final copies: its acked index does not cover them
        try:
            self._plan = self._plan.with_final_copies(e.entries, e.store)
        except InconsistentAnswers:
            # It lost copies it had acked (a restart without fsync; simulator seed
            # 12672): a peer's answer, not a reason to end the writer. Asking again
            # would get the same answer; the stores that wait for those copies are left
            # unbridged, and the recovery ends without them if enough others hold the
            # bridge.
            self._final_read = None
            return []
        if self._final_read is not None and self._final_read.from_index >= e.from_index:
            self._final_read = None
        out: list[Action] = []
        for b in list(self._bridging.values()):
            if b.waiting_final_copies:
                out += self._start_bridging(b.seal)
        if self._needs_content():
            out += self._maybe_seal_at_master()
        return out

    def _write_answered(self, e: WriteAnswered) -> list[Action]:
        b = self._bridging.get(e.store)
        if b is None or self._plan is None:
            return []
        if e.first_index == 0:
            return self._acked_answered(b, e)
        batch = b.batches.get(e.first_index)
        if batch is None or e.first_index in b.held or batch.entries[-1].index != e.last_index:
            return []
        sent = [x.epoch for x in batch.entries]
        if len(e.held_epochs) != len(sent) or any(
            h < s for h, s in zip(e.held_epochs, sent, strict=True)
        ):
            return [batch]  # the store does not say it holds the write: send it again
        b.held.add(e.first_index)
        if len(b.held) < len(b.batches) or b.complete:
            return self._send_more(b)
        b.complete = True
        return self._after_complete()

    def _after_complete(self) -> list[Action]:
        complete = [s for s, b in self._bridging.items() if b.complete]
        if not self._enough_complete():
            return []
        if self.declares_loss() and not self._done:
            return self._maybe_seal_at_master()  # the master records the loss first
        out: list[Action] = []
        for s in complete:
            b = self._bridging[s]
            if not b.acked_sent and not b.acked_confirmed:
                b.acked_sent = True
                out.append(SendAcked(s, self.raised_to()))
        return out + self._maybe_seal_at_master()

    def _enough_complete(self) -> bool:
        """W stores hold the whole run: acked indexes may be raised. Checked again after
        raising began: a store rewritten again (it lost writes) leaves fewer complete
        for a while, and raises wait for it (simulator seed 15693)."""
        complete = sum(1 for b in self._bridging.values() if b.complete)
        return complete >= self._holders_needed()

    def _acked_answered(self, b: _Bridging, e: WriteAnswered) -> list[Action]:
        if not b.acked_sent or b.acked_confirmed:
            return []
        if e.acked_index < self.raised_to():
            # It said it holds every batch, yet acks less: it lost writes it had
            # answered (a restart without fsync). Asking again gets the same answer for
            # ever (simulator seeds 12301, 13120): rewrite it from what it acks now.
            del self._bridging[e.store]
            acked = e.acked_index  # may be past its last index when sealed (rewritten since)
            seal = replace(
                b.seal,
                acked_index=acked,
                matched_index=acked,
                last_index=max(b.seal.last_index, acked),
            )
            self._sealed[e.store] = seal
            return self._start_bridging(seal)
        b.acked_confirmed = True
        return self._maybe_seal_at_master()

    def _maybe_seal_at_master(self) -> list[Action]:
        if self.declares_loss():
            # Every holder needed holds its range and the bridge; none was raised yet.
            ready = sum(1 for b in self._bridging.values() if b.complete)
        else:
            ready = sum(1 for b in self._bridging.values() if b.acked_confirmed)
        if self._seal_at_master_sent or ready < self._holders_needed():
            return []
        if self._content_pending():
            return []  # the final copies below the decided run are still being read
        positions = self._producer_positions()
        self._seal_at_master_sent = True
        self._sealed_with = self.certificate()
        self._seal_request = SealAtMaster(
            self.final_index, self._sealed_with, self.lost_from_index(), positions
        )
        return [self._seal_request]

    def raised_to(self) -> int:
        """The acked index the holders are raised to: the bridge, or, declaring a loss,
        the acked index the plan knew (`lost_from_index` - 1). A store serves what its
        acked index covers, and a reader tailing the segment before it learns of the
        seal would be handed the lost range, then hop its bridge and pass the acked
        events the lost replicas held past it, told nothing."""
        lost_from = self.lost_from_index()
        return lost_from - 1 if lost_from else self.final_index

    def _decided_from_fewer_than_r(self) -> bool:
        return self._plan is not None and len(self._deciders) < self.policy.read_quorum

    def declares_loss(self) -> bool:
        """Whether this recovery seals declaring a range lost (`lost_from_index`)."""
        return self.lost_from_index() > 0

    def lost_from_index(self) -> int:
        """Accepting loss with fewer than R deciders: the first index past what they
        knew acked; what came after, up to the segment's end whatever it was, may have
        been acked and lost. 0: nothing is lost (R deciders, or the acked index reached
        the bridge the plan found: a recovery sealed the segment, nothing was acked
        past it)."""
        plan = self._plan
        if plan is None or not self._decided_from_fewer_than_r():
            return 0
        if plan.existing_bridge and plan.final_index == plan.acked_index:
            return 0
        # A bridge above `a` proves nothing: an interrupted recovery left it there.
        return plan.acked_index + 1

    def certificate(self) -> Certificate | None:
        """The certificate of the decided content, when this leader knows all of it:
        what it appended itself (`known`) then the plan's bridge right after, or a plan
        holding every index from 1 (no store had acked anything). None declaring a loss:
        no replica's acked index reaches the bridge, so no chunk past the acked index
        could ever be read whole and checked."""
        plan = self._plan
        if plan is None or self.declares_loss():
            return None
        if self.known is not None:
            through = self.known.through_index
            # A drained segment: recovery found exactly what was appended, and bridged it.
            if plan.existing_bridge or plan.holes or plan.final_index != through + 1:
                return None
            digest = self.known.copy()
            bridge = plan.copy_at(plan.final_index)
            digest.add(bridge.index, bridge.kind, bridge.payload)
            return digest.finish()
        if plan.copies_from != 1:
            return None
        digest = ContentDigest()
        for copy in plan.copies:
            digest.add(copy.index, copy.kind, copy.payload)
        return digest.finish()

    def _master_sealed(self, now_ms: int, e: MasterSealed) -> list[Action]:
        if not self._seal_at_master_sent or self._done or e.final_index != self.final_index:
            return []
        self._done = True
        self._done_ms = now_ms
        if self.declares_loss():
            # The master holds the loss: the holders' acked index may now be raised.
            return [Done(self.final_index, self._runs), *self._after_complete()]
        return [Done(self.final_index, self._runs)]

    def _store_lost(self, store: str) -> list[Action]:
        self._lost.add(store)
        if self.accept_loss and self._plan is None and store not in self._deciders:
            return self._refill_deciders()  # fewer may now be enough
        if self.accept_loss and self._plan is not None:
            return self._after_complete() + self._reread_final_copies()
        if self._plan is not None:
            return self._reread_final_copies()
        if store not in self._deciders or store in self._full_reads:
            return []
        # Decide from another sealed store instead of waiting on this one.
        self._deciders.remove(store)
        return self._refill_deciders()


def _store_of(event: Event) -> str:
    """The copy-set store that answered, or "" (the master, the clock)."""
    if isinstance(event, SealAnswered | ReadAnswered | WriteAnswered | StoreBusy):
        return event.store
    if isinstance(event, RecoveryFenced) and event.store != MASTER:
        return event.store
    return ""


def _request_store(request: Request) -> str:
    return "" if isinstance(request, SealAtMaster) else request.store
