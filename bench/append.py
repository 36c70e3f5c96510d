"""Append throughput and latency of one writer: 3 stores, W=2, fsync always.

    .venv/bin/python bench/append.py                 # starts a local cluster
    .venv/bin/python bench/append.py --master HOST:PORT --seconds 10
    .venv/bin/python -m bench.append --tls            # TLS's cost: plaintext vs TLS

For each event size (100 B and 1 KiB by default), on a fresh stream:
- peak with batching: `append_batch` of `--batch` events, `--batches-in-flight` at once;
- peak of single appends: `--singles-in-flight` outstanding `append` calls;
- latency of single appends at light load: one at a time, `--light-rate` per second,
  once the servers are idle (`servers_idle`: what the peaks left them done);
- latency of single appends (at `--light-rate`) while batches load the cluster at 50%
  of the batched peak;
- latency of single appends alone at 50% of the single-append peak, open loop
  (counted from when each append was due, so a stalled writer shows up in it).

Events/s and payload MB/s; latency p50/p99 in milliseconds.

`--tls` measures what TLS costs instead: a plaintext and a TLS local cluster run side
by side, and the batched and single-append peaks are measured on each in turn,
`--rounds` times. Printed: the medians of the rate (TLS's cost: % below plaintext) and
of the CPU per event of every process (servers and client; TLS's cost: % above). On a
shared machine the CPU per event is the steadier figure: other load slows the rate of
both runs unevenly, but hardly changes the work each event takes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from streamengine.client import StreamClient
from streamengine.client.writer import Writer
from streamengine.protocol.clock import wall_ms
from streamengine.testing import free_port_run
from streamengine.tools.local_cluster import LocalCluster, ports_used


@dataclass(frozen=True)
class Rate:
    events: int
    seconds: float
    event_bytes: int

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.events * self.event_bytes / self.seconds / 1e6


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def latency_line(label: str, latencies_s: list[float]) -> str:
    ms = [v * 1000 for v in latencies_s]
    return (
        f"  {label:<50} n={len(ms):>6}  p50={percentile(ms, 0.50):7.2f} ms  "
        f"p99={percentile(ms, 0.99):7.2f} ms  max={max(ms):7.2f} ms  "
        f"mean={statistics.fmean(ms):6.2f} ms"
    )


async def peak_batched(
    writer: Writer, size: int, batch: int, in_flight: int, seconds: float
) -> Rate:
    payloads = [b"b" * size] * batch
    events = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal events
        while time.perf_counter() < deadline:
            await writer.append_batch(payloads)
            events += batch

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(in_flight):
            group.create_task(worker())
    return Rate(events, time.perf_counter() - started, size)


async def peak_single(writer: Writer, size: int, in_flight: int, seconds: float) -> Rate:
    payload = b"s" * size
    events = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal events
        while time.perf_counter() < deadline:
            await writer.append(payload)
            events += 1

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(in_flight):
            group.create_task(worker())
    return Rate(events, time.perf_counter() - started, size)


async def light_load(writer: Writer, size: int, rate: float, count: int) -> list[float]:
    payload = b"l" * size
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        await writer.append(payload)
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(max(0.0, 1 / rate - latencies[-1]))
    return latencies


# Open loop: appends outstanding at most. Past it the rate is not sustained and the run
# says so, instead of flooding the event loop (which would starve the writer's
# heartbeats and lose its lease, as a real overloaded client would).
OPEN_LOOP_OUTSTANDING_MAX = 5000


async def open_loop(
    writer: Writer, size: int, rate: float, seconds: float
) -> tuple[list[float], bool]:
    """Latencies from when each append was due; and whether the rate was sustained."""
    payload = b"o" * size
    total = int(rate * seconds)
    latencies: list[float] = []
    outstanding = 0
    sustained = True

    async def one(due: float) -> None:
        nonlocal outstanding
        try:
            await writer.append(payload)
            latencies.append(time.perf_counter() - due)
        finally:
            outstanding -= 1

    started = time.perf_counter()
    issued = 0
    async with asyncio.TaskGroup() as group:
        while issued < total:
            due_now = min(total, int((time.perf_counter() - started) * rate) + 1)
            while issued < due_now:
                if outstanding >= OPEN_LOOP_OUTSTANDING_MAX:
                    sustained = False
                    total = issued  # stop issuing; let what is out come back
                    break
                outstanding += 1
                group.create_task(one(started + issued / rate))
                issued += 1
            await asyncio.sleep(0.001)
    return latencies, sustained


# Background load under which single appends are probed: batches this big, paced.
LOAD_BATCH_EVENTS = 100


async def under_load(
    writer: Writer, size: int, load_rate: float, probe_rate: float, seconds: float
) -> tuple[list[float], float]:
    """Single appends, one at a time at `probe_rate`, while batches of
    `LOAD_BATCH_EVENTS` go in at `load_rate` events/s (open loop, at most 64 batches
    outstanding). Returns the probes' latencies and the load reached, events/s."""
    batch = [b"L" * size] * LOAD_BATCH_EVENTS
    loaded = 0
    stop = asyncio.Event()

    async def load() -> None:
        nonlocal loaded
        outstanding = asyncio.Semaphore(64)
        started = time.perf_counter()
        issued = 0

        async def one() -> None:
            nonlocal loaded
            try:
                await writer.append_batch(batch)
                loaded += LOAD_BATCH_EVENTS
            finally:
                outstanding.release()

        async with asyncio.TaskGroup() as group:
            while not stop.is_set():
                due = int((time.perf_counter() - started) * load_rate / LOAD_BATCH_EVENTS)
                while issued < due and not stop.is_set():
                    await outstanding.acquire()
                    group.create_task(one())
                    issued += 1
                await asyncio.sleep(0.002)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        group.create_task(load())
        await asyncio.sleep(0.5)  # let the load settle first
        latencies: list[float] = []
        # Probe for `seconds` (a slow probe waits its turn behind the load's events).
        probing_until = time.perf_counter() + seconds
        while time.perf_counter() < probing_until or len(latencies) < 100:
            latencies += await light_load(writer, size, probe_rate, 10)
        stop.set()
    return latencies, loaded / (time.perf_counter() - started)


async def bench_size(
    target: Target, client: StreamClient, args: argparse.Namespace, size: int
) -> None:
    name = f"bench/append-{size}-{wall_ms()}"
    await client.create_stream(name, replicas=3, write_quorum=2)
    async with client.writer(name) as writer:
        print(f"{size}-byte events (stream {name}, epoch {writer.epoch}):")
        await peak_batched(writer, size, args.batch, args.batches_in_flight, 1.0)  # warm up
        batched = await peak_batched(writer, size, args.batch, args.batches_in_flight, args.seconds)
        print(
            f"  peak, batches of {args.batch} x{args.batches_in_flight} in flight:"
            f" {batched.events_per_s:>10,.0f} events/s  {batched.mb_per_s:7.1f} MB/s"
        )
        single = await peak_single(writer, size, args.singles_in_flight, args.seconds)
        print(
            f"  peak, single appends x{args.singles_in_flight} in flight:"
            f"     {single.events_per_s:>10,.0f} events/s  {single.mb_per_s:7.1f} MB/s"
        )
        idle_after = await servers_idle(target)
        light = await light_load(writer, size, args.light_rate, args.light_count)
        print(latency_line(f"single append, light load ({args.light_rate:.0f}/s)", light))
        print(f"    (timed once the servers were idle: {_idle_words(idle_after)})")
        half = batched.events_per_s / 2
        probed, reached = await under_load(writer, size, half, args.light_rate, args.seconds)
        print(latency_line(f"single append, load at 50% of peak ({reached:,.0f}/s)", probed))
        half = single.events_per_s / 2
        loaded, sustained = await open_loop(writer, size, half, args.seconds)
        print(latency_line(f"single appends only, at 50% of their peak ({half:,.0f}/s)", loaded))
        if not sustained:
            print(f"    (not sustained: {OPEN_LOOP_OUTSTANDING_MAX} appends outstanding; stopped)")
        stats = writer.statistics()
        print(
            f"  writer: epoch {stats.epoch} (rolls by segment size change it), acked"
            f" {stats.acked_index} in that segment, retained {stats.retained_bytes} bytes"
        )


@dataclass(frozen=True)
class Target:
    """A cluster to measure: its master and, under TLS, the admin's certs dir."""

    master: str
    certs_dir: Path | None = None
    # The cluster's server processes, when this run started them (their CPU is counted).
    pids: tuple[int, ...] = ()

    def client(self) -> StreamClient:
        return StreamClient(self.master, certs_dir=self.certs_dir)

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by the servers and this process (the
        client): a cost that other load on the machine disturbs far less than rates."""
        return cpu_seconds([os.getpid(), *self.pids])

    def servers_cpu_s(self) -> float:
        """CPU seconds used so far by the servers this run started (0 without them)."""
        return cpu_seconds(self.pids)


def cpu_seconds(pids: Sequence[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


# Before the single-append phases the servers finish what the batched phase left them
# (memtable flushes, compactions, the scrub of the segments it sealed): an append "at
# light load" is timed on an otherwise idle cluster, as the peers' appends are.
IDLE_CPU_FRACTION = 0.05  # of one core, over IDLE_WINDOW_S
IDLE_WINDOW_S = 0.5
IDLE_WAIT_S_MAX = 60.0


async def servers_idle(target: Target, timeout_s: float = IDLE_WAIT_S_MAX) -> float | None:
    """Wait until the servers this run started use under IDLE_CPU_FRACTION of a core;
    the seconds that took, or None if they did not within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = target.servers_cpu_s()
        await asyncio.sleep(IDLE_WINDOW_S)
        if target.servers_cpu_s() - before < IDLE_CPU_FRACTION * IDLE_WINDOW_S:
            return time.monotonic() - started
    return None


@dataclass(frozen=True)
class Cost:
    """One measurement: events/s, and CPU microseconds per event (all processes)."""

    events_per_s: float
    cpu_us_per_event: float


@contextmanager
def local_cluster(fsync: str, tls: bool) -> Iterator[Target]:
    with tempfile.TemporaryDirectory(prefix="se-bench-") as data:
        port = free_port_run(ports_used(3))
        local = LocalCluster(Path(data), stores=3, port=port, fsync=fsync, tls=tls)
        try:
            local.start()
            pids = tuple(c.process.pid for c in local.children if c.process is not None)
            yield Target(local.master_address, local.admin_certs_dir, pids)
        finally:
            local.stop()


@contextmanager
def cluster(args: argparse.Namespace) -> Iterator[Target]:
    """The cluster of `--master` (with `--certs-dir`), else a local one (plaintext)."""
    if args.master:
        yield Target(args.master, args.certs_dir)
        return
    with local_cluster(args.fsync, tls=False) as target:
        yield target


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", help="an existing cluster's master (default: start one)")
    parser.add_argument(
        "--certs-dir", type=Path, help="TLS to --master: a certs dir with ca.crt and client.root"
    )
    parser.add_argument("--fsync", choices=["always", "never"], default="always")


def _idle_words(waited_s: float | None) -> str:
    if waited_s is None:
        return f"they were not within {IDLE_WAIT_S_MAX:.0f} s, timed anyway"
    return f"after {waited_s:.1f} s"


async def main_async(args: argparse.Namespace, target: Target) -> None:
    async with target.client() as client:
        for size in args.sizes:
            await bench_size(target, client, args, size)


def cost_lines(label: str, plaintext: list[Cost], tls: list[Cost]) -> list[str]:
    """Medians of each, and TLS's cost: the rate below plaintext's, the CPU per event
    above it."""
    lines = []
    for what, unit, value, sign in (
        ("rate", "events/s", lambda c: c.events_per_s, -1),
        ("CPU", "µs/event", lambda c: c.cpu_us_per_event, 1),
    ):
        plain = statistics.median(value(c) for c in plaintext)
        secured = statistics.median(value(c) for c in tls)
        spread = [value(c) for c in tls]
        lines.append(
            f"  {label + ' ' + what:<40} plaintext {plain:>10,.1f} {unit}  TLS {secured:>10,.1f}"
            f" {unit}  TLS cost {sign * 100 * (secured / plain - 1):5.1f} %"
            f"  (medians of {len(tls)}; TLS {min(spread):,.1f}..{max(spread):,.1f})"
        )
    return lines


async def measured(target: Target, events_of: Callable[[], Awaitable[Rate]]) -> Cost:
    cpu_before = target.cpu_s()
    rate = await events_of()
    cpu_us = (target.cpu_s() - cpu_before) * 1e6
    return Cost(rate.events_per_s, cpu_us / max(1, rate.events))


async def peaks(target: Target, args: argparse.Namespace, size: int) -> tuple[Cost, Cost]:
    """Batched and single-append peaks on a fresh stream of `target`."""
    async with target.client() as client:
        name = f"bench/tls-{size}-{time.time_ns()}"
        await client.create_stream(name, replicas=3, write_quorum=2)
        async with client.writer(name) as writer:
            await peak_batched(writer, size, args.batch, args.batches_in_flight, 0.5)  # warm up
            batched = await measured(
                target,
                lambda: peak_batched(
                    writer, size, args.batch, args.batches_in_flight, args.seconds
                ),
            )
            single = await measured(
                target, lambda: peak_single(writer, size, args.singles_in_flight, args.seconds)
            )
    return batched, single


def compare_tls(args: argparse.Namespace) -> None:
    """Both clusters up at once, measured in turn (the other idle), so both see the
    same machine; the order flips every round."""
    with local_cluster(args.fsync, tls=False) as plain, local_cluster(args.fsync, tls=True) as tls:
        print(f"TLS's cost: one writer, 3 stores, W=2, fsync={args.fsync}, {args.rounds} rounds")
        for size in args.sizes:
            results: dict[str, list[tuple[Cost, Cost]]] = {"plaintext": [], "tls": []}
            for round_number in range(args.rounds):
                order = [("plaintext", plain), ("tls", tls)]
                for mode, target in order if round_number % 2 == 0 else order[::-1]:
                    results[mode].append(asyncio.run(peaks(target, args, size)))
            print(f"{size}-byte events:")
            labels = (f"batches of {args.batch}", f"single appends x{args.singles_in_flight}")
            for position, label in enumerate(labels):
                plaintext = [r[position] for r in results["plaintext"]]
                secured = [r[position] for r in results["tls"]]
                for line in cost_lines(label, plaintext, secured):
                    print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[100, 1024]
    )
    parser.add_argument(
        "--tls", action="store_true", help="measure TLS's cost (plaintext and TLS clusters)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="--tls: measurements of each")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--batches-in-flight", type=int, default=8)
    parser.add_argument("--singles-in-flight", type=int, default=1000)
    parser.add_argument("--light-rate", type=float, default=100.0)
    parser.add_argument("--light-count", type=int, default=500)
    args = parser.parse_args(argv)
    if args.tls:
        compare_tls(args)
        return 0
    with cluster(args) as target:
        where = "an existing cluster" if args.master else f"a local cluster, fsync={args.fsync}"
        print(f"one writer, 3 stores, W=2, {where}")
        asyncio.run(main_async(args, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
