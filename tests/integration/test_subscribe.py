"""Followers against real processes: subscribe and read, failover, slow consumers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from streamengine.client import DataLossError, NotFound, StreamClient, Unavailable
from streamengine.client.core.subscription import StreamEvent
from streamengine.protocol.sequence import unpack_sequence
from streamengine.testing import Cluster, free_port, metric_value, running_cluster, wait_until
from tests.integration.paused_stores import (
    GIVE_UP_AFTER_S,
    READ_RAISES_S_MAX,
    acked_then_paused,
)

pytestmark = pytest.mark.timeout(240)


async def take(
    events: AsyncIterator[StreamEvent], count: int, timeout_s: float = 60
) -> list[StreamEvent]:
    taken: list[StreamEvent] = []

    async def consume() -> None:
        async for event in events:
            taken.append(event)
            if len(taken) == count:
                return

    await asyncio.wait_for(consume(), timeout_s)
    return taken


def assert_exactly(events: list[StreamEvent], payloads: list[bytes]) -> None:
    assert [e.payload for e in events] == payloads
    sequences = [e.sequence for e in events]
    assert sequences == sorted(set(sequences)), "a sequence twice or out of order"
    for event in events:
        assert unpack_sequence(event.sequence) == (event.epoch, event.index)


async def test_a_subscriber_started_before_the_writer_sees_everything(cluster: Cluster) -> None:
    payloads = [f"event-{i}".encode() for i in range(3000)]
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("sub/early")
        subscriber = asyncio.create_task(
            take(client.subscribe("sub/early", start=0), len(payloads))
        )
        async with client.writer("sub/early") as writer:
            for chunk in range(0, len(payloads), 500):
                await writer.append_batch(payloads[chunk : chunk + 500])
        assert_exactly(await subscriber, payloads)


async def test_read_returns_the_acked_range_and_stops(cluster: Cluster) -> None:
    payloads = [f"r{i}".encode() for i in range(1000)]
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("sub/read")
        async with client.writer("sub/read") as writer:
            sequences = await writer.append_batch(payloads)
        everything = [e async for e in client.read("sub/read")]
        assert_exactly(everything, payloads)
        middle = [
            e async for e in client.read("sub/read", start=sequences[100], end=sequences[200])
        ]
        assert_exactly(middle, payloads[100:200])
        resumed = await take(client.subscribe("sub/read", start=sequences[990]), 10)
        assert_exactly(resumed, payloads[990:])


async def test_start_end_yields_only_new_events(cluster: Cluster) -> None:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("sub/end")
        async with client.writer("sub/end") as writer:
            await writer.append_batch([b"old-1", b"old-2"])
            # "end" is the stores' acked index: let them learn the acked index first.
            await writer.flush()
            subscriber = asyncio.create_task(take(client.subscribe("sub/end", start="end"), 2))
            await asyncio.sleep(0)  # let it resolve "end" before new appends
            while not subscriber.done():
                # The subscriber resolves "end" asynchronously; whatever it sees must be new.
                await writer.append(b"new")
                await asyncio.sleep(0.05)
            events = await subscriber
        assert all(e.payload == b"new" for e in events)


async def test_ten_subscribers_all_see_the_same_sequence(cluster: Cluster) -> None:
    payloads = [f"ten-{i}".encode() for i in range(2000)]
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("sub/ten")
        subscribers = [
            asyncio.create_task(take(client.subscribe("sub/ten", start=0), len(payloads)))
            for _ in range(10)
        ]
        async with client.writer("sub/ten") as writer:
            for chunk in range(0, len(payloads), 400):
                await writer.append_batch(payloads[chunk : chunk + 400])
        results = await asyncio.gather(*subscribers)
    first = [(e.sequence, e.payload) for e in results[0]]
    assert_exactly(results[0], payloads)
    for result in results[1:]:
        assert [(e.sequence, e.payload) for e in result] == first


async def test_an_unknown_stream_raises_not_found(cluster: Cluster) -> None:
    async with StreamClient(cluster.master_address) as client:
        with pytest.raises(NotFound):
            await take(client.subscribe("sub/missing", start=0), 1, timeout_s=10)
        with pytest.raises(NotFound):
            [e async for e in client.read("sub/missing")]


async def test_the_subscribers_store_killed_it_continues_on_another_replica(
    cluster: Cluster,
) -> None:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("sub/failover")
        seen: list[StreamEvent] = []
        first_batch = [f"a{i}".encode() for i in range(500)]
        second_batch = [f"b{i}".encode() for i in range(500)]

        async def follow() -> None:
            async for event in client.subscribe("sub/failover", start=0):
                seen.append(event)
                if len(seen) == len(first_batch) + len(second_batch):
                    return

        follower = asyncio.create_task(follow())
        async with client.writer("sub/failover") as writer:
            await writer.append_batch(first_batch)
            await wait_until(lambda: len(seen) >= len(first_batch))
            # The subscriber tails the first replica of the copy set: kill that store.
            segments = await client.list_segments("sub/failover")
            first_replica = segments[-1].copy_set[0].address
            cluster.store_by_address(first_replica).kill()
            await writer.append_batch(second_batch)
            await asyncio.wait_for(follower, 60)
        assert_exactly(seen, first_batch + second_batch)


async def test_a_stalled_subscriber_gets_everything_and_the_store_stays_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="streamengine.client.subscription")
    total = 200_000
    payload = b"x" * 100
    metrics_ports = [free_port() for _ in range(3)]
    with running_cluster(
        tmp_path,
        store_args=["--subscribe-stall-ms", "500"],
        store_args_for=lambda n: ["--metrics-port", str(metrics_ports[n])],
    ) as cluster:
        await stall_then_catch_up(cluster, metrics_ports, total, payload)
    # The SDK saw the disconnect and resumed from its position on the same replica.
    assert "resuming" in caplog.text
    assert "failed" not in caplog.text


def dropped_as_slow(ports: list[int]) -> float:
    return sum(
        metric_value(port, "streamengine_store_subscribers_dropped_total", 'reason="slow"')
        for port in ports
    )


async def stall_then_catch_up(
    cluster: Cluster, metrics_ports: list[int], total: int, payload: bytes
) -> None:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("sub/slow")
        iterator = client.subscribe("sub/slow", start=0).__aiter__()
        async with client.writer("sub/slow") as writer:
            await writer.append(payload)
            # The first event comes with the catch-up read; the second through the live
            # tail that follows it. Then stop reading while the rest is appended.
            await asyncio.wait_for(iterator.__anext__(), 30)
            await writer.append(payload)
            await asyncio.wait_for(iterator.__anext__(), 30)
            peak_rss = 0
            for _ in range(0, total - 2, 5000):
                await writer.append_batch([payload] * 5000)
                for store in cluster.stores:
                    peak_rss = max(peak_rss, psutil.Process(store.pid).memory_info().rss)
            await writer.append_batch([payload] * ((total - 2) % 5000))
        # The store's bounded buffer stays full: it disconnects the stalled subscriber.
        await wait_until(lambda: dropped_as_slow(metrics_ports) >= 1, timeout_s=30)
        count = 2
        with contextlib.suppress(StopAsyncIteration):
            while count < total:
                await asyncio.wait_for(iterator.__anext__(), 60)
                count += 1
        assert count == total
        assert peak_rss < 600 * 1024 * 1024, f"a store grew to {peak_rss >> 20} MiB"


async def test_start_in_the_middle_of_a_sealed_segment_resumes_exactly_there(
    cluster: Cluster,
) -> None:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("sub/sealed", segment_bytes=8 * 1024)
        payloads = [f"s{i:05d}".encode() + b"." * 94 for i in range(600)]
        async with client.writer("sub/sealed") as writer:
            for chunk in range(0, len(payloads), 50):
                await writer.append_batch(payloads[chunk : chunk + 50])
        await client.seal("sub/sealed")
        everything = [e async for e in client.read("sub/sealed")]
        assert_exactly(everything, payloads)
        epochs = sorted({e.epoch for e in everything})
        assert len(epochs) >= 3, "the stream should have rolled into several segments"
        in_first = [e for e in everything if e.epoch == epochs[0]]
        middle = in_first[len(in_first) // 2]
        position = everything.index(middle)
        resumed = await take(
            client.subscribe("sub/sealed", start=middle.sequence), len(everything) - position
        )
        assert resumed == everything[position:]


async def test_a_writer_failover_under_a_live_subscriber_has_no_duplicate_and_no_gap(
    cluster: Cluster,
) -> None:
    from tests.integration.writer_process import WriterProcess, numbers_of

    name = "sub/failover-writer"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name)
        seen: list[StreamEvent] = []

        async def follow() -> None:
            async for event in client.subscribe(name, start=0):
                seen.append(event)

        follower = asyncio.create_task(follow())
        first = WriterProcess(cluster.master_address, name, "a")
        second: WriterProcess | None = None
        try:
            await wait_until(lambda: first.last_acked() >= 300, 30, "300 acked appends")
            first.kill()  # SIGKILL mid-stream
            acked_by_first = first.last_acked()
            second = WriterProcess(cluster.master_address, name, "b", batches=5)
            await wait_until(lambda: second.process.poll() is not None, 30, "takeover")
            assert second.first("done"), second.lines
            final = [(e.sequence, e.payload) async for e in client.read(name)]
            await wait_until(lambda: len(seen) >= len(final), 30, "subscriber caught up")
        finally:
            follower.cancel()
            first.kill()
            if second is not None:
                second.kill()
        # The live subscriber saw exactly what a reader of the sealed stream sees: every
        # acked event once, in order, across the bridge; holes never show up.
        assert [(e.sequence, e.payload) for e in seen] == final
        a_numbers = numbers_of(final, "a")
        assert a_numbers == list(range(len(a_numbers))) and len(a_numbers) > acked_by_first
        assert numbers_of(final, "b") == list(range(50))


async def _sealed_stream(client: StreamClient, name: str, count: int) -> list[bytes]:
    await client.create_stream(name)
    payloads = [f"{name}-{i}".encode() for i in range(count)]
    async with client.writer(name) as writer:
        for chunk in range(0, count, 500):
            await writer.append_batch(payloads[chunk : chunk + 500])
    await client.seal(name)
    return payloads


def _every_replica_tried(caplog: pytest.LogCaptureFixture, addresses: list[str]) -> bool:
    lines = [r.getMessage() for r in caplog.records if r.name.endswith(".subscription")]
    return all(any(address in line for line in lines) for address in addresses)


async def test_a_sealed_segment_read_while_every_replica_restarts_is_not_data_loss(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Replicas that fail (here: every store SIGKILLed) may only be restarting: the
    reader retries with backoff and reads everything once they are back."""
    caplog.set_level(logging.INFO, logger="streamengine.client.subscription")
    async with StreamClient(cluster.master_address) as client:
        name = "sub/restarting"
        payloads = await _sealed_stream(client, name, 3000)
        addresses = [r.address for r in (await client.list_segments(name))[-1].copy_set]
        for store in cluster.stores:
            store.kill()
        reader = asyncio.create_task(take(client.read(name), len(payloads)))
        await wait_until(
            lambda: reader.done() or _every_replica_tried(caplog, addresses),
            30,
            "the reader tried every replica",
        )
        for store in cluster.stores:
            store.start(wait=False)
        for store in cluster.stores:
            store.wait_serving()
        assert_exactly(await asyncio.wait_for(reader, 60), payloads)


async def test_a_subscriber_outlives_every_replica_pausing(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Every store SIGSTOPped: each replica falls silent in turn, none of that is data
    loss; once they resume, the subscriber reads everything once, in order."""
    caplog.set_level(logging.INFO, logger="streamengine.client.subscription")
    async with StreamClient(cluster.master_address) as client:
        name = "sub/paused"
        payloads = await _sealed_stream(client, name, 1000)
        addresses = [r.address for r in (await client.list_segments(name))[-1].copy_set]
        for store in cluster.stores:
            store.stop()
        try:
            reader = asyncio.create_task(
                take(client.subscribe(name, start=0), len(payloads), timeout_s=120)
            )
            await wait_until(
                lambda: reader.done() or _every_replica_tried(caplog, addresses),
                60,
                "the subscriber tried every replica",
            )
        finally:
            for store in cluster.stores:
                store.cont()
        assert_exactly(await asyncio.wait_for(reader, 60), payloads)


async def test_a_spark_partition_read_while_every_replica_restarts_is_not_data_loss(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The same rule for Spark's partition read (no Spark session needed: the executor
    side is a plain function)."""
    from streamengine.client.spark import fetch_layout, plan_ranges, read_range

    caplog.set_level(logging.INFO, logger="streamengine.client.spark")
    async with StreamClient(cluster.master_address) as client:
        name = "sub/spark-restarting"
        payloads = await _sealed_stream(client, name, 2000)
        layout = fetch_layout(cluster.master_address, name, with_open_acked=False)
        (part,) = plan_ranges(name, layout, 0, None, False, cluster.master_address)
        for store in cluster.stores:
            store.kill()
        reader = asyncio.create_task(asyncio.to_thread(lambda: list(read_range(part))))

        def spark_lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name.endswith(".spark")]

        await wait_until(
            lambda: (
                reader.done()
                or all(any(a in line for line in spark_lines()) for a in part.replicas)
            ),
            30,
            "the partition read tried every replica",
        )
        for store in cluster.stores:
            store.start(wait=False)
        for store in cluster.stores:
            store.wait_serving()
        batches = await asyncio.wait_for(reader, 60)
        assert [p for b in batches for p in b.column("payload").to_pylist()] == payloads
        # A real loss is still one: every replica answers NOT_FOUND for a segment the
        # master does not list either.
        missing = dataclasses.replace(part, epoch=part.epoch + 100)
        with pytest.raises(DataLossError, match=f"segment {missing.epoch} indexes 1..2000"):
            await asyncio.to_thread(lambda: list(read_range(missing)))


async def test_a_subscriber_outlives_a_master_restart(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The list refresh fails while the master is down: the subscriber keeps its list,
    asks again after a backoff, and reads on once the master is back."""
    caplog.set_level(logging.INFO, logger="streamengine.client.subscription")
    name = "sub/master-restart"
    first = [f"m{i}".encode() for i in range(100)]
    second = [f"n{i}".encode() for i in range(100)]
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name)
        seen: list[StreamEvent] = []

        async def follow() -> None:
            async for event in client.subscribe(name, start=0):
                seen.append(event)
                if len(seen) == len(first) + len(second):
                    return

        follower = asyncio.create_task(follow())
        async with client.writer(name) as writer:
            await writer.append_batch(first)
        await wait_until(lambda: len(seen) >= len(first) or follower.done())
        cluster.master.kill()
        await wait_until(
            lambda: follower.done() or "master did not list" in caplog.text,
            30,
            "a failed list refresh",
        )
        cluster.master.start()
        async with client.writer(name) as writer:
            await writer.append_batch(second)
        await asyncio.wait_for(follower, 60)
        assert_exactly(seen, first + second)


@pytest.mark.parametrize("bounded_by", ["the acked end", "an end sequence"])
async def test_a_read_of_paused_stores_raises_unavailable_naming_them(
    cluster: Cluster, bounded_by: str
) -> None:
    """Issue #36 (0): 100 events acked, every store SIGSTOPped. A read to the acked end
    once ended after 6 s with no event and no error; it raises Unavailable naming the
    stores, whether its end is asked of them (the acked end) or given (the cursor
    leaves each silent replica, then gives up)."""
    async with (
        StreamClient(cluster.master_address) as client,
        acked_then_paused(cluster, client, "sub/paused-read") as paused,
    ):
        end = None if bounded_by == "the acked end" else paused.last_sequence + 1
        events: list[StreamEvent] = []

        async def read_all() -> None:
            async for event in client.read(
                paused.name, start=0, end=end, give_up_after_s=GIVE_UP_AFTER_S
            ):
                events.append(event)

        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            await asyncio.wait_for(read_all(), READ_RAISES_S_MAX)
        logging.info("raised after %.1f s: %s", time.monotonic() - started, raised.value)
        assert all(store in str(raised.value) for store in paused.stores), raised.value
        assert events == []
