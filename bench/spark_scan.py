"""Spark scan rate over sealed segments, beside the SDK's read of the same events.

    .venv/bin/python -m bench.spark_scan                    # starts a local cluster
    .venv/bin/python -m bench.spark_scan --master HOST:PORT --events 1000000

Appends `--events` 100-byte events (rolling every `--segment-mb`), seals the stream,
then scans it with `spark.read.format("streamengine")` on local[2] (untimed warm-up
scans first: the first queries of a session pay for worker start-up and JIT
compilation) and reads the same events with `client.read`. Prints rows/s for both.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from bench.append import Target, add_target_arguments, cluster
from bench.subscribe import catch_up, fill
from streamengine.v1 import entry_pb2


async def prepare(target: Target, stream: str, events: int, segment_mb: int) -> int:
    async with target.client() as client:
        await client.create_stream(stream, segment_bytes=segment_mb << 20)
        async with client.writer(stream) as writer:
            seconds = await fill(writer, events, b"p" * 100)
        await client.seal(stream)
        listing = await client.list_segments(stream)
        sealed = [s for s in listing.segments if s.state == entry_pb2.SEALED]
        print(f"filled {events:,} events in {seconds:.1f}s; {len(sealed)} sealed segments")
        return len(sealed)


async def sdk_read_rate(target: Target, stream: str, events: int) -> float:
    async with target.client() as client:
        return events / await catch_up(client, stream, events)


def spark_scan_rates(
    target: Target, stream: str, events: int, warm_up: int, scans: int
) -> list[float]:
    """Rows/s of `scans` timed scans, after `warm_up` untimed ones (Python workers
    start, the JVM compiles the scan's hot code: the first scans run slower)."""
    from deploy.examples.analytics import session
    from streamengine.client.spark import register

    spark = session()
    try:
        register(spark)

        def scan() -> float:
            frame = spark.read.format("streamengine").option("master", target.master)
            frame = frame.option("certsDir", str(target.certs_dir or ""))
            frame = frame.option("stream", stream).load()
            started = time.perf_counter()
            # Touch every column so nothing is pruned away: a real scan of the rows.
            total = frame.selectExpr("sum(length(payload) + `index` + epoch)").collect()[0][0]
            seconds = time.perf_counter() - started
            rows = frame.count()
            if rows != events or total is None:
                raise SystemExit(f"Spark counted {rows} rows, expected {events}")
            return rows / seconds

        for _ in range(warm_up):
            scan()
        return [scan() for _ in range(scans)]
    finally:
        spark.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--segment-mb", type=int, default=32, help="roll threshold")
    parser.add_argument("--warm-up", type=int, default=2, help="untimed scans first")
    parser.add_argument("--scans", type=int, default=5, help="timed scans")
    args = parser.parse_args(argv)
    stream = f"bench/spark-{int(time.time())}"
    with cluster(args) as target:
        asyncio.run(prepare(target, stream, args.events, args.segment_mb))
        rates = spark_scan_rates(target, stream, args.events, args.warm_up, args.scans)
        sdk_rate = asyncio.run(sdk_read_rate(target, stream, args.events))
    rates.sort()
    print(
        f"spark scan (local[2], Arrow batches): {statistics.median(rates):>12,.0f} rows/s"
        f" median of {len(rates)} (slowest {rates[0]:,.0f}, fastest {rates[-1]:,.0f})"
    )
    print(f"SDK read (one reader):                {sdk_rate:>12,.0f} events/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
