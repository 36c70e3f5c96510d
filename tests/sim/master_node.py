"""The simulated master: the real `MasterState` over an in-memory catalog."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from streamengine.client.core.leader import (
    HeartbeatAnswered,
    Replica,
    SegmentGrant,
)
from streamengine.client.core.replicator import (
    SegmentRef,
)
from streamengine.master.catalog import Batch, Catalog
from streamengine.master.errors import MasterError, SealConflict
from streamengine.master.model import SegmentRecord
from streamengine.master.state import MasterState, WriterView
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.segment_store.store import (
    SegmentKey,
)
from tests.sim import messages as m
from tests.sim.network import Message

if TYPE_CHECKING:
    from tests.sim.world import World

from tests.sim.nodes import MASTER, Node

# ---- master ----


class MemoryCatalog(Catalog):
    """The real catalog's encoding and loading over a sorted dict instead of RocksDB
    (every commit is durable at once, as a synced RocksDB write is)."""

    def __init__(self) -> None:  # no RocksDB
        self.data: dict[bytes, bytes] = {}
        self._db = cast(Any, self)  # get/items: all the loading code needs

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def items(self, from_key: bytes) -> list[tuple[bytes, bytes]]:
        return sorted((k, v) for k, v in self.data.items() if k >= from_key)

    def commit(self, batch: Batch) -> None:
        for key in batch.deletes:
            self.data.pop(key, None)
        for key, value in batch.puts:
            self.data[key] = value

    def close(self) -> None:
        pass


def grant_of(record: SegmentRecord) -> SegmentGrant:
    return SegmentGrant(
        SegmentRef(record.stream_id, record.epoch, record.stream),
        tuple(Replica(store, f"{store}:1") for store in record.copy_set),
    )


class MasterNode(Node):
    def __init__(self, world: World) -> None:
        super().__init__(MASTER, world)
        self.catalog = MemoryCatalog()
        self.state = self._load()
        cfg = world.config
        self.stream = self.state.create_stream(
            cfg.stream,
            cfg.policy.replicas,
            cfg.policy.write_quorum,
            cfg.segment_bytes,
            cfg.segment_age_ms,
            True,
            0,
        )
        for store in world.store_names:
            self.state.register_store(store, f"{store}:1", "", 1 << 40, 0)

    def _load(self) -> MasterState:
        cfg = self.world.config
        return MasterState(self.catalog, self.world.now, cfg.lease_ms, cfg.store_timeout_ms)

    def restart(self) -> None:
        super().restart()
        self.state = self._load()
        self.world.checker.master_changed(self.state)

    def handle(self, message: Message) -> None:
        body = message.body
        if isinstance(body, m.StoreHeartbeat):
            now = self.world.now
            if self.state.store_heartbeat(body.store, 0, 1 << 40, {}, now) is None:
                self.state.register_store(body.store, f"{body.store}:1", "", 1 << 40, now)
            return
        assert isinstance(body, m.Call)
        try:
            result = self._serve(body.request)
        except MasterError as error:
            result = error
        self.answer(message, result)

    def _serve(self, request: object) -> object:
        now = self.world.now
        state = self.state
        if isinstance(request, m.WriterHeartbeat):
            before = state.leases[request.stream].epoch
            view = state.writer_heartbeat(
                request.stream,
                request.client_id,
                request.epoch,
                request.acked_index,
                request.segment_bytes,
                now,
            )
            return self._view(view, before, request.client_id)
        if isinstance(request, m.RollSegment):
            # Ready for the leader's roll: a shell action for it maps here.
            before = state.leases[request.stream].epoch
            view = state.roll_segment(
                request.stream, request.client_id, request.epoch, request.exclude, now
            )
            return self._view(view, before, request.client_id)
        if isinstance(request, m.ReleaseLease):
            return state.release_lease(request.stream, request.client_id, request.epoch, now)
        if isinstance(request, m.SealSegment):
            return self._seal(request)
        if isinstance(request, m.ListSegments):
            _, segments = state.list_segments(request.stream, 0)
            return tuple(segments)
        raise AssertionError(f"unknown request {request!r}")

    def _view(self, view: WriterView, before: int, client_id: str) -> HeartbeatAnswered:
        """The reply to a heartbeat or a roll, as the master's service builds it."""
        state = self.state
        now = self.world.now
        granted = view.lease.epoch if view.lease.epoch != before else 0
        self.world.checker.master_changed(state, granted)
        if granted:
            self.world.note(f"master grants epoch {granted} to {client_id}")
        record = view.stream
        return HeartbeatAnswered(
            sent_at_ms=0,
            leader=view.leads,
            epoch=view.lease.epoch,
            lease_ms=state.lease_ms,
            leader_id=view.lease.holder if view.lease.running(now) else "",
            segment=grant_of(view.segment) if view.leads and view.segment else None,
            unsealed=tuple(grant_of(s) for s in view.unsealed) if view.leads else (),
            policy=ReplicationPolicy(record.replicas, record.write_quorum),
            roll_requested=bool(view.roll_reason),
            roll_reason=view.roll_reason,
            segment_bytes_max=record.segment_bytes,
            segment_age_ms_max=record.segment_age_ms,
        )

    def _seal(self, request: m.SealSegment) -> object:
        key = SegmentKey(self.stream.stream_id, request.segment_epoch)
        try:
            sealed = self.state.seal_segment(
                request.stream,
                request.segment_epoch,
                request.writer_epoch,
                request.final_index,
                self.world.now,
            )
        except SealConflict as conflict:
            self.world.checker.seal_conflict(key, str(conflict))
            raise
        self.world.checker.master_changed(self.state)
        cores = {n: s.core for n, s in self.world.stores.items()}
        self.world.checker.sealed_at_master(key, sealed.final_index, cores)
        return sealed
