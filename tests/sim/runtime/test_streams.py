"""Byte streams on the simulated network: asyncio's streams with TCP's semantics, in
virtual time (`SimNetwork.open_connection`, `SimNetwork.start_server`)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from tests.sim.faults import BREAK_DETECTION_MS_MAX, Faults
from tests.sim.runtime.loop import run
from tests.sim.runtime.transport import (
    SimNetwork,
    SimStreamReader,
    SimStreamWriter,
    StreamFaults,
    node_context,
    start_node,
)

T = TypeVar("T")

CLIENT = "client"
SERVER = "server"
ADDRESS = f"{SERVER}:9000"
ROUGH = Faults(loss=0.05, duplicate=0.0, delay_ms_max=20, slow=0.05, slow_delay_ms_max=400)
DETECTION_S_MAX = BREAK_DETECTION_MS_MAX / 1000
# Far longer than any delay or detection a run draws: a wait that reaches it waited
# for something that never comes.
PATIENCE_S = 5.0


def simulate(
    seed: int,
    scenario: Callable[[SimNetwork], Coroutine[Any, Any, T]],
    faults: Faults | None = None,
    stream_faults: StreamFaults | None = None,
) -> T:
    async def main() -> T:
        network = SimNetwork(asyncio.get_running_loop(), faults, stream_faults)
        with network.installed():
            return await asyncio.get_running_loop().create_task(
                scenario(network), context=node_context(CLIENT)
            )

    return run(main(), seed)


async def echo(reader: SimStreamReader, writer: SimStreamWriter) -> None:
    while data := await reader.read(1000):
        writer.write(data)
        await writer.drain()
    writer.close()


async def serve_in(
    group: asyncio.TaskGroup, network: SimNetwork, handler: Any
) -> asyncio.Task[None]:
    """`handler` served at ADDRESS by the process of node SERVER, until cancelled."""
    listening = asyncio.Event()

    async def process() -> None:
        server = await network.start_server(handler, SERVER, 9000)
        listening.set()
        async with server:
            await server.serve_forever()

    task = start_node(group, SERVER, process())
    await listening.wait()
    return task


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


async def read_frame(reader: SimStreamReader) -> bytes:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    return await reader.readexactly(size)


def test_a_server_echoes_bytes_across_two_nodes() -> None:
    async def scenario(network: SimNetwork) -> tuple[bytes, bool, list[Any]]:
        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, echo)
            reader, writer = await network.open_connection(SERVER, 9000)
            writer.writelines([b"hello ", b"world"])
            await writer.drain()
            echoed = await reader.readexactly(11)
            writer.write_eof()
            at_end = await reader.read(100) == b"" and reader.at_eof()
            info = [writer.get_extra_info(name) for name in ("peername", "peercert", "socket")] + [
                writer.get_extra_info("sockname")[0]
            ]
            writer.close()
            await writer.wait_closed()
            serving.cancel()
        return echoed, at_end, info

    echoed, at_end, info = simulate(1, scenario)
    assert echoed == b"hello world"
    assert at_end
    assert info == [(SERVER, 9000), None, None, CLIENT]


def test_bytes_arrive_in_order_under_delays_splits_and_coalescing() -> None:
    payloads = [bytes([n % 251]) * (1 + (n * 37) % 300) for n in range(200)]

    async def scenario(network: SimNetwork) -> tuple[list[bytes], int]:
        received: list[bytes] = []
        reads = 0
        collected = asyncio.Event()

        async def collect(reader: SimStreamReader, writer: SimStreamWriter) -> None:
            nonlocal reads
            buffer = b""
            while chunk := await reader.read(4096):
                reads += 1
                buffer += chunk
            while buffer:
                (size,) = struct.unpack(">I", buffer[:4])
                received.append(buffer[4 : 4 + size])
                buffer = buffer[4 + size :]
            writer.close()
            collected.set()

        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, collect)
            _, writer = await network.open_connection(SERVER, 9000)
            for payload in payloads:
                writer.write(frame(payload))
                await asyncio.sleep(0.001 * (len(payload) % 3))
            writer.close()
            async with asyncio.timeout(PATIENCE_S):
                await collected.wait()
            serving.cancel()
        return received, reads

    for seed in range(3):
        received, reads = simulate(seed, scenario, ROUGH)
        assert received == payloads
        # Neither one read per write: pieces were split and coalesced.
        assert reads != len(payloads)


def test_a_reader_copes_with_frames_split_at_any_point() -> None:
    async def scenario(network: SimNetwork) -> list[bytes]:
        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, echo)
            reader, writer = await network.open_connection(SERVER, 9000)
            payloads = [bytes(range(n % 256)) * 3 for n in range(1, 60)]
            writer.write(b"".join(frame(p) for p in payloads))
            got = [await read_frame(reader) for _ in payloads]
            assert got == payloads
            writer.write(frame(b"cut short")[:7])
            writer.write_eof()
            with pytest.raises(asyncio.IncompleteReadError) as incomplete:
                await read_frame(reader)
            serving.cancel()
        return [incomplete.value.partial]

    assert simulate(4, scenario, ROUGH, StreamFaults(split=1.0)) == [b"cut"]


def test_a_writer_never_read_stops_at_the_bound_in_drain() -> None:
    bound = StreamFaults(send_buffer_bytes=8 * 1024)

    async def scenario(network: SimNetwork) -> tuple[int, int]:
        readers: list[SimStreamReader] = []

        async def hold(reader: SimStreamReader, writer: SimStreamWriter) -> None:
            readers.append(reader)
            await asyncio.Event().wait()

        written = 0
        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, hold)
            _, writer = await network.open_connection(SERVER, 9000)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(PATIENCE_S):
                    for _ in range(1000):
                        writer.write(b"x" * 1024)
                        written += 1024
                        await writer.drain()
            blocked_at = written

            async def read_all() -> None:
                while await readers[0].read(4096):
                    pass

            # Once the peer reads, the writer goes on.
            reading = group.create_task(read_all(), context=node_context(SERVER))
            async with asyncio.timeout(PATIENCE_S):
                while written < blocked_at + 64 * 1024:
                    writer.write(b"y" * 1024)
                    written += 1024
                    await writer.drain()
            writer.close()
            await reading
            serving.cancel()
        return blocked_at, written

    blocked_at, written = simulate(2, scenario, ROUGH, bound)
    assert 8 * 1024 < blocked_at <= 9 * 1024
    assert written > blocked_at


async def _broken_ends(network: SimNetwork, breaking: Callable[[], None]) -> list[str]:
    """What each end sees, and how long after `breaking` it saw it."""
    seen: list[str] = []

    async def outcome(name: str, reader: SimStreamReader, writer: SimStreamWriter) -> None:
        loop = asyncio.get_running_loop()
        broke_at = loop.time()
        try:
            async with asyncio.timeout(PATIENCE_S):
                await reader.read(100)
        except ConnectionResetError:
            after_s = loop.time() - broke_at
            assert 0 < after_s <= DETECTION_S_MAX
            with pytest.raises(ConnectionResetError):
                await writer.drain()
            seen.append(f"{name} reset")
        except TimeoutError:
            seen.append(f"{name} silent")

    server_ends: list[tuple[SimStreamReader, SimStreamWriter]] = []
    accepted = asyncio.Event()

    async def keep(reader: SimStreamReader, writer: SimStreamWriter) -> None:
        server_ends.append((reader, writer))
        accepted.set()
        await asyncio.Event().wait()

    async with asyncio.TaskGroup() as group:
        serving = await serve_in(group, network, keep)
        reader, writer = await network.open_connection(SERVER, 9000)
        await accepted.wait()
        breaking()
        async with asyncio.TaskGroup() as ends:
            ends.create_task(outcome("client", reader, writer))
            ends.create_task(outcome("server", *server_ends[0]))
        serving.cancel()
    return sorted(seen)


def test_a_cut_is_seen_by_both_ends_as_a_reset_after_the_detection_delay() -> None:
    async def scenario(network: SimNetwork) -> list[str]:
        return await _broken_ends(network, lambda: network.cut(CLIENT, SERVER))

    announced = StreamFaults(silent_cut=0.0)
    assert simulate(5, scenario, ROUGH, announced) == ["client reset", "server reset"]


def test_a_silent_cut_brings_nothing_until_the_readers_own_timeout() -> None:
    async def scenario(network: SimNetwork) -> list[str]:
        return await _broken_ends(network, lambda: network.cut(CLIENT, SERVER))

    silent = StreamFaults(silent_cut=1.0)
    assert simulate(5, scenario, ROUGH, silent) == ["client silent", "server silent"]


def test_a_reset_is_seen_by_both_ends_after_the_detection_delay() -> None:
    async def scenario(network: SimNetwork) -> list[str]:
        return await _broken_ends(network, lambda: network.reset(CLIENT, SERVER))

    silent = StreamFaults(silent_cut=1.0)  # a reset is never silent
    for seed in range(3):
        assert simulate(seed, scenario, ROUGH, silent) == ["client reset", "server reset"]


def test_connecting_where_nobody_listens_or_across_a_cut_fails_after_a_delay() -> None:
    async def scenario(network: SimNetwork) -> list[str]:
        loop = asyncio.get_running_loop()
        outcomes = []
        started = loop.time()
        with pytest.raises(ConnectionRefusedError):
            await network.open_connection(SERVER, 9000)
        assert loop.time() > started
        outcomes.append("refused")
        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, echo)
            network.cut(CLIENT, SERVER)
            started = loop.time()
            with pytest.raises(OSError) as unreachable:
                await network.open_connection(SERVER, 9000)
            assert loop.time() > started
            assert not isinstance(unreachable.value, ConnectionRefusedError)
            outcomes.append("unreachable")
            network.heal()
            reader, writer = await network.open_connection(SERVER, 9000)
            writer.write(b"again")
            outcomes.append((await reader.readexactly(5)).decode())
            writer.close()
            serving.cancel()
        return outcomes

    assert simulate(3, scenario, ROUGH) == ["refused", "unreachable", "again"]


def test_a_crash_closes_the_connections_of_the_dead_process() -> None:
    async def scenario(network: SimNetwork) -> list[str]:
        outcomes: list[str] = []
        server_readers: list[SimStreamReader] = []

        async def idle(reader: SimStreamReader, writer: SimStreamWriter) -> None:
            server_readers.append(reader)
            writer.write(b"greeting")
            await asyncio.Event().wait()

        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, idle)
            quiet_reader, _ = await network.open_connection(SERVER, 9000)
            busy_reader, busy_writer = await network.open_connection(SERVER, 9000)
            await quiet_reader.readexactly(8)
            await busy_reader.readexactly(8)
            busy_writer.write(b"never read by the server")  # unread at its death: a reset
            await asyncio.sleep(1)
            serving.cancel()
            # Everything the dead process sent arrived; then the end: EOF, or a reset.
            async with asyncio.timeout(PATIENCE_S):
                outcomes.append(f"quiet {await quiet_reader.read(100)!r}")
                try:
                    await busy_reader.read(100)
                except ConnectionResetError:
                    outcomes.append("busy reset")
            with pytest.raises(ConnectionRefusedError):
                await network.open_connection(SERVER, 9000)
            outcomes.append("refused")
        return outcomes

    assert simulate(6, scenario, ROUGH) == ["quiet b''", "busy reset", "refused"]


def test_bytes_sent_to_a_closed_end_reset_the_sender() -> None:
    async def scenario(network: SimNetwork) -> str:
        async def hang_up(reader: SimStreamReader, writer: SimStreamWriter) -> None:
            writer.close()

        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, hang_up)
            reader, writer = await network.open_connection(SERVER, 9000)
            assert await reader.read(10) == b""  # the server's FIN
            writer.write(b"anyone there?")
            async with asyncio.timeout(PATIENCE_S):
                while True:
                    try:
                        await writer.drain()
                        await asyncio.sleep(0.01)
                    except ConnectionResetError:
                        break
            serving.cancel()
        return "reset"

    assert simulate(7, scenario, ROUGH) == "reset"


def test_an_address_taken_is_refused_and_tls_is_not_simulated() -> None:
    async def scenario(network: SimNetwork) -> int:
        server = await network.start_server(echo, SERVER, 9000)
        with pytest.raises(OSError, match="in use"):
            await network.start_server(echo, SERVER, 9000)
        with pytest.raises(NotImplementedError):
            await network.open_connection(SERVER, 9000, ssl=object())
        free = await network.start_server(echo, SERVER, 0)
        port: int = free.sockets[0].getsockname()[1]
        server.close()
        free.close()
        await server.wait_closed()
        return port

    assert simulate(1, scenario) > 0


async def _conversation(network: SimNetwork) -> list[tuple[float, str]]:
    """Three clients talk to an echo server over a rough network; one is reset."""
    loop = asyncio.get_running_loop()
    trace: list[tuple[float, str]] = []

    async def client(name: str) -> None:
        try:
            reader, writer = await network.open_connection(SERVER, 9000)
            for n in range(20):
                writer.write(f"{name}:{n};".encode())
                await writer.drain()
                got = await reader.read(7)
                trace.append((round(loop.time(), 6), f"{name} {got!r}"))
            writer.close()
        except ConnectionResetError as error:
            trace.append((round(loop.time(), 6), f"{name} {error}"))

    async with asyncio.TaskGroup() as group:
        serving = await serve_in(group, network, echo)
        async with asyncio.TaskGroup() as clients:
            for name in ("a", "b", "c"):
                clients.create_task(client(name), context=node_context(name))
            await asyncio.sleep(0.05)
            network.reset("b", SERVER)
        serving.cancel()
    return trace


def test_a_seed_replays_the_same_trace() -> None:
    first = simulate(11, _conversation, ROUGH)
    assert first == simulate(11, _conversation, ROUGH)
    assert any("reset" in line for _, line in first)
    assert first != simulate(12, _conversation, ROUGH)


def test_a_client_process_that_dies_or_a_handler_that_fails_closes_its_end() -> None:
    async def scenario(network: SimNetwork) -> list[str]:
        seen: list[str] = []
        last_words_read = asyncio.Event()

        async def note_end(reader: SimStreamReader, writer: SimStreamWriter) -> None:
            data = await reader.read()
            seen.append(f"server read {data!r} to the end")
            if data == b"last words":
                last_words_read.set()
            if data == b"fail":
                raise RuntimeError("a handler's defect")

        async def client_process(message: bytes) -> None:
            _, writer = await network.open_connection(SERVER, 9000)
            writer.write(message)
            await asyncio.Event().wait()  # never closes: it dies with its process

        async with asyncio.TaskGroup() as group:
            serving = await serve_in(group, network, note_end)
            dying = start_node(group, CLIENT, client_process(b"last words"))
            await asyncio.sleep(1)
            dying.cancel()
            reader, writer = await network.open_connection(SERVER, 9000)
            writer.write(b"fail")
            writer.write_eof()
            async with asyncio.timeout(PATIENCE_S):
                seen.append(f"client read {await reader.read()!r} to the end")
            async with asyncio.timeout(PATIENCE_S):
                await last_words_read.wait()
            writer.close()
            serving.cancel()
        return sorted(seen)

    assert simulate(8, scenario, ROUGH) == [
        "client read b'' to the end",
        "server read b'fail' to the end",
        "server read b'last words' to the end",
    ]
