"""Cost against the number of streams one client process leads (issue #38).

    .venv/bin/python -m bench.scale                     # N = 100, 1,000, 10,000
    .venv/bin/python -m bench.scale --streams 1000 --idle-s 5

For each N, a fresh local cluster (a master, 3 stores, plaintext, fsync never) and one
`StreamClient` in this process, which:

- creates N streams (N=3, W=2), spread over tenants of `TENANT_STREAMS` each (a tenant
  holds at most the master's `--tenant-streams-max`);
- leads a writer on each (`lead all`: from the first `writer` entered to the last
  leading, all at once);
- appends one 100-byte event to each stream in turn, one append at a time, `--appends`
  in all (at least one a stream), and times each (round-robin latency p50 / p99). The
  first append that fails, or waits past `APPEND_WAIT_S_MAX`, ends the phase and is
  reported. Every writer's batches go through the client's one Write stream per store
  (`client.store_session`): before, each writer held its own to each store of its copy
  set, and a store serves at most `CONCURRENT_RPCS_MAX` (512) calls at once, so the
  writers past about 500 streams per store never connected;
- spread throughput: every writer appends `--spread-batch` 100-byte events at a time
  (one by default), all at once, for `--throughput-s` (events acked per second in
  all); then one stream batched, in
  the same run: one writer with `ONE_STREAM_IN_FLIGHT` appends of `ONE_STREAM_BATCH`
  events each in flight, for as long (issue #38 wants the first at least half the
  second);
- holds every lease idle for `--idle-s`, and reads the CPU each process used meanwhile
  (% of one core) and its RSS at the end;
- closes every writer (`close all`) and checks that no writer stepped down and no
  append failed or was in doubt.

Every phase is bounded in time (`--phase-timeout-s`); a phase past it fails the run.
The figures, with the machine they were taken on, are in docs/performance.md; with
`--plot STEM` the rows go to STEM.json and their cost curves, each figure's growth
against N named, to STEM.png (`bench.scale_plot`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from streamengine.client import StreamClient, StreamEngineError
from streamengine.client.writer import Writer
from streamengine.testing.processes import Cluster, running_cluster

EVENT_BYTES = 100
TENANT_STREAMS = 1000
# Streams created (and writers entered) at once: enough to keep the master busy,
# few enough that no call waits behind thousands of others.
CONCURRENT_CALLS = 100
STREAMS_DEFAULT = (100, 1000, 10_000)
# An append not acked in this long ends the append phase (and is reported).
APPEND_WAIT_S_MAX = 5.0
# One stream batched, the throughput the spread appends are held against: batches of
# this many events, this many in flight (the writer's own batching does the rest).
ONE_STREAM_BATCH = 1000
ONE_STREAM_IN_FLIGHT = 8


class AppendStuck(Exception):
    """An append waited past `APPEND_WAIT_S_MAX`."""


class PhaseTimedOut(Exception):
    """A phase took longer than `--phase-timeout-s`."""


@dataclass
class Row:
    streams: int
    create_s: float = 0.0
    lead_s: float = 0.0
    append_p50_ms: float = 0.0
    append_p99_ms: float = 0.0
    appends: int = 0
    append_s: float = 0.0
    idle_cpu_pct: dict[str, float] | None = None
    rss_mib: dict[str, float] | None = None
    close_s: float = 0.0
    spread_events_per_s: float = 0.0
    one_stream_events_per_s: float = 0.0
    # This process's CPU per event acked in each throughput phase (all its threads).
    spread_cpu_us: float = 0.0
    one_stream_cpu_us: float = 0.0
    problems: tuple[str, ...] = ()


def stream_name(number: int) -> str:
    return f"scale{number // TENANT_STREAMS}/s{number}"


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def bounded(label: str, seconds: float, work: asyncio.Future[object] | object) -> None:
    started = time.monotonic()
    try:
        async with asyncio.timeout(seconds):
            await work  # type: ignore[misc]
    except TimeoutError:
        raise PhaseTimedOut(f"{label}: not done within {seconds} s") from None
    print(f"  {label}: {time.monotonic() - started:.2f} s", file=sys.stderr, flush=True)


async def in_batches(calls: list, width: int = CONCURRENT_CALLS) -> list:  # type: ignore[type-arg]
    results = []
    for start in range(0, len(calls), width):
        results.extend(await asyncio.gather(*calls[start : start + width]))
    return results


async def lead_all_and_append_once(
    client: StreamClient,
    names: list[str],
    exits: contextlib.AsyncExitStack,
    timeout_s: float,
) -> list[Writer]:
    """A writer on each of `names` (entered into `exits`), then one event appended to
    each: the set-up of the scripts that measure what many leaders of one client do."""
    writers: list[Writer] = []

    async def lead(name: str) -> None:
        writers.append(
            await exits.enter_async_context(client.writer(name, leadership_timeout_s=timeout_s))
        )

    await bounded("lead all", timeout_s, in_batches([lead(n) for n in names]))
    first = [w.append(bytes(EVENT_BYTES)) for w in writers]
    await bounded("one append each", timeout_s, in_batches(first, CONCURRENT_CALLS))
    return writers


def on_a_local_cluster(
    prefix: str, keep: Path | None, measure: Callable[[str], Coroutine[Any, Any, None]]
) -> None:
    """`measure(master address)` on a fresh local cluster (a master, 3 stores with fsync
    never, plaintext) under `keep`, or a temporary directory."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        root = keep or Path(scratch)
        with running_cluster(root, store_args=["--fsync", "never"]) as cluster:
            asyncio.run(measure(cluster.master_address))


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, process in processes.items():
        times = process.cpu_times()
        out[name] = times.user + times.system
    return out


async def measure(cluster: Cluster, streams: int, args: argparse.Namespace) -> Row:
    row = Row(streams)
    problems: list[str] = []
    names = [stream_name(n) for n in range(streams)]
    processes = {"master": psutil.Process(cluster.master.pid), "client": psutil.Process()}
    for store in cluster.stores:
        processes[store.name] = psutil.Process(store.pid)
    async with StreamClient(cluster.master_address) as client:
        started = time.monotonic()
        creating = client.create_streams(names, replicas=3, write_quorum=2)
        await bounded("create", args.phase_timeout_s, creating)
        row.create_s = time.monotonic() - started

        exits = contextlib.AsyncExitStack()
        try:
            writers: list[Writer] = []

            async def lead(name: str) -> None:
                writers.append(
                    await exits.enter_async_context(
                        client.writer(name, leadership_timeout_s=args.phase_timeout_s)
                    )
                )

            started = time.monotonic()
            await bounded("lead all", args.phase_timeout_s, in_batches([lead(n) for n in names]))
            row.lead_s = time.monotonic() - started

            latencies: list[float] = []

            async def append_one(writer: Writer, payload: bytes) -> None:
                sent = time.monotonic()
                try:
                    async with asyncio.timeout(APPEND_WAIT_S_MAX):
                        await writer.append(payload)
                except TimeoutError:
                    connected = writer.statistics().connected
                    raise AppendStuck(
                        f"{writer.stream}: not acked within {APPEND_WAIT_S_MAX} s; Write "
                        f"streams open: {sum(connected.values())} of {len(connected)}"
                    ) from None
                latencies.append(time.monotonic() - sent)

            async def round_robin(count: int) -> None:
                for number in range(count):
                    await append_one(writers[number % len(writers)], payload)
                    if args.verbose and number % 200 == 199:
                        print(
                            f"    {number + 1} appends, slowest of the last 200: "
                            f"{max(latencies[-200:]) * 1000:.0f} ms",
                            file=sys.stderr,
                            flush=True,
                        )

            payload = bytes(EVENT_BYTES)
            started = time.monotonic()
            appends = max(args.appends, len(writers))
            try:
                await bounded("round-robin appends", args.phase_timeout_s, round_robin(appends))
            except (StreamEngineError, AppendStuck, PhaseTimedOut) as error:
                # Measured on: the leases and the idle cost do not depend on it.
                problems.append(f"append {len(latencies) + 1} failed: {error!r}")
            row.append_s = time.monotonic() - started
            row.appends = len(latencies)
            if latencies:
                row.append_p50_ms = statistics.median(latencies) * 1000
                row.append_p99_ms = percentile(latencies, 0.99) * 1000

            if args.throughput_s > 0:
                try:
                    row.spread_events_per_s, row.spread_cpu_us = await bounded_rate(
                        "spread appends",
                        args,
                        spread_appends(writers, args.spread_batch, args.throughput_s),
                    )
                    row.one_stream_events_per_s, row.one_stream_cpu_us = await bounded_rate(
                        "one stream batched", args, one_stream(writers[0], args.throughput_s)
                    )
                except (StreamEngineError, AppendStuck, PhaseTimedOut) as error:
                    problems.append(f"throughput: {error!r}")

            before = cpu_seconds(processes)
            started = time.monotonic()
            await asyncio.sleep(args.idle_s)  # the window measured: every lease held, idle
            spent = time.monotonic() - started
            after = cpu_seconds(processes)
            row.idle_cpu_pct = {n: 100 * (after[n] - before[n]) / spent for n in processes}
            row.rss_mib = {n: p.memory_info().rss / (1 << 20) for n, p in processes.items()}
            stepped_down = [w.stream for w in writers if not w.leading]
        except Exception as error:
            print(f"  failed: {error!r}", file=sys.stderr, flush=True)
            raise
        finally:
            started = time.monotonic()
            await bounded("close all", args.phase_timeout_s, exits.aclose())
            row.close_s = time.monotonic() - started
    if stepped_down:
        problems.append(f"{len(stepped_down)} writer(s) stepped down, e.g. {stepped_down[0]}")
    row.problems = tuple(problems)
    return row


async def bounded_rate(
    label: str, args: argparse.Namespace, work: Awaitable[tuple[float, int]]
) -> tuple[float, float]:
    """The events per second `work` measured, within the phase timeout, and this
    process's CPU per event meanwhile (microseconds: the client's cost, which the
    machine's load inflates less than it does the rate)."""
    measured: list[tuple[float, int]] = []
    cpu_s = time.process_time()

    async def run() -> None:
        measured.append(await work)

    await bounded(label, args.phase_timeout_s, run())
    rate, events = measured[0]
    cpu_us = (time.process_time() - cpu_s) * 1e6 / max(1, events)
    print(f"    {rate:,.0f} events/s, {cpu_us:.1f} us of CPU each", file=sys.stderr, flush=True)
    return rate, cpu_us


async def _append_until(writer: Writer, payloads: list[bytes], deadline: float) -> int:
    """Appends of `payloads`, one after the other, until `deadline`: events acked."""
    acked = 0
    while time.monotonic() < deadline:
        try:
            async with asyncio.timeout(APPEND_WAIT_S_MAX):
                await writer.append_batch(payloads)
        except TimeoutError:
            raise AppendStuck(f"{writer.stream}: not acked within {APPEND_WAIT_S_MAX} s") from None
        acked += len(payloads)
    return acked


async def spread_appends(writers: list[Writer], batch: int, seconds: float) -> tuple[float, int]:
    """Every writer appends `batch` events at a time, all at once: events acked per
    second, and how many."""
    payload = [bytes(EVENT_BYTES)] * batch
    started = time.monotonic()
    counts = await asyncio.gather(
        *(_append_until(writer, payload, started + seconds) for writer in writers)
    )
    return sum(counts) / (time.monotonic() - started), sum(counts)


async def one_stream(writer: Writer, seconds: float) -> tuple[float, int]:
    """One writer, `ONE_STREAM_IN_FLIGHT` batches of `ONE_STREAM_BATCH` in flight:
    events acked per second, and how many."""
    batch = [bytes(EVENT_BYTES)] * ONE_STREAM_BATCH
    started = time.monotonic()
    counts = await asyncio.gather(
        *(_append_until(writer, batch, started + seconds) for _ in range(ONE_STREAM_IN_FLIGHT))
    )
    return sum(counts) / (time.monotonic() - started), sum(counts)


@contextlib.contextmanager
def cluster_for(streams: int, keep: Path | None, lease_ms: int) -> Iterator[Cluster]:
    """A fresh cluster; its data and logs under `keep/N` when given (else removed).
    `lease_ms` (0: the master's default) keeps leases through a machine too loaded for
    thousands of writers to heartbeat in time, when the writes are what is measured."""
    with contextlib.ExitStack() as stack:
        if keep is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="se-scale-")))
        else:
            root = keep / str(streams)
            root.mkdir(parents=True)
        master_args = ["--lease-ms", str(lease_ms)] if lease_ms else []
        yield stack.enter_context(
            running_cluster(root, master_args=master_args, store_args=["--fsync", "never"])
        )


def print_row(row: Row) -> None:
    cpu = row.idle_cpu_pct or {}
    rss = row.rss_mib or {}
    stores = [n for n in cpu if n.startswith("store")]
    print(
        f"| {row.streams:,} | {row.create_s:.2f} s | {row.lead_s:.2f} s "
        f"| {row.appends:,} in {row.append_s:.2f} s, p50 {row.append_p50_ms:.1f} ms, "
        f"p99 {row.append_p99_ms:.1f} ms "
        f"| master {cpu.get('master', 0):.1f} %, client {cpu.get('client', 0):.1f} %, "
        f"stores {min((cpu[s] for s in stores), default=0):.1f}-"
        f"{max((cpu[s] for s in stores), default=0):.1f} % "
        f"| master {rss.get('master', 0):.0f}, client {rss.get('client', 0):.0f}, "
        f"stores {max((rss[s] for s in stores), default=0):.0f} MiB "
        f"| {row.close_s:.2f} s "
        f"| {row.spread_events_per_s:,.0f} / {row.one_stream_events_per_s:,.0f} events/s "
        f"({_ratio(row)}; client CPU {row.spread_cpu_us:.1f} / {row.one_stream_cpu_us:.1f} "
        "us per event) |",
        flush=True,
    )
    for problem in row.problems:
        print(f"  problem: {problem}", flush=True)


def _ratio(row: Row) -> str:
    if not row.one_stream_events_per_s:
        return "-"
    return f"{row.spread_events_per_s / row.one_stream_events_per_s:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=list(STREAMS_DEFAULT))
    parser.add_argument(
        "--appends", type=int, default=2000, help="round-robin appends (at least one a stream)"
    )
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle window measured")
    parser.add_argument(
        "--throughput-s",
        type=float,
        default=5.0,
        help="each throughput phase (spread over every stream, then one stream batched)",
    )
    parser.add_argument(
        "--spread-batch", type=int, default=1, help="events per append in the spread phase"
    )
    parser.add_argument("--phase-timeout-s", type=float, default=120.0)
    parser.add_argument("--verbose", action="store_true", help="progress of the appends")
    parser.add_argument(
        "--lease-ms", type=int, default=0, help="the master's lease (default: its own)"
    )
    parser.add_argument("--keep", type=Path, help="keep each cluster's data and logs here")
    parser.add_argument(
        "--plot",
        type=Path,
        help="write the rows to PLOT.json and their cost curves to PLOT.png (bench.scale_plot)",
    )
    args = parser.parse_args(argv)
    print(
        "| N | create | lead all | round-robin appends | idle CPU (% of a core) "
        "| RSS | close all | spread / one stream batched (ratio; client CPU per event) |"
        "\n|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    failed = False
    rows: list[Row] = []
    for streams in args.streams:
        try:
            with cluster_for(streams, args.keep, args.lease_ms) as cluster:
                row = asyncio.run(measure(cluster, streams, args))
        except PhaseTimedOut as error:
            print(f"| {streams:,} | {error} |", flush=True)
            failed = True
            continue
        print_row(row)
        rows.append(row)
        failed = failed or bool(row.problems)
    if args.plot and rows:
        from bench import scale_plot  # matplotlib only when drawing

        data, picture = scale_plot.save(rows, args.plot)
        print("\n".join(scale_plot.growth_lines(rows)), flush=True)
        print(f"rows: {data}, curves: {picture}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
