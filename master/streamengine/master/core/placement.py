"""Placement: which stores hold a segment, and which replicas to move to even out bytes.

Pure functions over `StoreView`s. Rules, in order:
1. never two replicas of a segment on one store;
2. only live, non-draining stores receive replicas;
3. distinct zones while there are zones left unused by the copy set;
4. least bytes first (then fewest replicas, then id, so the choice is deterministic).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from streamengine.master.core.errors import NotEnoughStores
from streamengine.master.core.model import SegmentKey, StoreView

# Rebalance stops once every store is within this fraction of the mean bytes per store.
REBALANCE_TOLERANCE = 0.10
# A plan never grows beyond this many moves: an operator reruns rebalance for more.
REBALANCE_MOVES_MAX = 1000


def _load(store: StoreView) -> tuple[int, int, str]:
    return (store.used_bytes, store.segments, store.store_id)


def _pick(
    candidates: Sequence[StoreView], count: int, zones_taken: Iterable[str]
) -> list[StoreView]:
    """Up to `count` stores: first one per unused zone, least loaded first, then fill."""
    ranked = sorted(candidates, key=_load)
    zones = set(zones_taken)
    chosen: list[StoreView] = []
    for store in ranked:
        if len(chosen) == count:
            return chosen
        if store.zone not in zones:
            chosen.append(store)
            zones.add(store.zone)
    for store in ranked:
        if len(chosen) == count:
            break
        if store not in chosen:
            chosen.append(store)
    return chosen


def choose_copy_set(
    stores: Iterable[StoreView], replicas: int, exclude: Iterable[str] = ()
) -> tuple[str, ...]:
    """A copy set of `replicas` distinct usable stores; raises NotEnoughStores."""
    excluded = set(exclude)
    usable = [s for s in stores if s.usable and s.store_id not in excluded]
    if len(usable) < replicas:
        raise NotEnoughStores(
            f"{replicas} replicas need {replicas} live stores, {len(usable)} usable"
        )
    return tuple(s.store_id for s in _pick(usable, replicas, ()))


def drain_refusal(
    stores: Iterable[StoreView], store_id: str, replicas_by_stream: Mapping[str, int]
) -> str:
    """Why draining `store_id` would leave some stream short of stores for a copy set
    ("" when it would not): the stores left usable must hold N replicas of every stream,
    in as many distinct zones as the usable stores span now (up to N) where zones are
    used (rule 3 spreads them, and a drain must not take that away)."""
    views = list(stores)
    before = [s for s in views if s.usable or s.store_id == store_id]
    after = [s for s in before if s.store_id != store_id]
    zones_before = {s.zone for s in before}
    zones_after = {s.zone for s in after}
    zoned = any(s.zone for s in views)
    for stream, replicas in sorted(replicas_by_stream.items(), key=lambda i: (-i[1], i[0])):
        if len(after) < replicas:
            return (
                f"{stream} keeps {replicas} replicas: {len(after)} usable stores would be "
                f"left without {store_id}"
            )
        wanted = min(replicas, len(zones_before))
        if zoned and len(zones_after) < wanted:
            return (
                f"{stream} keeps {replicas} replicas in distinct zones: without {store_id} "
                f"the usable stores span {len(zones_after)} zones "
                f"({', '.join(sorted(zones_after)) or 'none'}), not {wanted}"
            )
    return ""


def choose_target(
    stores: Iterable[StoreView], keep: Iterable[str], avoid: Iterable[str] = ()
) -> str | None:
    """A store to receive one more replica of a segment whose surviving members are
    `keep`; never a store in `keep` or `avoid`. None when no store fits."""
    by_id = {s.store_id: s for s in stores}
    members = set(keep)
    blocked = members | set(avoid)
    candidates = [s for s in by_id.values() if s.usable and s.store_id not in blocked]
    zones = [by_id[m].zone for m in sorted(members) if m in by_id]
    picked = _pick(candidates, 1, zones)
    return picked[0].store_id if picked else None


@dataclass(frozen=True, slots=True)
class MovableSegment:
    """A sealed segment whose replicas rebalance may move: its copy set and size."""

    segment: SegmentKey
    copy_set: tuple[str, ...]
    bytes: int


@dataclass(frozen=True, slots=True)
class Move:
    segment: SegmentKey
    source: str
    target: str
    bytes: int


def balanced(bytes_per_store: Mapping[str, int], tolerance: float = REBALANCE_TOLERANCE) -> bool:
    if not bytes_per_store:
        return True
    mean = sum(bytes_per_store.values()) / len(bytes_per_store)
    return all(abs(b - mean) <= tolerance * mean for b in bytes_per_store.values())


def plan_rebalance(
    stores: Iterable[StoreView],
    replicas: Sequence[MovableSegment],
    tolerance: float = REBALANCE_TOLERANCE,
) -> tuple[list[Move], dict[str, int], dict[str, int]]:
    """Moves from the fullest to the emptiest usable store until bytes per store are
    within `tolerance` of the mean, or no move narrows the gap. Returns the moves and
    bytes per store before and after (sum of the replica bytes each store holds)."""
    usable = {s.store_id: s for s in stores if s.usable}
    before = {sid: 0 for sid in usable}
    copy_sets = {r.segment: list(r.copy_set) for r in replicas}
    sizes = {r.segment: r.bytes for r in replicas}
    for r in replicas:
        for member in r.copy_set:
            if member in before:
                before[member] += r.bytes
    after = dict(before)
    moves: list[Move] = []
    while len(moves) < REBALANCE_MOVES_MAX and not balanced(after, tolerance):
        move = _best_move(usable, after, copy_sets, sizes)
        if move is None:
            break
        moves.append(move)
        after[move.source] -= move.bytes
        after[move.target] += move.bytes
        members = copy_sets[move.segment]
        members[members.index(move.source)] = move.target
    return moves, before, after


def _best_move(
    usable: Mapping[str, StoreView],
    load: Mapping[str, int],
    copy_sets: Mapping[SegmentKey, list[str]],
    sizes: Mapping[SegmentKey, int],
) -> Move | None:
    """The first move, fullest source first, largest replica first, emptiest target
    first, that narrows the gap between source and target (so the sum of squared loads
    drops and planning ends) and keeps the copy set's zones spread."""
    ranked = sorted(load, key=lambda sid: (load[sid], sid))
    by_size = sorted(copy_sets, key=lambda k: (-sizes[k], k))
    for source in reversed(ranked):
        for segment in by_size:
            members = copy_sets[segment]
            size = sizes[segment]
            if source not in members or size <= 0:
                continue
            for target in ranked:
                if load[target] + size >= load[source]:
                    break
                if target in members or not _keeps_zones(usable, members, source, target):
                    continue
                return Move(segment, source, target, size)
    return None


def _keeps_zones(
    usable: Mapping[str, StoreView], members: list[str], source: str, target: str
) -> bool:
    """A move may not put two replicas in one zone that were in distinct zones."""

    def zones(ids: Iterable[str]) -> int:
        return len({usable[i].zone if i in usable else f"?{i}" for i in ids})

    moved = [target if m == source else m for m in members]
    return zones(moved) >= zones(members)
