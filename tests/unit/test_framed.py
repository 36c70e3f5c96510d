"""The data plane's asyncio shell (protocol/framed.py, framed_server.py) over real
sockets on 127.0.0.1: requests multiplexed on a connection, errors with their statuses
and fence details, credits holding a sender back, the hello refusing what it cannot
serve, dead peers dropped, TLS identities (the handshake's certificate, the hello's
token), and the seams the simulator replaces."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from streamengine.protocol import auth, framed, framed_peer, framing
from streamengine.protocol.framed import HELLO_TIMEOUT_MS, CallError, DataConnection
from streamengine.protocol.framed_server import ServerCall
from streamengine.protocol.framing import Kind, StatusCode, VersionRange
from streamengine.protocol.limits import FRAME_PAYLOAD_BYTES_MAX
from streamengine.protocol.status import FENCE_METADATA_KEY
from streamengine.protocol.transport import Transport, server_ssl_context
from streamengine.testing.ports import free_port
from streamengine.tools import certs
from streamengine.v1 import data_plane_pb2, segment_store_pb2
from tests.unit import data_servers

DEADLINE_S = data_servers.DEADLINE_S
TENANT = auth.Principal(auth.PrincipalKind.TENANT, "t1", tenant="acme", role=auth.Role.WRITE)


def reply_to(request: Any) -> segment_store_pb2.WriteReply:
    return segment_store_pb2.WriteReply(request_id=request.request_id, matched_index=7)


async def echo(call: ServerCall) -> None:
    async for request in call:
        await call.send(reply_to(request))


def accept_any(identity: auth.Principal, token: str | None) -> auth.Principal | auth.Denial:
    if token is None:
        return identity
    return TENANT if token == "good" else auth.Denial("the token is not valid here")


def serving(
    handler: Callable[[ServerCall], Awaitable[None]] | None = echo,
    context: Any = None,
    **options: Any,
) -> contextlib.AbstractAsyncContextManager[str]:
    handlers = {Kind.WRITE_REQUEST: handler} if handler else {}
    return data_servers.serving(handlers, accept_any, context, **options)


def request(request_id: int, size: int = 0) -> segment_store_pb2.WriteRequest:
    return segment_store_pb2.WriteRequest(request_id=request_id, packed_values=b"v" * size)


async def test_requests_are_answered_in_order_and_multiplexed() -> None:
    async with serving() as address, framed.connect(address, Transport()) as connection:
        first = await connection.call(framing.WRITE)
        second = await connection.call(framing.WRITE)
        assert first.request_id != second.request_id
        for n in range(3):
            await first.send(request(n))
            await second.send(request(100 + n))
        await first.end()
        await second.end()
        firsts = [await first.receive() for _ in range(4)]
        seconds = [await second.receive() for _ in range(4)]
    assert [r.request_id for r in firsts[:3]] == [0, 1, 2] and firsts[3] is None  # type: ignore[union-attr]
    assert [r.request_id for r in seconds[:3]] == [100, 101, 102] and seconds[3] is None  # type: ignore[union-attr]


async def test_already_serialized_parts_go_as_one_message() -> None:
    data = request(5, size=300).SerializeToString()
    async with serving() as address, framed.connect(address, Transport()) as connection:
        call = await connection.call(framing.WRITE)
        await call.send_parts([data[:10], data[10:]])
        reply = await call.receive()
    assert isinstance(reply, segment_store_pb2.WriteReply) and reply.request_id == 5


async def test_large_messages_go_by_the_sender_threads_in_order_with_small_ones() -> None:
    """A message of `THREADED_SEND_BYTES_MIN` or more leaves from a sender thread; the
    small ones and the control frames (credits, the end) written meanwhile follow it,
    so the server reads every message whole and in the order sent."""
    sizes = [framed_peer.THREADED_SEND_BYTES_MIN, 10, 3 << 20, 0, 200 << 10, 5]
    seen: list[int] = []

    async def sizes_of(call: ServerCall) -> None:
        async for message in call:
            seen.append(len(message.packed_values))  # type: ignore[attr-defined]
            await call.send(reply_to(message))

    async with serving(sizes_of) as address, framed.connect(address, Transport()) as connection:
        call = await connection.call(framing.WRITE)
        sends = [asyncio.ensure_future(call.send(request(n, size))) for n, size in enumerate(sizes)]
        await asyncio.gather(*sends)
        assert connection.peer._thread_socket is not None  # the large ones went by thread
        await call.end()
        replies = [await call.receive() for _ in range(len(sizes) + 1)]
    assert seen == sizes
    assert [r.request_id for r in replies[:-1]] == list(range(len(sizes)))  # type: ignore[union-attr]
    assert replies[-1] is None


async def test_an_error_carries_its_status_and_the_fence() -> None:
    async def fenced(call: ServerCall) -> None:
        await call.receive()
        raise CallError(
            StatusCode.FAILED_PRECONDITION, "below the fence", {FENCE_METADATA_KEY: "9"}
        )

    async with serving(fenced) as address, framed.connect(address, Transport()) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(request(1))
        with pytest.raises(CallError) as raised:
            await call.receive()
        # The call is over; the connection goes on.
        with pytest.raises(CallError):
            await call.send(request(2))
        again = await connection.call(framing.WRITE)
        await again.send(request(3))
        with pytest.raises(CallError):
            await again.receive()
    assert raised.value.code is StatusCode.FAILED_PRECONDITION
    assert raised.value.metadata == {FENCE_METADATA_KEY: "9"}


async def test_a_method_not_served_is_unimplemented() -> None:
    async with serving(None) as address, framed.connect(address, Transport()) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(request(1))
        with pytest.raises(CallError) as raised:
            await call.receive()
    assert raised.value.code is StatusCode.UNIMPLEMENTED


async def test_a_handler_failing_answers_internal_and_the_connection_goes_on() -> None:
    async def broken(call: ServerCall) -> None:
        raise RuntimeError("a bug")

    async with serving(broken) as address, framed.connect(address, Transport()) as connection:
        for _ in range(2):
            call = await connection.call(framing.WRITE)
            await call.send(request(1))
            with pytest.raises(CallError) as raised:
                await call.receive()
            assert raised.value.code is StatusCode.INTERNAL


async def test_credit_holds_a_writer_back_until_the_server_reads() -> None:
    reading = asyncio.Event()

    async def slow(call: ServerCall) -> None:
        await reading.wait()
        await echo(call)

    payload_max, credit = 1024, 2 * 1040
    async with (
        serving(slow, frame_payload_bytes_max=payload_max, stream_credit_bytes=credit) as address,
        framed.connect(address, Transport()) as connection,
    ):
        call = await connection.call(framing.WRITE)
        # Ids 1-127 serialize alike: each frame costs the same.
        frame_bytes = framing.HEADER.size + len(request(1, 500).SerializeToString())
        sent = 0
        while call._stream.credit.can_send(frame_bytes):
            sent += 1
            await call.send(request(sent, 500))
        assert sent == credit // frame_bytes  # all the server granted, no more
        blocked = asyncio.ensure_future(call.send(request(sent + 1, 500)))
        await asyncio.sleep(0)
        assert not blocked.done()
        reading.set()
        await blocked  # the server read: credit came back
        await call.end()
        replies = [await call.receive() for _ in range(sent + 2)]
    assert replies[-1] is None and len([r for r in replies if r is not None]) == sent + 1


async def test_a_request_over_the_servers_bound_is_refused_before_sending() -> None:
    async with (
        serving(frame_payload_bytes_max=1024, stream_credit_bytes=4096) as address,
        framed.connect(address, Transport()) as connection,
    ):
        call = await connection.call(framing.WRITE)
        with pytest.raises(CallError) as raised:
            await call.send(request(1, 2000))
    assert raised.value.code is StatusCode.RESOURCE_EXHAUSTED


async def test_cancel_stops_the_handler() -> None:
    started, stopped = asyncio.Event(), asyncio.Event()

    async def waits(call: ServerCall) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    async with serving(waits) as address, framed.connect(address, Transport()) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(request(1))
        await started.wait()
        call.cancel()
        await stopped.wait()


async def test_cancel_after_the_clients_end_stops_the_handler_and_frees_the_slot() -> None:
    """A call given up after its End (a read left early) is cancelled at the server, and
    the next call, opened at once on the freed slot, is no request too many: the server
    counts the cancelled one gone as it reads the Cancel, before its handler has ended,
    as the client does (the Cancel and the next request may arrive in one read)."""
    stopped: asyncio.Queue[int] = asyncio.Queue()

    async def waits(call: ServerCall) -> None:
        await call.send(reply_to(await call.receive()))
        try:
            await asyncio.Event().wait()
        finally:
            stopped.put_nowait(call.request_id)

    async with (
        serving(waits, requests_max=2) as address,
        framed.connect(address, Transport()) as connection,
    ):
        for number in range(1, 11):
            call = await connection.call(framing.WRITE)
            await call.send(request(number))
            await call.end()
            assert isinstance(await call.receive(), segment_store_pb2.WriteReply)
            call.cancel()
        assert sorted([await stopped.get() for _ in range(10)]) == list(range(1, 11))
        assert connection.failure is None
        last = await connection.call(framing.WRITE)
        await last.send(request(11))
        assert await last.receive() == reply_to(request(11))


async def test_no_common_version_is_refused_at_hello() -> None:
    async with serving() as address:
        with pytest.raises(CallError) as raised:
            async with framed.connect(address, Transport(), VersionRange(5, 6)):
                pass
    assert raised.value.code is StatusCode.FAILED_PRECONDITION
    assert "upgrade" in raised.value.details


async def raw_exchange(address: str, data: bytes) -> list[framing.Frame]:
    """What a server answers to `data` before it closes the connection."""
    host, port = framed_peer.split_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    decoder = framing.FrameDecoder(FRAME_PAYLOAD_BYTES_MAX)
    frames: list[framing.Frame] = []
    while chunk := await reader.read(1 << 16):
        frames += decoder.feed(chunk)
    writer.close()
    return frames


def hello(credit: int = framing.HEADER.size + FRAME_PAYLOAD_BYTES_MAX) -> bytes:
    message = data_plane_pb2.Hello(version_min=1, version_max=1, stream_credit_bytes=credit)
    return framing.encode(Kind.HELLO, 0, message)


def error_of(frame: framing.Frame) -> data_plane_pb2.Error:
    assert frame.kind is Kind.ERROR and frame.request_id == 0
    error = framing.parse_control(frame)
    assert isinstance(error, data_plane_pb2.Error)
    return error


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", StatusCode.RESOURCE_EXHAUSTED),  # reads as a huge length
        (framing.header(Kind.HELLO, 0, 1 << 20), StatusCode.RESOURCE_EXHAUSTED),
        (framing.encode(Kind.PING, 0, data_plane_pb2.Ping()), StatusCode.INVALID_ARGUMENT),
        (hello(credit=10), StatusCode.INVALID_ARGUMENT),
        (hello() + hello(), StatusCode.INVALID_ARGUMENT),
        (hello() + framing.encode(Kind.END, 5, data_plane_pb2.End()), StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_input_is_answered_with_one_error_and_the_end(
    data: bytes, code: StatusCode
) -> None:
    async with serving() as address:
        frames = await raw_exchange(address, data)
    assert error_of(frames[-1]).code == code
    assert all(frame.kind is Kind.HELLO_OK for frame in frames[:-1])


async def test_a_client_past_its_credit_is_dropped() -> None:
    never = asyncio.Event()

    async def stuck(call: ServerCall) -> None:
        await never.wait()

    frame = framing.encode(Kind.WRITE_REQUEST, 1, request(1, 900))
    async with serving(stuck, frame_payload_bytes_max=1024, stream_credit_bytes=2048) as address:
        frames = await raw_exchange(address, hello() + frame * 3)
    assert error_of(frames[-1]).code == StatusCode.RESOURCE_EXHAUSTED


async def test_a_silent_client_is_dropped() -> None:
    async with serving(ping_interval_ms=50, dead_peer_ms=300) as address:
        frames = await raw_exchange(address, hello())  # then nothing, not even a ping
    assert [frame.kind for frame in frames] == [Kind.HELLO_OK]


async def test_connections_past_the_bound_waiting_for_their_hello_are_closed() -> None:
    """Nobody is known before the hello: a flood of silent connections holds no more
    than `hellos_max` sockets and tasks; one past it is closed at once, and a caller
    that says hello once there is room is served."""
    async with serving(hellos_max=2) as address:
        host, port = framed_peer.split_address(address)
        silent = [await asyncio.open_connection(host, port) for _ in range(2)]
        reader, writer = await asyncio.open_connection(host, port)
        async with asyncio.timeout(HELLO_TIMEOUT_MS / 1000 / 5):  # not by its timeout
            assert await reader.read(1) == b""  # closed without a word
        writer.close()
        for _, held in silent:
            held.close()
        async with asyncio.timeout(DEADLINE_S):
            while True:
                frames = await raw_exchange_first(address, hello())
                if frames:
                    break
        assert frames[0].kind is Kind.HELLO_OK


async def test_a_request_opened_in_the_same_read_as_a_cancel_takes_its_slot() -> None:
    """The Cancel of one request and the next request, in one write at the bound of open
    requests: the next is served, not refused as one too many."""

    def write(request_id: int) -> bytes:
        return framing.encode(Kind.WRITE_REQUEST, request_id, request(request_id))

    cancel = framing.encode(Kind.CANCEL, 1, data_plane_pb2.Cancel())
    end = framing.encode(Kind.END, 3, data_plane_pb2.End())
    async with serving(requests_max=2) as address:
        host, port = framed_peer.split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(hello() + write(1) + write(2) + cancel + write(3) + end)
        decoder = framing.FrameDecoder(FRAME_PAYLOAD_BYTES_MAX)
        frames: list[framing.Frame] = []
        while not any(f.kind in (Kind.END, Kind.ERROR) for f in frames):
            chunk = await reader.read(1 << 16)
            assert chunk, "the server closed the connection"
            frames += decoder.feed(chunk)
        writer.close()
    assert [(f.kind, f.request_id) for f in frames if f.request_id == 3] == [
        (Kind.WRITE_REPLY, 3),
        (Kind.END, 3),
    ]


async def raw_exchange_first(address: str, data: bytes) -> list[framing.Frame]:
    """The first frames a server answers to `data` ([] if it closed at once)."""
    host, port = framed_peer.split_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    decoder = framing.FrameDecoder(FRAME_PAYLOAD_BYTES_MAX)
    frames: list[framing.Frame] = []
    while not frames and (chunk := await reader.read(1 << 16)):
        frames += decoder.feed(chunk)
    writer.close()
    return frames


def raw_hello_ok(ping_interval_ms: int, dead_peer_ms: int) -> bytes:
    """A HelloOk frame, for servers of a test's own that then misbehave."""
    hello_ok = data_plane_pb2.HelloOk(
        version=1,
        stream_credit_bytes=1 << 24,
        frame_payload_bytes_max=1 << 20,
        requests_max=4,
        ping_interval_ms=ping_interval_ms,
        dead_peer_ms=dead_peer_ms,
    )
    return framing.encode(Kind.HELLO_OK, 0, hello_ok)


async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that answers the hello, then reads nothing more and answers nothing."""
    await reader.read(1 << 16)  # the hello
    writer.write(raw_hello_ok(ping_interval_ms=20_000, dead_peer_ms=60_000))
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def raw_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[DataConnection]:
    """A connection to a server of the test's own (`handle`), within the deadline."""
    server = await asyncio.start_server(handle, "127.0.0.1", free_port())
    port = server.sockets[0].getsockname()[1]
    async with (
        asyncio.timeout(DEADLINE_S),
        server,
        framed.connect(f"127.0.0.1:{port}", Transport()) as connection,
    ):
        yield connection


async def test_a_silent_server_fails_the_calls() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(raw_hello_ok(ping_interval_ms=50, dead_peer_ms=300))
        while await reader.read(1 << 16):
            pass  # hears everything, answers no ping

    async with raw_server(mute) as connection:
        call = await connection.call(framing.WRITE)
        with pytest.raises(CallError) as raised:
            await call.receive()
    assert raised.value.code is StatusCode.UNAVAILABLE and "silent" in raised.value.details


async def test_a_server_that_answers_nothing_sent_is_dropped_before_its_dead_peer_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection whose sends go unanswered (the kernel's retransmission backoff after
    a healed partition, a peer that stopped reading) is dropped after
    `UNANSWERED_MS_MAX`, long before the dead-peer time, so that its owner dials anew."""
    monkeypatch.setattr(framed, "UNANSWERED_PROBE_MS", 50)
    monkeypatch.setattr(framed, "UNANSWERED_MS_MAX", 300)

    async with raw_server(deaf) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(request(1))
        started = asyncio.get_running_loop().time()
        with pytest.raises(CallError) as raised:
            await call.receive()
        waited_s = asyncio.get_running_loop().time() - started
    assert raised.value.code is StatusCode.UNAVAILABLE
    assert "answered nothing" in raised.value.details
    assert 0.3 <= waited_s < 5.0


async def test_a_server_found_dead_is_dropped_with_what_was_buffered_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a connection is found unanswered, its holder is out of it at once, though
    bytes for the server still wait in the socket: a graceful close would wait for a
    peer that takes nothing (here a server that stopped reading; in S7 one cut off one
    way, whose buffer went only when TCP's backed-off retransmission got through, 5 s
    after the connection was found dead)."""
    monkeypatch.setattr(framed, "UNANSWERED_PROBE_MS", 50)
    monkeypatch.setattr(framed, "UNANSWERED_MS_MAX", 2_000)
    loop = asyncio.get_running_loop()

    async def flood(call: framed.ClientCall) -> None:
        for number in itertools.count(1):
            await call.send(request(number, size=16_000))

    async with raw_server(deaf) as connection:
        call = await connection.call(framing.WRITE)
        flooding = asyncio.create_task(flood(call))
        transport = connection.peer.writer.transport
        while not transport.get_write_buffer_size():  # the kernel's buffers are full
            assert connection.failure is None, "found dead before its buffer filled"
            await asyncio.sleep(0.01)
        with pytest.raises(CallError) as raised:
            await call.receive()
        found_dead_at = loop.time()
        flooding.cancel()
        with contextlib.suppress(asyncio.CancelledError, CallError):
            await flooding
    assert "answered nothing" in raised.value.details
    assert loop.time() - found_dead_at < 1.0


async def test_a_slow_answer_from_a_server_that_pongs_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's ping is answered at once by a live server: a reply that takes longer
    than `UNANSWERED_MS_MAX` (a slow disk) still comes on the same connection."""
    monkeypatch.setattr(framed, "UNANSWERED_PROBE_MS", 50)
    monkeypatch.setattr(framed, "UNANSWERED_MS_MAX", 200)

    async def slow_echo(call: ServerCall) -> None:
        await asyncio.sleep(0.6)
        await echo(call)

    async with serving(slow_echo) as address, framed.connect(address, Transport()) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(request(7))
        await call.end()
        reply = await call.receive()
        assert reply is not None and connection.failure is None


async def test_nothing_listening_is_unavailable() -> None:
    with pytest.raises(CallError) as raised:
        async with framed.connect(f"127.0.0.1:{free_port()}", Transport()):
            pass
    assert raised.value.code is StatusCode.UNAVAILABLE


async def test_connections_go_through_the_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[tuple[str, int]] = []
    started: list[int] = []
    real_open, real_start = framed.open_connection, framed.start_server

    async def open_connection(host: str, port: int, **kwargs: Any) -> Any:
        opened.append((host, port))
        return await real_open(host, port, **kwargs)

    async def start_server(callback: Any, host: str, port: int, **kwargs: Any) -> Any:
        started.append(port)
        return await real_start(callback, host, port, **kwargs)

    monkeypatch.setattr(framed, "open_connection", open_connection)
    monkeypatch.setattr(framed, "start_server", start_server)
    async with serving() as address, framed.connect(address, Transport()):
        pass
    assert opened == [framed_peer.split_address(address)] and started == [opened[0][1]]


def dials_where_the_first_syns_are_lost(
    monkeypatch: pytest.MonkeyPatch, lost: int
) -> tuple[list[float], list[str]]:
    """`open_connection` whose first `lost` dials hang as a SYN dropped by a partition
    does: when each dial began, and how each unanswered one ended."""
    began: list[float] = []
    ended: list[str] = []
    real_open = framed.open_connection

    async def open_connection(host: str, port: int, **kwargs: Any) -> Any:
        began.append(asyncio.get_running_loop().time())
        if len(began) > lost:
            return await real_open(host, port, **kwargs)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        raise AssertionError("a lost SYN's dial outlived its connect")

    monkeypatch.setattr(framed, "open_connection", open_connection)
    return began, ended


async def test_a_dial_sends_a_fresh_syn_while_the_first_goes_unanswered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition healed while a dial waited: the next SYN, a hedge later, connects,
    long before the connect timeout, and the dials left waiting are cancelled."""
    began, ended = dials_where_the_first_syns_are_lost(monkeypatch, lost=2)
    async with serving(echo) as address, framed.connect(address, Transport()) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(request(1))
        assert await call.receive() is not None
    assert len(began) == 3 and ended == ["cancelled", "cancelled"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(began)]
    assert all(gap >= framed.DIAL_HEDGE_MS / 1000 * 0.9 for gap in gaps)
    assert began[-1] - began[0] < framed.CONNECT_TIMEOUT_MS / 1000


async def seconds_to_unavailable() -> float:
    """How long a connect to a port nobody listens on took to fail UNAVAILABLE."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(CallError) as raised:
        async with framed.connect(f"127.0.0.1:{free_port()}", Transport()):
            pass
    assert raised.value.code is StatusCode.UNAVAILABLE
    return loop.time() - start


async def test_a_dial_nothing_answers_is_unavailable_at_the_connect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(framed, "CONNECT_TIMEOUT_MS", 500)
    monkeypatch.setattr(framed, "DIAL_HEDGE_MS", 100)
    began, ended = dials_where_the_first_syns_are_lost(monkeypatch, lost=1_000)
    assert 0.45 <= await seconds_to_unavailable() < 2.0
    assert 4 <= len(began) <= 6
    await asyncio.sleep(0)
    assert len(ended) == len(began)


async def test_a_refused_dial_ends_the_dial_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal is an answer: the dial still waiting on an earlier SYN is not waited for."""
    began, ended = dials_where_the_first_syns_are_lost(monkeypatch, lost=1)
    assert await seconds_to_unavailable() < framed.CONNECT_TIMEOUT_MS / 1000
    assert len(began) == 2
    await asyncio.sleep(0)
    assert ended == ["cancelled"]


# TLS: the handshake's certificate and the hello's token say who calls.


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> certs.LocalCerts:
    local = certs.create_local_certs(tmp_path_factory.mktemp("certs"))
    local.add_node("store1", store_id="s1")
    local.add_node("master", master=True)
    return local


async def principal_seen(cluster: certs.LocalCerts, transport: Transport) -> auth.Principal:
    seen: list[auth.Principal] = []

    async def who(call: ServerCall) -> None:
        seen.append(call.principal)
        await echo(call)

    context = server_ssl_context(cluster.node_dir("store1"))
    async with serving(who, context) as address, framed.connect(address, transport) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(request(1))
        await call.receive()
    return seen[0]


async def test_a_member_is_known_by_its_certificate(cluster: certs.LocalCerts) -> None:
    master = Transport.for_node(cluster.node_dir("master"))
    assert await principal_seen(cluster, master) == auth.Principal(
        auth.PrincipalKind.MASTER, "master"
    )


async def test_a_tenant_is_known_by_the_token_of_its_hello(cluster: certs.LocalCerts) -> None:
    tenant = Transport.for_client(cluster.tenant_dir, token="good")
    assert await principal_seen(cluster, tenant) == TENANT
    anonymous = Transport.for_client(cluster.tenant_dir)
    assert await principal_seen(cluster, anonymous) == auth.ANONYMOUS


async def test_a_bad_token_is_unauthenticated(cluster: certs.LocalCerts) -> None:
    context = server_ssl_context(cluster.node_dir("store1"))
    async with serving(echo, context) as address:
        with pytest.raises(CallError) as raised:
            async with framed.connect(address, Transport.for_client(cluster.tenant_dir, "bad")):
                pass
    assert raised.value.code is StatusCode.UNAUTHENTICATED


async def test_a_server_of_another_ca_is_not_trusted(
    cluster: certs.LocalCerts, tmp_path: Path
) -> None:
    other = certs.create_local_certs(tmp_path / "other")
    other.add_node("store1", store_id="s1")
    context = server_ssl_context(other.node_dir("store1"))
    async with serving(echo, context) as address:
        with pytest.raises(CallError) as raised:
            async with framed.connect(address, Transport.for_client(cluster.tenant_dir)):
                pass
    assert raised.value.code is StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in raised.value.details


async def test_a_plaintext_client_of_a_tls_server_gets_nowhere(cluster: certs.LocalCerts) -> None:
    context = server_ssl_context(cluster.node_dir("store1"))
    async with serving(echo, context) as address:
        with pytest.raises(CallError) as raised:
            async with framed.connect(address, Transport()):
                pass
    assert raised.value.code is StatusCode.UNAVAILABLE
