"""Read on the data plane from both kinds of caller (protocol/framed_read.py), against a
server on 127.0.0.1 that serves READ from a script: replies in order, a status with its
metadata, a deadline, a reader cancelled mid-read, the synchronous bridge taking replies
from its own loop however long its caller waits (the connection stays alive) and ending
the read when left early, and reads on a pool's shared connection: one connection for
many reads, a read left early (or late, or cancelled) freeing its slot there, and a
reader taking nothing holding back its own request only."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from streamengine.client.data_connections import DataConnections
from streamengine.protocol import framed_read
from streamengine.protocol.framed import CallError
from streamengine.protocol.framed_server import ServerCall
from streamengine.protocol.framing import Kind, StatusCode
from streamengine.protocol.limits import STREAM_CREDIT_BYTES
from streamengine.protocol.status import FENCE_METADATA_KEY
from streamengine.protocol.transport import PLAINTEXT
from streamengine.v1 import entry_pb2, segment_store_pb2
from tests.unit import data_servers

DEADLINE_S = data_servers.DEADLINE_S
REQUEST = segment_store_pb2.ReadRequest(
    segment=entry_pb2.SegmentId(stream_id=7, epoch=3), from_index=1, to_index=5
)


def reply(index: int) -> segment_store_pb2.ReadReply:
    return segment_store_pb2.ReadReply(first_index=index, packed_values=b"v%d" % index)


async def five_replies(call: ServerCall) -> None:
    request = await call.receive()
    assert isinstance(request, segment_store_pb2.ReadRequest)
    for index in range(request.from_index, request.to_index + 1):
        await call.send(reply(index))


async def fenced(call: ServerCall) -> None:
    await call.send(reply(1))
    raise CallError(StatusCode.FAILED_PRECONDITION, "below the fence", {FENCE_METADATA_KEY: "9"})


def serving(
    handler: Callable[[ServerCall], Awaitable[None]], **options: Any
) -> contextlib.AbstractAsyncContextManager[str]:
    return data_servers.serving({Kind.READ_REQUEST: handler}, **options)


async def test_replies_come_in_order_and_the_read_ends_with_the_stores_end() -> None:
    async with serving(five_replies) as address:
        replies = [r async for r in framed_read.read(address, PLAINTEXT, REQUEST, DEADLINE_S)]
    assert [r.first_index for r in replies] == [1, 2, 3, 4, 5]


async def test_a_refusal_carries_its_status_and_fence() -> None:
    async with serving(fenced) as address:
        got: list[segment_store_pb2.ReadReply] = []
        with pytest.raises(CallError) as refused:
            async for r in framed_read.read(address, PLAINTEXT, REQUEST, DEADLINE_S):
                got.append(r)
    assert [r.first_index for r in got] == [1]
    assert refused.value.code is StatusCode.FAILED_PRECONDITION
    assert refused.value.metadata == {FENCE_METADATA_KEY: "9"}


async def test_a_read_not_over_by_its_deadline_is_deadline_exceeded() -> None:
    never = asyncio.Event()

    async def stalls(call: ServerCall) -> None:
        await call.send(reply(1))
        await never.wait()

    async with serving(stalls) as address:
        with pytest.raises(CallError) as late:
            async for _ in framed_read.read(address, PLAINTEXT, REQUEST, 0.3):
                pass
    assert late.value.code is StatusCode.DEADLINE_EXCEEDED


async def test_a_reader_cancelled_mid_read_ends_cancelled_not_in_an_exception_group() -> None:
    # A store's CopySegment cancelled (its caller gone) closes its source's read at the
    # read's yield: GeneratorExit inside the connection's TaskGroup came out as a
    # BaseExceptionGroup, a traceback in the store's log (S18 seed 1, C16).
    async with serving(five_replies) as address:
        reading = asyncio.Event()

        async def copy() -> None:
            reads = framed_read.read(address, PLAINTEXT, REQUEST, DEADLINE_S)
            async with contextlib.aclosing(reads):
                async for _ in reads:
                    reading.set()
                    await asyncio.Event().wait()

        task = asyncio.create_task(copy())
        await reading.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_nothing_to_dial_is_a_clear_error() -> None:
    with pytest.raises(CallError) as refused:
        async for _ in framed_read.read("", PLAINTEXT, REQUEST, DEADLINE_S):
            pass
    assert refused.value.code is StatusCode.INVALID_ARGUMENT


def bridge_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "framed-read")


def test_the_sync_bridge_reads_refuses_ends_early_and_keeps_the_connection() -> None:
    """Servers on a loop in a thread of the test; the sync reads from the test's own."""
    ready = threading.Event()
    addresses: dict[str, str] = {}
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        async with (
            serving(five_replies) as good,
            serving(fenced) as bad,
            serving(five_replies, ping_interval_ms=50, dead_peer_ms=300) as strict,
        ):
            addresses.update(good=good, bad=bad, strict=strict)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        assert ready.wait(DEADLINE_S)
        replies = framed_read.read_sync(addresses["good"], PLAINTEXT, REQUEST, DEADLINE_S)
        assert [r.first_index for r in replies] == [1, 2, 3, 4, 5]
        with pytest.raises(CallError) as refused:
            list(framed_read.read_sync(addresses["bad"], PLAINTEXT, REQUEST, DEADLINE_S))
        assert refused.value.code is StatusCode.FAILED_PRECONDITION
        # Left after one reply: closing the iterator ends the read and its thread.
        # Other tests' threads may end meanwhile: only the bridges' own are counted.
        early = framed_read.read_sync(addresses["good"], PLAINTEXT, REQUEST, DEADLINE_S)
        assert next(early).first_index == 1
        assert bridge_threads() == 1
        early.close()
        assert bridge_threads() == 0
        # A caller slower than the server's dead-peer time: the bridge's own loop pings.
        slow = framed_read.read_sync(addresses["strict"], PLAINTEXT, REQUEST, DEADLINE_S)
        taken = []
        for r in slow:
            taken.append(r.first_index)
            if len(taken) == 1:
                time.sleep(0.6)  # twice the dead-peer time, between two replies
        assert taken == [1, 2, 3, 4, 5]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(DEADLINE_S * 3)
        loop.close()


class Counted:
    """A server's connections (whose hello it accepted) and its handlers stopped early."""

    def __init__(self) -> None:
        self.connections = 0
        self.stopped: asyncio.Queue[None] = asyncio.Queue()

    def connected(self) -> None:
        self.connections += 1


def stalling(counted: Counted) -> Callable[[ServerCall], Awaitable[None]]:
    """A read of `to_index` 1 stalls after its first reply; others get five."""

    async def serve(call: ServerCall) -> None:
        request = await call.receive()
        assert isinstance(request, segment_store_pb2.ReadRequest)
        if request.to_index != 1:
            await five_replies_of(call, request)
            return
        await call.send(reply(1))
        try:
            await asyncio.Event().wait()
        finally:
            counted.stopped.put_nowait(None)

    return serve


async def five_replies_of(call: ServerCall, request: segment_store_pb2.ReadRequest) -> None:
    for index in range(request.from_index, request.to_index + 1):
        await call.send(reply(index))


STALLS = segment_store_pb2.ReadRequest(segment=REQUEST.segment, from_index=1, to_index=1)


async def consume(address: str, pool: DataConnections, taken: asyncio.Event) -> None:
    async for _ in framed_read.read(address, pool.call, STALLS, DEADLINE_S):
        taken.set()


async def test_reads_on_a_pool_share_one_connection_and_free_their_slots_when_left() -> None:
    """More reads left early than a connection holds requests, each a way (the consumer
    stops, its task is cancelled, its deadline passes): each cancels its request at the
    server, and the next read still rides the one connection."""
    counted = Counted()
    pool = DataConnections(PLAINTEXT)
    try:
        async with serving(
            stalling(counted), requests_max=4, on_connection=counted.connected
        ) as address:
            for _ in range(2):
                replies = framed_read.read(address, pool.call, REQUEST, DEADLINE_S)
                assert [r.first_index async for r in replies] == [1, 2, 3, 4, 5]
            for _ in range(4):  # left by its consumer
                replies = framed_read.read(address, pool.call, STALLS, DEADLINE_S)
                assert (await anext(replies)).first_index == 1
                await replies.aclose()
            for _ in range(3):  # its task cancelled
                taken = asyncio.Event()
                task = asyncio.create_task(consume(address, pool, taken))
                await taken.wait()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            for _ in range(3):  # past its deadline
                with pytest.raises(CallError) as late:
                    async for _ in framed_read.read(address, pool.call, STALLS, 0.1):
                        pass
                assert late.value.code is StatusCode.DEADLINE_EXCEEDED
            replies = framed_read.read(address, pool.call, REQUEST, DEADLINE_S)
            assert [r.first_index async for r in replies] == [1, 2, 3, 4, 5]
            for _ in range(10):
                await counted.stopped.get()
            assert counted.connections == 1
    finally:
        await pool.close()


async def test_a_reader_taking_nothing_holds_back_its_own_request_only() -> None:
    """Credit is per request: a pooled read whose consumer stops taking replies holds
    the server to one window of them, while another read on the same connection runs
    to its end."""
    big = segment_store_pb2.ReadRequest(segment=REQUEST.segment, from_index=1, to_index=40)
    sent = 0

    async def serve(call: ServerCall) -> None:
        nonlocal sent
        request = await call.receive()
        assert isinstance(request, segment_store_pb2.ReadRequest)
        if request.to_index != big.to_index:
            await five_replies_of(call, request)
            return
        for index in range(1, big.to_index + 1):
            await call.send(segment_store_pb2.ReadReply(first_index=index, packed_values=MIB))
            sent += 1

    counted = Counted()
    pool = DataConnections(PLAINTEXT)
    try:
        async with serving(serve, on_connection=counted.connected) as address:
            stalled = framed_read.read(address, pool.call, big, DEADLINE_S)
            assert (await anext(stalled)).first_index == 1
            replies = framed_read.read(address, pool.call, REQUEST, DEADLINE_S)
            assert [r.first_index async for r in replies] == [1, 2, 3, 4, 5]
            assert sent <= STREAM_CREDIT_BYTES // len(MIB) + 1, "sent past the reader's credit"
            await stalled.aclose()
            assert counted.connections == 1
    finally:
        await pool.close()


MIB = b"m" * (1 << 20)
