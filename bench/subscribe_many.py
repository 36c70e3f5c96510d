"""One client following many streams (`StreamClient.subscribe_many`): its CPU and the
delivery latency.

    .venv/bin/python -m bench.subscribe_many                       # 1,000 and 10,000 streams
    .venv/bin/python -m bench.subscribe_many --streams 1000 --seconds 20
    .venv/bin/python -m bench.subscribe_many --master HOST:PORT

For each count N of `--streams`: N streams are created under tenants of their own (1,000
each, the default quota), and a follower process subscribes to their common prefix
(one `subscribe_many`). Then:

- idle: nothing is appended for `--seconds`; the follower's CPU (user + system) per
  second of wall time: what following N quiet streams costs;
- appends: `--writers` of the streams take `--rate` events/s between them for
  `--seconds`; the follower's CPU per second again, and the delivery latency of every
  event (the append's wall clock, in its payload, to the follower's hand-out: p50, p99,
  max; both clocks are this machine's).

The follower is a process of its own so that its CPU is its alone. Before the idle
phase it is given `--settle` seconds (default: 5 s plus 3 s per 1,000 streams) to open
every stream's cursor.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import struct
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import psutil

from bench.append import Target, add_target_arguments, cluster
from streamengine.client.writer import Writer

CREATES_IN_FLIGHT = 64
APPENDS_IN_FLIGHT = 4  # per writer
TENANT_STREAMS = 1000
STAMP = struct.Struct(">q")  # the append's wall clock, ns, first in every payload


@dataclass(frozen=True)
class Phase:
    label: str
    cpu_per_s: float
    events: int


def follow(master: str, prefix: str, results: Connection, stop: Connection) -> None:
    """The follower process: subscribe, and when told to, send the latencies (ms)."""
    from streamengine.client import StreamClient

    async def run() -> None:
        latencies: list[float] = []
        async with StreamClient(master) as client:
            events = client.subscribe_many(prefix=prefix, start="end")
            loop = asyncio.get_running_loop()
            stopped = asyncio.Event()
            loop.add_reader(stop.fileno(), stopped.set)

            async def consume() -> None:
                async for event in events:
                    (stamp,) = STAMP.unpack_from(event.payload)
                    latencies.append((time.time_ns() - stamp) / 1e6)

            consumer = asyncio.ensure_future(consume())
            await stopped.wait()
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        results.send(latencies)

    asyncio.run(run())


async def create_streams(target: Target, names: list[str]) -> float:
    started = time.perf_counter()
    limit = asyncio.Semaphore(CREATES_IN_FLIGHT)
    async with target.client() as client:

        async def create(name: str) -> None:
            async with limit:
                await client.create_stream(name)

        await asyncio.gather(*(create(name) for name in names))
    return time.perf_counter() - started


async def append_for(target: Target, names: list[str], rate: float, seconds: float) -> int:
    """`rate` events/s spread over the writers of `names`, for `seconds`: each writer
    appends on its schedule, up to `APPENDS_IN_FLIGHT` at once, however long each takes."""
    appended = 0
    async with target.client() as client:
        writers = [await client.writer(name).__aenter__() for name in names]
        try:
            interval_s = len(writers) / rate
            started = time.monotonic()

            async def append(writer: Writer, room: asyncio.Semaphore) -> None:
                nonlocal appended
                async with room:
                    await writer.append(STAMP.pack(time.time_ns()) + b"." * 92)
                    appended += 1

            async def run(writer: Writer, offset_s: float) -> None:
                room = asyncio.Semaphore(APPENDS_IN_FLIGHT)
                async with asyncio.TaskGroup() as group:
                    for tick in range(int(seconds / interval_s)):
                        due_s = started + offset_s + tick * interval_s - time.monotonic()
                        await asyncio.sleep(max(due_s, 0))
                        if not room.locked():
                            group.create_task(append(writer, room))

            await asyncio.gather(
                *(run(w, n * interval_s / len(writers)) for n, w in enumerate(writers))
            )
        finally:
            for writer in writers:
                await writer.__aexit__(None, None, None)
    return appended


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(target: Target, count: int, args: argparse.Namespace) -> None:
    run = f"many{count}x{int(time.time())}"
    # A tenant holds at most 1,000 streams (the master's default quota).
    names = [f"{run}-t{n // TENANT_STREAMS}/s{n:05d}" for n in range(count)]
    created_s = asyncio.run(create_streams(target, names))
    print(f"{count:,} streams: created in {created_s:.1f} s")
    context = multiprocessing.get_context("spawn")
    results_in, results_out = context.Pipe(duplex=False)
    stop_in, stop_out = context.Pipe(duplex=False)
    follower = context.Process(
        target=follow, args=(target.master, f"{run}-", results_out, stop_in)
    )
    follower.start()
    process = psutil.Process(follower.pid)
    settle_s = args.settle if args.settle is not None else 5 + 3 * count / 1000
    time.sleep(settle_s)
    opening_cpu = cpu_s(process)
    phases = []
    before, started = cpu_s(process), time.monotonic()
    time.sleep(args.seconds)
    phases.append(Phase("idle", (cpu_s(process) - before) / (time.monotonic() - started), 0))
    before, started = cpu_s(process), time.monotonic()
    writers = names[:: max(1, count // args.writers)][: args.writers]
    appended = asyncio.run(append_for(target, writers, args.rate, args.seconds))
    phases.append(
        Phase("appends", (cpu_s(process) - before) / (time.monotonic() - started), appended)
    )
    time.sleep(1.0)  # the last events' delivery
    stop_out.send(b"stop")
    latencies: list[float] = results_in.recv()
    follower.join(30)
    print(f"  opening {count:,} cursors: {opening_cpu:.1f} s CPU within {settle_s:.0f} s")
    for phase in phases:
        print(f"  {phase.label:8} follower CPU {phase.cpu_per_s * 100:5.1f} % of a core", end="")
        if phase.events:
            rate = phase.events / args.seconds
            print(f", {phase.events:,} events appended ({rate:,.0f}/s)", end="")
        print()
    if latencies:
        ordered = sorted(latencies)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        print(
            f"  delivery latency ms: p50 {statistics.median(ordered):.1f}, p99 {p99:.1f}, "
            f"max {ordered[-1]:.1f} ({len(ordered):,} events received of {appended:,})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--streams", default="1000,10000", help="counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--writers", type=int, default=50, help="streams appended to")
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s, all writers")
    parser.add_argument("--settle", type=float, default=None, help="seconds to open cursors")
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.streams.split(",")]
    with cluster(args) as target:
        for count in counts:
            measure(target, count, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
