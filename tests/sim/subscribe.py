"""The Subscribe push protocol over the simulated network: its messages, and the store
node's side, which drives the real `segment_store.core.tail.TailStream` as the
servicer's pump does (`streamengine.segment_store.tail`, `_Tail`).

A subscriber opens a stream to a store and sends `SubscribeStart`, then a
`SubscriberKeepalive` every interval; the store pushes `PushedPosition` first, then
`PushedBatch`es of acked entries (the token is the last index), `PushedKeepalive`s,
and ends a stream with `Dropped` (the status a gRPC abort carries). The network keeps a
stream's order or breaks it; there is no flow control, so the store's buffer never
fills and "slow" drops do not happen here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamengine.protocol.entry import StoredEntry
from streamengine.protocol.limits import WRITE_BATCH_ENTRIES_MAX
from streamengine.segment_store.core import tail
from streamengine.segment_store.core.commands import SegmentKey
from tests.sim.messages import show_entries, show_segment
from tests.sim.network import Message

if TYPE_CHECKING:
    from tests.sim.store_node import StoreNode


@dataclass(frozen=True, slots=True)
class SubscribeStart:
    segment: SegmentKey
    from_index: int
    batch_entries: int
    keepalive_ms: int

    def __str__(self) -> str:
        return f"Subscribe({show_segment(self.segment)}, {self.from_index}..)"


@dataclass(frozen=True, slots=True)
class SubscriberKeepalive:
    pass


@dataclass(frozen=True, slots=True)
class PushedPosition:
    position: tail.Position


@dataclass(frozen=True, slots=True)
class PushedBatch:
    entries: tuple[StoredEntry, ...]

    def __str__(self) -> str:
        return f"PushedBatch({show_entries(self.entries)})"


@dataclass(frozen=True, slots=True)
class PushedKeepalive:
    pass


@dataclass(frozen=True, slots=True)
class Dropped:
    reason: str
    detail: str


@dataclass(slots=True)
class _Tail:
    segment: SegmentKey
    subscriber: str
    stream: tail.TailStream
    wake_at_ms: int | None = None


class TailServer:
    """The open Subscribe streams of one store node."""

    def __init__(self, store: StoreNode) -> None:
        self.store = store
        self.tails: dict[int, _Tail] = {}

    def handle(self, message: Message) -> bool:
        """Take a message of a Subscribe stream; False if it is not one."""
        body = message.body
        now = self.store.world.now
        if isinstance(body, SubscribeStart):
            settings = tail.TailSettings.asked(
                body.batch_entries, body.keepalive_ms, WRITE_BATCH_ENTRIES_MAX
            )
            stream = tail.TailStream(body.from_index, settings, now)
            self.tails[message.stream] = _Tail(body.segment, message.src, stream)
            self.pump(message.stream)
            return True
        if isinstance(body, SubscriberKeepalive):
            found = self.tails.get(message.stream)
            if found is not None:
                found.stream.on_heard(now)
            return True
        return False

    def pump_all(self) -> None:
        """After anything that may have changed a segment (writes, seals)."""
        for number in sorted(self.tails):
            self.pump(number)

    def pump(self, number: int) -> None:
        store = self.store
        net = store.world.net
        found = self.tails.get(number)
        if found is None:
            return
        while True:
            if not net.stream_open(number):
                del self.tails[number]
                return
            action = found.stream.step(self._position(found.segment), 0, store.world.now)
            if isinstance(action, tail.WaitUntil):
                self._wake(number, found, action.until_ms)
                return
            if isinstance(action, tail.Drop):
                net.stream_send(number, store.name, found.subscriber, Dropped(action.reason, ""))
                del self.tails[number]
                return
            net.stream_send(number, store.name, found.subscriber, self._carry_out(found, action))

    def _carry_out(self, found: _Tail, action: tail.Action) -> object:
        if isinstance(action, tail.SendPosition):
            return PushedPosition(action.position)
        if isinstance(action, tail.SendKeepalive):
            return PushedKeepalive()
        assert isinstance(action, tail.ReadBatch)
        entries = tuple(
            self.store.core.reader.read(
                found.segment, action.from_index, action.to_index, limit=action.entries_max
            )
        )
        last = entries[-1].index if entries else action.from_index - 1
        found.stream.on_read(action, last, self.store.world.now)
        return PushedBatch(entries)

    def _position(self, segment: SegmentKey) -> tail.Position:
        meta = self.store.core.catalog.meta(segment)
        if meta is None:
            return tail.Position(0, 0, 0)
        served = meta.acked_index
        if "serve_matched" in self.store.world.config.flaws:
            # The flaw: a store that trusts its matched index when serving readers.
            served = meta.matched_index
        return tail.Position(served, meta.fence, meta.bridge_index)

    def _wake(self, number: int, found: _Tail, at_ms: int) -> None:
        if found.wake_at_ms is not None and found.wake_at_ms <= at_ms:
            return
        found.wake_at_ms = at_ms

        def wake() -> None:
            if found.wake_at_ms == at_ms:
                found.wake_at_ms = None
                self.pump(number)

        self.store.timer(max(at_ms - self.store.world.now, 0), f"tail #{number} wakes", wake)
