"""Stores: registered (each incarnation), heartbeats recorded, drains begun and ended.

A section of the master's state (`master.state`). A heartbeat's reply names the
replicas the store holds as garbage (`_garbage`): deleted, trimmed or left behind.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch
from streamengine.master.core import placement
from streamengine.master.core.errors import InvalidArgument, NotEnoughStores, NotFound, WrongCluster
from streamengine.master.core.model import (
    Held,
    SegmentKey,
    SegmentState,
    StoreRecord,
    validate_name_part,
)
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX

if TYPE_CHECKING:
    from streamengine.master.state import MasterState

ADDRESS_CHARS_MAX = 255
# Every replica a store holds is judged at least this often (garbage to delete, records
# to send), from what the master holds of its reports: a delta names only what changed,
# and a store sends its report whole only now and then
# (`segment_store.core.held_reports.FULL_REPORT_MS`), since reading ten thousand
# segments' reports was most of an idle master's work.
HELD_JUDGED_MS = 5_000


@dataclass
class StoreLive:
    """What the master knows of a store since it started (not persisted)."""

    last_seen_ms: int
    reported_at_ms: int = 0
    used_bytes: int = 0
    free_bytes: int = 0
    held: dict[SegmentKey, Held] = field(default_factory=dict)
    # `held` is the store's whole report (and the deltas since): a delta applies to it.
    # False until the first whole report, and again after a registration.
    whole: bool = False
    # When every replica in `held` was last judged (`HELD_JUDGED_MS`).
    judged_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class Registered:
    """A store's registration: its heartbeat interval, the cluster id to keep ("" while
    a rebuild has not adopted one), and the replicas its earlier incarnation held."""

    heartbeat_ms: int
    cluster_id: str
    lost: tuple[SegmentKey, ...]


class StoreRegistry:
    """The stores: their registrations, reports and drains."""

    def __init__(self, state: MasterState) -> None:
        self.state = state

    def register_store(
        self,
        store_id: str,
        address: str,
        zone: str,
        free_bytes: int,
        now_ms: int,
        incarnation: int = 0,
        cluster_id: str = "",
        data_address: str = "",
    ) -> Registered:
        """Register a store (again). Refused (WrongCluster) when it keeps another
        cluster's id. A new incarnation of a known store holds none of its earlier
        replicas: those are `Registered.lost`, the store is told so and refuses to seal
        or write them, the open ones roll, and repair refills the sealed ones. So does a
        store unknown to the master with an incarnation and no cluster id (a new disk),
        of the copy sets a rebuild it missed named it in.

        Every registration of that incarnation answers the same `lost` (those segments
        the master still knows): the answer that first named them may never have reached
        the store (a lost reply, a master killed after its commit, a store crashing
        before it joined), and a store that joined without them would answer a
        recovery's seal as an empty replica, and count for the one it lost."""
        validate_name_part("store id", store_id)
        if not address or len(address) > ADDRESS_CHARS_MAX or ":" not in address:
            raise InvalidArgument(f"store address {address!r} must be host:port")
        if data_address and (len(data_address) > ADDRESS_CHARS_MAX or ":" not in data_address):
            raise InvalidArgument(f"store data address {data_address!r} must be host:port")
        if zone and len(zone) > ADDRESS_CHARS_MAX:
            raise InvalidArgument("zone label too long")
        if len(cluster_id) > ADDRESS_CHARS_MAX:
            raise InvalidArgument("cluster id too long")
        if cluster_id and self.state.cluster_id and cluster_id != self.state.cluster_id:
            raise WrongCluster(
                f"store {store_id} belongs to cluster {cluster_id}, this master's cluster "
                f"is {self.state.cluster_id}"
            )
        if not self.state.cluster_id:
            self.state.store_cluster_ids[store_id] = cluster_id
        existing = self.state.stores.get(store_id)
        draining = existing.draining if existing else False
        known = existing.incarnation if existing else 0
        lost: list[SegmentKey] = []
        kept_lost: tuple[SegmentKey, ...] = existing.lost if existing else ()
        if (known and incarnation and incarnation != known) or (
            existing is None and incarnation and not cluster_id
        ):
            # A store the master never registered is named by copy sets only when they
            # were rebuilt from the other stores' records while it was away; keeping no
            # cluster id, its database was made since it last joined: it holds none.
            lost = sorted(self.state.members.get(store_id, ()))
            kept_lost = tuple(lost)
        # A segment dropped since (deleted or trimmed) needs no mark any more.
        answered = tuple(key for key in kept_lost if key in self.state.segments)
        for key in answered:
            if self.state.segments[key].state != SegmentState.SEALED:
                self.state.lost_members.setdefault(key, set()).add(store_id)
        record = StoreRecord(
            store_id, address, zone, draining, incarnation or known, kept_lost, data_address
        )
        if record != existing:
            self.state.catalog.commit(Batch().store(record))
            self.state.stores[store_id] = record
        live = self.state.live.setdefault(store_id, StoreLive(last_seen_ms=now_ms))
        live.last_seen_ms = now_ms
        live.free_bytes = free_bytes
        live.whole = False  # the store's next report is whole
        if lost:
            # What it reported of them was its old incarnation's, and what it matched too.
            gone = set(lost)
            live.held = {k: v for k, v in live.held.items() if k not in gone}
            sealed = [k for k in lost if self.state.segments[k].state == SegmentState.SEALED]
            self.state.unconfirmed.update(sealed)
            unverified = []
            for key in sealed:
                checks = self.state.checks.get(key)
                if checks is not None and checks.verified.pop(store_id, None) is not None:
                    segment = self.state.segments[key]
                    unverified.append(
                        replace(segment, verified=self.state.verified_members(segment))
                    )
            if unverified:
                batch = Batch()
                for segment in unverified:
                    batch.segment(segment)
                self.state.catalog.commit(batch)
                for segment in unverified:
                    self.state.put_segment(segment)
        return Registered(self.state.store_heartbeat_ms(), self.state.cluster_id, answered)

    def count_silence_from(self, now_ms: int) -> None:
        """The master serves from `now_ms`, once its catalog is loaded: stores could not
        reach it while it loaded, so each one that has not reported has the store timeout
        from now to report. (A load longer than the timeout left every store dead, and the
        first passes judged every replica for a copy elsewhere.) The restart rule for
        leases still counts from the start: the last holder's lease ran out as always."""
        for live in self.state.live.values():
            if not live.reported_at_ms:
                live.last_seen_ms = max(live.last_seen_ms, now_ms)

    def adopt_cluster_id(self, cluster_id: str) -> None:
        """Keep `cluster_id` as the cluster's (once: it never changes after)."""
        assert cluster_id and not self.state.cluster_id, "a cluster id is adopted once"
        self.state.catalog.commit(Batch().cluster_id(cluster_id))
        self.state.cluster_id = cluster_id

    def store_heartbeat(
        self,
        store_id: str,
        used_bytes: int,
        free_bytes: int,
        held: dict[SegmentKey, Held],
        now_ms: int,
        removed: tuple[SegmentKey, ...] | None = None,
    ) -> list[SegmentKey] | None:
        """Record a store's report; returns the segments it should delete, or None when
        it must register again. `removed` None: `held` is everything the store holds;
        else a delta (`segment_store.core.held_reports`): `held` is what changed since
        its last report answered and `removed` what it no longer holds, taken only once
        a whole report was (`takes_delta`). A whole report judges every segment held,
        and so does a delta once `HELD_JUDGED_MS` passed since (`judged_held`); else a
        delta judges those it names and the store's pending deletes."""
        if store_id not in self.state.stores:
            return None
        live = self.state.live.setdefault(store_id, StoreLive(last_seen_ms=now_ms))
        live.last_seen_ms = now_ms
        live.reported_at_ms = now_ms
        live.used_bytes = used_bytes
        live.free_bytes = free_bytes
        touched: set[SegmentKey] | None = None
        if removed is None:
            live.held = dict(held)
            live.whole = True
        else:
            assert live.whole, "a delta applies only to a whole report"
            for key in removed:
                live.held.pop(key, None)
            live.held.update(held)
            if now_ms - live.judged_at_ms < HELD_JUDGED_MS:
                touched = set(held).union(removed)
        if touched is None:
            live.judged_at_ms = now_ms
        holds = live.held
        # A member that no longer holds the bridge makes its segment suspect again.
        members = self.state.members.get(store_id, set())
        for key in members if touched is None else members & touched:
            segment = self.state.segments[key]
            if segment.state == SegmentState.SEALED and key not in self.state.unconfirmed:
                copy = holds.get(key)
                if copy is None or copy.acked_index < segment.final_index:
                    self.state.unconfirmed.add(key)
        # A pending delete the store no longer reports is done.
        pending = [key for sid, key in self.state.deletes if sid == store_id]
        done = sorted((store_id, key) for key in pending if key not in holds)
        # Each record is independent: a long list goes in several transactions, and
        # memory follows each one that committed.
        for start in range(0, len(done), OPS_PER_TRANSACTION_MAX):
            chunk = done[start : start + OPS_PER_TRANSACTION_MAX]
            batch = Batch()
            for sid, key in chunk:
                batch.replica_deleted(sid, key)
            self.state.catalog.commit(batch)
            self.state.deletes -= set(chunk)
        judged: Iterable[SegmentKey] = holds
        if touched is not None:
            judged = set(held).union(key for key in pending if key in holds)
        return sorted(key for key in judged if self._garbage(store_id, key))

    def judged_held(
        self, store_id: str, now_ms: int, named: dict[SegmentKey, Held]
    ) -> dict[SegmentKey, Held]:
        """The reports a heartbeat of `store_id` at `now_ms` judged (their records are
        checked in its answer, `master.records`): every one the store holds when it
        judged them all, else those it `named`."""
        live = self.state.live.get(store_id)
        if live is not None and live.judged_at_ms == now_ms:
            return live.held
        return named

    def takes_delta(self, store_id: str) -> bool:
        """Whether a delta report of `store_id` applies now: the master holds its whole
        report (`StoreHeartbeatReply.report_full` otherwise)."""
        live = self.state.live.get(store_id)
        return live is not None and live.whole

    def drain_refusal(self, store_id: str, now_ms: int) -> str:
        """Why draining `store_id` would leave a stream without stores for N replicas
        (`placement.drain_refusal`), "" when it would not."""
        if store_id not in self.state.stores:
            raise NotFound(f"store {store_id!r} is not registered")
        replicas = {
            r.name: r.replicas for r in self.state.streams.values() if not r.deleted_until_ms
        }
        return placement.drain_refusal(self.state.store_views(now_ms).values(), store_id, replicas)

    def set_draining(self, store_id: str, now_ms: int, draining: bool = True) -> StoreRecord:
        """Drain `store_id` (refused with NotEnoughStores when that would leave a stream
        without stores for its replicas), or end its drain (`draining` False)."""
        record = self.state.stores.get(store_id)
        if record is None:
            raise NotFound(f"store {store_id!r} is not registered")
        if draining and not record.draining:
            refusal = self.drain_refusal(store_id, now_ms)
            if refusal:
                raise NotEnoughStores(f"drain of {store_id} refused: {refusal}")
        if record.draining != draining:
            record = replace(record, draining=draining)
            self.state.catalog.commit(Batch().store(record))
            self.state.stores[store_id] = record
        return record

    def _garbage(self, store_id: str, key: SegmentKey) -> bool:
        if (store_id, key) in self.state.deletes:
            return True
        if (store_id, key) in self.state.copying:
            return False
        stream_id, _ = key
        if stream_id not in self.state.names:
            # Ids are never reused: one below the next id that no stream has was deleted.
            return self.state.rebuilt_through < stream_id < self.state.next_stream_id
        segment = self.state.segments.get(key)
        if segment is None:
            # Trims take whole segments from the head: a segment of a trimmed epoch
            # whose record is gone was removed after its grace.
            stream = self.state.streams[self.state.names[stream_id]]
            return key[1] <= stream.trimmed_through_epoch
        return segment.state == SegmentState.SEALED and store_id not in segment.copy_set
