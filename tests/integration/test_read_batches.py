"""The batch readers against real processes: `read_batches` and `subscribe_batches`
yield exactly the events `read` and `subscribe` do, as Arrow record batches, across
sealed segments and the open one, resume from a sequence, skip a damaged replica, and
follow new appends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pyarrow as pa
import pytest

from streamengine.client import StreamClient, Unavailable
from streamengine.client.packed import EVENT_SCHEMA
from streamengine.protocol.sequence import unpack_sequence
from streamengine.testing import Cluster, free_port, metric_value, running_cluster, wait_until
from streamengine.v1 import master_pb2
from tests.integration import damage
from tests.integration.paused_stores import (
    GIVE_UP_AFTER_S,
    READ_RAISES_S_MAX,
    acked_then_paused,
)

pytestmark = pytest.mark.timeout(240)

Row = tuple[int, int, int, bytes]  # sequence, epoch, index, payload


def rows(batches: list[pa.RecordBatch]) -> list[Row]:
    for batch in batches:
        assert batch.schema == EVENT_SCHEMA
        assert batch.num_rows > 0, "an empty batch"
    table = pa.Table.from_batches(batches, EVENT_SCHEMA)
    return list(
        zip(
            table.column("sequence").to_pylist(),
            table.column("epoch").to_pylist(),
            table.column("index").to_pylist(),
            table.column("payload").to_pylist(),
            strict=True,
        )
    )


async def take_rows(batches: AsyncIterator[pa.RecordBatch], count: int) -> list[Row]:
    """Rows of `batches` until `count` arrived (a deadline, never a blind sleep)."""
    taken: list[pa.RecordBatch] = []

    async def consume() -> None:
        seen = 0
        async for batch in batches:
            taken.append(batch)
            seen += batch.num_rows
            if seen >= count:
                return

    await asyncio.wait_for(consume(), 60)
    return rows(taken)


async def first_of(batches: AsyncIterator[pa.RecordBatch]) -> pa.RecordBatch:
    async for batch in batches:
        return batch
    raise AssertionError("no batch")


async def read_rows(client: StreamClient, stream: str, **bounds: int) -> list[Row]:
    return rows([batch async for batch in client.read_batches(stream, **bounds)])


async def event_rows(client: StreamClient, stream: str, **bounds: int) -> list[Row]:
    return [(e.sequence, e.epoch, e.index, e.payload) async for e in client.read(stream, **bounds)]


async def several_segments(client: StreamClient, stream: str) -> list[bytes]:
    """Sealed segments (8 KiB rolls), then events left in the open segment."""
    await client.create_stream(stream, segment_bytes=8 * 1024)
    payloads = [f"b{i:05d}".encode() + b"." * 94 for i in range(900)]
    async with client.writer(stream) as writer:
        for chunk in range(0, 600, 50):
            await writer.append_batch(payloads[chunk : chunk + 50])
    await client.seal(stream)
    async with client.writer(stream, rolling=False) as writer:
        await writer.append_batch(payloads[600:])
    return payloads


async def test_read_batches_returns_exactly_what_read_returns(cluster: Cluster) -> None:
    async with StreamClient(cluster.master_address) as client:
        payloads = await several_segments(client, "batch/exact")
        listing = await client.list_segments("batch/exact")
        sealed = [s for s in listing if s.sealed]
        assert len(sealed) >= 3, "the stream should have rolled into several segments"
        assert not listing[-1].sealed

        everything = await read_rows(client, "batch/exact")
        assert everything == await event_rows(client, "batch/exact")
        assert [row[3] for row in everything] == payloads
        for sequence, epoch, index, _ in everything:
            assert unpack_sequence(sequence) == (epoch, index)
        assert len({row[1] for row in everything}) >= 3, "events of several segments"
        assert everything[-1][1] == listing[-1].epoch, "and of the open one"

        # A range from the middle of one sealed segment to the middle of a later one,
        # and from a sealed segment into the open one.
        low, high = everything[100][0], everything[450][0]
        assert await read_rows(client, "batch/exact", start=low, end=high) == everything[100:450]
        assert await read_rows(client, "batch/exact", start=everything[550][0]) == (
            everything[550:]
        )
        assert await read_rows(client, "batch/exact", start=high, end=high) == []


async def test_read_batches_resumes_after_the_last_sequence_it_yielded(cluster: Cluster) -> None:
    async with StreamClient(cluster.master_address) as client:
        await several_segments(client, "batch/resume")
        everything = await read_rows(client, "batch/resume")
        first = await first_of(client.read_batches("batch/resume"))
        resume_at = first.column("sequence")[-1].as_py() + 1
        rest = await read_rows(client, "batch/resume", start=resume_at)
        assert rows([first]) + rest == everything


async def test_subscribe_batches_follows_new_appends(cluster: Cluster) -> None:
    payloads = [f"live-{i}".encode() for i in range(3000)]
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("batch/live")
        async with client.writer("batch/live") as writer:
            await writer.append_batch(payloads[:1000])
            subscriber = asyncio.create_task(
                take_rows(client.subscribe_batches("batch/live", start=0), len(payloads))
            )
            for chunk in range(1000, len(payloads), 250):
                await writer.append_batch(payloads[chunk : chunk + 250])
            taken = await subscriber
        assert [row[3] for row in taken] == payloads
        sequences = [row[0] for row in taken]
        assert sequences == sorted(set(sequences))
        # From "end": only what is appended after the subscription began.
        later = [b"after-%d" % i for i in range(100)]
        tail = client.subscribe_batches("batch/live", start="end")
        first = asyncio.create_task(first_of(tail))
        # The subscription resolves "end" first: append until its first batch arrives.
        async with client.writer("batch/live") as writer:
            while not first.done():
                await writer.append_batch(later)
                await asyncio.wait({first}, timeout=0.2)
        assert set(first.result().column("payload").to_pylist()) <= set(later)


async def test_read_batches_skip_a_copy_that_differs_and_one_failing_its_crc(
    tmp_path: Path,
) -> None:
    """One replica holds a forged payload under a valid crc32c (only the certificate
    tells), another one a payload that fails its crc32c (the store refuses to send it):
    the batch reader hands out neither, reads those chunks from the third replica, and
    the master hears of the forged one."""
    port = free_port()
    with running_cluster(
        tmp_path,
        stores=3,
        master_args=["--lease-ms", "1000", "--metrics-port", str(port)],
        store_args=["--scrub-mb-per-s", "0"],  # no store finds itself out meanwhile
    ) as cluster:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream("batch/damaged", replicas=3, write_quorum=2)
            payloads = [b"%06d:" % i + bytes([i % 251]) * 300 for i in range(2000)]
            async with client.writer("batch/damaged") as writer:
                for chunk in range(0, len(payloads), 500):
                    await writer.append_batch(payloads[chunk : chunk + 500])
                await client.seal("batch/damaged")  # by its writer's roll: certified
            listing = await client.list_segments("batch/damaged")
            segment = next(s for s in listing if s.sealed and s.final_index > len(payloads))
            certified = await client.master.ListSegments(
                master_pb2.ListSegmentsRequest(stream="batch/damaged", certificates=True)
            )
            assert any(s.certificate.chunks for s in certified.segments), "no certificate"
            assert len(segment.copy_set) == 3
            forged, flipped = (r.store_id for r in segment.copy_set[:2])
            stream_id, epoch = segment.stream_id, segment.epoch
            for store_id, index, valid_crc in ((forged, 700, True), (flipped, 1500, False)):
                store = next(s for s in cluster.stores if s.name == store_id)
                assert store.terminate() == 0
                damage.rewrite_copy(
                    cluster.root / store_id, stream_id, epoch, index, b"changed", valid_crc
                )
                store.start()
            # Readers go to the first member first: it and the second are damaged.
            assert [row[3] for row in await read_rows(client, "batch/damaged")] == payloads
            await wait_until(
                lambda: metric_value(port, "streamengine_master_reader_reports_total") >= 2,
                30,
                "the reader's reports",
            )


@pytest.mark.parametrize("bounded_by", ["the acked end", "an end sequence"])
async def test_read_batches_of_paused_stores_raises_unavailable_naming_them(
    cluster: Cluster, bounded_by: str
) -> None:
    """Issue #36 (0), as for `read`: never an empty answer for acked events."""
    async with (
        StreamClient(cluster.master_address) as client,
        acked_then_paused(cluster, client, "batch/paused") as paused,
    ):
        end = None if bounded_by == "the acked end" else paused.last_sequence + 1
        batches: list[pa.RecordBatch] = []

        async def read_all() -> None:
            async for batch in client.read_batches(
                paused.name, start=0, end=end, give_up_after_s=GIVE_UP_AFTER_S
            ):
                batches.append(batch)

        with pytest.raises(Unavailable) as raised:
            await asyncio.wait_for(read_all(), READ_RAISES_S_MAX)
        assert all(store in str(raised.value) for store in paused.stores), raised.value
        assert batches == []
