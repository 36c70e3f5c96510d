"""Writing to the `streamengine` Spark data source with a producer id (issue #40): the
same job run twice appends every row once; a streaming query run again from its
checkpoint over a batch it had written writes each input event once; a task retried
after it appended part of its rows leaves each row once. On a secured cluster the
executors write with the CA and a token that may write, never the driver's key.

The tests share one plaintext and one secured cluster (each writes its own streams).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamengine.client import StreamClient
from streamengine.testing import Cluster, running_cluster
from streamengine.v1 import master_pb2
from tests.integration.authority_helpers import create_token_as

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
        tmp_path_factory.mktemp("plain"), stores=3, master_args=["--lease-ms", "1000"]
    ) as running:
        yield running


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
        tmp_path_factory.mktemp("secured"), stores=3, tls=True, master_args=["--lease-ms", "1000"]
    ) as running:
        yield running


def client_of(cluster: Cluster) -> StreamClient:
    return StreamClient(cluster.master_address, certs_dir=cluster.admin_certs_dir)


async def read_payloads(cluster: Cluster, name: str) -> list[bytes]:
    async with client_of(cluster) as client:
        return [event.payload async for event in client.read(name)]


async def create(cluster: Cluster, name: str) -> None:
    async with client_of(cluster) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)


async def append_and_seal(cluster: Cluster, name: str, payloads: list[bytes]) -> None:
    async with client_of(cluster) as client:
        async with client.writer(name) as writer:
            await writer.append_batch(payloads)
        await client.seal(name)


def save(frame: Any, cluster: Cluster, name: str, **options: str) -> None:
    from streamengine.client.spark import register

    register(frame.sparkSession)
    writer = frame.write.format("streamengine").option("master", cluster.master_address)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.option("stream", name).mode("append").save()


def test_the_same_job_run_twice_with_a_producer_id_appends_every_row_once(
    spark: Any, plain: Cluster
) -> None:
    name = "spark/write"
    asyncio.run(create(plain, name))
    # A string column goes as UTF-8; two partitions, each its own producer, of the
    # same rows at the same positions every run (no shuffle).
    frame = spark.range(0, 400, numPartitions=2).selectExpr(
        "format_string('row-%03d-é', id) AS payload"
    )
    save(frame, plain, name, producerId="orders-job")
    save(frame, plain, name, producerId="orders-job")
    payloads = asyncio.run(read_payloads(plain, name))
    assert sorted(payloads) == [f"row-{n:03d}-é".encode() for n in range(400)]


def run_stream_query(
    spark: Any, cluster: Cluster, source: str, sink: str, checkpoint: Path, **options: str
) -> None:
    """Copy `source` to `sink` up to what is acked now (`availableNow`), through a
    query checkpointed at `checkpoint`; `options` go to both ends."""
    from streamengine.client.spark import register

    register(spark)
    reader = spark.readStream.format("streamengine").option("master", cluster.master_address)
    writer = (
        reader.options(**options)
        .option("stream", source)
        .load()
        .select("payload")
        .repartition(2)
        .writeStream.format("streamengine")
        .option("master", cluster.master_address)
    )
    query = (
        writer.options(**options)
        .option("stream", sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(60)
    assert query.exception() is None


def test_a_streaming_query_restarted_from_its_checkpoint_writes_each_event_once(
    spark: Any, plain: Cluster, tmp_path: Path
) -> None:
    for name in ("spark/in", "spark/out"):
        asyncio.run(create(plain, name))
    checkpoint = tmp_path / "checkpoint"
    first = [b"in-%03d" % n for n in range(30)]
    asyncio.run(append_and_seal(plain, "spark/in", first))
    run_stream_query(spark, plain, "spark/in", "spark/out", checkpoint)
    # Killed after the sink wrote the batch and before Spark recorded it: the restart
    # runs the batch again over the same offsets.
    commits = checkpoint / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for written in (commits / str(last), commits / f".{last}.crc"):
        written.unlink(missing_ok=True)
    run_stream_query(spark, plain, "spark/in", "spark/out", checkpoint)
    later = [b"in-%03d" % n for n in range(30, 45)]
    asyncio.run(append_and_seal(plain, "spark/in", later))
    run_stream_query(spark, plain, "spark/in", "spark/out", checkpoint)
    assert sorted(asyncio.run(read_payloads(plain, "spark/out"))) == first + later


def test_a_task_whose_rows_come_slower_than_its_lease_keeps_leading(plain: Cluster) -> None:
    """A task takes its rows as the stages before it make them: waiting for them (a
    slow UDF) must not starve its writer's heartbeats, or another task waiting to
    lead takes the stream and the slow one fails."""
    from streamengine.client.errors import Unavailable
    from streamengine.client.spark import WRITE_BATCH_ROWS, _write_rows
    from streamengine.protocol.transport import PLAINTEXT

    name = "spark/slow-rows"
    asyncio.run(create(plain, name))
    lease_s = 1.0  # the cluster's --lease-ms
    contender_led: list[bool] = []

    async def contend() -> None:
        async with StreamClient(plain.master_address) as client:
            try:
                async with client.writer(name, leadership_timeout_s=2.5 * lease_s):
                    contender_led.append(True)
            except Unavailable:  # no leadership in time: the slow task kept it
                contender_led.append(False)

    def rows() -> Iterator[dict[str, bytes]]:
        for number in range(2 * WRITE_BATCH_ROWS):
            if number == WRITE_BATCH_ROWS:  # the task waits for its next rows meanwhile
                contender = threading.Thread(target=asyncio.run, args=(contend(),))
                contender.start()
                contender.join()
            yield {"payload": b"slow-%d" % number}

    master = plain.master_address
    written = asyncio.run(_write_rows(master, PLAINTEXT, name, "slow-job.0", rows()))
    assert (written, contender_led) == (2 * WRITE_BATCH_ROWS, [False])
    assert len(asyncio.run(read_payloads(plain, name))) == 2 * WRITE_BATCH_ROWS


# The retried job: rows `row-N-xxx…` (RETRIED_PAYLOAD_BYTES long, so that the stages'
# buffers flush rows on to the sink), N below RETRIED_ROWS, in two partitions. The first
# attempt of each task fails at its partition's row RETRIED_FAIL_AT once the stream holds
# the task's first appended batch (`WRITE_BATCH_ROWS` rows): far enough past it that the
# sink got that batch whole through the 64 KiB buffers and 500-row Arrow batches between.
RETRIED_ROWS = 8000
RETRIED_PARTITION_ROWS = RETRIED_ROWS // 2
RETRIED_FAIL_AT = 2500
RETRIED_PAYLOAD_BYTES = 1000
RETRIED_APPEND_WAIT_S = 30.0
# What the first attempt writes instead of failing when its batch never showed up: the
# job then succeeds without a retry, and the rows compared at the end say so.
RETRIED_NO_BATCH = "the first attempt saw no batch of its own appended"


def retried_payload(number: int) -> str:
    return f"row-{number}-".ljust(RETRIED_PAYLOAD_BYTES, "x")


def appended_of_partition(master: str, name: str, partition: int) -> int:
    """How many rows of `partition` the stream holds now."""
    low, high = partition * RETRIED_PARTITION_ROWS, (partition + 1) * RETRIED_PARTITION_ROWS

    async def count() -> int:
        async with StreamClient(master) as client:
            numbers = [int(e.payload.split(b"-")[1]) async for e in client.read(name)]
        return sum(low <= number < high for number in numbers)

    return asyncio.run(count())


@pytest.mark.spark_task_retries
def test_a_task_retried_after_it_appended_part_of_its_rows_leaves_each_row_once(
    spark: Any, plain: Cluster
) -> None:
    """The shared session retries a failed task once (tests/conftest.py)."""
    from pyspark import TaskContext
    from pyspark.sql import functions as F

    from streamengine.client.spark import WRITE_BATCH_ROWS

    name, master = "spark/retried", plain.master_address
    asyncio.run(create(plain, name))

    def fail_first_attempt(number: int) -> str:
        context = TaskContext.get()
        first_attempt = context is not None and context.attemptNumber() == 0
        if first_attempt and number % RETRIED_PARTITION_ROWS == RETRIED_FAIL_AT:
            partition = number // RETRIED_PARTITION_ROWS
            deadline = time.monotonic() + RETRIED_APPEND_WAIT_S
            while appended_of_partition(master, name, partition) < WRITE_BATCH_ROWS:
                if time.monotonic() > deadline:
                    return RETRIED_NO_BATCH
                time.sleep(0.1)
            raise RuntimeError("the first attempt fails past its first appended batch")
        return retried_payload(number)

    payload = F.udf(fail_first_attempt, "string")
    frame = spark.range(0, RETRIED_ROWS, numPartitions=2).select(payload("id").alias("payload"))
    # The sink takes its rows in Arrow batches of this many: fewer than a write batch,
    # so that a task appends its first batch before the UDF reaches the row it fails at.
    batch_rows = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(batch_rows)
    spark.conf.set(batch_rows, "500")
    try:
        save(frame, plain, name, producerId="retried-job")
    finally:
        spark.conf.set(batch_rows, before)
    payloads = asyncio.run(read_payloads(plain, name))
    assert sorted(payloads) == sorted(retried_payload(n).encode() for n in range(RETRIED_ROWS))


def test_a_batch_and_a_streaming_write_reach_a_secured_cluster(
    spark: Any, secured: Cluster, tmp_path: Path
) -> None:
    """A cluster admin's driver (client.root) mints the executors a write token; a
    tenant's driver hands its own write token on."""
    for name in ("spark/tls-batch", "spark/tls-in", "spark/tls-out"):
        asyncio.run(create(secured, name))
    admin = str(secured.admin_certs_dir)
    rows = [(b"batch-%03d" % n,) for n in range(100)]
    frame = spark.createDataFrame(rows, "payload binary").repartition(2)
    save(frame, secured, "spark/tls-batch", certsDir=admin, producerId="tls-job")
    assert sorted(asyncio.run(read_payloads(secured, "spark/tls-batch"))) == [r for (r,) in rows]

    assert secured.certs is not None
    token = create_token_as(
        secured.client_transport, secured.master_address, "spark", master_pb2.TOKEN_ROLE_WRITE
    )
    events = [b"in-%03d" % n for n in range(20)]
    asyncio.run(append_and_seal(secured, "spark/tls-in", events))
    tenant = {"certsDir": str(secured.certs.tenant_dir), "token": token}
    run_stream_query(spark, secured, "spark/tls-in", "spark/tls-out", tmp_path / "cp", **tenant)
    assert sorted(asyncio.run(read_payloads(secured, "spark/tls-out"))) == events


def test_a_driver_holding_a_read_token_is_refused_before_any_task(
    spark: Any, secured: Cluster
) -> None:
    asyncio.run(create(secured, "spark/tls-refused"))
    assert secured.certs is not None
    token = create_token_as(
        secured.client_transport, secured.master_address, "spark", master_pb2.TOKEN_ROLE_READ
    )
    frame = spark.createDataFrame([(b"never",)], "payload binary")
    tenant = {"certsDir": str(secured.certs.tenant_dir), "token": token}
    with pytest.raises(Exception, match="a read token cannot write spark/tls-refused"):
        save(frame, secured, "spark/tls-refused", **tenant)
    assert asyncio.run(read_payloads(secured, "spark/tls-refused")) == []


def test_executors_get_no_key_and_no_driver_token_only_a_write_token(secured: Cluster) -> None:
    """What PySpark pickles for executors (the writer; the data source too, as for
    reads) holds nothing of the driver's cluster-admin key, nor a driver's token when
    `executorToken` names another: only the CA and a token that may write."""
    from pyspark import cloudpickle
    from pyspark.sql.types import BinaryType, StructField, StructType

    from streamengine.client.spark import StreamEngineDataSource
    from streamengine.protocol.auth import Role
    from streamengine.protocol.tokens import unverified_claims

    asyncio.run(create(secured, "spark/tls-shipped"))
    schema = StructType([StructField("payload", BinaryType())])
    admin = secured.admin_certs_dir
    assert admin is not None and secured.certs is not None
    base = {"master": secured.master_address, "stream": "spark/tls-shipped"}

    source = StreamEngineDataSource({**base, "certsdir": str(admin)})
    writer = source.writer(schema, False)
    shipped = cloudpickle.dumps((source, writer))
    key = (admin / "client.root.key").read_bytes()
    assert b"PRIVATE KEY" not in shipped and b"".join(key.splitlines()[1:-1])[:40] not in shipped
    assert b"client.root" not in shipped
    transport = cloudpickle.loads(shipped)[1].transport
    assert transport.tls and not transport.cert_pem and not transport.key_pem
    claims = unverified_claims(transport.token)
    assert (claims.tenant, claims.role, claims.stream_ids) == ("spark", Role.WRITE, ())

    def write_token() -> str:
        return create_token_as(
            secured.client_transport, secured.master_address, "spark", master_pb2.TOKEN_ROLE_WRITE
        )

    driver_token, executor_token = write_token(), write_token()
    tenant = str(secured.certs.tenant_dir)
    options = {**base, "certsdir": tenant, "token": driver_token, "executortoken": executor_token}
    source = StreamEngineDataSource(options)
    stream_writer = source.streamWriter(schema, False)
    shipped = cloudpickle.dumps((source, stream_writer))
    assert driver_token.encode() not in shipped and executor_token.encode() in shipped
