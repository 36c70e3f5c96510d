"""Follower read rates: catch-up from the start of a stream, and a live tail.

    .venv/bin/python -m bench.subscribe                  # starts a local cluster
    .venv/bin/python -m bench.subscribe --master HOST:PORT --events 1000000
    .venv/bin/python -m bench.subscribe --tls --events 300000   # TLS's cost on reads

- catch-up: `--events` 100-byte events are appended first (the stream rolls every
  `--segment-mb`, so most of them sit in sealed segments), then one reader reads them
  all from sequence 0 with `client.read` (an object per event) and with
  `client.read_batches` (Arrow record batches), twice: right after the fill, and again;
- live tail: a subscriber starts at "end" while a writer appends at full speed for
  `--seconds`; events/s the subscriber received, and how far it trailed the writer
  when the writer stopped.

`--tls` measures what TLS costs readers instead: the same events filled into a
plaintext and a TLS local cluster side by side, then catch-up reads of each in turn,
`--rounds` times; the medians of the rate and of the CPU per event (all processes),
and TLS's cost on each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from bench.append import (
    Cost,
    Target,
    add_target_arguments,
    cluster,
    cost_lines,
    local_cluster,
)
from streamengine.client import StreamClient
from streamengine.client.writer import Writer

BATCH = 1000
BATCHES_IN_FLIGHT = 8


async def fill(writer: Writer, events: int, payload: bytes) -> float:
    """Append `events` events as fast as the writer goes; returns the seconds taken."""
    remaining = events
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            count = min(BATCH, remaining)
            remaining -= count
            await writer.append_batch([payload] * count)

    async with asyncio.TaskGroup() as group:
        for _ in range(BATCHES_IN_FLIGHT):
            group.create_task(worker())
    return time.perf_counter() - started


async def catch_up(client: StreamClient, stream: str, expected: int) -> float:
    started = time.perf_counter()
    count = 0
    async for _event in client.read(stream):
        count += 1
    seconds = time.perf_counter() - started
    if count != expected:
        raise SystemExit(f"catch-up read {count} events, expected {expected}")
    return seconds


async def catch_up_batches(client: StreamClient, stream: str, expected: int) -> float:
    """`catch_up` through `read_batches`: record batches, no object per event."""
    started = time.perf_counter()
    count = 0
    async for batch in client.read_batches(stream):
        count += batch.num_rows
    seconds = time.perf_counter() - started
    if count != expected:
        raise SystemExit(f"catch-up read {count} events in batches, expected {expected}")
    return seconds


async def live_tail(client: StreamClient, stream: str, seconds: float, payload: bytes) -> None:
    received = 0
    first_at: float | None = None
    written = 0

    target: int | None = None
    caught_up = asyncio.Event()

    async def follow() -> None:
        nonlocal received, first_at
        async for _event in client.subscribe(stream, start="end"):
            if first_at is None:
                first_at = time.perf_counter()
            received += 1
            if target is not None and received >= target:
                caught_up.set()

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.5)  # let the subscriber resolve "end" before the burst
    async with client.writer(stream) as writer:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal written
            while time.perf_counter() < deadline:
                await writer.append_batch([payload] * BATCH)
                written += BATCH

        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(BATCHES_IN_FLIGHT):
                group.create_task(worker())
        write_seconds = time.perf_counter() - started
    trailing = written - received
    target = written
    if received >= target:
        caught_up.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(caught_up.wait(), 60)
    tail_seconds = time.perf_counter() - (first_at or started)
    follower.cancel()
    print(
        f"live tail:  writer {written / write_seconds:>10,.0f} events/s, "
        f"subscriber {received / tail_seconds:>10,.0f} events/s "
        f"({received:,} of {written:,}; {trailing:,} behind when the writer stopped)"
    )


async def run(args: argparse.Namespace, target: Target) -> None:
    payload = b"s" * 100
    stream = f"bench/subscribe-{int(time.time())}"
    async with target.client() as client:
        await client.create_stream(stream, segment_bytes=args.segment_mb << 20)
        async with client.writer(stream) as writer:
            fill_seconds = await fill(writer, args.events, payload)
        segments = await client.list_segments(stream)
        sealed = sum(1 for s in segments if s.sealed)
        print(
            f"filled {args.events:,} events in {fill_seconds:.1f}s "
            f"({len(segments)} segments, {sealed} sealed)"
        )
        # Right after the fill the stores still flush and compact what was written; the
        # second pass reads data at rest, as a reader catching up later would.
        for label in ("right after the fill", "data at rest"):
            seconds = await catch_up(client, stream, args.events)
            batch_seconds = await catch_up_batches(client, stream, args.events)
            print(
                f"catch-up:   {args.events / seconds:>10,.0f} events/s per event "
                f"({seconds:.1f}s), {args.events / batch_seconds:>10,.0f} events/s in "
                f"batches ({batch_seconds:.1f}s; {label})"
            )
        await client.create_stream(f"{stream}-live")
        await live_tail(client, f"{stream}-live", args.seconds, payload)


async def filled(target: Target, args: argparse.Namespace) -> str:
    stream = f"bench/read-{time.time_ns()}"
    async with target.client() as client:
        await client.create_stream(stream, segment_bytes=args.segment_mb << 20)
        async with client.writer(stream) as writer:
            await fill(writer, args.events, b"r" * 100)
    return stream


async def read_cost(target: Target, stream: str, events: int) -> Cost:
    async with target.client() as client:
        cpu_before = target.cpu_s()
        seconds = await catch_up(client, stream, events)
        return Cost(events / seconds, (target.cpu_s() - cpu_before) * 1e6 / events)


def compare_tls(args: argparse.Namespace) -> None:
    with local_cluster(args.fsync, tls=False) as plain, local_cluster(args.fsync, tls=True) as tls:
        targets = {"plaintext": plain, "tls": tls}
        streams = {mode: asyncio.run(filled(target, args)) for mode, target in targets.items()}
        print(f"TLS's cost on catch-up reads: {args.events:,} 100-byte events, {args.rounds}x")
        costs: dict[str, list[Cost]] = {"plaintext": [], "tls": []}
        for round_number in range(args.rounds):
            order = ["plaintext", "tls"] if round_number % 2 == 0 else ["tls", "plaintext"]
            for mode in order:
                cost = asyncio.run(read_cost(targets[mode], streams[mode], args.events))
                costs[mode].append(cost)
        for line in cost_lines("catch-up read", costs["plaintext"], costs["tls"]):
            print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--segment-mb", type=int, default=32, help="roll threshold")
    parser.add_argument("--seconds", type=float, default=10.0, help="live tail duration")
    parser.add_argument(
        "--tls", action="store_true", help="measure TLS's cost (plaintext and TLS clusters)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="--tls: measurements of each")
    args = parser.parse_args(argv)
    if args.tls:
        compare_tls(args)
        return 0
    with cluster(args) as target:
        asyncio.run(run(args, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
