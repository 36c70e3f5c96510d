"""A real store process under crashes and floods: SIGKILL in the middle of a stream of
synced writes loses nothing that was answered and shows nothing half-written; back
pressure keeps memory bounded while clients send far more than it can queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from streamengine.protocol.framed import CallError
from streamengine.protocol.framing import StatusCode
from streamengine.protocol.limits import FRAME_PAYLOAD_BYTES_MAX, STREAM_CREDIT_BYTES
from streamengine.segment_store.kv import MEMTABLE_BYTES, MEMTABLES_MAX
from streamengine.v1 import segment_store_pb2
from tests.integration.store_helpers import (
    entries,
    entry,
    granted,
    lone_store,
    read_all,
    seg,
    state,
    store_stub,
    stream_writes,
    write_request,
)

BATCH = 100
KILL_AFTER_REPLIES = 25


async def test_sigkill_mid_stream_keeps_every_answered_write_and_nothing_half_written(
    tmp_path: Path,
) -> None:
    segment = seg(201, 3)
    answered_batches: set[int] = set()
    answered_acked = 0
    with lone_store(tmp_path) as store:
        async with store_stub(store) as stub:

            async def requests() -> AsyncIterator[segment_store_pb2.WriteRequest]:
                for number in range(10_000):
                    first = number * BATCH + 1
                    yield write_request(
                        segment,
                        3,
                        first - 1,
                        entries(first, first + BATCH - 1),
                        number,
                        grant=granted(segment, 3) if number == 0 else b"",
                    )

            def answered(reply: segment_store_pb2.WriteReply) -> None:
                nonlocal answered_acked
                if reply.status == segment_store_pb2.ACCEPTED:
                    answered_batches.add(reply.request_id)
                    answered_acked = max(answered_acked, reply.acked_index)
                if len(answered_batches) == KILL_AFTER_REPLIES:
                    store.kill()  # SIGKILL while the stream still sends

            with pytest.raises(CallError) as died:
                await stream_writes(store.data_address, requests(), answered)
            # The peer died mid-stream: the connection is lost.
            assert died.value.code is StatusCode.UNAVAILABLE, died.value
        assert not store.alive() and len(answered_batches) >= KILL_AFTER_REPLIES

        store.start()
        async with store_stub(store) as stub:
            after = await state(stub, segment)
            held = await read_all(stub, segment)  # every copy's crc verified on the way
    by_batch: dict[int, list[int]] = {}
    for held_entry in held:
        expected = entries(held_entry.index, held_entry.index)[0]
        assert held_entry == expected, f"index {held_entry.index} differs"
        by_batch.setdefault((held_entry.index - 1) // BATCH, []).append(held_entry.index)
    # Nothing half-written: each batch is wholly there or wholly absent.
    for number, indexes in by_batch.items():
        assert len(indexes) == BATCH, f"batch {number} is half there: {len(indexes)} entries"
    # Every answered write is there, and the metadata came back with it.
    assert answered_batches <= set(by_batch)
    assert after.last_index == max(i for e in by_batch.values() for i in e)
    prefix = 0
    while prefix in by_batch:
        prefix += 1
    assert after.matched_index == prefix * BATCH
    assert after.acked_index >= answered_acked


async def test_back_pressure_keeps_memory_bounded_while_clients_flood(tmp_path: Path) -> None:
    streams, batches, entry_bytes, per_batch = 4, 150, 64 << 10, 16  # 1 MiB batches, 600 MiB
    queue_bytes_max = 2 << 20
    with lone_store(tmp_path, ["--queue-bytes-max", str(queue_bytes_max)]) as store:
        process = psutil.Process(store.pid)
        baseline = process.memory_info().rss
        peak = baseline
        busy = accepted = 0
        payload = b"p" * entry_bytes

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, process.memory_info().rss)
                await asyncio.sleep(0.02)

        async def flood(stream_id: int) -> None:
            nonlocal busy, accepted
            segment = seg(300 + stream_id, 1)

            async def requests() -> AsyncIterator[segment_store_pb2.WriteRequest]:
                for number in range(batches):
                    first = number * per_batch + 1
                    yield write_request(
                        segment,
                        1,
                        0,
                        [entry(i, 1, payload) for i in range(first, first + per_batch)],
                        number,
                        grant=granted(segment, 1) if number == 0 else b"",
                    )

            def answered(reply: segment_store_pb2.WriteReply) -> None:
                nonlocal busy, accepted
                if reply.status == segment_store_pb2.REFUSED_BUSY:
                    busy += 1
                else:
                    accepted += 1

            await stream_writes(store.data_address, requests(), answered)

        sampler = asyncio.create_task(sample())
        started = time.monotonic()
        await asyncio.gather(*(flood(n) for n in range(streams)))
        sampler.cancel()
        elapsed = time.monotonic() - started
        assert busy + accepted == streams * batches
        assert busy > 0, "the flood never filled the queue"
        assert accepted > 0
        growth_mib = (peak - baseline) / (1 << 20)
        # 600 MiB were sent. The store holds at most its queue, RocksDB's memtables, per
        # stream a message being admitted and the data plane's window of frames (its
        # credit: on gRPC, BDP probing once let a flood grow the store by 519 MiB), and
        # what the allocator keeps of freed blocks (the slack: glibc returns little of
        # it at once).
        slack_bytes = 96 << 20
        bound_mib = (
            queue_bytes_max
            + MEMTABLE_BYTES * MEMTABLES_MAX
            + streams * (FRAME_PAYLOAD_BYTES_MAX + STREAM_CREDIT_BYTES)
        ) / (1 << 20) + slack_bytes / (1 << 20)
        print(f"flood: {busy} busy, {accepted} accepted, RSS +{growth_mib:.0f} MiB, {elapsed:.1f}s")
        assert growth_mib < bound_mib, f"RSS grew {growth_mib:.0f} MiB in {elapsed:.1f}s"
        async with store_stub(store) as stub:
            for stream_id in range(streams):
                held = await state(stub, seg(300 + stream_id, 1))
                assert held.matched_index <= held.last_index <= batches * per_batch
        assert store.alive()
