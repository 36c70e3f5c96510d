"""A simulated segment store: the real `SegmentStoreCore` over an in-memory KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.protocol.entry import StoredEntry
from streamengine.segment_store.kv import MemoryKV
from streamengine.segment_store.store import (
    SegmentKey,
    SegmentNotFound,
    SegmentStoreCore,
    WriteResult,
)
from streamengine.segment_store.store import StoreFenced as StoreRefused
from tests.sim import messages as m
from tests.sim.network import Message
from tests.sim.subscribe import TailServer

if TYPE_CHECKING:
    from tests.sim.world import World

from tests.sim.nodes import MASTER, STORE_HEARTBEAT_MS, Node

# ---- stores ----


class SyncedMemoryKV(MemoryKV):
    """The store syncs every write it answers, so nothing is lost in a crash; keeping a
    second, durable copy of the whole KV per write (as `MemoryKV` does to model unsynced
    writes) would make a run quadratic in its length."""

    def _checkpoint(self) -> None:
        pass

    def crash(self) -> None:
        pass


class StoreNode(Node):
    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        self.kv = SyncedMemoryKV()
        self.core = SegmentStoreCore(self.kv)
        self.tails = TailServer(self)
        self.heartbeat()

    def heartbeat(self) -> None:
        self.world.net.send(self.name, MASTER, m.StoreHeartbeat(self.name))
        self.timer(STORE_HEARTBEAT_MS, "heartbeat", self.heartbeat)

    def restart(self) -> None:
        super().restart()
        self.kv.crash()  # loses nothing: every write was synced
        self.core = SegmentStoreCore(self.kv)
        self.tails = TailServer(self)
        self.world.checker.store_restarted(self.name, self.core)
        self.heartbeat()

    def fence(self, segment: SegmentKey) -> int:
        meta = self.core.meta(segment)
        return meta.fence if meta else 0

    def write(
        self, segment: SegmentKey, epoch: int, acked: int, entries: tuple[StoredEntry, ...]
    ) -> WriteResult | m.Refused:
        """The store's write rule, with the checks around it (invariants 2, 3, 4)."""
        fence = self.fence(segment)
        applied = epoch
        if "ignore_fence" in self.world.config.flaws and epoch < fence:
            applied = fence  # the flaw: a store that lets a stale writer through
        try:
            result = self.core.write(segment, applied, acked, entries)
        except StoreRefused as refused:
            self.world.checker.write_attempted(self.name, segment, epoch, fence, False)
            return m.Refused(refused.fence)
        self.world.checker.write_attempted(self.name, segment, epoch, fence, True)
        touched = (entries[0].index, entries[-1].index) if entries else (1, 0)
        self.world.checker.store_changed(self.name, self.core, segment, touched)
        return result

    def handle(self, message: Message) -> None:
        self._handle(message)
        self.tails.pump_all()  # Subscribe: what changed may be pushed now

    def _handle(self, message: Message) -> None:
        body = message.body
        if message.stream and self.tails.handle(message):
            return
        if isinstance(body, m.WriteRequest):
            self._stream_write(message, body)
            return
        assert isinstance(body, m.Call)
        self.answer(message, self._serve(body.request))

    def _stream_write(self, message: Message, request: m.WriteRequest) -> None:
        net = self.world.net
        if request.entries and self.world.rng.random() < self.world.config.busy:
            meta = self.core.meta(request.segment)
            reply = m.WriteReply(
                request.request_id,
                True,
                meta.matched_index if meta else 0,
                meta.acked_index if meta else 0,
                request.entries[0].index,
                request.entries[-1].index,
            )
            net.stream_send(message.stream, self.name, message.src, reply)
            return
        result = self.write(
            request.segment, request.writer_epoch, request.acked_index, request.entries
        )
        if isinstance(result, m.Refused):
            # FAILED_PRECONDITION ends the stream: the status is its last message.
            net.stream_send(message.stream, self.name, message.src, result)
            return
        first = request.entries[0].index if request.entries else 0
        last = request.entries[-1].index if request.entries else 0
        reply = m.WriteReply(
            request.request_id, False, result.matched_index, result.acked_index, first, last
        )
        net.stream_send(message.stream, self.name, message.src, reply)

    def _serve(self, request: object) -> object:
        core = self.core
        checker = self.world.checker
        try:
            if isinstance(request, m.Seal):
                fence = self.fence(request.segment)
                try:
                    result = core.seal(request.segment, request.new_epoch)
                except StoreRefused as refused:
                    return m.Refused(refused.fence)
                checker.write_attempted(self.name, request.segment, request.new_epoch, fence, True)
                checker.store_changed(self.name, core, request.segment, (1, 0))
                return result
            if isinstance(request, m.Read):
                entries = core.read(request.segment, request.from_index, request.to_index)
                return m.ReadReply(tuple(entries), self.fence(request.segment))
            if isinstance(request, m.RecoveryWrite):
                return self.write(
                    request.segment, request.writer_epoch, request.acked_index, request.entries
                )
        except SegmentNotFound as error:
            return error
        raise AssertionError(f"unknown request {request!r}")
