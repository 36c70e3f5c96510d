"""Writing to the `streamengine` Spark data source with a producer id (issue #40): the
same job run twice appends every row once; a streaming query run again from its
checkpoint over a batch it had written writes each input event once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from streamengine.client import StreamClient
from streamengine.testing import Cluster

# Slow: each task leads the stream in turn, and a save of two partitions took 75-107 s
# on a loaded 2-core machine (load average 16-22), far past CI's budget per test.
pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]


async def read_payloads(cluster: Cluster, name: str) -> list[bytes]:
    async with StreamClient(cluster.master_address) as client:
        return [event.payload async for event in client.read(name)]


async def create(cluster: Cluster, name: str) -> None:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)


def save(frame: Any, cluster: Cluster, name: str, **options: str) -> None:
    from streamengine.client.spark import register

    register(frame.sparkSession)
    writer = frame.write.format("streamengine").option("master", cluster.master_address)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.option("stream", name).mode("append").save()


def test_the_same_job_run_twice_with_a_producer_id_appends_every_row_once(
    spark: Any, cluster: Cluster
) -> None:
    name = "spark/write"
    asyncio.run(create(cluster, name))
    # A string column goes as UTF-8; two partitions, each its own producer.
    rows = [(f"row-{n:03d}-é",) for n in range(400)]
    frame = spark.createDataFrame(rows, "payload string").repartition(2)
    frame = frame.sortWithinPartitions("payload")  # the same rows at the same positions
    save(frame, cluster, name, producerId="orders-job")
    save(frame, cluster, name, producerId="orders-job")
    payloads = asyncio.run(read_payloads(cluster, name))
    assert sorted(payloads) == [row.encode() for (row,) in rows]


async def append_and_seal(cluster: Cluster, name: str, payloads: list[bytes]) -> None:
    async with StreamClient(cluster.master_address) as client:
        async with client.writer(name) as writer:
            await writer.append_batch(payloads)
        await client.seal(name)


def test_a_streaming_query_restarted_from_its_checkpoint_writes_each_event_once(
    spark: Any, cluster: Cluster, tmp_path: Path
) -> None:
    from streamengine.client.spark import register

    register(spark)
    for name in ("spark/in", "spark/out"):
        asyncio.run(create(cluster, name))
    checkpoint = tmp_path / "checkpoint"

    def run_once() -> None:
        query = (
            spark.readStream.format("streamengine")
            .option("master", cluster.master_address)
            .option("stream", "spark/in")
            .load()
            .select("payload")
            .repartition(2)
            .writeStream.format("streamengine")
            .option("master", cluster.master_address)
            .option("stream", "spark/out")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None

    first = [b"in-%03d" % n for n in range(30)]
    asyncio.run(append_and_seal(cluster, "spark/in", first))
    run_once()
    # Killed after the sink wrote the batch and before Spark recorded it: the restart
    # runs the batch again over the same offsets.
    commits = checkpoint / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for written in (commits / str(last), commits / f".{last}.crc"):
        written.unlink(missing_ok=True)
    run_once()
    later = [b"in-%03d" % n for n in range(30, 45)]
    asyncio.run(append_and_seal(cluster, "spark/in", later))
    run_once()
    assert sorted(asyncio.run(read_payloads(cluster, "spark/out"))) == first + later


def test_a_task_retried_after_it_appended_part_of_its_rows_leaves_each_row_once(
    cluster: Cluster,
) -> None:
    from tests.integration.spark_retry_job import ROWS

    name = "spark/retried"
    asyncio.run(create(cluster, name))
    job = [sys.executable, "-m", "tests.integration.spark_retry_job"]
    # Its own JVM: not the one this process's Spark session runs on.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY_")}
    done = subprocess.run(
        [*job, cluster.master_address, name, "retried-job"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payloads = asyncio.run(read_payloads(cluster, name))
    assert sorted(payloads) == sorted(b"row-%d" % n for n in range(ROWS))
