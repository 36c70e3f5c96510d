"""Replica moves: copies under way, copy-set swaps, and the plans of repair, drain and
rebalance (decided by `core/repair.py` and `core/placement.py`, run by `repair.py`).

A section of the master's state (`master.state`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch
from streamengine.master.core import integrity, placement, repair
from streamengine.master.core.durability import Exposure
from streamengine.master.core.errors import AlreadyExists, NotFound
from streamengine.master.core.model import Held, SegmentKey, SegmentRecord, SegmentState

if TYPE_CHECKING:
    from streamengine.master.state import MasterState


class Replicas:
    """Where replicas go: copies, swaps, and the plans that move them."""

    def __init__(self, state: MasterState) -> None:
        self.state = state
        # Where the last repair window ended (`plan_repairs`).
        self._repair_cursor: SegmentKey = (0, 0)

    def begin_copy(self, store_id: str, key: SegmentKey) -> None:
        self.state.copying.add((store_id, key))
        if (store_id, key) in self.state.deletes:
            self.state.catalog.commit(Batch().replica_deleted(store_id, key))
            self.state.deletes.discard((store_id, key))

    def end_copy(self, store_id: str, key: SegmentKey) -> None:
        self.state.copying.discard((store_id, key))

    def swap_replica(
        self, key: SegmentKey, replaced: str, target: str, held: Held, now_ms: int
    ) -> SegmentRecord:
        """Put `target` in `replaced`'s place in a sealed segment's copy set, durably,
        and have `replaced` delete its copy."""
        segment = self.state.segments.get(key)
        if segment is None or segment.state != SegmentState.SEALED:
            raise NotFound(f"segment {key} is gone or not sealed")
        if replaced not in segment.copy_set:
            raise NotFound(f"store {replaced} left segment {key}'s copy set meanwhile")
        if target != replaced and target in segment.copy_set:
            raise AlreadyExists(f"store {target} already holds segment {key}")
        copy_set = tuple(target if m == replaced else m for m in segment.copy_set)
        # The target's copy was verified (against the certificate when there is one).
        bad = tuple(m for m in segment.bad if m in copy_set and m != target)
        checks = self.state.checks_of(key)
        if target != replaced:
            checks.forget(replaced)
        if segment.certificate is not None:
            condemned = integrity.copy_verified(checks, copy_set, target, now_ms)
            bad = tuple(sorted(set(bad) | set(condemned)))
        swapped = replace(segment, copy_set=copy_set, settled_at_ms=now_ms, bad=bad)
        swapped = replace(swapped, verified=self.state.verified_members(swapped))
        batch = Batch().segment(swapped)
        if target != replaced:
            batch.delete_replica(replaced, key)
        self.state.catalog.commit(batch)
        self.state.put_segment(swapped)
        if target != replaced:
            self.state.deletes.add((replaced, key))
        if target in self.state.live:
            self.state.live[target].held[key] = held
        return swapped

    def plan_repairs(
        self,
        now_ms: int,
        busy: set[SegmentKey],
        slots: int,
        failed_sources: dict[SegmentKey, set[str]] | None = None,
    ) -> list[repair.Task]:
        """Repairs for the segments that may need one; segments seen with every member
        good are confirmed and left alone until something about them changes.
        `failed_sources`: per segment, sources whose copies failed lately (the repair
        queue's): the next copy is made from another replica."""
        views = self.state.store_views(now_ms)
        candidates = self._repair_window(self.state.repair_candidates(views))
        held = self.state.held_for(candidates)
        for segment in candidates:
            verdict = repair.judge(
                segment, views, held[segment.key], now_ms, self.state.bridge_grace_ms
            )
            if len(verdict.good) == len(segment.copy_set) and segment.key not in busy:
                # Confirmed: not judged again until something of it changes.
                self.state.unconfirmed.discard(segment.key)
        return repair.plan_tasks(
            candidates,
            views,
            held,
            now_ms,
            self.state.bridge_grace_ms,
            busy,
            slots,
            self.state.pending_deletes(),
            failed_sources,
            self._write_quorums(candidates),
        )

    def _write_quorums(self, segments: list[SegmentRecord]) -> dict[int, int]:
        """W of each stream of `segments`, by stream id (a refill in place needs it)."""
        quorums: dict[int, int] = {}
        for segment in segments:
            stream = self.state.streams.get(self.state.names.get(segment.stream_id, ""))
            if stream is not None:
                quorums[segment.stream_id] = stream.write_quorum
        return quorums

    def below_n(self, now_ms: int) -> tuple[list[SegmentRecord], list[SegmentRecord]]:
        """Sealed segments with fewer than N good replicas: those under-replicated (a
        member lacking), and those being verified (`repair.being_verified`)."""
        exposures = self.exposures(now_ms)
        return (
            [self.state.segments[e.segment] for e in exposures if not e.verifying],
            [self.state.segments[e.segment] for e in exposures if e.verifying],
        )

    def exposures(self, now_ms: int) -> list[Exposure]:
        """Sealed segments with fewer than N good replicas now, for the durability
        ledger and status (with how many are good, and whether any is lacking)."""
        views = self.state.store_views(now_ms)
        candidates = self.state.repair_candidates(views)
        held = self.state.held_for(candidates)
        out = []
        for segment in candidates:
            stream = self.state.streams[self.state.names[segment.stream_id]]
            verdict = repair.judge(
                segment, views, held[segment.key], now_ms, self.state.bridge_grace_ms
            )
            good = len(verdict.good)
            if good < stream.replicas:
                out.append(
                    Exposure(
                        segment.key,
                        stream.name,
                        good,
                        stream.replicas,
                        stream.write_quorum,
                        self.state.segment_bytes(segment.key),
                        len(verdict.unverified),
                        repair.being_verified(segment, verdict, stream.replicas),
                    )
                )
        return out

    def replica_bytes(self) -> dict[str, int]:
        """Bytes of the replicas each registered store is assigned, by segment size."""
        out = dict.fromkeys(sorted(self.state.stores), 0)
        for key, segment in self.state.segments.items():
            size = self.state.segment_bytes(key)
            for member in segment.copy_set:
                if member in out:
                    out[member] += size
        return out

    def drain_preview(
        self, store_id: str, now_ms: int
    ) -> tuple[list[repair.Task], dict[str, int], dict[str, int]]:
        """The moves draining `store_id` needs, as the repairer will pick them now."""
        views = self.state.store_views(now_ms)
        before = self.replica_bytes()
        after = dict(before)
        tasks = []
        pending: dict[str, int] = {}
        for key, segment in sorted(self.state.segments.items()):
            if segment.state != SegmentState.SEALED or store_id not in segment.copy_set:
                continue
            keep = [m for m in segment.copy_set if m != store_id]
            candidates = [
                replace(v, segments=v.segments + pending.get(v.store_id, 0)) for v in views.values()
            ]
            target = placement.choose_target(candidates, keep, avoid=[store_id])
            if target is None:
                continue
            size = self.state.segment_bytes(key)
            source = next((m for m in keep if views.get(m) and views[m].alive), store_id)
            tasks.append(repair.Task(key, source, target, store_id, repair.DRAIN, size))
            pending[target] = pending.get(target, 0) + 1
            after[store_id] -= size
            after[target] = after.get(target, 0) + size
        return tasks, before, after

    def rebalance_plan(
        self, now_ms: int, busy: Iterable[SegmentKey] = ()
    ) -> tuple[list[repair.Task], dict[str, int], dict[str, int]]:
        """Moves of healthy sealed replicas, none of a segment in `busy` (a copy running),
        until bytes per usable store are even."""
        skip = set(busy)
        views = self.state.store_views(now_ms)
        sealed = [s for s in self.state.segments.values() if s.state == SegmentState.SEALED]
        held = self.state.held_for(sealed)
        replicas = []
        for key, segment in sorted(self.state.segments.items()):
            if segment.state != SegmentState.SEALED or key in skip:
                continue
            verdict = repair.judge(
                segment, views, held.get(key, {}), now_ms, self.state.bridge_grace_ms
            )
            if len(verdict.good) == len(segment.copy_set):
                size = self.state.segment_bytes(key)
                replicas.append(placement.MovableSegment(key, segment.copy_set, size))
        moves, before, after = placement.plan_rebalance(views.values(), replicas)
        tasks = [
            repair.Task(m.segment, m.source, m.target, m.source, repair.REBALANCE, m.bytes)
            for m in moves
        ]
        return tasks, before, after

    def _repair_window(self, candidates: list[SegmentRecord]) -> list[SegmentRecord]:
        """At most JUDGED_PER_TICK candidates, resuming after the last one judged, so a
        tick stays short (it runs on the loop that answers heartbeats) and every
        candidate gets its turn."""
        if len(candidates) <= repair.JUDGED_PER_TICK:
            return candidates
        start = next((i for i, s in enumerate(candidates) if s.key > self._repair_cursor), 0)
        window = (candidates[start:] + candidates[:start])[: repair.JUDGED_PER_TICK]
        self._repair_cursor = window[-1].key
        return window
