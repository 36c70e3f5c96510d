"""The client's pooled data connections, against real stores: a follower hopping sealed
segments rides one connection per store (each store counts the connections it
accepted, `streamengine_store_data_connections_total`), reads left early free their
slots there, so more of them than a connection holds requests leave it serving the
next read, and a recovery's reads and writes ride one connection per store too."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamengine.client import StreamClient, store_session
from streamengine.client import recovery as recovery_module
from streamengine.client.channels import ChannelPool
from streamengine.protocol import framed_read
from streamengine.protocol.limits import DATA_REQUESTS_MAX
from streamengine.testing import Cluster, free_port, metric_value, running_cluster
from streamengine.v1 import entry_pb2, segment_store_pb2

pytestmark = pytest.mark.timeout(60)

STREAM = "pool/segments"
CONNECTIONS = "streamengine_store_data_connections_total"
# Events of 100 bytes in segments of 8 KiB: about 80 events a segment.
EVENTS = 800
SEGMENT_BYTES = 8 << 10
SEGMENTS_MIN = 6
READ_TIMEOUT_S = 10.0


@pytest.fixture
def metered(tmp_path: Path) -> Iterator[tuple[Cluster, list[int]]]:
    """Three stores, each serving its metrics."""
    ports = [free_port() for _ in range(3)]
    with running_cluster(
        tmp_path,
        stores=3,
        master_args=["--lease-ms", "1000"],
        store_args_for=lambda n: ["--metrics-port", str(ports[n])],
    ) as cluster:
        yield cluster, ports


def accepted(ports: list[int]) -> list[float]:
    return [metric_value(port, CONNECTIONS) for port in ports]


async def test_a_follower_across_sealed_segments_rides_one_connection_per_store(
    metered: tuple[Cluster, list[int]],
) -> None:
    cluster, ports = metered
    payloads = [b"%06d" % i + b"." * 94 for i in range(EVENTS)]
    async with StreamClient(cluster.master_address) as writing:
        await writing.create_stream(STREAM, segment_bytes=SEGMENT_BYTES)
        async with writing.writer(STREAM) as writer:
            for chunk in range(0, EVENTS, 50):
                await writer.append_batch(payloads[chunk : chunk + 50])
        await writing.seal(STREAM)
    before = accepted(ports)
    async with StreamClient(cluster.master_address) as reading:
        events = [event async for event in reading.read(STREAM)]
        after = accepted(ports)
    assert [event.payload for event in events] == payloads
    segments = len({event.epoch for event in events})
    assert segments >= SEGMENTS_MIN, f"the stream rolled into {segments} segments only"
    dialled = [now - then for now, then in zip(after, before, strict=True)]
    # A Read a connection each would have dialled a store once a segment (and once more
    # a read-ahead): `segments` or more in all.
    assert all(count <= 1 for count in dialled), f"connections per store: {dialled}"
    assert 1 <= sum(dialled) < segments


async def test_reads_left_early_free_their_slots_on_the_shared_connection(
    metered: tuple[Cluster, list[int]],
) -> None:
    """More reads than a connection holds requests, each left after its first reply
    while the store still had the rest of its range to send (one entry a reply), then a
    read to its end: all on one connection the store accepted."""
    cluster, ports = metered
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(STREAM, segment_bytes=1 << 30)
        async with client.writer(STREAM, rolling=False) as writer:
            sequences = await writer.append_batch([b"e" * 100] * 1000)
        segment = (await client.list_segments(STREAM))[0]
    data_address = segment.copy_set[0].data_address
    store = next(n for n, s in enumerate(cluster.stores) if s.data_address == data_address)
    request = segment_store_pb2.ReadRequest(
        segment=entry_pb2.SegmentId(stream_id=segment.stream_id, epoch=segment.epoch),
        from_index=1,
        to_index=len(sequences),
        max_entries_per_reply=1,
    )
    before = metric_value(ports[store], CONNECTIONS)
    pool = ChannelPool()
    try:
        for _ in range(DATA_REQUESTS_MAX + 6):
            replies = framed_read.read(data_address, pool.data_call, request, READ_TIMEOUT_S)
            async with contextlib.aclosing(replies):
                first = await anext(replies)
            assert first.entries[0].index == 1
        replies = framed_read.read(data_address, pool.data_call, request, READ_TIMEOUT_S)
        assert sum([len(reply.entries) async for reply in replies]) == len(sequences)
        assert metric_value(ports[store], CONNECTIONS) - before == 1
    finally:
        await pool.close()


async def test_a_recovery_writes_on_one_connection_per_store(
    metered: tuple[Cluster, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer leaves its segment open; a seal then leads, recovers it (reads, a bridge
    and a raise of the acked index to each store: two writes a store or more) and opens
    a new segment on the three stores."""
    cluster, ports = metered
    async with StreamClient(cluster.master_address) as writing:
        await writing.create_stream(STREAM, segment_bytes=1 << 30)
        async with writing.writer(STREAM, rolling=False) as writer:
            for chunk in range(10):
                await writer.append_batch([b"%06d" % chunk + b"." * 94] * 100)
    writes: collections.Counter[str] = collections.Counter()
    write_once = store_session.write_once

    async def counted(data_address: str, *args: Any) -> Any:
        writes[data_address] += 1
        return await write_once(data_address, *args)

    monkeypatch.setattr(recovery_module, "write_once", counted)
    before = accepted(ports)
    async with StreamClient(cluster.master_address) as sealing:
        await sealing.seal(STREAM)
        after = accepted(ports)
    assert len(writes) == 3 and min(writes.values()) >= 2, f"recovery writes: {writes}"
    dialled = [now - then for now, then in zip(after, before, strict=True)]
    # Per store: one connection for the recovery's reads and writes, and the new
    # segment's Write stream (with a connection per write: 3 or 4).
    assert all(count <= 2 for count in dialled), f"connections per store: {dialled}"
