"""The `streamengine` Spark data source against real master and store processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from bench.segment_driver import Driver, write
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.sequence import pack_sequence
from streamengine.testing import Cluster

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

PAYLOAD_BYTES = 20


def payload_of(index: int) -> bytes:
    return bytes([index % 256]) * PAYLOAD_BYTES


def create_stream(cluster: Cluster, name: str) -> None:
    import grpc

    from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

    with grpc.insecure_channel(cluster.master_address) as channel:
        master_pb2_grpc.MasterStub(channel).CreateStream(
            master_pb2.CreateStreamRequest(
                name=name,
                policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
                create_tenant=True,
            ),
            timeout=10,
        )


def load(spark: Any, cluster: Cluster, stream: str, **options: str) -> Any:
    from streamengine.client.spark import register

    register(spark)
    reader = spark.read.format("streamengine").option("master", cluster.master_address)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.option("stream", stream).load()


def rows_of(frame: Any) -> list[tuple[int, int, int, bytes]]:
    return sorted(
        (row["epoch"], row["index"], row["sequence"], bytes(row["payload"]))
        for row in frame.collect()
    )


def expected_rows(segments: list[tuple[int, int]]) -> list[tuple[int, int, int, bytes]]:
    """(epoch, events) per sealed segment -> the rows a scan must return."""
    return sorted(
        (epoch, index, pack_sequence(epoch, index), payload_of(index))
        for epoch, events in segments
        for index in range(1, events + 1)
    )


def fill(driver: Driver, sizes: list[int]) -> list[tuple[int, int]]:
    made = []
    for events in sizes:
        sealed = driver.fill_and_roll(events, PAYLOAD_BYTES)
        made.append((sealed.id.epoch, events))
    return made


def test_a_scan_returns_every_event_of_every_sealed_segment(spark: Any, cluster: Cluster) -> None:
    create_stream(cluster, "spark/scan")
    made = fill(Driver(cluster.master_address, "spark/scan"), [300, 1, 250])
    frame = load(spark, cluster, "spark/scan", partitionEntries="100")
    assert frame.schema.simpleString() == (
        "struct<stream:string,epoch:int,index:bigint,sequence:bigint,payload:binary>"
    )
    assert frame.rdd.getNumPartitions() == 6  # 551 events, at most 100 a partition
    assert rows_of(frame) == expected_rows(made)
    assert {row["stream"] for row in frame.select("stream").distinct().collect()} == {"spark/scan"}


def test_a_scan_reads_only_what_is_retained(spark: Any, cluster: Cluster) -> None:
    import grpc

    from streamengine.v1 import master_pb2, master_pb2_grpc

    create_stream(cluster, "spark/trimmed")
    made = fill(Driver(cluster.master_address, "spark/trimmed"), [30, 20, 10])
    with grpc.insecure_channel(cluster.master_address) as channel:
        trimmed = master_pb2_grpc.MasterStub(channel).TrimStream(
            master_pb2.TrimStreamRequest(
                name="spark/trimmed", before_sequence=pack_sequence(made[2][0], 1)
            ),
            timeout=10,
        )
    assert list(trimmed.trimmed_epochs) == [made[0][0], made[1][0]]
    # The trimmed segments are still on the stores (the grace): the scan skips them.
    assert rows_of(load(spark, cluster, "spark/trimmed")) == expected_rows(made[2:])


def test_a_sequence_range_reads_exactly_that_range(spark: Any, cluster: Cluster) -> None:
    create_stream(cluster, "spark/range")
    made = fill(Driver(cluster.master_address, "spark/range"), [50, 50, 50])
    (e1, _), (e2, _), (e3, _) = made
    frame = load(
        spark,
        cluster,
        "spark/range",
        fromSequence=str(pack_sequence(e1, 40)),
        toSequence=str(pack_sequence(e3, 11)),
    )
    got = [(epoch, index) for epoch, index, _, _ in rows_of(frame)]
    want = [(e1, i) for i in range(40, 51)] + [(e2, i) for i in range(1, 51)]
    want += [(e3, i) for i in range(1, 11)]
    assert got == want
    past_the_end = load(spark, cluster, "spark/range", fromSequence=str(pack_sequence(e3, 51)))
    assert past_the_end.count() == 0
    empty = load(
        spark,
        cluster,
        "spark/range",
        fromSequence=str(pack_sequence(e2, 5)),
        toSequence=str(pack_sequence(e2, 5)),
    )
    assert empty.count() == 0


def test_a_scan_with_one_replica_of_each_segment_down_fails_over(
    spark: Any, cluster: Cluster
) -> None:
    create_stream(cluster, "spark/down")
    made = fill(Driver(cluster.master_address, "spark/down"), [200, 200])
    cluster.stores[0].kill()  # with 3 stores, every copy set holds store0
    assert rows_of(load(spark, cluster, "spark/down")) == expected_rows(made)


def test_holes_left_by_a_recovery_never_appear_as_rows(spark: Any, cluster: Cluster) -> None:
    import asyncio

    import grpc

    from streamengine.client import StreamClient
    from streamengine.v1 import master_pb2, master_pb2_grpc

    create_stream(cluster, "spark/holes")
    driver = Driver(cluster.master_address, "spark/holes")
    epoch = driver.lead().epoch
    assert driver.segment is not None
    # A leader wrote indexes 1 and 3 everywhere and died before index 2 reached any store.
    entries = [StoredEntry.make(i, EntryKind.EVENT, epoch, payload_of(i)) for i in (1, 3)]
    for replica in driver.segment.copy_set:
        write(replica.data_address, driver.segment.id, epoch, entries[:1], 0, driver.grant)
        write(replica.data_address, driver.segment.id, epoch, entries[1:], 0, driver.grant)
    with grpc.insecure_channel(cluster.master_address) as channel:
        master_pb2_grpc.MasterStub(channel).ReleaseLease(
            master_pb2.ReleaseLeaseRequest(
                stream="spark/holes",
                client_id="driver",
                epoch=epoch,
                grant=driver.grant,
                lease_secret=driver.lease_secret,
            ),
            timeout=10,
        )

    async def recover() -> None:
        # The next leader seals and recovers segment 1: index 2 becomes a HOLE.
        async with StreamClient(cluster.master_address) as client:
            await client.seal("spark/holes")

    asyncio.run(recover())
    got = [(e, i) for e, i, _, _ in rows_of(load(spark, cluster, "spark/holes"))]
    assert got == [(epoch, 1), (epoch, 3)]


def test_include_open_adds_the_open_segment_up_to_its_acked_index(
    spark: Any, cluster: Cluster
) -> None:
    create_stream(cluster, "spark/open")
    driver = Driver(cluster.master_address, "spark/open")
    made = fill(driver, [30])
    assert driver.segment is not None
    open_epoch = driver.epoch
    entries = [
        StoredEntry.make(i, EntryKind.EVENT, open_epoch, payload_of(i)) for i in range(1, 11)
    ]
    for replica in driver.segment.copy_set:
        # 8..10 unacked
        write(replica.data_address, driver.segment.id, open_epoch, entries, 7, driver.grant)
    assert rows_of(load(spark, cluster, "spark/open")) == expected_rows(made)
    with_open = rows_of(load(spark, cluster, "spark/open", includeOpen="true"))
    assert with_open == expected_rows([*made, (open_epoch, 7)])


@contextmanager
def keep_leading(driver: Driver) -> Iterator[None]:
    """Heartbeat for the driver while Spark runs, so its lease (and open segment) stays."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.2):
            driver.lead()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def test_streaming_picks_up_new_events_and_never_re_emits_after_a_restart(
    spark: Any, cluster: Cluster, tmp_path: Path
) -> None:
    from streamengine.client.spark import register

    register(spark)
    create_stream(cluster, "spark/live")
    driver = Driver(cluster.master_address, "spark/live")
    made = fill(driver, [40, 25])
    output, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def run_once() -> None:
        query = (
            spark.readStream.format("streamengine")
            .option("master", cluster.master_address)
            .option("stream", "spark/live")
            .load()
            .writeStream.format("parquet")
            .option("path", str(output))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None

    with keep_leading(driver):  # the driver cannot recover: its lease must not lapse
        run_once()
        assert rows_of(spark.read.parquet(str(output))) == expected_rows(made)

        # A newly sealed segment, and acked events of the open one after it.
        made += fill(driver, [15])
        assert driver.segment is not None
        open_epoch = driver.epoch
        entries = [
            StoredEntry.make(i, EntryKind.EVENT, open_epoch, payload_of(i)) for i in range(1, 6)
        ]
        for replica in driver.segment.copy_set:
            write(replica.data_address, driver.segment.id, open_epoch, entries, 5, driver.grant)
        run_once()  # a new query on the same checkpoint: resumes where the first stopped
        assert rows_of(spark.read.parquet(str(output))) == expected_rows([*made, (open_epoch, 5)])


async def _written_over_tls(cluster: Cluster, stream: str, events: int) -> None:
    from streamengine.client.stream_client import StreamClient

    async with StreamClient(cluster.master_address, certs_dir=cluster.admin_certs_dir) as client:
        await client.create_stream(stream, replicas=3, write_quorum=2)
        async with client.writer(stream) as writer:
            await writer.append_batch([payload_of(n) for n in range(1, events + 1)])
        await client.seal(stream)


def test_a_scan_of_a_secured_cluster_with_the_certs_dir(spark: Any, tmp_path: Path) -> None:
    """The driver reads the certs dir; the executors reach the stores with what the
    partitions carry. Without it, the scan fails on TLS."""
    import asyncio

    from streamengine.testing import running_cluster

    with running_cluster(tmp_path, stores=3, tls=True) as secured:
        asyncio.run(_written_over_tls(secured, "spark/tls", 120))
        certs_dir = str(secured.admin_certs_dir)
        frame = load(spark, secured, "spark/tls", certsDir=certs_dir)
        assert [row[3] for row in rows_of(frame)] == [payload_of(n) for n in range(1, 121)]
        with pytest.raises(Exception, match="serves TLS"):
            load(spark, secured, "spark/tls").collect()
        _executors_get_no_key_and_a_read_token_of_the_stream(secured, "spark/tls", certs_dir)


def _executors_get_no_key_and_a_read_token_of_the_stream(
    cluster: Cluster, stream: str, certs_dir: str
) -> None:
    """What PySpark pickles for executors (the data source, its reader, the partitions)
    holds nothing of the driver's cluster-admin key: only the CA and a read token the
    driver minted, limited to the job's stream."""
    from pyspark import cloudpickle
    from pyspark.sql.types import StructType

    from streamengine.client.spark import StreamEngineDataSource
    from streamengine.protocol.auth import Role
    from streamengine.protocol.signing import KEY_ID_BYTES, MAGIC_BYTES, SIGNATURE_BYTES
    from streamengine.protocol.tokens import TokenClaims, token_envelope

    options = {"master": cluster.master_address, "stream": stream, "certsdir": certs_dir}
    source = StreamEngineDataSource(options)
    reader = source.reader(StructType())
    shipped = cloudpickle.dumps((source, reader))  # as PySpark does, before planning
    partitions = reader.partitions()
    shipped += cloudpickle.dumps(partitions)
    key = (Path(certs_dir) / "client.root.key").read_bytes()
    key_body = b"".join(key.splitlines()[1:-1])
    assert b"PRIVATE KEY" not in shipped and key_body[:40] not in shipped
    assert b"client.root" not in shipped
    transports = {r.transport for partition in partitions for r in partition.ranges}
    assert len(transports) == 1
    (transport,) = transports
    assert transport.tls and not transport.cert_pem and not transport.key_pem
    envelope = token_envelope(transport.token)
    claims = TokenClaims.decode(envelope[MAGIC_BYTES + KEY_ID_BYTES : -SIGNATURE_BYTES])
    stream_id = partitions[0].ranges[0].stream_id
    assert (claims.role, claims.stream_ids, claims.tenant) == (Role.READ, (stream_id,), "spark")


def test_a_scan_never_returns_a_copy_that_differs_from_the_certificate(
    spark: Any, cluster: Cluster
) -> None:
    """store0 (in every copy set of three stores) holds, behind its back, a forged copy
    under a valid crc32c in the first segment and a flipped payload bit under the old
    crc in the second. Partitions that start there leave it (the chunk differs from the
    certificate; the store answers DATA_LOSS), read the rest elsewhere, and report it:
    the scan returns exactly what was written."""
    import grpc

    from streamengine.v1 import master_pb2, master_pb2_grpc
    from tests.integration import damage

    create_stream(cluster, "spark/forged")
    made = fill(Driver(cluster.master_address, "spark/forged"), [300, 200])
    with grpc.insecure_channel(cluster.master_address) as channel:
        listing = master_pb2_grpc.MasterStub(channel).ListSegments(
            master_pb2.ListSegmentsRequest(stream="spark/forged"), timeout=10
        )
    store0 = cluster.stores[0]
    assert store0.terminate() == 0
    (first, _), (second, _) = made
    root = cluster.root / store0.name
    damage.rewrite_copy(root, listing.stream_id, first, 150, b"forged", valid_crc=True)
    damage.rewrite_copy(root, listing.stream_id, second, 10, payload_of(11), valid_crc=False)
    store0.args += ["--scrub-mb-per-s", "0"]  # its own scrub must not give it away first
    store0.start()
    assert rows_of(load(spark, cluster, "spark/forged", partitionEntries="100")) == (
        expected_rows(made)
    )
    log = cluster.master.log()
    assert "a reader reports a replica" in log and "differ from the certificate" in log, log


# A driver that talks gRPC to the cluster (threads inside gRPC calls, an asyncio read
# through the SDK), then starts Spark the way the example and the benchmarks do, and
# scans. Forks of the driver are counted: a fork of a process with gRPC's threads running
# once left Spark's JVM unanswered (JAVA_GATEWAY_EXITED).
GRPC_THEN_SPARK_DRIVER = """
import asyncio, json, os, sys, threading

forks = []
os.register_at_fork(before=lambda: forks.append(1))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from streamengine.client import StreamClient

master, stream = sys.argv[1], sys.argv[2]
channel = grpc.insecure_channel(master)
# A thread inside a gRPC call all along: a Watch answers once, then waits for changes.
watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

def watch_the_master():
    try:
        for _ in watch:
            pass
    except grpc.RpcError:
        pass

watcher = threading.Thread(target=watch_the_master)
watcher.start()

async def read_through_the_sdk():
    async with StreamClient(master) as client:
        return sum([1 async for _ in client.read(stream)])

try:
    through_the_sdk = asyncio.run(read_through_the_sdk())
    from deploy.examples.analytics import analyse, session

    spark = session()
    try:
        report = analyse(spark, master, stream, "kind")
    finally:
        spark.stop()
finally:
    watch.cancel()
    watcher.join()
    channel.close()
print(json.dumps({"forks": len(forks), "sdk": through_the_sdk, "spark": report.events}))
"""


def test_spark_starts_in_a_driver_already_inside_grpc(
    cluster: Cluster, tmp_path: Path
) -> None:
    import json
    import subprocess
    import sys

    from tests.tree import ROOT, child_env

    create_stream(cluster, "spark/grpc-first")
    fill(Driver(cluster.master_address, "spark/grpc-first"), [120, 80])
    script = tmp_path / "driver.py"
    script.write_text(GRPC_THEN_SPARK_DRIVER)
    env = child_env()
    env.pop("PYSPARK_GATEWAY_PORT", None)  # this process's JVM: each driver starts its own
    env.pop("PYSPARK_GATEWAY_SECRET", None)
    # Forks are counted, so one start shows the driver is never forked (a second start,
    # once run here too, took 25 s more and showed the same).
    result = subprocess.run(
        [sys.executable, str(script), cluster.master_address, "spark/grpc-first"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome == {"forks": 0, "sdk": 200, "spark": 200}, outcome


def test_the_readme_spark_example_runs_as_written(cluster: Cluster) -> None:
    """The README's line, run as a shell runs it after the set-up (the virtual
    environment not activated: its bin not on PATH)."""
    import os
    import re
    import subprocess
    import sys

    from tests.tree import ROOT, child_env

    (line,) = [
        found
        for found in re.findall(
            r"`([^`]*deploy/examples/analytics\.py[^`]*)`", (ROOT / "README.md").read_text()
        )
        if "--stream" in found
    ]
    create_stream(cluster, "acme/orders")
    fill(Driver(cluster.master_address, "acme/orders"), [30])
    venv_bin = str(Path(sys.executable).parent)
    env = child_env()
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    env["STREAMENGINE_MASTER"] = cluster.master_address
    for inherited in (
        "PYSPARK_PYTHON",
        "PYSPARK_DRIVER_PYTHON",
        "PYSPARK_GATEWAY_PORT",
        "PYSPARK_GATEWAY_SECRET",
        "VIRTUAL_ENV",
    ):
        env.pop(inherited, None)
    # The set-up's virtual environment is `.venv` of the checkout; this one's may be elsewhere.
    command = line.replace(".venv/bin/", venv_bin + "/")
    result = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, cwd=ROOT, env=env, timeout=240
    )
    assert result.returncode == 0, (line, result.stderr[-3000:])
    assert '"events": 30' in result.stdout


def test_a_scan_of_many_streams_names_each_rows_stream(spark: Any, cluster: Cluster) -> None:
    from streamengine.client.spark import register

    names = [f"sparkmany/s{n}" for n in range(4)]
    made = {}
    for n, name in enumerate(names):
        create_stream(cluster, name)
        made[name] = fill(Driver(cluster.master_address, name), [10 + n, 5])
    create_stream(cluster, "sparkother/s")  # not under the prefix
    fill(Driver(cluster.master_address, "sparkother/s"), [3])
    register(spark)

    def reader() -> Any:  # a DataFrameReader keeps every option given: one per load
        return spark.read.format("streamengine").option("master", cluster.master_address)

    # 4 small streams of 15 to 18 events, 40 at most a partition: partitions span streams.
    frame = reader().option("prefix", "sparkmany/").option("partitionEntries", "40").load()
    rows = sorted(
        (row["stream"], row["epoch"], row["index"], row["sequence"], bytes(row["payload"]))
        for row in frame.collect()
    )
    assert rows == sorted((name, *row) for name in names for row in expected_rows(made[name]))
    assert frame.rdd.getNumPartitions() == 2  # 66 events
    listed = reader().option("streams", f"{names[2]}, {names[0]}").load()
    assert {row["stream"] for row in listed.select("stream").distinct().collect()} == {
        names[0],
        names[2],
    }


def test_streaming_over_a_prefix_follows_each_stream_and_one_created_later(
    spark: Any, cluster: Cluster, tmp_path: Path
) -> None:
    from streamengine.client.spark import register

    register(spark)
    drivers: dict[str, Driver] = {}
    made: dict[str, list[tuple[int, int]]] = {}
    output, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def add(name: str, events: int) -> None:
        if name not in drivers:
            create_stream(cluster, name)
            drivers[name] = Driver(cluster.master_address, name)
            stack.enter_context(keep_leading(drivers[name]))  # it cannot recover
        made[name] = made.get(name, []) + fill(drivers[name], [events])

    def run_once() -> list[tuple[Any, ...]]:
        query = (
            spark.readStream.format("streamengine")
            .option("master", cluster.master_address)
            .option("prefix", "sparklive/")
            .load()
            .writeStream.format("parquet")
            .option("path", str(output))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None
        rows = spark.read.parquet(str(output)).collect()
        return sorted((row["stream"], *rows_of_one(row)) for row in rows)

    def expected() -> list[tuple[Any, ...]]:
        return sorted((name, *row) for name, made_ in made.items() for row in expected_rows(made_))

    with ExitStack() as stack:
        add("sparklive/a", 12)
        add("sparklive/b", 9)
        assert run_once() == expected()
        # More in one stream, and a stream created since: the checkpoint resumes each.
        add("sparklive/a", 7)
        add("sparklive/c", 5)
        assert run_once() == expected()


def rows_of_one(row: Any) -> tuple[int, int, int, bytes]:
    return (row["epoch"], row["index"], row["sequence"], bytes(row["payload"]))
