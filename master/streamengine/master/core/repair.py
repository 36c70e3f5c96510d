"""Repair: which sealed segments lack good replicas, and which copies to run next.

Pure functions of a snapshot and `now_ms`.

A replica of a sealed segment is *good* when its store is alive, not draining, it
reported an acked index at or past the bridge (`final_index`), and its store read it
back and found it equal to the segment's certificate (`SegmentRecord.verified`,
`integrity.py`). One that reached the bridge but was not read back yet is *unverified*:
a copy source (after the verified ones), never counted as good, so a segment sealed a
moment ago is under-replicated until its stores' scrubs (which read never-checked
replicas first) report it. A member is *bad* when:
- its store is dead (silent for the store timeout): reason "store-dead";
- its store is draining: reason "drain" (it still serves as a copy source);
- its replica differs from the certificate (`SegmentRecord.bad`, `integrity.py`): reason
  "bad-copy"; never a copy source;
- its store is alive but its latest report, sent at least `bridge_grace_ms` after the
  segment settled (sealed, or its copy set last changed), shows the acked index below
  the bridge or no copy at all: reason "missed-bridge". The grace lets a leader finish
  raising acked indexes on the slower members and lets heartbeats catch up.
A member neither good, unverified nor bad is *pending*: not judged yet, neither
repaired nor counted as good.

Each bad member becomes one task: copy the segment from a good (or draining) replica to
a target chosen by placement, then swap target for the bad member. A member whose
replica missed the bridge (its store found it damaged, or it never got there) or differs
from the certificate is refilled *in place* when no store outside the copy set can take
it (a cluster of exactly N stores): its own store drops every copy it holds of the
segment, then copies it again (`CopyToTarget.replace_held`), so neither a damaged block
nor a copy of a higher epoch outlives the refill. Only while the other members hold at
least W good replicas (`in_place_allowed`): the refill erases what the member held, and
the segment must stay readable and copyable meanwhile; below that the task waits,
unless the member holds nothing a refill could erase (`holds_nothing`: no copy at all,
as a wiped store or one that lost unsynced writes has, or one that acked nothing and
stops short of the bridge, as a copy that never finished leaves): so a segment left
with fewer than W good replicas on exactly N stores (a wiped store, a store that lost
what it never synced, and a replica that rotted) climbs back to W through its empty
members, and then to N. A dead or draining member is never refilled in place. The
source is a replica verified against the certificate when there is one, else any good
one, never one whose copy failed lately when another can serve (a failed copy rotates
the source); the copy is verified against the certificate, never against the source:
its target reads the whole copy back and computes its certificate before confirming
it (`segment_store.core.copy`), so a replica a repair swapped in is verified from
then on (`integrity.copy_verified`), with no scrub to wait for. `RepairOp` carries
one task out step by step (the shells, real and simulated, only do the calls it asks
for); `RepairQueue` says which tasks run next. Open and sealing
segments are never copied; the leader of a stream whose open segment has a bad member
is asked to roll instead (`roll_reason`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from streamengine.master.core.model import Held, SegmentKey, SegmentRecord, SegmentState, StoreView
from streamengine.master.core.placement import choose_target
from streamengine.protocol.certificate import Certificate

STORE_DEAD = "store-dead"
DRAIN = "drain"
MISSED_BRIDGE = "missed-bridge"
BAD_COPY = "bad-copy"
REBALANCE = "rebalance"
# Reasons whose member may be refilled in place when no other store can take it: its
# store is up and stays in the copy set.
IN_PLACE_REASONS = (MISSED_BRIDGE, BAD_COPY)


@dataclass(frozen=True, slots=True)
class Verdict:
    good: tuple[str, ...]
    # (store id, reason), in copy-set order.
    bad: tuple[tuple[str, str], ...]
    # Members able to serve a copy: good ones first, then unverified ones, then draining
    # ones holding the bridge.
    sources: tuple[str, ...]
    unverified: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Task:
    segment: SegmentKey
    source: str
    target: str
    # The member the target replaces; equal to `target` when the member is refilled in
    # place (no other store can take it).
    replaced: str
    reason: str
    bytes: int

    @property
    def in_place(self) -> bool:
        return self.target == self.replaced


def _reached_bridge(held: Held | None, segment: SegmentRecord) -> bool:
    return held is not None and held.acked_index >= segment.final_index > 0


def judge(
    segment: SegmentRecord,
    stores: Mapping[str, StoreView],
    held: Mapping[str, Held],
    now_ms: int,
    bridge_grace_ms: int,
) -> Verdict:
    """Classify every member of a sealed segment. `held` maps store id to what that
    store last reported for this segment."""
    assert segment.state == SegmentState.SEALED, "only sealed segments are judged"
    good: list[str] = []
    unverified: list[str] = []
    bad: list[tuple[str, str]] = []
    draining_sources: list[str] = []
    judged_after = segment.settled_at_ms + bridge_grace_ms
    for member in segment.copy_set:
        store = stores.get(member)
        copy = held.get(member)
        if store is None or not store.alive:
            bad.append((member, STORE_DEAD))
        elif member in segment.bad:
            bad.append((member, BAD_COPY))
        elif store.draining:
            bad.append((member, DRAIN))
            if _reached_bridge(copy, segment):
                draining_sources.append(member)
        elif _reached_bridge(copy, segment):
            (good if member in segment.verified else unverified).append(member)
        elif store.reported_at_ms >= judged_after and now_ms >= judged_after:
            bad.append((member, MISSED_BRIDGE))
    return Verdict(
        tuple(good), tuple(bad), (*good, *unverified, *draining_sources), tuple(unverified)
    )


def being_verified(segment: SegmentRecord, verdict: Verdict, replicas: int) -> bool:
    """Whether a sealed segment short of N good replicas lacks none: its copy set is
    whole and no member is bad (every store live and not draining, no copy differs or
    missed the bridge), only some not judged or not read back yet. A segment sealed a
    moment ago is such, until its stores report and scrub it: status shows it as being
    verified, apart from the under-replicated ones, and repair copies nothing for it."""
    return len(segment.copy_set) >= replicas and not verdict.bad and len(verdict.good) < replicas


def plan_tasks(
    segments: Sequence[SegmentRecord],
    stores: Mapping[str, StoreView],
    held: Mapping[SegmentKey, Mapping[str, Held]],
    now_ms: int,
    bridge_grace_ms: int,
    busy: Iterable[SegmentKey],
    slots: int,
    avoid: Mapping[SegmentKey, Iterable[str]] | None = None,
    failed_sources: Mapping[SegmentKey, Iterable[str]] | None = None,
    write_quorums: Mapping[int, int] | None = None,
) -> list[Task]:
    """At most `slots` new tasks, one per segment, none for a segment in `busy`
    (a task running or backing off). Segments are taken oldest first. `avoid` names,
    per segment, stores that must not receive it (told to delete it, not yet done);
    `failed_sources`, sources of copies that failed lately (`choose_source`);
    `write_quorums`, each stream's W by stream id (a stream not named is never refilled
    in place)."""
    taken = set(busy)
    targets_used: dict[str, int] = {}
    sources_used: dict[str, int] = {}
    tasks: list[Task] = []
    for segment in sorted(segments, key=lambda s: s.key):
        if len(tasks) >= slots:
            break
        if segment.state != SegmentState.SEALED or segment.key in taken:
            continue
        copies = held.get(segment.key, {})
        verdict = judge(segment, stores, copies, now_ms, bridge_grace_ms)
        if not verdict.bad or not verdict.sources:
            continue
        chosen = _replacement(
            segment,
            verdict,
            copies,
            _with_pending(stores, targets_used),
            (avoid or {}).get(segment.key, ()),
            (write_quorums or {}).get(segment.stream_id, 0),
        )
        if chosen is None:
            continue
        replaced, reason, target = chosen
        source = choose_source(
            verdict.sources,
            set(segment.verified),
            set((failed_sources or {}).get(segment.key, ())),
            sources_used,
        )
        assert source != target, "a member is never refilled from itself"
        size = max((c.bytes for c in copies.values()), default=0)
        tasks.append(Task(segment.key, source, target, replaced, reason, size))
        targets_used[target] = targets_used.get(target, 0) + 1
        sources_used[source] = sources_used.get(source, 0) + 1
    return tasks


def _replacement(
    segment: SegmentRecord,
    verdict: Verdict,
    copies: Mapping[str, Held],
    stores: Sequence[StoreView],
    avoid: Iterable[str],
    write_quorum: int,
) -> tuple[str, str, str] | None:
    """The bad member to replace now, its reason and its target: a store outside the
    copy set as placement chooses, else the member itself where it may be refilled in
    place; the first in copy-set order that can be (below W good replicas, those that
    hold nothing: `in_place_allowed`). None: every bad member waits."""
    for replaced, reason in verdict.bad:
        keep = [m for m in segment.copy_set if m != replaced]
        target = choose_target(stores, keep, avoid=[replaced, *avoid])
        if target is None and in_place_allowed(
            reason,
            verdict,
            write_quorum,
            holds_nothing(copies.get(replaced), segment.final_index),
        ):
            target = replaced
        if target is not None:
            return replaced, reason, target
    return None


def holds_nothing(held: Held | None, final_index: int) -> bool:
    """Whether a member's replica holds nothing a refill in place could erase: no copy
    at all (nothing reported, or only a fence), or one that acked nothing and stops
    short of the bridge (a copy that never finished; a replica its store found damaged
    is reported with acked index 0 too, but reaches the bridge)."""
    return held is None or held.last_index == 0 or (
        held.acked_index == 0 and held.last_index < final_index
    )


def in_place_allowed(
    reason: str, verdict: Verdict, write_quorum: int, member_holds_nothing: bool = False
) -> bool:
    """Whether a member bad for `reason` may be refilled in place: its store is up, and
    either the other members hold W good replicas, so erasing what it held leaves the
    segment readable and copyable, or it holds nothing to erase (`write_quorum` 0:
    unknown, never)."""
    if reason not in IN_PLACE_REASONS or write_quorum <= 0:
        return False
    return member_holds_nothing or len(verdict.good) >= write_quorum


def choose_source(
    sources: Sequence[str],
    verified: set[str],
    failed: set[str],
    load: Mapping[str, int],
) -> str:
    """The replica to copy from: among those whose copy did not fail lately (all of
    them when every one did: start the rotation over), the verified ones if any, the
    least busy in this round, then the earliest in `sources` (good before draining)."""
    assert sources, "a copy needs a source"
    fresh = [s for s in sources if s not in failed] or list(sources)
    preferred = [s for s in fresh if s in verified] or fresh
    return min(preferred, key=lambda s: (load.get(s, 0), sources.index(s)))


def _with_pending(stores: Mapping[str, StoreView], pending: Mapping[str, int]) -> list[StoreView]:
    """Count targets chosen in this round as replicas, so one round spreads them."""
    return [replace(s, segments=s.segments + pending.get(sid, 0)) for sid, s in stores.items()]


def roll_reason(copy_set: Iterable[str], stores: Mapping[str, StoreView]) -> str:
    """Why the leader of an open segment with this copy set should roll, or ""."""
    for member in copy_set:
        store = stores.get(member)
        if store is None or not store.alive:
            return f"{STORE_DEAD}: {member}"
        if store.draining:
            return f"{DRAIN}: {member}"
    return ""


def trusted_at_start(segment: SegmentRecord) -> bool:
    """Whether a sealed segment a master loads at its start needs no judging until
    something of it changes: every member's replica matched the certificate before,
    and none is bad. A member's store that no longer holds it says so in its first
    heartbeat (the segment is suspect again), one that never reports is dead after the
    store timeout (its segments are candidates again), a new incarnation's lost
    replicas are suspect at its registration. So a start judges what was not settled
    before, not every sealed segment of every idle stream."""
    return (
        segment.state == SegmentState.SEALED
        and not segment.bad
        and all(member in segment.verified for member in segment.copy_set)
    )


# ---- carrying a task out ----

# How often the repairer looks for work.
REPAIR_TICK_MS = 200
# Segments judged per tick: about 50 ms of work, so heartbeats are never held up long
# (a master just started judges once the sealed segments not `trusted_at_start`).
JUDGED_PER_TICK = 1000
# A failed task's segment waits this long before another attempt, so a broken store is
# not hammered and the rest of the queue moves on.
REPAIR_RETRY_MS = 2000
# Tasks carried out at once (the master's `--repair-concurrency` default).
REPAIR_CONCURRENCY_DEFAULT = 3


@dataclass(frozen=True, slots=True)
class RepairTimeouts:
    """How long a task's calls may take before the task fails (and is retried later)."""

    # A copy of a whole sealed segment may take a while; a stuck one must end.
    copy_ms: int = 120_000
    # Every other call of a task (state, digest, delete).
    control_ms: int = 5_000

    def __post_init__(self) -> None:
        assert 0 < self.control_ms <= self.copy_ms, "a copy is the longest call of a task"


TIMEOUTS = RepairTimeouts()
# The simulator's virtual-time runs last seconds: the same calls, scaled to them.
SIMULATED_TIMEOUTS = RepairTimeouts(copy_ms=2000, control_ms=500)
COPY_TIMEOUT_MS = TIMEOUTS.copy_ms
CONTROL_TIMEOUT_MS = TIMEOUTS.control_ms


@dataclass(frozen=True, slots=True)
class AskSourceState:
    """Ask the source for the segment's state: answered with `SourceState`."""

    source: str


@dataclass(frozen=True, slots=True)
class CopyToTarget:
    """CopySegment on the target, pulling from the source, verified against the
    certificate when there is one: answered with `Copied`. `replace_held`: a refill in
    place, the target drops what it holds of the segment first."""

    target: str
    source: str
    final_index: int
    fence: int
    certificate: Certificate | None = None
    replace_held: bool = False


@dataclass(frozen=True, slots=True)
class AskDigests:
    """Digest up to the final index on source and target: answered with `Digests`."""

    source: str
    target: str
    final_index: int


@dataclass(frozen=True, slots=True)
class SwapReplica:
    """Put the target in the replaced member's place, durably: answered with `Swapped`."""

    replaced: str
    target: str
    held: Held


@dataclass(frozen=True, slots=True)
class DeleteReplaced:
    """Ask the replaced store to delete its copy, best effort (heartbeat replies keep
    asking until it is gone); nothing answers it: the task is done."""

    store: str


RepairAction = AskSourceState | CopyToTarget | AskDigests | SwapReplica | DeleteReplaced


@dataclass(frozen=True, slots=True)
class SourceState:
    fence: int
    acked_index: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Copied:
    digest: bytes  # as the target reported it; empty if it reported none


@dataclass(frozen=True, slots=True)
class Digests:
    source: bytes
    target: bytes
    target_entries_held: int


@dataclass(frozen=True, slots=True)
class Swapped:
    pass


@dataclass(frozen=True, slots=True)
class StepFailed:
    """A call failed, timed out, or the master refused the swap."""

    error: str


RepairEvent = SourceState | Copied | Digests | Swapped | StepFailed


def task_still_valid(task: Task, segment: SegmentRecord | None) -> str:
    """Why a planned task no longer applies to the segment as it is now, or ""."""
    if segment is None or segment.state != SegmentState.SEALED:
        return "segment is gone or not sealed"
    if task.replaced not in segment.copy_set:
        return f"{task.replaced} is no longer in the copy set"
    if task.target != task.replaced and task.target in segment.copy_set:
        return f"{task.target} is already in the copy set"
    return ""


class RepairOp:
    """One task, with no I/O: ask the source's state (it must hold the bridge), have the
    target copy (the store verifies the copy against the certificate and confirms it
    itself; the root it reports must be the certificate's), swap the copy set, and only
    then delete the replaced copy; a member refilled in place drops its own copies
    before the copy (`CopyToTarget.replace_held`) and is never deleted. Without
    a certificate (a segment sealed before certificates, not yet certified by its
    replicas) both digests up to the final index are compared instead. `start` and
    `step` return the next action, None once the task is over (`error` says whether it
    failed)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.certificate: Certificate | None = None
        self.final_index = 0
        self.fence = 0
        self.bytes = 0
        self.copied_digest = b""
        self.error = ""
        self._waiting: type[RepairEvent] | None = None

    def start(self, segment: SegmentRecord | None) -> RepairAction | None:
        assert self._waiting is None, "started twice"
        invalid = task_still_valid(self.task, segment)
        if invalid:
            return self._fail(invalid)
        assert segment is not None and segment.final_index > 0
        self.final_index = segment.final_index
        self.certificate = segment.certificate
        return self._wait(SourceState, AskSourceState(self.task.source))

    def step(self, event: RepairEvent) -> RepairAction | None:
        if isinstance(event, StepFailed):
            return self._fail(event.error)
        assert self._waiting is not None and isinstance(event, self._waiting), (event, self)
        task, final = self.task, self.final_index
        if isinstance(event, SourceState):
            if event.acked_index < final:
                return self._fail(
                    f"source acked index {event.acked_index} below the bridge {final}"
                )
            self.fence, self.bytes = event.fence, event.bytes
            copy = CopyToTarget(
                task.target, task.source, final, event.fence, self.certificate, task.in_place
            )
            return self._wait(Copied, copy)
        if isinstance(event, Copied):
            self.copied_digest = event.digest
            if self.certificate is None:
                return self._wait(Digests, AskDigests(task.source, task.target, final))
            if event.digest != self.certificate.root():
                return self._fail("the copy reported another root than the certificate's")
            return self._swap()
        if isinstance(event, Digests):
            if event.source != event.target:
                return self._fail("digest of the copy differs from the source's")
            if self.copied_digest and self.copied_digest != event.source:
                return self._fail("CopySegment reported a digest differing from the source's")
            if event.target_entries_held < final:
                return self._fail(f"copy holds {event.target_entries_held} of {final} indexes")
            return self._swap()
        assert isinstance(event, Swapped)
        self._waiting = None
        if task.in_place:
            return None  # refilled in place: the member keeps its (now complete) copy
        return DeleteReplaced(task.replaced)

    def _swap(self) -> RepairAction:
        held = Held(self.fence, self.final_index, self.final_index, self.bytes)
        return self._wait(Swapped, SwapReplica(self.task.replaced, self.task.target, held))

    def _wait(self, event: type[RepairEvent], action: RepairAction) -> RepairAction:
        self._waiting = event
        return action

    def _fail(self, error: str) -> RepairAction | None:
        self.error = error or "failed"
        self._waiting = None
        return None


class RepairQueue:
    """Which tasks run next: operator moves (rebalance) first, in order, then repairs
    planned from the state; at most `concurrency` at once, one per segment, none for a
    segment whose last attempt failed less than `retry_ms` ago."""

    def __init__(self, concurrency: int, retry_ms: int = REPAIR_RETRY_MS) -> None:
        assert concurrency >= 1 and retry_ms > 0
        self.concurrency = concurrency
        self.retry_ms = retry_ms
        self.queued: list[Task] = []
        self.running: dict[SegmentKey, Task] = {}
        self.retry_after: dict[SegmentKey, int] = {}
        # Per segment, the sources of its copies that failed since the last success:
        # the next attempt copies from another replica (`choose_source`).
        self.failed_sources: dict[SegmentKey, set[str]] = {}

    def plan_moves(self, tasks: Sequence[Task]) -> None:
        """An operator's plan replaces any earlier one not yet started: a plan is
        computed from the copy sets as they are, so two plans queued together would
        move the same bytes twice."""
        self.queued = list(tasks)

    def next_tasks(
        self, now_ms: int, plan: Callable[[set[SegmentKey], int], list[Task]]
    ) -> list[Task]:
        """The tasks to start now (marked running); `plan(busy, slots)` plans repairs."""
        slots = self.concurrency - len(self.running)
        self.retry_after = {k: t for k, t in self.retry_after.items() if t > now_ms}
        busy = set(self.running) | set(self.retry_after)
        chosen: list[Task] = []
        for task in list(self.queued):
            if len(chosen) >= slots:
                break
            if task.segment in busy:
                continue
            self.queued.remove(task)
            chosen.append(task)
            busy.add(task.segment)
        if len(chosen) < slots:
            chosen += plan(busy, slots - len(chosen))
        for task in chosen:
            assert task.segment not in self.running
            self.running[task.segment] = task
        assert len(self.running) <= self.concurrency
        return chosen

    def finished(self, task: Task, failed: bool, now_ms: int) -> None:
        assert self.running.get(task.segment) == task
        del self.running[task.segment]
        if failed:
            self.retry_after[task.segment] = now_ms + self.retry_ms
            self.failed_sources.setdefault(task.segment, set()).add(task.source)
        else:
            self.retry_after.pop(task.segment, None)
            self.failed_sources.pop(task.segment, None)
