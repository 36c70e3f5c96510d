"""A recovery's one-request Writes (`store_session.write_once`) on the client's pooled
data connections, against a server on 127.0.0.1 that serves WRITE from a script: many
writes ride one connection, and a write's three endings keep their surface (its reply,
None when the store ended the call without one, DEADLINE_EXCEEDED past its timeout),
each freeing its slot on the shared connection."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from streamengine.client.data_connections import DataConnections
from streamengine.client.store_session import write_once
from streamengine.protocol.framed import CallError
from streamengine.protocol.framed_server import ServerCall
from streamengine.protocol.framing import Kind, StatusCode
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing.ports import free_port
from streamengine.v1 import segment_store_pb2
from tests.unit import data_servers

DEADLINE_S = data_servers.DEADLINE_S
# Request ids the script answers otherwise than with a reply.
ENDS_UNANSWERED = 1000
NEVER_ANSWERS = 2000


async def scripted_write(call: ServerCall) -> None:
    request = await call.receive()
    assert isinstance(request, segment_store_pb2.WriteRequest)
    if request.request_id == NEVER_ANSWERS:
        await asyncio.Event().wait()
    if request.request_id != ENDS_UNANSWERED:
        await call.send(
            segment_store_pb2.WriteReply(request_id=request.request_id, last_index=7)
        )
    assert await call.receive() is None  # the client's End


def serving(connections: list[None]) -> contextlib.AbstractAsyncContextManager[str]:
    return data_servers.serving(
        {Kind.WRITE_REQUEST: scripted_write},
        requests_max=2,
        on_connection=lambda: connections.append(None),
    )


def write(request_id: int) -> segment_store_pb2.WriteRequest:
    return segment_store_pb2.WriteRequest(request_id=request_id, first_index=7)


async def test_writes_ride_one_pooled_connection_whatever_their_ending() -> None:
    """More writes than the connection holds requests (2), of every ending, then as many
    at once as it holds: each frees its slot, and the server accepted one connection
    for them all."""
    connections: list[None] = []
    pool = DataConnections(PLAINTEXT)
    try:
        async with serving(connections) as address:
            for request_id in range(1, 6):
                reply = await write_once(address, pool.call, write(request_id), DEADLINE_S)
                assert reply is not None
                assert (reply.request_id, reply.last_index) == (request_id, 7)
            for _ in range(3):
                assert (
                    await write_once(address, pool.call, write(ENDS_UNANSWERED), DEADLINE_S)
                ) is None
            for _ in range(3):
                with pytest.raises(CallError) as late:
                    await write_once(address, pool.call, write(NEVER_ANSWERS), 0.1)
                assert late.value.code is StatusCode.DEADLINE_EXCEEDED
            both = [write_once(address, pool.call, write(n), DEADLINE_S) for n in (10, 11)]
            replies = await asyncio.gather(*both)
            assert [reply.request_id for reply in replies if reply] == [10, 11]
            assert len(connections) == 1
    finally:
        await pool.close()


async def test_a_store_out_of_reach_is_unavailable() -> None:
    pool = DataConnections(PLAINTEXT)
    try:
        with pytest.raises(CallError) as unreachable:
            await write_once(f"127.0.0.1:{free_port()}", pool.call, write(1), DEADLINE_S)
        assert unreachable.value.code is StatusCode.UNAVAILABLE
    finally:
        await pool.close()
