"""Append latency beside a catch-up read on the same client: what a read's replies cost
the appends of a client that also reads (a follower that writes what it derives, a
repair reading a segment while the writer appends).

    .venv/bin/python -m bench.append_beside_read          # starts a local cluster
    .venv/bin/python -m bench.append_beside_read --rounds 5 --read-mb 64

A stream of `--read-mb` MB of 1 KiB events is filled first, in segments of
`--segment-mb` (its replies reach the store's bound on a reply). Then, `--rounds` times,
one writer of the same client appends single 100-byte events at `--rate` per second
for `--seconds`: alone, and while the client reads the filled stream again and again
(`read_batches`, the lightest reader per event, so the most bytes per second on the
connections). The phases alternate, so load from elsewhere on the machine falls on
both. Latency p50/p99/max of each phase over all rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from bench.append import Target, add_target_arguments, cluster, latency_line
from bench.subscribe import fill
from streamengine.client import StreamClient
from streamengine.client.writer import Writer

READ_EVENT_BYTES = 1024
APPEND_EVENT_BYTES = 100


async def appends(writer: Writer, rate: float, seconds: float) -> list[float]:
    """Single appends, one at a time, at `rate` per second for `seconds`."""
    payload = b"a" * APPEND_EVENT_BYTES
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        await writer.append(payload)
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(max(0.0, 1 / rate - latencies[-1]))
    return latencies


async def read_again_and_again(client: StreamClient, stream: str, read_bytes: list[int]) -> None:
    """Catch-up reads of `stream` from its start, one after another, until cancelled."""
    while True:
        async for batch in client.read_batches(stream):
            read_bytes[0] += batch.nbytes


async def run(args: argparse.Namespace, target: Target) -> None:
    read_stream = f"bench/beside-read-{time.time_ns()}"
    append_stream = f"{read_stream}-appends"
    events = (args.read_mb << 20) // READ_EVENT_BYTES
    async with target.client() as client:
        await client.create_stream(read_stream, segment_bytes=args.segment_mb << 20)
        await client.create_stream(append_stream)
        async with client.writer(read_stream) as filling:
            await fill(filling, events, b"r" * READ_EVENT_BYTES)
        print(f"filled {events:,} events of {READ_EVENT_BYTES} B ({args.read_mb} MB)")
        alone: list[float] = []
        beside: list[float] = []
        read_bytes = [0]
        read_seconds = 0.0
        async with client.writer(append_stream) as writer:
            await appends(writer, args.rate, 1.0)  # warm: the Write stream is up
            for _ in range(args.rounds):
                alone += await appends(writer, args.rate, args.seconds)
                reader = asyncio.create_task(read_again_and_again(client, read_stream, read_bytes))
                started = time.perf_counter()
                try:
                    beside += await appends(writer, args.rate, args.seconds)
                finally:
                    read_seconds += time.perf_counter() - started
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reader
        print(latency_line("single appends alone", alone))
        print(latency_line("single appends beside a catch-up read", beside))
        print(f"  the catch-up read meanwhile: {read_bytes[0] / read_seconds / 1e6:,.0f} MB/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--read-mb", type=int, default=64, help="the stream read meanwhile")
    parser.add_argument("--segment-mb", type=int, default=32, help="its roll threshold")
    parser.add_argument("--rate", type=float, default=100.0, help="appends per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="each phase, each round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with cluster(args) as target:
        asyncio.run(run(args, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
