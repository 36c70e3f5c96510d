"""The floor under a lone append on this machine, beside ours, measured in one run.

    .venv/bin/python -m bench.append_floor [--rounds 3] [--count 300] [--rate 100]

A lone append (100 B, N=3, W=2, fsync always) can take no less than its bare exchange:
one message to three servers, each of which makes it durable and answers, the second
answer acking it. Each server here writes the payload with the store's own `RocksKV`
and syncs it (`flush_wal`), on its event loop, as a store commits a lone write; nothing
else of ours runs. The exchange goes over two transports:
- grpc.aio, which our stores serve: a bidirectional stream per server with the project's
  channel and server options, a sender task per stream as the writer has;
- bare asyncio TCP streams of length-prefixed frames: no thread but the event loop's.
Our own lone append (`bench.append`'s light load, on a local cluster) runs in the same
rounds. Each is timed at `--rate` per second and back to back; the order rotates every
round; printed are the medians over the rounds of each one's p50 and p99, and the CPU of
every process involved per append (the servers' and this one's).

Also printed: what a wake-up costs here, as CPU of an event loop that sleeps 10 ms
between wake-ups versus 1 ms. On a VM whose idle vCPUs halt, every hop that finds its
thread asleep pays for a wake-up, which is why an append at light load takes longer
than back to back, and why a transport with more threads per message pays more.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import grpc

from bench.append import Target, cpu_seconds, light_load, local_cluster, percentile
from bench.compare import cpu_pressure_avg60
from streamengine.protocol.channels import CLIENT_OPTIONS, SERVER_OPTIONS
from streamengine.segment_store.core.kv import Put
from streamengine.segment_store.kv import RocksKV
from streamengine.testing import free_port

SERVERS = 3
QUORUM = 2
EVENT_BYTES = 100
# Appends made before each timed run (connections, the writer's segment and streams).
WARM_UP = 100
SERVER_START_S_MAX = 30.0
# An exchange not acked by then means a server is gone: the run stops and says so.
EXCHANGE_TIMEOUT_S = 10.0

_FRAME = struct.Struct("<I")
_ANSWER = b"ok"
_METHOD = "/streamengine.bench.Floor/Exchange"
_Call = grpc.aio.StreamStreamCall[bytes, bytes]


# ---- the servers (one process each) ----


def serve_floor(transport: str, port: int, data_dir: str, ready: EventType) -> None:
    kv = RocksKV(data_dir)
    keys = itertools.count()

    def make_durable(payload: bytes) -> None:
        kv.write([Put(next(keys).to_bytes(8, "big"), payload)], sync=False)
        kv.sync()

    serve = _serve_grpc if transport == "grpc" else _serve_tcp
    asyncio.run(serve(port, make_durable, ready))


async def _serve_grpc(port: int, make_durable: Callable[[bytes], None], ready: EventType) -> None:
    async def exchange(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> None:
        async for payload in requests:
            make_durable(payload)
            await context.write(_ANSWER)

    handler = grpc.method_handlers_generic_handler(
        "streamengine.bench.Floor",
        {"Exchange": grpc.stream_stream_rpc_method_handler(exchange)},
    )
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


async def _serve_tcp(port: int, make_durable: Callable[[bytes], None], ready: EventType) -> None:
    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                make_durable(await reader.readexactly(size))
                writer.write(_FRAME.pack(len(_ANSWER)) + _ANSWER)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(exchange, "127.0.0.1", port)
    ready.set()
    await server.serve_forever()


# ---- the client: one payload to every server, acked by the QUORUM-th answer ----


class ExchangeQuorum:
    """Answers come in order on each server's stream: exchange k is acked once QUORUM
    servers have answered k times."""

    def __init__(self) -> None:
        self.answered = [0] * SERVERS
        self.sent = 0
        self.acked: asyncio.Future[None] | None = None

    def answer(self, server: int) -> None:
        self.answered[server] += 1
        acked = self.acked
        if acked is not None and not acked.done() and self._holders() >= QUORUM:
            acked.set_result(None)

    def _holders(self) -> int:
        return sum(count >= self.sent for count in self.answered)

    async def exchange(self, send: Callable[[bytes], None], payload: bytes) -> None:
        self.sent += 1
        self.acked = asyncio.get_running_loop().create_future()
        send(payload)
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT_S):
                await self.acked
        except TimeoutError:
            raise RuntimeError(
                f"exchange {self.sent} not acked by {QUORUM} servers within"
                f" {EXCHANGE_TIMEOUT_S:.0f} s (answers: {self.answered})"
            ) from None


async def timed_exchanges(
    transport: str, ports: Sequence[int], rate: float, count: int, cpu_s: Callable[[], float]
) -> Timed:
    quorum = ExchangeQuorum()
    tasks: list[asyncio.Task[None]] = []
    links = _grpc_links if transport == "grpc" else _tcp_links
    send, close = await links(ports, quorum, tasks)
    try:
        payload = b"f" * EVENT_BYTES
        for _ in range(WARM_UP):
            await quorum.exchange(send, payload)
        cpu_before = cpu_s()
        latencies = []
        for _ in range(count):
            started = time.perf_counter()
            await quorum.exchange(send, payload)
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(max(0.0, 1 / rate - latencies[-1]))
        spent = cpu_s() - cpu_before
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close()
    return timed(latencies, spent)


async def _grpc_links(
    ports: Sequence[int], quorum: ExchangeQuorum, tasks: list[asyncio.Task[None]]
) -> tuple[Callable[[bytes], None], Callable[[], Awaitable[None]]]:
    queues: list[asyncio.Queue[bytes]] = []
    channels = []
    for server, port in enumerate(ports):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
        channels.append(channel)
        call: _Call = channel.stream_stream(_METHOD)()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        queues.append(queue)

        async def send_loop(call: _Call = call, queue: asyncio.Queue[bytes] = queue) -> None:
            while True:
                await call.write(await queue.get())

        async def receive_loop(call: _Call = call, server: int = server) -> None:
            async for _ in call:
                quorum.answer(server)

        tasks += [asyncio.create_task(send_loop()), asyncio.create_task(receive_loop())]

    def send(payload: bytes) -> None:
        for queue in queues:
            queue.put_nowait(payload)

    async def close() -> None:
        for channel in channels:
            await channel.close()

    return send, close


async def _tcp_links(
    ports: Sequence[int], quorum: ExchangeQuorum, tasks: list[asyncio.Task[None]]
) -> tuple[Callable[[bytes], None], Callable[[], Awaitable[None]]]:
    writers = []
    for server, port in enumerate(ports):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)

        async def receive_loop(reader: asyncio.StreamReader = reader, server: int = server) -> None:
            try:
                while True:
                    (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                    await reader.readexactly(size)
                    quorum.answer(server)
            except (asyncio.IncompleteReadError, ConnectionError):
                return

        tasks.append(asyncio.create_task(receive_loop()))

    def send(payload: bytes) -> None:
        frame = _FRAME.pack(len(payload)) + payload
        for writer in writers:
            writer.write(frame)

    async def close() -> None:
        for writer in writers:
            writer.close()

    return send, close


async def _our_appends(target: Target, rate: float, count: int) -> Timed:
    async with target.client() as client:
        stream = f"bench/floor-{time.time_ns()}"
        await client.create_stream(stream, replicas=SERVERS, write_quorum=QUORUM)
        async with client.writer(stream) as writer:
            await light_load(writer, EVENT_BYTES, float("inf"), WARM_UP)
            cpu_before = target.cpu_s()
            latencies = await light_load(writer, EVENT_BYTES, rate, count)
            return timed(latencies, target.cpu_s() - cpu_before)


# ---- what a wake-up costs ----


async def _wake_up_cpu_us(gap_s: float, count: int) -> float:
    """CPU of this (event loop) thread per wake-up from an `asyncio.sleep(gap_s)`."""
    started = time.thread_time()
    for _ in range(count):
        await asyncio.sleep(gap_s)
    return (time.thread_time() - started) / count * 1e6


# ---- the run ----


@dataclass(frozen=True)
class Timed:
    p50_ms: float
    p99_ms: float
    cpu_us: float  # per append, every process involved


def timed(latencies: list[float], cpu_s: float) -> Timed:
    ms = [v * 1000 for v in latencies]
    return Timed(percentile(ms, 0.5), percentile(ms, 0.99), cpu_s / len(latencies) * 1e6)


LABELS = {
    "tcp": "exchange, bare asyncio TCP",
    "grpc": "exchange, grpc.aio",
    "ours": "our append (real cluster)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=300, help="timed appends of each run")
    parser.add_argument("--rate", type=float, default=100.0, help="appends/s of the paced runs")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.count < 10 or args.rate <= 0:
        parser.error("--rounds >= 1, --count >= 10 and --rate > 0")

    pressure_at_start = cpu_pressure_avg60()
    context = multiprocessing.get_context("spawn")
    servers: list[SpawnProcess] = []
    ports: dict[str, list[int]] = {}
    paces = {"paced": args.rate, "back to back": float("inf")}
    results: dict[tuple[str, str], list[Timed]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="append-floor-") as data,
        local_cluster("always", tls=False) as target,
    ):
        try:
            for transport in ("grpc", "tcp"):
                ports[transport] = [free_port() for _ in range(SERVERS)]
                for number, port in enumerate(ports[transport]):
                    ready = context.Event()
                    server = context.Process(
                        target=serve_floor,
                        args=(transport, port, str(Path(data) / f"{transport}-{number}"), ready),
                        daemon=True,
                    )
                    server.start()
                    servers.append(server)
                    if not ready.wait(SERVER_START_S_MAX):
                        raise RuntimeError(f"a {transport} server did not start")
            floor_pids = [os.getpid(), *(s.pid for s in servers if s.pid is not None)]

            def floor_cpu_s() -> float:
                return cpu_seconds(floor_pids)

            order = ["tcp", "grpc", "ours"]
            for round_number in range(args.rounds):
                for what in order[round_number % 3 :] + order[: round_number % 3]:
                    for pace, rate in paces.items():
                        if what == "ours":
                            measured = asyncio.run(_our_appends(target, rate, args.count))
                        else:
                            measured = asyncio.run(
                                timed_exchanges(what, ports[what], rate, args.count, floor_cpu_s)
                            )
                        results.setdefault((what, pace), []).append(measured)
                        print(
                            f"round {round_number + 1}/{args.rounds} {LABELS[what]}, {pace}:"
                            f" p50 {results[(what, pace)][-1].p50_ms:.2f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            for server in servers:
                server.kill()
    wake_10ms = asyncio.run(_wake_up_cpu_us(0.010, 200))
    wake_1ms = asyncio.run(_wake_up_cpu_us(0.001, 1000))

    print(
        f"A lone append's floor: {EVENT_BYTES} B to {SERVERS} servers that each sync it,"
        f" W={QUORUM}; {args.rounds} rounds of {args.count}, medians;"
        f" {os.cpu_count()} CPUs, CPU pressure {pressure_at_start}% at the start,"
        f" {cpu_pressure_avg60()}% at the end"
    )
    header = f"{'':<30}"
    for pace in paces:
        label = f"{args.rate:.0f}/s" if pace == "paced" else pace
        header += f" | {label + ': p50 / p99 ms, CPU us':>34}"
    print(header)
    for what in LABELS:
        line = f"{LABELS[what]:<30}"
        for pace in paces:
            runs = results[(what, pace)]
            p50 = statistics.median([r.p50_ms for r in runs])
            p99 = statistics.median([r.p99_ms for r in runs])
            cpu_us = statistics.median([r.cpu_us for r in runs])
            line += f" | {p50:6.2f} / {p99:5.2f}  {cpu_us:14.0f}"
        print(line)
    for pace in paces:
        ours = statistics.median([r.p50_ms for r in results[("ours", pace)]])
        grpc_floor = statistics.median([r.p50_ms for r in results[("grpc", pace)]])
        tcp_floor = statistics.median([r.p50_ms for r in results[("tcp", pace)]])
        print(
            f"{pace}: ours {ours:.2f} ms p50 = the grpc.aio floor {grpc_floor:.2f}"
            f" + {ours - grpc_floor:.2f}; the bare TCP floor is {tcp_floor:.2f}"
        )
    print(
        f"a sleeping event loop's wake-up costs {wake_10ms:.0f} us of CPU 10 ms apart,"
        f" {wake_1ms:.0f} us 1 ms apart"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
