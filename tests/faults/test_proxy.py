"""The fault proxy against a real echo server on 127.0.0.1: bytes pass unchanged and in
order, delay and throttle cost the time they say, a blackhole holds bytes and releases
them intact when healed, a reset is a TCP RST, a refusing link resets new connections."""

from __future__ import annotations

import asyncio
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from streamengine.client import StreamClient
from streamengine.testing import Cluster
from tests.faults.proxy import Link, ProxyHost

pytestmark = pytest.mark.timeout(60)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except ConnectionResetError:
            pass  # the reset tests


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo() -> Iterator[str]:
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def link(echo: str) -> Iterator[Link]:
    host = ProxyHost().start()
    try:
        yield host.link("test>echo", echo)
    finally:
        host.close()


def connect(link: Link, timeout_s: float = 10.0) -> socket.socket:
    host, port = link.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def receive(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {count} bytes")
        data += chunk
    return bytes(data)


def round_trip(sock: socket.socket, data: bytes) -> bytes:
    """Send `data` while reading the echo (a large message would fill both windows)."""
    sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    sender.start()
    echoed = receive(sock, len(data))
    sender.join(10)
    return echoed


def test_bytes_pass_unchanged(link: Link) -> None:
    data = os.urandom(3 << 20)
    with connect(link) as sock:
        assert round_trip(sock, data) == data
    assert link.bytes["up"] == link.bytes["down"] == len(data)


def test_delay_applies_each_way(link: Link) -> None:
    link.set(delay_s=0.15)
    with connect(link) as sock:
        started = time.monotonic()
        assert round_trip(sock, b"ping") == b"ping"
        elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 2.0, elapsed


def test_jitter_keeps_order(link: Link) -> None:
    link.set(delay_s=0.02, jitter_s=0.02)
    messages = [f"{n:05d};".encode() for n in range(300)]
    with connect(link) as sock:
        for message in messages:
            sock.sendall(message)
        assert receive(sock, sum(map(len, messages))) == b"".join(messages)


def test_blackhole_holds_then_releases(link: Link) -> None:
    with connect(link) as sock:
        assert round_trip(sock, b"before") == b"before"
        link.set(blackhole=True)
        sock.sendall(b"held")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(16)  # nothing comes back while blackholed
        link.heal()
        sock.settimeout(10)
        assert receive(sock, 4) == b"held"


def test_throttle_limits_the_rate(link: Link) -> None:
    rate = 64_000
    link.set(rate_bytes_per_s=rate)
    data = os.urandom(rate)
    with connect(link) as sock:
        started = time.monotonic()
        assert round_trip(sock, data) == data
        elapsed = time.monotonic() - started
    # Both directions run at the rate, pipelined: about one second for `rate` bytes.
    assert 0.8 <= elapsed < 6.0, elapsed


def test_a_link_covers_each_port_of_its_server_under_the_same_faults(echo: str) -> None:
    other = _EchoServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    second = f"127.0.0.1:{other.server_address[1]}"
    host = ProxyHost().start()
    try:
        link = host.link("test>echo", echo, also=[second])
        assert list(link.dial) == [echo, second]
        assert link.address == link.dial[echo] != link.dial[second]
        link.set(blackhole=True)
        socks = [socket.create_connection(_split(link.dial[a]), timeout=10) for a in link.dial]
        for sock in socks:
            sock.sendall(b"held")
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(4)
        link.heal()
        for sock in socks:
            sock.settimeout(10)
            assert receive(sock, 4) == b"held"
            sock.close()
    finally:
        host.close()
        other.shutdown()
        other.server_close()


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def assert_reset(sock: socket.socket) -> None:
    """The peer reset the connection (a RST, not a FIN: recv raises, not b"")."""
    with pytest.raises(ConnectionResetError):
        sock.sendall(b"?")
        sock.recv(1)


def test_reset_and_refuse(link: Link) -> None:
    with connect(link) as sock:
        assert round_trip(sock, b"x") == b"x"
        assert link.reset() == 1
        assert_reset(sock)
    link.set(refuse=True)
    # The kernel accepts, the proxy resets at once: seen at connect or at first use.
    with pytest.raises(ConnectionResetError), connect(link) as sock:
        sock.sendall(b"?")
        sock.recv(1)
    link.heal()
    with connect(link) as sock:
        assert round_trip(sock, b"back") == b"back"


async def test_client_reaches_stores_through_proxies(cluster: Cluster) -> None:
    """`StreamClient(dial=...)` sends each store's traffic, its data port's included,
    through its link; with one store blackholed, appends still reach the other two
    (W=2) and reads still work."""
    host = ProxyHost().start()
    try:
        links = {
            s.address: host.link(f"client>{s.name}", s.address, also=[s.data_address])
            for s in cluster.stores
        }
        dial = {advertised: via for link in links.values() for advertised, via in link.dial.items()}
        async with StreamClient(cluster.master_address, dial=dial) as client:
            await client.create_stream("proxy/events", replicas=3, write_quorum=2)
            async with client.writer("proxy/events") as writer:
                first = await writer.append_batch([b"a%d" % n for n in range(50)])
                blackholed = next(iter(links.values()))
                blackholed.set(blackhole=True)
                second = await asyncio.wait_for(
                    writer.append_batch([b"b%d" % n for n in range(50)]), 10
                )
                blackholed.heal()
            read = [event.sequence async for event in client.read("proxy/events")]
        assert read[: len(first) + len(second)] == [*first, *second]
        assert all(link.bytes["up"] > 0 for link in links.values())
    finally:
        host.close()
