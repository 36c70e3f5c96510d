"""A harness-owned TCP proxy per directed link: delay and jitter, blackholes, throttles
and resets, where `tc netem` is missing (FAULTS.md §2; the etcd robustness suite's
approach).

    host = ProxyHost().start()
    link = host.link("w1>store2", upstream="127.0.0.1:7071",   # listens on 127.0.0.1:<free>
                     also=["127.0.0.1:7072"])                  # the store's data port too
    ...the process dials link.address instead of the store (link.dial: every port)...
    link.set(delay_s=0.1, jitter_s=0.05)     # every chunk, both directions, order kept
    link.set(rate_bytes_per_s=32_000)        # a thin pipe, each direction
    link.set(blackhole=True)                 # bytes held, nothing forwarded, until healed
    link.reset()                             # every open connection closed with a RST
    link.set(refuse=True)                    # new connections reset at once
    link.heal()
    host.close()

A link is the path to one server: a listening socket per port of it (`upstream`, and
`also` for its other ports, as a store's data port beside its gRPC port), every one
under the link's faults, so a fault on the link reaches whatever the process sends that
server. Each accepted connection opens its own upstream connection and pumps bytes both
ways. A pump reads a chunk, stamps it with the moment it
may leave (now + delay ± jitter, never before the previous chunk: TCP keeps order), and a
writer sends it then, at the link's rate. A blackhole holds bytes rather than dropping
them: a real blackhole shorter than TCP's retransmission timeout loses nothing either,
it only delays; what a peer notices is silence (gRPC keepalive and deadlines). Each
direction buffers at most `QUEUE_BYTES_MAX`, after which the proxy stops reading and the
sender's socket fills, as a slow path's window would.

The proxies run on one asyncio loop in a daemon thread of the harness; the control
methods may be called from any thread and return once the change is in force.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK_BYTES = 64 * 1024
# Bytes held per direction of one connection (delayed, throttled or blackholed) before
# the proxy stops reading from the sender.
QUEUE_BYTES_MAX = 4 << 20
# A throttled direction sends at most this much at a time, so its rate stays smooth.
THROTTLED_SLICE_BYTES = 4096
# The token bucket of a throttled link holds at most this long a burst.
BURST_S = 0.05
CONTROL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LinkFaults:
    """What a link does to its traffic now; the default passes it through unchanged."""

    delay_s: float = 0.0
    jitter_s: float = 0.0  # each chunk's delay is uniform in delay ± jitter (at least 0)
    rate_bytes_per_s: float = 0.0  # per direction; 0: unlimited
    blackhole: bool = False  # hold every byte, both directions, until healed
    refuse: bool = False  # reset new connections at once

    @property
    def clean(self) -> bool:
        return self == LinkFaults()


class _Bucket:
    """A token bucket: `take(n)` waits until n bytes may pass at the link's rate."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.at = time.monotonic()

    async def take(self, count: int, rate: float) -> None:
        if rate <= 0:
            return
        now = time.monotonic()
        self.tokens = min(self.tokens + (now - self.at) * rate, max(rate * BURST_S, count))
        self.at = now
        self.tokens -= count
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / rate)


class _Direction:
    """One direction of one proxied connection: bytes waiting to leave, in order."""

    def __init__(self) -> None:
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued_bytes = 0
        self.changed = asyncio.Event()  # something queued, or the link's faults changed
        self.room = asyncio.Event()  # below QUEUE_BYTES_MAX again
        self.room.set()
        self.last_due = 0.0
        self.ended = False  # the sender closed: send what is queued, then close

    def wake(self) -> None:
        self.changed.set()


class Link:
    """One directed link: a listening socket per upstream address (the ports of one
    server), forwarding every connection to its upstream."""

    def __init__(
        self, host: ProxyHost, name: str, upstreams: Sequence[str], listen_host: str
    ) -> None:
        self.host = host
        self.name = name
        self.upstreams = list(upstreams)
        self.listen_host = listen_host
        self.faults = LinkFaults()
        self.rng = random.Random(name)
        self.buckets = {"up": _Bucket(), "down": _Bucket()}
        self.connections: set[_Connection] = set()
        self.servers: list[asyncio.Server] = []
        self.ports: dict[str, int] = {}  # upstream address -> the port listening for it
        # Counters, for tests and reports.
        self.accepted = 0
        self.bytes = {"up": 0, "down": 0}

    @property
    def address(self) -> str:
        """Where to dial the first upstream (the server's main port)."""
        return self.address_of(self.upstreams[0])

    def address_of(self, upstream: str) -> str:
        return f"{self.listen_host}:{self.ports[upstream]}"

    @property
    def dial(self) -> dict[str, str]:
        """Each upstream address and the link's address to dial instead."""
        return {upstream: self.address_of(upstream) for upstream in self.upstreams}

    async def _open(self) -> None:
        for upstream in self.upstreams:
            host, port = upstream.rsplit(":", 1)
            accept = functools.partial(self._accept, (host, int(port)))
            server = await asyncio.start_server(accept, self.listen_host, 0)
            self.servers.append(server)
            self.ports[upstream] = server.sockets[0].getsockname()[1]

    # ---- control, from any thread ----

    def set(self, **changes: Any) -> LinkFaults:
        """Change some of the link's faults (the others stay); returns the new ones."""
        return self.host.call(self._set(replace(self.faults, **changes)))

    def heal(self) -> None:
        self.host.call(self._set(LinkFaults()))

    def reset(self) -> int:
        """Close every open connection with a RST; returns how many."""
        return self.host.call(self._reset())

    async def _set(self, faults: LinkFaults) -> LinkFaults:
        self.faults = faults
        for connection in list(self.connections):
            connection.wake()
        return faults

    async def _reset(self) -> int:
        connections = list(self.connections)
        for connection in connections:
            connection.abort()
        return len(connections)

    async def _close(self) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.connections):
            connection.abort()

    # ---- the data path ----

    async def _accept(
        self,
        upstream: tuple[str, int],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.accepted += 1
        if self.faults.refuse:
            _abort_with_reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*upstream), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            _abort_with_reset(writer)
            return
        connection = _Connection(self, (reader, writer), (up_reader, up_writer))
        self.connections.add(connection)
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)

    def due(self, direction: _Direction) -> float:
        """When a chunk read now may leave: after the delay, never before the last one."""
        faults = self.faults
        delay = faults.delay_s
        if faults.jitter_s:
            delay += self.rng.uniform(-faults.jitter_s, faults.jitter_s)
        due = max(time.monotonic() + max(delay, 0.0), direction.last_due)
        direction.last_due = due
        return due


class _Connection:
    """One proxied connection: a pump per direction (read side and write side)."""

    def __init__(
        self,
        link: Link,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.link = link
        self.client = client
        self.upstream = upstream
        self.directions = {"up": _Direction(), "down": _Direction()}

    def wake(self) -> None:
        for direction in self.directions.values():
            direction.wake()

    def abort(self) -> None:
        for _, writer in (self.client, self.upstream):
            _abort_with_reset(writer)

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                for name, source, target in (
                    ("up", self.client[0], self.upstream[1]),
                    ("down", self.upstream[0], self.client[1]),
                ):
                    tasks.create_task(self._read(name, source))
                    tasks.create_task(self._write(name, target))
        except* OSError:
            self.abort()  # one side reset: so is the other, as on a real path
        finally:
            for _, writer in (self.client, self.upstream):
                writer.close()

    async def _read(self, name: str, source: asyncio.StreamReader) -> None:
        direction = self.directions[name]
        while True:
            await direction.room.wait()
            data = await source.read(CHUNK_BYTES)
            if not data:
                direction.ended = True
                direction.wake()
                return
            direction.queue.append((self.link.due(direction), data))
            direction.queued_bytes += len(data)
            if direction.queued_bytes >= QUEUE_BYTES_MAX:
                direction.room.clear()
            direction.wake()

    async def _write(self, name: str, target: asyncio.StreamWriter) -> None:
        direction = self.directions[name]
        bucket = self.link.buckets[name]
        while True:
            if not direction.queue:
                if direction.ended:
                    # The sender closed and everything it sent has left: pass the FIN on.
                    with contextlib.suppress(OSError):
                        target.write_eof()
                    return
                direction.changed.clear()
                await direction.changed.wait()
                continue
            faults = self.link.faults
            due, data = direction.queue[0]
            wait_s = due - time.monotonic()
            if faults.blackhole or wait_s > 0:
                direction.changed.clear()
                # Woken early by a change of faults (a heal), else at the chunk's moment.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        direction.changed.wait(), None if faults.blackhole else wait_s
                    )
                continue
            rate = faults.rate_bytes_per_s
            piece = data[:THROTTLED_SLICE_BYTES] if rate > 0 else data
            await bucket.take(len(piece), rate)
            if self.link.faults.blackhole:
                continue  # blackholed while waiting for the bucket: hold the piece
            # Counted before it is handed to the socket: the write may send at once, and
            # the peer (a test on another thread) may read the piece and check the count
            # before this thread runs its next line.
            self.link.bytes[name] += len(piece)
            target.write(piece)
            await target.drain()
            if len(piece) < len(data):
                direction.queue[0] = (due, data[len(piece) :])
            else:
                direction.queue.popleft()
            direction.queued_bytes -= len(piece)
            if direction.queued_bytes < QUEUE_BYTES_MAX:
                direction.room.set()


def _abort_with_reset(writer: asyncio.StreamWriter) -> None:
    """Close at once with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class ProxyHost:
    """The asyncio loop (a daemon thread) that runs every link of a run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.links: dict[str, Link] = {}
        self._thread = threading.Thread(target=self._run, name="fault-proxies", daemon=True)

    def start(self) -> ProxyHost:
        self._thread.start()
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the proxies' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(CONTROL_TIMEOUT_S)

    def link(
        self, name: str, upstream: str, listen_host: str = "127.0.0.1", also: Sequence[str] = ()
    ) -> Link:
        """A new link to `upstream` (and to the same server's other ports, `also`),
        each listening on a free port of `listen_host`."""
        assert name not in self.links, f"link {name} exists"
        link = Link(self, name, [upstream, *also], listen_host)
        self.call(link._open())
        self.links[name] = link
        return link

    def heal(self) -> None:
        for link in self.links.values():
            if not link.faults.clean:
                link.heal()

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def close_all() -> None:
            for link in self.links.values():
                await link._close()

        with contextlib.suppress(Exception):
            self.call(close_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CONTROL_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()
