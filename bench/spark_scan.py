"""Spark scan rate over sealed segments, beside the SDK's read of the same events.

    .venv/bin/python -m bench.spark_scan                    # starts a local cluster
    .venv/bin/python -m bench.spark_scan --master HOST:PORT --events 1000000

Appends `--events` 100-byte events (rolling every `--segment-mb`), seals the stream,
waits until the stores have read back their fresh replicas once (the scrub; otherwise
the scans would share the cores with it), then scans it with
`spark.read.format("streamengine")` on local[2] (untimed warm-up scans first: the first
queries of a session pay for worker start-up and JIT compilation) and reads the same
events with `client.read`. Prints rows/s for both, beside Spark's own ceiling here: the
same query over a Python data source of the same schema that yields ready-made batches
(no store, no network), in the same session.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.append import Target, add_target_arguments, cluster
from bench.subscribe import catch_up, fill
from streamengine.client import StreamClient
from streamengine.v1 import entry_pb2, master_pb2


async def prepare(target: Target, stream: str, events: int, segment_mb: int) -> int:
    async with target.client() as client:
        await client.create_stream(stream, segment_bytes=segment_mb << 20)
        async with client.writer(stream) as writer:
            seconds = await fill(writer, events, b"p" * 100)
        await client.seal(stream)
        sealed = [s for s in await client.list_segments(stream) if s.sealed]
        print(
            f"filled {events:,} events in {seconds:.1f}s; {len(sealed)} sealed segments", flush=True
        )
        await settled(client, stream)
        return len(sealed)


async def settled(client: StreamClient, stream: str, timeout_s: float = 600.0) -> None:
    """Wait until every replica of every sealed segment was read back once by its
    store (the scrub's first check of a fresh seal, at `--scrub-mb-per-s`): the scans
    then measure a cluster at rest, not one still checking what was just written."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        request = master_pb2.ListSegmentsRequest(stream=stream, certificates=True)
        listing = await client.master.ListSegments(request, timeout=5.0)
        sealed = [s for s in listing.segments if s.state == entry_pb2.SEALED]
        if all(
            {r.store_id for r in s.copy_set} <= {v.store_id for v in s.verified} for s in sealed
        ):
            print(f"every replica read back by its store after {time.monotonic() - started:.0f}s")
            return
        await asyncio.sleep(1.0)
    print(f"replicas not all read back after {timeout_s:.0f}s: scanning anyway")


async def sdk_read_rate(target: Target, stream: str, events: int) -> float:
    async with target.client() as client:
        return events / await catch_up(client, stream, events)


QUERY = "sum(length(payload) + `index` + epoch)"  # every column read: nothing pruned


def ready_made_source(events: int) -> type:
    """A PySpark data source of the scan's schema yielding the same ready-made Arrow
    batch over and over: the rate of Spark's own side (JVM, Python workers, the Arrow
    hand-over) with no store and no network. Defined in a function so that Spark ships
    it by value to its workers."""
    import pyarrow as pa
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from streamengine.client.spark import ARROW_BATCH_ROWS, ARROW_SCHEMA, SCHEMA

    partitions = 4

    class ReadyMadeReader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            return [InputPartition(n) for n in range(partitions)]

        def read(self, partition: InputPartition) -> Any:
            rows = ARROW_BATCH_ROWS
            indexes = pa.array(range(1, rows + 1), pa.int64())
            batch = pa.RecordBatch.from_arrays(
                [
                    pa.repeat(pa.scalar("bench/ceiling", pa.string()), rows),
                    pa.repeat(pa.scalar(1, pa.int32()), rows),
                    indexes,
                    indexes,
                    pa.array([b"p" * 100] * rows, pa.binary()),
                ],
                schema=ARROW_SCHEMA,
            )
            left = events // partitions + (partition.value < events % partitions)
            while left > 0:
                yield batch.slice(0, min(rows, left))
                left -= rows

    class ReadyMade(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ready_made"

        def schema(self) -> str:
            return SCHEMA

        def reader(self, schema: Any) -> DataSourceReader:
            return ReadyMadeReader()

    return ReadyMade


def spark_scan_rates(
    target: Target,
    stream: str,
    events: int,
    warm_up: int,
    scans: int,
    partition_entries: Sequence[int | None],
) -> tuple[list[list[float]], list[float]]:
    """Rows/s of `scans` timed scans of the stream with each `partitionEntries` (None:
    the default), and of as many of the ready-made source, each after `warm_up` untimed
    ones (Python workers start, the JVM compiles the scan's hot code: the first scans
    run slower)."""
    from deploy.examples.analytics import session
    from streamengine.client.spark import register

    spark = session()
    try:
        register(spark)
        spark.dataSource.register(ready_made_source(events))

        def scan(source: str, entries: int | None) -> float:
            reader = spark.read.format(source)
            if source == "streamengine":
                reader = reader.option("master", target.master).option("stream", stream)
                reader = reader.option("certsDir", str(target.certs_dir or ""))
                if entries is not None:
                    reader = reader.option("partitionEntries", str(entries))
            frame = reader.load()
            started = time.perf_counter()
            total = frame.selectExpr(QUERY).collect()[0][0]
            seconds = time.perf_counter() - started
            rows = frame.count()
            if rows != events or total is None:
                raise SystemExit(f"Spark counted {rows} rows of {source}, expected {events}")
            return rows / seconds

        rates: list[list[float]] = []
        for source, entries in [
            *(("streamengine", e) for e in partition_entries),
            ("ready_made", None),
        ]:
            for _ in range(warm_up):
                scan(source, entries)
            rates.append(sorted(scan(source, entries) for _ in range(scans)))
        return rates[:-1], rates[-1]
    finally:
        spark.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--segment-mb", type=int, default=32, help="roll threshold")
    # The JVM's JIT settles after about ten scans of a million rows: in 24 scans in a row,
    # the 2nd-9th ran 1.0-1.4 M rows/s, the 11th on 1.45-1.6 M; during the 3rd-6th its
    # compiler threads took 22 % of the machine's CPU, 11 % after the 12th. A job reading
    # a long stream spends nearly all of its time past that point.
    parser.add_argument("--warm-up", type=int, default=10, help="untimed scans first")
    parser.add_argument("--scans", type=int, default=5, help="timed scans")
    parser.add_argument(
        "--partition-entries",
        type=lambda text: [int(n) if n else None for n in text.split(",")],
        default=[None],
        help="comma-separated partitionEntries to scan with, in turn (default: the option's)",
    )
    args = parser.parse_args(argv)
    stream = f"bench/spark-{int(time.time())}"
    with cluster(args) as target:
        asyncio.run(prepare(target, stream, args.events, args.segment_mb))
        rates, ceiling = spark_scan_rates(
            target, stream, args.events, args.warm_up, args.scans, args.partition_entries
        )
        sdk_rate = asyncio.run(sdk_read_rate(target, stream, args.events))
    labelled = [
        (
            "spark scan (local[2], Arrow batches)"
            + ("" if entries is None else f", partitionEntries {entries:,}"),
            scanned,
        )
        for entries, scanned in zip(args.partition_entries, rates, strict=True)
    ]
    for label, scanned in [*labelled, ("  Spark's ceiling (ready-made batches)", ceiling)]:
        print(
            f"{label:<40} {statistics.median(scanned):>12,.0f} rows/s median of"
            f" {len(scanned)} (slowest {scanned[0]:,.0f}, fastest {scanned[-1]:,.0f})"
        )
    share = statistics.median(rates[0]) / statistics.median(ceiling)
    print(f"  the (first) scan at {100 * share:.0f} % of Spark's ceiling on this machine")
    print(f"{'SDK read (one reader)':<40} {sdk_rate:>12,.0f} events/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
