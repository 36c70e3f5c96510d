"""Subscribe against a real store, on its data port: the position first, acked entries
as the acked index advances with the token of each batch, keepalives both ways, a
silent peer dropped, a slow consumer disconnected with RESOURCE_EXHAUSTED; a follower
that takes nothing holding the store to its credit; a multiplexed call's tails started,
stopped and ended one by one, with one keepalive for the whole call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from streamengine.client.data_connections import DataConnections
from streamengine.protocol import framing
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.entry import EntryKind
from streamengine.protocol.limits import DATA_REQUESTS_MAX, STREAM_CREDIT_BYTES
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing import ServerProcess
from streamengine.v1 import entry_pb2, segment_store_pb2
from tests.integration.store_helpers import (
    SubscribeCall,
    entries,
    entry,
    lone_store,
    next_reply,
    seal_request,
    seg,
    store_stub,
    subscribe_start,
    write_all,
    write_request,
)

STALL_MS = 500


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--subscribe-buffer-batches", "4", "--subscribe-stall-ms", str(STALL_MS)]
    with lone_store(Path(tmp_path_factory.mktemp("store")), args) as running:
        yield running


def _keepalive() -> segment_store_pb2.SubscribeRequest:
    return segment_store_pb2.SubscribeRequest(
        keepalive=segment_store_pb2.Keepalive(sent_at_ms=wall_ms())
    )


async def _requests(
    start: segment_store_pb2.SubscribeRequest, keepalive_s: float | None
) -> AsyncIterator[segment_store_pb2.SubscribeRequest]:
    yield start
    if keepalive_s is None:
        await asyncio.Event().wait()  # silent, the stream left open
        return
    while True:
        await asyncio.sleep(keepalive_s)
        yield _keepalive()


async def test_subscribe_sends_the_position_first_then_acked_entries_with_tokens(
    store: ServerProcess,
) -> None:
    segment = seg(401, 3)
    async with store_stub(store) as stub:
        await write_all(stub, [write_request(segment, 3, 2, entries(1, 5))])
        call = stub.Subscribe(_requests(subscribe_start(segment, 2, 200, batch=2), 0.1))
        first = await next_reply(call)
        assert first.WhichOneof("message") == "position"
        assert (first.position.acked_index, first.position.fence) == (2, 0)
        batch = (await next_reply(call)).batch
        assert [e.index for e in batch.entries] == [2] and batch.token == 2
        # The acked index advances: entries follow, at most 2 per batch, each with its token.
        await write_all(stub, [write_request(segment, 3, 5, [])])
        seen: list[int] = []
        tokens: list[int] = []
        while len(seen) < 3:
            reply = await next_reply(call)
            if reply.WhichOneof("message") == "batch":
                seen += [e.index for e in reply.batch.entries]
                tokens.append(reply.batch.token)
                assert len(reply.batch.entries) <= 2
        assert seen == [3, 4, 5] and tokens[-1] == 5
        # Sealed with a bridge while no entries flow: a new position says so.
        await write_all(stub, [write_request(segment, 3, 6, [entry(6, kind=EntryKind.BRIDGE)])])
        await stub.Seal(seal_request(segment, 4))
        while True:
            reply = await next_reply(call)
            if reply.WhichOneof("message") == "position" and reply.position.fence == 4:
                break
        assert (reply.position.acked_index, reply.position.bridge_index) == (6, 6)
        call.cancel()


async def test_subscribe_keepalives_flow_both_ways_on_an_idle_segment(
    store: ServerProcess,
) -> None:
    segment = seg(402, 3)
    async with store_stub(store) as stub:
        await write_all(stub, [write_request(segment, 3, 1, entries(1, 1))])
        call = stub.Subscribe(_requests(subscribe_start(segment, 2, 200), 0.05))
        assert (await next_reply(call)).WhichOneof("message") == "position"
        kinds = [(await next_reply(call, 2.0)).WhichOneof("message") for _ in range(5)]
        assert kinds == ["keepalive"] * 5  # and the stream stays up well past 3 intervals
        call.cancel()


async def test_a_silent_subscriber_is_dropped(store: ServerProcess) -> None:
    segment = seg(403, 3)
    async with store_stub(store) as stub:
        call = stub.Subscribe(_requests(subscribe_start(segment, 1, 100), None))
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as dropped:
            async for _reply in call:
                pass
        assert dropped.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "silent" in (dropped.value.details() or "")
        assert time.monotonic() - started < 5


async def test_a_slow_consumer_is_disconnected_with_resource_exhausted(
    store: ServerProcess,
) -> None:
    segment = seg(404, 3)
    entry_bytes, per_batch, batches = 256 << 10, 16, 8  # 32 MiB acked, beyond the transport
    async with store_stub(store) as stub:
        await write_all(
            stub,
            [
                write_request(
                    segment,
                    3,
                    (n + 1) * per_batch,
                    entries(n * per_batch + 1, (n + 1) * per_batch, size=entry_bytes),
                )
                for n in range(batches)
            ],
        )
        call = stub.Subscribe(_requests(subscribe_start(segment, 1, 60_000, batch=4), 1.0))
        assert (await next_reply(call)).WhichOneof("message") == "position"
        await asyncio.sleep(STALL_MS / 1000 * 5)  # read nothing meanwhile
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as disconnected:
            while (reply := await call.read()) is not grpc.aio.EOF:
                assert isinstance(reply, segment_store_pb2.SubscribeReply)
                received += len(reply.batch.entries)
        assert disconnected.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too slow" in (disconnected.value.details() or "")
        assert received < batches * per_batch


def _tail_start(
    segment: entry_pb2.SegmentId, tail: int, from_index: int = 1
) -> segment_store_pb2.SubscribeRequest:
    request = subscribe_start(segment, from_index, 100, batch=2)
    request.start.tail = tail
    return request


async def _queued(
    queue: asyncio.Queue[segment_store_pb2.SubscribeRequest],
) -> AsyncIterator[segment_store_pb2.SubscribeRequest]:
    while True:
        try:
            yield await asyncio.wait_for(queue.get(), 0.05)
        except TimeoutError:
            yield _keepalive()


async def _until_indexes(
    call: SubscribeCall,
    seen: dict[int, list[int]],
    wanted: dict[int, list[int]],
) -> list[segment_store_pb2.SubscribeReply]:
    """Read replies until every tail of `wanted` saw its indexes; the replies read."""
    replies = []
    while any(seen.get(tail, []) != indexes for tail, indexes in wanted.items()):
        reply = await next_reply(call)
        replies.append(reply)
        if reply.WhichOneof("message") == "batch":
            seen.setdefault(reply.tail, []).extend(e.index for e in reply.batch.entries)
    return replies


async def test_one_multiplexed_call_starts_and_stops_many_tails(store: ServerProcess) -> None:
    first, second, later = seg(411, 3), seg(412, 3), seg(413, 3)
    async with store_stub(store) as stub:
        await write_all(
            stub,
            [
                write_request(first, 3, 3, entries(1, 3)),
                write_request(second, 3, 2, entries(1, 2)),
                write_request(later, 3, 1, entries(1, 1)),
            ],
        )
        requests: asyncio.Queue[segment_store_pb2.SubscribeRequest] = asyncio.Queue()
        requests.put_nowait(_tail_start(first, 1))
        requests.put_nowait(_tail_start(second, 2, from_index=2))
        call = stub.Subscribe(_queued(requests))
        seen: dict[int, list[int]] = {}
        replies = await _until_indexes(call, seen, {1: [1, 2, 3], 2: [2]})
        positions = [r.tail for r in replies if r.WhichOneof("message") == "position"]
        assert positions[:2] == [1, 2]  # each tail's position before its entries
        # A tail added later, and one stopped: what its segment acks next is not sent.
        requests.put_nowait(_tail_start(later, 3))
        requests.put_nowait(segment_store_pb2.SubscribeRequest(stop=_stop(1)))
        await _until_indexes(call, seen, {3: [1]})
        await write_all(stub, [write_request(first, 3, 4, entries(4, 4))])
        await write_all(stub, [write_request(second, 3, 3, entries(3, 3))])
        await _until_indexes(call, seen, {2: [2, 3]})
        # A tail that cannot run ends alone, with its status; the call and the others go on.
        requests.put_nowait(_tail_start(second, 2))
        ended = None
        while ended is None:
            reply = await next_reply(call)
            if reply.WhichOneof("message") == "ended":
                ended = reply
        assert ended.tail == 2
        assert ended.ended.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        await write_all(stub, [write_request(later, 3, 2, entries(2, 2))])
        await _until_indexes(call, seen, {3: [1, 2]})
        assert seen[1] == [1, 2, 3]
        call.cancel()


def _stop(tail: int) -> segment_store_pb2.SubscribeStop:
    return segment_store_pb2.SubscribeStop(tail=tail)


async def test_an_idle_multiplexed_call_sends_one_keepalive_per_interval(
    store: ServerProcess,
) -> None:
    segments = [seg(420 + n, 3) for n in range(20)]
    async with store_stub(store) as stub:
        requests: asyncio.Queue[segment_store_pb2.SubscribeRequest] = asyncio.Queue()
        for tail, segment in enumerate(segments, start=1):
            requests.put_nowait(_tail_start(segment, tail))
        call = stub.Subscribe(_queued(requests))
        kinds = [(await next_reply(call)).WhichOneof("message") for _ in range(len(segments) + 3)]
        assert kinds == ["position"] * len(segments) + ["keepalive"] * 3
        call.cancel()


# A follower's credit test: 24 MiB acked, over twice the credit a follower grants (one
# largest frame, `STREAM_CREDIT_BYTES`), in replies of 1 MiB (4 entries of 256 KiB).
BIG_ENTRY_BYTES = 256 << 10
CREDIT_ENTRIES = 96
# What the store process may grow by while its follower takes nothing: well below the
# 10 MiB it would queue if it did not wait for credit.
CREDIT_RSS_GROWTH_BYTES_MAX = 4 << 20


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def _settled(call: SubscribeCall, deadline_s: float) -> int:
    """What the store sent the call and the call did not take, once it stops growing."""
    deadline = time.monotonic() + deadline_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = call.buffered_bytes
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            return now
        await asyncio.sleep(0.05)
    raise AssertionError(f"the store kept sending: {last} bytes unread")


async def test_a_follower_that_takes_nothing_holds_the_store_to_its_credit(
    tmp_path: Path,
) -> None:
    segment = seg(430, 3)
    # Never dropped as too slow within the test: what holds the store back is the credit.
    args = ["--subscribe-buffer-batches", "4", "--subscribe-stall-ms", "60000"]
    with lone_store(tmp_path, args) as lone:
        async with store_stub(lone) as stub:
            await write_all(
                stub,
                [
                    write_request(segment, 3, n + 16, entries(n + 1, n + 16, size=BIG_ENTRY_BYTES))
                    for n in range(0, CREDIT_ENTRIES, 16)
                ],
            )
            call = stub.Subscribe(_requests(subscribe_start(segment, 1, 1000, batch=4), 0.2))
            assert (await next_reply(call)).WhichOneof("message") == "position"
            unread = await _settled(call, 10)
            assert 0 < unread <= STREAM_CREDIT_BYTES
            rss = _rss_bytes(lone.pid)
            await asyncio.sleep(2)  # keepalives flow both ways; nothing is taken
            assert call.buffered_bytes == unread, "the store sent past its credit"
            grown = _rss_bytes(lone.pid) - rss
            assert grown < CREDIT_RSS_GROWTH_BYTES_MAX, f"the store grew by {grown} bytes"
            # Taken, each reply's bytes granted back: the rest follows, in order.
            seen: list[int] = []
            while len(seen) < CREDIT_ENTRIES:
                reply = await next_reply(call)
                seen += [e.index for e in reply.batch.entries]
            assert seen == list(range(1, CREDIT_ENTRIES + 1))
            call.cancel()


async def test_a_client_with_more_tails_than_a_connection_holds_gets_them_all(
    store: ServerProcess,
) -> None:
    """Past a connection's bound of open requests, the client's data connections dial
    another for the next ones instead of waiting for a tail to end."""
    segment = seg(440, 3)
    connections = DataConnections(PLAINTEXT)
    calls = []
    try:
        for _ in range(DATA_REQUESTS_MAX + 6):
            call = await asyncio.wait_for(
                connections.call(store.data_address, framing.SUBSCRIBE), 5
            )
            await call.send(subscribe_start(segment, 1, 60_000))
            calls.append(call)
        for call in calls:
            reply = await asyncio.wait_for(call.receive(), 5)
            assert isinstance(reply, segment_store_pb2.SubscribeReply)
            assert reply.WhichOneof("message") == "position"
    finally:
        await connections.close()
