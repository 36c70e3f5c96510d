"""Read on the data plane, for every reader: `read` in asyncio code (followers,
recoveries, a store copying a segment) and `read_sync` in synchronous code (Spark's
executors, the CLI, the fault suite's checks) (docs/data-plane.md, "Read").

A Read is one request: the ReadRequest, the client's End, then the store's replies
until its End (the read is done) or its Error (`CallError`, with the status and metadata
the gRPC Read ended with). Each reply taken grants its bytes back (`framed`): a reader
that stops taking replies holds the store to one window of them, on its own request
only (credit is per request, never per connection).

Where the request goes is the caller's choice, `via`: a `Transport`, for a connection
of the read's own, dialled for it and closed after it (a store copying a segment,
`read_sync`); or a pool's way to open a request on a connection it keeps (`OpenCall`:
the SDK's `ChannelPool.data_call`), for a read that rides the connection the client's
tails and other reads share. A read left before the store's End (its consumer stops,
is cancelled, or its deadline passes) then cancels its request there: the store stops
sending and the slot is free, while the connection goes on for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator, Iterator
from typing import Any, TypeVar

from streamengine.protocol import framed, framing, loop_thread
from streamengine.protocol.framed import CallError, ClientCall
from streamengine.protocol.framing import Method, StatusCode
from streamengine.protocol.transport import Transport
from streamengine.v1 import segment_store_pb2

_ReadReply = segment_store_pb2.ReadReply
T = TypeVar("T")
# Replies a synchronous reader's loop takes ahead of it: the store is held back by credit
# beyond them.
SYNC_REPLIES_AHEAD = 1
# A request of a method on a connection to the data port at an address, opened by a pool
# that keeps its connections (`ChannelPool.data_call`). Raises CallError.
OpenCall = Callable[[str, Method], Awaitable[ClientCall]]


async def read(
    data_address: str,
    via: Transport | OpenCall,
    request: segment_store_pb2.ReadRequest,
    timeout_s: float | None = None,
) -> AsyncGenerator[_ReadReply, None]:
    """The replies to `request` from the store at `data_address`, on a connection of
    its own (`via` a Transport) or on a pool's (`via` an `OpenCall`: see the module
    doc). Raises CallError: the store's status, UNAVAILABLE when it cannot be reached
    or the connection fails, DEADLINE_EXCEEDED when the read is not over `timeout_s`
    after it began (None: no deadline). Consume a read on a connection of its own in
    one task (its connection's tasks belong to the one that opened it)."""
    deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
    try:
        async with contextlib.AsyncExitStack() as stack:
            async with asyncio.timeout_at(deadline):
                call = await _opened(stack, data_address, via)
                await call.send(request)
                await call.end()
            while True:
                # The deadline bounds each wait here, never the caller's work between
                # replies (a timeout across a yield would cancel the caller).
                async with asyncio.timeout_at(deadline):
                    reply = await call.receive()
                if reply is None:
                    return
                assert isinstance(reply, _ReadReply)
                yield reply
    except TimeoutError:
        raise CallError(
            StatusCode.DEADLINE_EXCEEDED, f"{data_address}: the read took over {timeout_s} s"
        ) from None


async def _opened(
    stack: contextlib.AsyncExitStack, data_address: str, via: Transport | OpenCall
) -> ClientCall:
    """A Read request on `via`, ended with `stack`: its own connection closed, or the
    request cancelled on the pool's (nothing to say once the store ended it)."""
    if isinstance(via, Transport):
        connection = await stack.enter_async_context(framed.connect(data_address, via))
        return await connection.call(framing.READ)
    call = await via(data_address, framing.READ)
    stack.callback(call.cancel)  # at once: no await between the opening and this
    return call


def read_sync(
    data_address: str,
    transport: Transport,
    request: segment_store_pb2.ReadRequest,
    timeout_s: float | None = None,
) -> Generator[_ReadReply, None, None]:
    """`read` for synchronous code: the replies, as an iterator. The read runs on an
    event loop of its own in a thread of its own (`loop_thread`), so the connection
    answers pings and keeps its credit however long the caller takes between replies; closing the
    iterator (or leaving it early) ends the read."""
    bridge = _SyncRead(data_address, transport, request, timeout_s)
    try:
        yield from bridge.replies()
    finally:
        bridge.close()


class _SyncRead:
    """One `read_sync`: a private loop in a thread (`loop_thread.start`), its task
    pumping `read` into a small queue the caller's thread takes replies from."""

    def __init__(
        self,
        data_address: str,
        transport: Transport,
        request: segment_store_pb2.ReadRequest,
        timeout_s: float | None,
    ) -> None:
        self._runner = loop_thread.start("framed-read")
        started = self._start(data_address, transport, request, timeout_s)
        self._queue, self._pump = self._run(started)

    async def _start(
        self,
        data_address: str,
        transport: Transport,
        request: segment_store_pb2.ReadRequest,
        timeout_s: float | None,
    ) -> tuple[asyncio.Queue[_ReadReply | CallError | None], asyncio.Task[None]]:
        queue: asyncio.Queue[_ReadReply | CallError | None] = asyncio.Queue(SYNC_REPLIES_AHEAD)

        async def pump() -> None:
            replies = read(data_address, transport, request, timeout_s)
            try:
                # Closed in this task however the pump ends (its connection is this task's).
                async with contextlib.aclosing(replies):
                    async for reply in replies:
                        await queue.put(reply)
                await queue.put(None)
            except CallError as error:
                await queue.put(error)

        return queue, asyncio.get_running_loop().create_task(pump())

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(coroutine)

    def replies(self) -> Iterator[_ReadReply]:
        while True:
            item = self._run(self._queue.get())
            if item is None:
                return
            if isinstance(item, CallError):
                raise item
            assert isinstance(item, _ReadReply)
            yield item

    def close(self) -> None:
        async def stop(pump: asyncio.Task[None]) -> None:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

        try:
            self._run(stop(self._pump))
        finally:
            self._runner.close()
