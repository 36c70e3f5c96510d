"""Repair: which sealed segments lack good replicas, and which copies to run next.

Pure functions of a snapshot and `now_ms`.

A replica of a sealed segment is *good* when its store is alive, not draining, and
reported an acked index at or past the bridge (`final_index`). A member is *bad* when:
- its store is dead (silent for the store timeout): reason "store-dead";
- its store is draining: reason "drain" (it still serves as a copy source);
- its store is alive but its latest report, sent at least `bridge_grace_ms` after the
  segment settled (sealed, or its copy set last changed), shows the acked index below
  the bridge or no copy at all: reason "missed-bridge". The grace lets a leader finish
  raising acked indexes on the slower members and lets heartbeats catch up.
A member neither good nor bad is *pending*: not judged yet, neither repaired nor
counted as good.

Each bad member becomes one task: copy the segment from a good (or draining) replica to
a target chosen by placement, then swap target for the bad member. Open and sealing
segments are never copied; the leader of a stream whose open segment has a bad member
is asked to roll instead (`roll_reason`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from streamengine.master.model import Held, SegmentKey, SegmentRecord, SegmentState, StoreView
from streamengine.master.placement import choose_target

STORE_DEAD = "store-dead"
DRAIN = "drain"
MISSED_BRIDGE = "missed-bridge"
REBALANCE = "rebalance"


@dataclass(frozen=True, slots=True)
class Verdict:
    good: tuple[str, ...]
    # (store id, reason), in copy-set order.
    bad: tuple[tuple[str, str], ...]
    # Members able to serve a copy: good ones first, then draining ones holding the bridge.
    sources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Task:
    segment: SegmentKey
    source: str
    target: str
    # The member the target replaces; equal to `target` when a member that missed the
    # bridge is refilled in place (no other store can take it).
    replaced: str
    reason: str
    bytes: int


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
    bad: list[tuple[str, str]] = []
    draining_sources: list[str] = []
    judged_after = segment.settled_at_ms + bridge_grace_ms
    for member in segment.copy_set:
        store = stores.get(member)
        copy = held.get(member)
        if store is None or not store.alive:
            bad.append((member, STORE_DEAD))
        elif store.draining:
            bad.append((member, DRAIN))
            if _reached_bridge(copy, segment):
                draining_sources.append(member)
        elif _reached_bridge(copy, segment):
            good.append(member)
        elif store.reported_at_ms >= judged_after and now_ms >= judged_after:
            bad.append((member, MISSED_BRIDGE))
    return Verdict(tuple(good), tuple(bad), (*good, *draining_sources))


def under_replicated(
    segment: SegmentRecord, stores: Mapping[str, StoreView], held: Mapping[str, Held], replicas: int
) -> bool:
    """Fewer than N live, non-draining members whose acked index reached the bridge."""
    good = [
        m
        for m in segment.copy_set
        if m in stores and stores[m].usable and _reached_bridge(held.get(m), segment)
    ]
    return len(good) < replicas


def plan_tasks(
    segments: Sequence[SegmentRecord],
    stores: Mapping[str, StoreView],
    held: Mapping[SegmentKey, Mapping[str, Held]],
    now_ms: int,
    bridge_grace_ms: int,
    busy: Iterable[SegmentKey],
    slots: int,
    avoid: Mapping[SegmentKey, Iterable[str]] | None = None,
) -> list[Task]:
    """At most `slots` new tasks, one per segment, none for a segment in `busy`
    (a task running or backing off). Segments are taken oldest first. `avoid` names,
    per segment, stores that must not receive it (told to delete it, not yet done)."""
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
        replaced, reason = verdict.bad[0]
        source = _least_busy(verdict.sources, sources_used)
        keep = [m for m in segment.copy_set if m != replaced]
        target = choose_target(
            _with_pending(stores, targets_used),
            keep,
            avoid=[replaced, *(avoid or {}).get(segment.key, ())],
        )
        if target is None and reason == MISSED_BRIDGE:
            target = replaced
        if target is None:
            continue
        size = max((c.bytes for c in copies.values()), default=0)
        tasks.append(Task(segment.key, source, target, replaced, reason, size))
        targets_used[target] = targets_used.get(target, 0) + 1
        sources_used[source] = sources_used.get(source, 0) + 1
    return tasks


def _least_busy(sources: Sequence[str], load: Mapping[str, int]) -> str:
    return min(sources, key=lambda s: (load.get(s, 0), sources.index(s)))


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
