"""Appends with a producer id against appends without, in one run (issue #40's cost).

    .venv/bin/python -m bench.producer                  # starts a local cluster
    .venv/bin/python -m bench.producer --rounds 5 --seconds 5 --sizes 100,1024

One local cluster (3 stores, W=2, fsync always). Per round and event size, two fresh
streams are measured in turn, the order flipping every round: one writer appending
batches of `--batch` events, `--batches-in-flight` at once, without a producer id; and
one with a producer id, each batch at the next producer sequences
(`append_batch(payloads, producer_sequence=K)`). Printed: the medians of the rate
(events/s) and of the CPU per event of every process (servers and client), and the
producer's rate as a share of the plain one (the goal: at least 90 %). On a shared
machine the CPU per event is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.append import Cost, Rate, Target, local_cluster, measured, peak_batched
from streamengine.client.writer import Writer

# The goal of issue #40: appends with a producer id at this share of the rate without.
PRODUCER_SHARE_GOAL = 0.9


async def peak_producer(
    writer: Writer, size: int, batch: int, in_flight: int, seconds: float
) -> Rate:
    """As `peak_batched`, each batch at the next producer sequences: the sequence is
    taken and the call made without a pause between, so batches decide in order."""
    payloads = [b"p" * size] * batch
    events = 0
    next_sequence = (writer.last_producer_sequence or -1) + 1
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal events, next_sequence
        while time.perf_counter() < deadline:
            sequence, next_sequence = next_sequence, next_sequence + batch
            await writer.append_batch(payloads, producer_sequence=sequence)
            events += batch

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(in_flight):
            group.create_task(worker())
    return Rate(events, time.perf_counter() - started, size)


async def one_round(
    target: Target, args: argparse.Namespace, size: int, flip: bool
) -> dict[str, Cost]:
    results: dict[str, Cost] = {}
    async with target.client() as client:
        modes = ["plain", "producer"]
        for mode in modes[::-1] if flip else modes:
            name = f"bench/producer-{mode}-{size}-{time.time_ns()}"
            await client.create_stream(name, replicas=3, write_quorum=2)
            producer_id = "bench-producer" if mode == "producer" else None
            peak = peak_producer if producer_id else peak_batched
            async with client.writer(name, producer_id=producer_id) as writer:
                await peak(writer, size, args.batch, args.batches_in_flight, 0.5)  # warm up
                results[mode] = await measured(
                    target,
                    lambda w=writer, p=peak: p(  # type: ignore[misc]
                        w, size, args.batch, args.batches_in_flight, args.seconds
                    ),
                )
    return results


async def all_rounds(target: Target, args: argparse.Namespace, size: int) -> list[dict[str, Cost]]:
    """Every round on one event loop: grpc.aio's poller outlives a loop closed under it
    (a traceback at exit, "Event loop is closed")."""
    return [await one_round(target, args, size, flip=n % 2 == 1) for n in range(args.rounds)]


def report(size: int, rounds: list[dict[str, Cost]]) -> list[str]:
    rate = {m: statistics.median(r[m].events_per_s for r in rounds) for m in ("plain", "producer")}
    cpu = {
        m: statistics.median(r[m].cpu_us_per_event for r in rounds) for m in ("plain", "producer")
    }
    share = rate["producer"] / rate["plain"]
    verdict = "meets" if share >= PRODUCER_SHARE_GOAL else "misses"
    lines = [f"{size}-byte events (medians of {len(rounds)}):"]
    for mode, label in (("plain", "without producer id"), ("producer", "with producer id")):
        lines.append(f"  {label:<20} {rate[mode]:>12,.0f} events/s  {cpu[mode]:>8.1f} µs/event")
    lines.append(
        f"  producer rate {100 * share:.1f} % of plain ({verdict} the "
        f"{PRODUCER_SHARE_GOAL:.0%} goal); CPU per event "
        f"{100 * (cpu['producer'] / cpu['plain'] - 1):+.1f} %"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[100])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--batches-in-flight", type=int, default=8)
    parser.add_argument("--fsync", choices=["always", "never"], default="always")
    args = parser.parse_args(argv)
    with local_cluster(args.fsync, tls=False) as target:
        print(f"producer id's cost: one writer, 3 stores, W=2, fsync={args.fsync}")
        for size in args.sizes:
            rounds = asyncio.run(all_rounds(target, args, size))
            for line in report(size, rounds):
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
