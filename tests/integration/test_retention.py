"""Retention, trims and deletes in two phases against real processes: a master with a
short grace (`--delete-grace-s`), three stores, the SDK and the CLI. Every wait is for a
condition, with a deadline."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from streamengine.client import StreamClient, StreamDeleted, StreamEngineError, Trimmed
from streamengine.protocol.sequence import pack_sequence
from streamengine.testing import (
    STREAMENGINE,
    Cluster,
    free_port,
    metric_value,
    running_cluster,
    wait_for,
    wait_until,
)
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.integration.store_helpers import subscribe_first
from tests.integration.test_cli import run_cli

NAME = "acme/logs"
GRACE_S = 2
Code = grpc.StatusCode
m = master_pb2


# Long enough to see a pending trim in the metrics before it goes.
METERED_GRACE_S = 6
# Long enough for what a test does between a delete and its undelete.
UNDELETE_GRACE_S = 12


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    args = ["--lease-ms", "1000", "--delete-grace-s", str(GRACE_S)]
    with running_cluster(tmp_path, stores=3, master_args=args) as running:
        yield running


@pytest.fixture
def metered_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, int]]:
    port = free_port()
    args = ["--lease-ms", "1000", "--delete-grace-s", str(METERED_GRACE_S)]
    args += ["--metrics-port", str(port)]
    with running_cluster(tmp_path, stores=3, master_args=args) as running:
        yield running, port


@pytest.fixture
def slow_cluster(tmp_path: Path) -> Iterator[Cluster]:
    args = ["--lease-ms", "1000", "--delete-grace-s", str(UNDELETE_GRACE_S)]
    with running_cluster(tmp_path, stores=3, master_args=args) as running:
        yield running


def master_call(cluster: Cluster, method: str, request: object) -> object:
    with grpc.insecure_channel(cluster.master_address) as channel:
        return getattr(master_pb2_grpc.MasterStub(channel), method)(request, timeout=5)


def describe(cluster: Cluster) -> m.StreamInfo:
    info = master_call(cluster, "DescribeStream", m.DescribeStreamRequest(name=NAME))
    assert isinstance(info, m.StreamInfo)
    return info


def metadata(cluster: Cluster) -> tuple[int, ...]:
    """The stream's record as the master keeps it (not what the stores report since)."""
    info = describe(cluster)
    return (
        info.stream_id,
        info.epoch,
        info.retention_age_ms,
        info.retention_bytes,
        info.trimmed_through_epoch,
        info.deleted_until_ms,
    )


def listing(cluster: Cluster) -> list[entry_pb2.Segment]:
    reply = master_call(cluster, "ListSegments", m.ListSegmentsRequest(stream=NAME))
    assert isinstance(reply, m.ListSegmentsReply)
    return list(reply.segments)


def fill(cluster: Cluster, rounds: list[list[bytes]], **retention: int) -> list[int]:
    """Create the stream, append each round then seal it (the last round stays in the
    open segment); returns the epochs of the sealed segments."""

    async def run() -> list[int]:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(NAME, **retention)
            sealed = []
            async with client.writer(NAME, leadership_timeout_s=15) as writer:
                for number, payloads in enumerate(rounds):
                    await writer.append_batch(payloads)
                    if number < len(rounds) - 1:
                        sealed.append(await client.seal(NAME))
            return sealed

    return asyncio.run(run())


def read_all(cluster: Cluster, start: int | str) -> list[bytes]:
    async def run() -> list[bytes]:
        async with StreamClient(cluster.master_address) as client:
            return [event.payload async for event in client.read(NAME, start=start)]  # type: ignore[arg-type]

    return asyncio.run(run())


def read_all_batches(cluster: Cluster, start: int | str) -> list[bytes]:
    async def run() -> list[bytes]:
        async with StreamClient(cluster.master_address) as client:
            return [
                payload
                async for batch in client.read_batches(NAME, start=start)  # type: ignore[arg-type]
                for payload in batch.column("payload").to_pylist()
            ]

    return asyncio.run(run())


def first_subscribed(cluster: Cluster, start: int | str) -> bytes:
    async def run() -> bytes:
        async with StreamClient(cluster.master_address) as client:
            async for event in client.subscribe(NAME, start=start):  # type: ignore[arg-type]
                return event.payload
        raise AssertionError("the subscription ended")

    return asyncio.run(asyncio.wait_for(run(), 20))


def held_by(address: str, segment: entry_pb2.SegmentId) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            store_grpc.SegmentStoreStub(channel).GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(segment=segment), timeout=5
            )
        except grpc.RpcError as error:
            assert error.code() == Code.NOT_FOUND, error
            return False
    return True


def every_replica_gone(segments: list[entry_pb2.Segment]) -> bool:
    return not any(held_by(r.address, s.id) for s in segments for r in s.copy_set)


def rounds_of(*labels: str, count: int = 10, size: int = 0) -> list[list[bytes]]:
    return [[f"{label}{i}".encode().ljust(size, b".") for i in range(count)] for label in labels]


def test_retention_by_age_trims_only_sealed_segments_and_readers_see_trimmed(
    cluster: Cluster,
) -> None:
    sealed = fill(cluster, rounds_of("a", "b", "c"))
    before = listing(cluster)
    assert [s.id.epoch for s in before if s.state == entry_pb2.SEALED] == sealed
    master = ["--master", cluster.master_address]
    updated = run_cli("stream", "update", NAME, "--retention-age", "300ms", *master)
    assert updated.returncode == 0 and "age 0.3 s" in updated.stdout, updated.stderr
    wait_for(
        lambda: describe(cluster).trimmed_through_epoch == sealed[-1],
        10,
        0.05,
        "both sealed segments trimmed by age",
    )
    # The open segment is never trimmed, however old.
    left = listing(cluster)
    assert [(s.state, s.id.epoch) for s in left] == [(entry_pb2.OPEN, before[-1].id.epoch)]
    first = pack_sequence(left[0].id.epoch, 1)
    assert describe(cluster).first_retained_sequence == first
    for start in (0, pack_sequence(sealed[0], 3), pack_sequence(sealed[-1], 1)):
        with pytest.raises(Trimmed) as trimmed:
            read_all(cluster, start)
        assert trimmed.value.first_retained_sequence == first
        with pytest.raises(Trimmed):
            read_all_batches(cluster, start)
    c = [f"c{i}".encode() for i in range(10)]
    assert read_all(cluster, "earliest") == c
    assert read_all_batches(cluster, "earliest") == c
    assert read_all(cluster, first) == c
    assert first_subscribed(cluster, "earliest") == b"c0"
    tail = run_cli("tail", NAME, "--from", "earliest", *master)
    assert tail.returncode == 0, tail.stderr
    assert [line.split("\t")[1] for line in tail.stdout.splitlines()] == [p.decode() for p in c]
    refused = run_cli("tail", NAME, "--from", "0", *master)
    assert refused.returncode == 1 and f"first retained sequence is {first}" in refused.stderr
    # After the grace, the trimmed segments' data is gone from every store.
    wait_for(lambda: every_replica_gone(before[:-1]), GRACE_S + 15, 0.2, "trimmed replicas deleted")
    assert all(held_by(r.address, before[-1].id) for r in before[-1].copy_set)


def test_retention_by_bytes_keeps_at_least_the_limit(cluster: Cluster) -> None:
    # Four segments of 10 events of 100 bytes: 1000 payload bytes each, the last open.
    sealed = fill(cluster, rounds_of("a", "b", "c", "d", size=100), retention_bytes=1500)

    def reported() -> bool:
        return all(s.bytes >= 1000 for s in listing(cluster)[-2:])

    wait_for(reported, 15, 0.1, "the stores' reports of the newest segments")
    wait_for(
        lambda: describe(cluster).trimmed_through_epoch == sealed[1],
        10,
        0.05,
        "the head trimmed while the rest holds more than 1500 bytes",
    )
    # Watched over several retention passes (one a second): never below the limit.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert describe(cluster).trimmed_through_epoch == sealed[1]
        time.sleep(0.1)
    assert listing(cluster)[0].id.epoch == sealed[2]
    assert read_all(cluster, "earliest")[:1] == [b"c0".ljust(100, b".")]


def test_trim_by_hand_takes_whole_sealed_segments_before_a_sequence(
    metered_cluster: tuple[Cluster, int],
) -> None:
    cluster, port = metered_cluster
    sealed = fill(cluster, rounds_of("a", "b", "c"))
    before = listing(cluster)
    master = ["--master", cluster.master_address]
    # Inside the second segment: only the first lies entirely before.
    trimmed = run_cli("stream", "trim", NAME, "--before", str(pack_sequence(sealed[1], 4)), *master)
    assert trimmed.returncode == 0, trimmed.stderr
    assert f"segments {sealed[0]} (10 entries" in trimmed.stdout, trimmed.stdout
    assert f"first retained sequence is {pack_sequence(sealed[1], 1)}" in trimmed.stdout
    assert metric_value(port, "streamengine_master_trimmed_segments_total", 'by="hand"') == 1
    wait_for(
        lambda: metric_value(port, "streamengine_master_pending_deletes", 'kind="segment"') == 1,
        5,
        0.1,
        "the pending trim in the metrics",
    )
    due_s = metric_value(
        port,
        "streamengine_master_pending_delete_timestamp_seconds",
        f'kind="trim",stream="{NAME}"',
    )
    assert time.time() < due_s <= time.time() + METERED_GRACE_S
    again = run_cli("stream", "trim", NAME, "--before", str(pack_sequence(sealed[1], 4)), *master)
    assert again.returncode == 0 and "nothing to trim" in again.stdout, again.stdout
    # Past the open segment: refused whole, nothing changes.
    info = metadata(cluster)
    past_open = str(pack_sequence(before[-1].id.epoch + 1, 1))
    refused = run_cli("stream", "trim", NAME, "--before", past_open, *master)
    assert refused.returncode == 1 and "not sealed" in refused.stderr, refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert metadata(cluster) == info
    for args in (["acme/none", "--before", "5"], [NAME, "--before", "x"]):
        bad = run_cli("stream", "trim", *args, *master)
        assert bad.returncode in (1, 2) and "Traceback" not in bad.stderr, bad.stderr
    assert metadata(cluster) == info
    assert read_all(cluster, "earliest")[0] == b"b0"
    wait_for(
        lambda: every_replica_gone(before[:1]), METERED_GRACE_S + 15, 0.2, "trimmed replicas gone"
    )
    wait_for(
        lambda: metric_value(port, "streamengine_master_removed_total", 'kind="segment"') == 1,
        5,
        0.1,
        "the removal counted",
    )


def test_negative_retention_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    fill(cluster, rounds_of("a"))
    info = metadata(cluster)
    master = ["--master", cluster.master_address]
    for args in (["--retention-age", "-5s"], ["--retention-bytes", "-1"], []):
        result = run_cli("stream", "update", NAME, *args, *master)
        assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr
    with pytest.raises(grpc.RpcError) as refused:
        master_call(cluster, "UpdateStream", m.UpdateStreamRequest(name=NAME, retention_age_ms=-1))
    assert refused.value.code() == Code.INVALID_ARGUMENT
    assert metadata(cluster) == info


def test_delete_asks_for_yes_then_undelete_restores_every_event(slow_cluster: Cluster) -> None:
    cluster = slow_cluster
    fill(cluster, rounds_of("a", "b"))
    events = read_all(cluster, 0)
    assert len(events) == 20
    before, info = listing(cluster), metadata(cluster)
    master = ["--master", cluster.master_address]

    asked = run_cli("stream", "delete", NAME, *master)
    assert asked.returncode == 1, asked.stderr
    assert "would delete acme/logs" in asked.stdout and "2 segments" in asked.stdout
    assert "add --yes" in asked.stdout
    assert metadata(cluster) == info and read_all(cluster, 0) == events

    deleted = run_cli("stream", "delete", NAME, "--yes", *master)
    assert deleted.returncode == 0 and "undelete" in deleted.stdout, deleted.stderr
    with pytest.raises(StreamDeleted) as refused:
        read_all(cluster, 0)
    assert refused.value.deleted_until_ms > 0

    async def append_refused() -> None:
        async with StreamClient(cluster.master_address) as client:
            with pytest.raises(StreamDeleted):  # the master's refusal ends the writer
                async with client.writer(NAME, leadership_timeout_s=10):
                    pass

    asyncio.run(append_refused())
    tail = run_cli("tail", NAME, *master)
    assert tail.returncode == 1 and "deleted" in tail.stderr, tail.stderr
    status = json.loads(run_cli("status", "--json", *master).stdout)
    assert [(p["stream"], p["kind"]) for p in status["pending_deletes"]] == [(NAME, "stream")]
    assert status["pending_deletes"][0]["removed_at_ms"] == refused.value.deleted_until_ms
    assert "PENDING DELETES: 1" in run_cli("status", *master).stdout
    assert "deleted, removed at" in run_cli("stream", "list", *master).stdout

    # The intent survives a master restart.
    cluster.master.kill()
    cluster.master.start()
    assert describe(cluster).deleted_until_ms == refused.value.deleted_until_ms
    undeleted = run_cli("stream", "undelete", NAME, *master)
    assert undeleted.returncode == 0, undeleted.stderr
    back = describe(cluster)
    assert metadata(cluster) == info and back.deleted_until_ms == 0
    assert [(s.id.epoch, s.state) for s in listing(cluster)] == [
        (s.id.epoch, s.state) for s in before
    ]
    # Past the grace nothing goes; reads and appends work again.
    wait_for(
        lambda: time.time() * 1000 > refused.value.deleted_until_ms + 1500,
        UNDELETE_GRACE_S + 5,
        0.1,
        "a retention pass past the first grace",
    )
    assert read_all(cluster, 0) == events

    async def append_again() -> None:
        async with (
            StreamClient(cluster.master_address) as client,
            client.writer(NAME, leadership_timeout_s=15) as writer,
        ):
            await writer.append(b"after")

    asyncio.run(append_again())
    assert read_all(cluster, 0) == [*events, b"after"]


def test_a_deleted_stream_leaves_every_store_after_the_grace(cluster: Cluster) -> None:
    fill(cluster, rounds_of("a", "b"))
    segments = listing(cluster)
    deleted = master_call(cluster, "DeleteStream", m.DeleteStreamRequest(name=NAME))
    assert isinstance(deleted, m.DeleteStreamReply) and deleted.segments == len(segments)
    assert deleted.deleted_until_ms > time.time() * 1000
    assert all(held_by(r.address, s.id) for s in segments for r in s.copy_set)
    wait_for(lambda: every_replica_gone(segments), GRACE_S + 15, 0.2, "every replica deleted")
    assert time.time() * 1000 >= deleted.deleted_until_ms
    with pytest.raises(grpc.RpcError) as gone:
        describe(cluster)
    assert gone.value.code() == Code.NOT_FOUND
    with pytest.raises(grpc.RpcError) as late:
        master_call(cluster, "UndeleteStream", m.UndeleteStreamRequest(name=NAME))
    assert late.value.code() == Code.NOT_FOUND


def test_a_running_writer_and_subscriber_of_a_deleted_stream_are_refused(
    slow_cluster: Cluster,
) -> None:
    """The master refuses at once; the stores refuse the leader's next writes once a
    heartbeat reply lists the stream; a live tail ends at its next refresh."""
    cluster = slow_cluster

    async def run() -> tuple[list[bytes], BaseException, BaseException]:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(NAME)
            seen: list[bytes] = []

            async def follow() -> None:
                async for event in client.subscribe(NAME, start=0):
                    seen.append(event.payload)

            async with client.writer(NAME, leadership_timeout_s=15) as writer:
                await writer.append_batch([b"x%d" % i for i in range(5)])
                follower = asyncio.create_task(follow())
                await wait_until(lambda: len(seen) == 5, 15, "the subscriber read what is acked")
                deleted = master_call(cluster, "DeleteStream", m.DeleteStreamRequest(name=NAME))
                assert isinstance(deleted, m.DeleteStreamReply)
                deadline = time.monotonic() + 15
                refused: BaseException | None = None
                while refused is None and time.monotonic() < deadline:
                    try:
                        await writer.append(b"late")
                    except StreamEngineError as error:
                        refused = error
                    await asyncio.sleep(0.05)
                assert refused is not None, "the leader kept appending to a deleted stream"
                try:
                    await asyncio.wait_for(follower, 15)
                except StreamDeleted as error:
                    ended: BaseException = error
                else:
                    raise AssertionError("the subscription ended without an error")
            return seen, refused, ended

    try:
        seen, refused, ended = asyncio.run(run())
    except BaseExceptionGroup as group:  # the writer's tasks end with its refusal
        raise group.exceptions[0] from group
    assert seen[:5] == [b"x%d" % i for i in range(5)]
    assert isinstance(ended, StreamDeleted) and ended.deleted_until_ms > 0
    assert refused is not None
    # Undeleted, a new writer leads and everything acked before is there.
    assert run_cli("stream", "undelete", NAME, "--master", cluster.master_address).returncode == 0
    events = read_all(cluster, 0)
    assert events[:5] == [b"x%d" % i for i in range(5)]


def refuses_subscribe(data_address: str, segment: entry_pb2.SegmentId) -> bool:
    """Whether the store refuses a live tail of `segment` as of a deleted stream: it has
    heard of the delete."""
    start = segment_store_pb2.SubscribeRequest(
        start=segment_store_pb2.SubscribeStart(segment=segment, from_index=1)
    )
    try:
        subscribe_first(data_address, [start], timeout_s=2)
    except grpc.aio.AioRpcError as error:
        return error.code() == Code.FAILED_PRECONDITION
    except TimeoutError:
        pass
    return False


def delete_until_every_store_refuses(cluster: Cluster) -> None:
    segments = listing(cluster)
    master_call(cluster, "DeleteStream", m.DeleteStreamRequest(name=NAME))
    wait_for(
        lambda: all(
            refuses_subscribe(r.data_address, s.id) for s in segments for r in s.copy_set
        ),
        10,
        0.05,
        "every store of the copy sets refusing the deleted stream",
    )


def test_a_writer_right_after_an_undelete_is_acked_at_once(slow_cluster: Cluster) -> None:
    """Issue #36: the stores still fence the deleted stream until their next heartbeat
    reply; a writer granted after the undelete appends before then, via the SDK and via
    the CLI."""
    cluster = slow_cluster
    master = ["--master", cluster.master_address]
    fill(cluster, rounds_of("a"))
    delete_until_every_store_refuses(cluster)

    async def undelete_then_append() -> None:
        async with StreamClient(cluster.master_address) as client:
            master_call(cluster, "UndeleteStream", m.UndeleteStreamRequest(name=NAME))
            async with client.writer(NAME, leadership_timeout_s=15) as writer:
                await writer.append(b"sdk")

    asyncio.run(undelete_then_append())

    delete_until_every_store_refuses(cluster)
    undeleted = run_cli("stream", "undelete", NAME, *master)
    assert undeleted.returncode == 0, undeleted.stderr
    appended = subprocess.run(
        [STREAMENGINE, "append", NAME, *master],
        input="cli\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert appended.returncode == 0, appended.stderr
    assert read_all(cluster, 0) == [*rounds_of("a")[0], b"sdk", b"cli"]


def test_producer_positions_outlive_a_trim_of_every_sealed_segment(cluster: Cluster) -> None:
    payloads = [b"p-%d" % n for n in range(10)]

    async def produce_and_seal() -> int:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(NAME)
            async with client.writer(NAME, producer_id="ingest", leadership_timeout_s=15) as w:
                await w.append_batch(payloads, producer_sequence=0)
            return await client.seal(NAME)

    sealed = asyncio.run(asyncio.wait_for(produce_and_seal(), 30))
    trimmed = [s for s in listing(cluster) if s.id.epoch <= sealed]
    assert [s.state for s in trimmed] == [entry_pb2.SEALED]
    trim = m.TrimStreamRequest(name=NAME, before_sequence=pack_sequence(sealed + 1, 0))
    master_call(cluster, "TrimStream", trim)
    # After the grace the master drops every sealed segment's record, then its replicas:
    # only the stream's record keeps the positions.
    wait_for(lambda: every_replica_gone(trimmed), GRACE_S + 15, 0.1, "trimmed replicas deleted")

    async def resend() -> list[int]:
        async with (
            StreamClient(cluster.master_address) as client,
            client.writer(NAME, producer_id="ingest", leadership_timeout_s=15) as w,
        ):
            assert w.last_producer_sequence == len(payloads) - 1
            return await w.append_batch(payloads, producer_sequence=0)

    answered = asyncio.run(asyncio.wait_for(resend(), 30))
    # Known, in a segment trimmed since: nothing is appended again.
    assert len(answered) == len(payloads)
    assert not [p for p in read_all(cluster, "earliest") if p.startswith(b"p-")]
