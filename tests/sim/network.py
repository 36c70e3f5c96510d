"""Virtual time and a faulty network, on one thread, driven by one `random.Random`.

`Scheduler` is a heap of (time, order, label, callback): the order breaks ties in the
order things were scheduled, so a seed replays exactly. `Network` carries two kinds of
traffic, as gRPC does:

- unary messages (heartbeats, seals, reads, recovery writes, seals at the master): each
  may be lost, duplicated (a retry whose first attempt arrived after all) or delayed,
  and so arrives in any order;
- streams (a writer's bidirectional Write stream to one store): messages arrive in the
  order sent or not at all. A lost message breaks the stream (as a TCP reset or a
  deadline would): everything still in flight on it is dropped and both ends learn it
  after a detection delay. What a stream carries reaches only the process it was sent
  to: a receiver that crashed since (a new incarnation) never gets it, as a restarted
  process gets nothing of its predecessor's connections.

A partition cuts a pair of nodes both ways; it breaks the streams between them and drops
what is in flight between them at delivery time.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Faults:
    """Per-seed fault rates; `Faults.none()` for the liveness phase."""

    loss: float
    duplicate: float
    delay_ms_max: int
    # A few messages take much longer (a stalled connection, a slow GC on the peer).
    slow: float
    slow_delay_ms_max: int

    @staticmethod
    def none() -> Faults:
        return Faults(loss=0.0, duplicate=0.0, delay_ms_max=3, slow=0.0, slow_delay_ms_max=3)

    @staticmethod
    def draw(rng: random.Random) -> Faults:
        return Faults(
            loss=rng.choice((0.0, 0.01, 0.03, 0.08)),
            duplicate=rng.choice((0.0, 0.02, 0.08)),
            delay_ms_max=rng.choice((2, 8, 20)),
            slow=rng.choice((0.0, 0.01, 0.05)),
            slow_delay_ms_max=rng.choice((100, 400, 900)),
        )


class Scheduler:
    def __init__(self) -> None:
        self.now_ms = 0
        self._heap: list[tuple[int, int, object, Callable[[], None]]] = []
        self._order = 0

    def at(self, time_ms: int, label: object, callback: Callable[[], None]) -> None:
        assert time_ms >= self.now_ms, f"scheduling {label} in the past"
        self._order += 1
        heapq.heappush(self._heap, (time_ms, self._order, label, callback))

    def after(self, delay_ms: int, label: object, callback: Callable[[], None]) -> None:
        self.at(self.now_ms + delay_ms, label, callback)

    def pop(self) -> tuple[object, Callable[[], None]] | None:
        if not self._heap:
            return None
        time_ms, _, label, callback = heapq.heappop(self._heap)
        self.now_ms = time_ms
        return label, callback

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(frozen=True, slots=True)
class Message:
    src: str
    dst: str
    body: object
    stream: int = 0  # 0: a unary message
    # A stream message: the receiver's incarnation when it was sent (-1: any).
    dst_incarnation: int = -1

    def __str__(self) -> str:
        via = f" [stream {self.stream}]" if self.stream else ""
        return f"{self.src}->{self.dst}{via} {self.body}"


@dataclass(slots=True)
class _Stream:
    a: str
    b: str
    open: bool = True
    # Per direction, when the last message sent is delivered: later ones come after it.
    last_delivery_ms: dict[str, int] = field(default_factory=dict)
    on_break: dict[str, Callable[[], None]] = field(default_factory=dict)


# How long an end takes to notice a broken stream (keepalive, RST).
BREAK_DETECTION_MS_MAX = 30


class Network:
    def __init__(
        self,
        scheduler: Scheduler,
        rng: random.Random,
        faults: Faults,
        deliver: Callable[[Message], None],
        incarnation_of: Callable[[str], int] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self._incarnation_of = incarnation_of
        self.rng = rng
        self.faults = faults
        self._deliver = deliver
        self._streams: dict[int, _Stream] = {}
        self._next_stream = 1
        # Streams closed by a crash of one end: what that end sent before it died is
        # still in the network and arrives (the kernel flushes a dead process's socket).
        self._draining: dict[int, str] = {}
        self.cuts: set[tuple[str, str]] = set()

    # ---- partitions ----

    def partitioned(self, a: str, b: str) -> bool:
        return (min(a, b), max(a, b)) in self.cuts

    def cut(self, a: str, b: str) -> None:
        self.cuts.add((min(a, b), max(a, b)))
        for number, stream in sorted(self._streams.items()):
            if {stream.a, stream.b} == {a, b}:
                self.break_stream(number)

    def heal(self) -> None:
        self.cuts.clear()

    def _incarnation(self, node: str) -> int:
        """`node`'s incarnation, -1 when the network is not told (any matches)."""
        return self._incarnation_of(node) if self._incarnation_of is not None else -1

    # ---- unary ----

    def _delay(self) -> int:
        f = self.faults
        if f.slow and self.rng.random() < f.slow:
            return self.rng.randint(1, f.slow_delay_ms_max)
        return self.rng.randint(1, f.delay_ms_max)

    def send(self, src: str, dst: str, body: object) -> None:
        if self.partitioned(src, dst) or self.rng.random() < self.faults.loss:
            return
        copies = 2 if self.rng.random() < self.faults.duplicate else 1
        for _ in range(copies):
            self._schedule(Message(src, dst, body), self._delay())

    def _schedule(self, message: Message, delay_ms: int) -> None:
        def arrive() -> None:
            if self.partitioned(message.src, message.dst):
                return
            closed = message.stream and not self.stream_open(message.stream)
            if closed and self._draining.get(message.stream) != message.src:
                return
            if message.stream and message.dst_incarnation != self._incarnation(message.dst):
                return
            self._deliver(message)

        self.scheduler.after(delay_ms, message, arrive)

    # ---- streams ----

    def open_stream(
        self, a: str, b: str, on_break_a: Callable[[], None], on_break_b: Callable[[], None]
    ) -> int:
        number = self._next_stream
        self._next_stream += 1
        self._streams[number] = _Stream(a, b, on_break={a: on_break_a, b: on_break_b})
        return number

    def stream_open(self, number: int) -> bool:
        stream = self._streams.get(number)
        return stream is not None and stream.open

    def stream_send(self, number: int, src: str, dst: str, body: object) -> None:
        stream = self._streams.get(number)
        if stream is None or not stream.open:
            return
        if self.partitioned(src, dst) or self.rng.random() < self.faults.loss:
            self.break_stream(number)
            return
        now = self.scheduler.now_ms
        at = max(stream.last_delivery_ms.get(src, now), now + self._delay())
        stream.last_delivery_ms[src] = at
        self._schedule(Message(src, dst, body, number, self._incarnation(dst)), at - now)

    def break_stream(self, number: int) -> None:
        stream = self._streams.pop(number, None)
        if stream is None:
            return
        stream.open = False
        for end in (stream.a, stream.b):
            notify = stream.on_break[end]
            delay = self.rng.randint(1, BREAK_DETECTION_MS_MAX)
            self.scheduler.after(delay, f"{end} notices stream {number} broke", notify)

    def break_streams_of(self, node: str) -> None:
        """`node` died: its streams close; what it had sent still arrives."""
        for number, stream in sorted(self._streams.items()):
            if node in (stream.a, stream.b):
                self._draining[number] = node
                self.break_stream(number)
