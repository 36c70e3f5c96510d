"""The client's long-lived data-plane connections to each store's data port, dialled on
first use, shared by every call the client opens there (its followers' catch-up reads,
read-aheads and live tails, its recoveries' reads and writes), dialled again after one
fails, closed with the client (docs/data-plane.md).

One connection per store carries up to the store's bound of open requests
(`HelloOk.requests_max`, 64): a client with more requests on one store (a reader of many
streams, each its own Subscribe) gets another connection for the next 64, rather than
waiting for one to end. A request given up (`ClientCall.cancel`: a read left early) is
cancelled at the store and frees its slot at once; credit is per request, so a reader
that stops taking replies holds back its own request only, never the others on its
connection.

`framed.connect` scopes a connection to an `async with` block; a holder task keeps each
one open here until it fails or the client closes, and calls are opened on it from any
task. A failure ends the calls on it (`CallError`, UNAVAILABLE) and the next call dials
anew: each caller has its own retry and backoff (a follower's cursor), so there is none
here.
"""

from __future__ import annotations

import asyncio
import contextlib

from streamengine.protocol import framed
from streamengine.protocol.framed import CallError, ClientCall, DataConnection
from streamengine.protocol.framing import Method, StatusCode
from streamengine.protocol.transport import Transport


class DataConnections:
    """See the module doc. `call` raises CallError when the store cannot be reached,
    refuses the hello, or the pool is closed (CANCELLED)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        # Each address's connections, dialled or being dialled, oldest first.
        self._pools: dict[str, list[asyncio.Future[DataConnection]]] = {}
        self._holders: set[asyncio.Task[None]] = set()
        self.closed = False

    async def call(self, address: str, method: Method) -> ClientCall:
        """A new request of `method` on a connection to `address` (as dialled)."""
        connection = await self._connection(address)
        return await connection.call(method)

    async def _connection(self, address: str) -> DataConnection:
        if self.closed:
            raise CallError(StatusCode.CANCELLED, "the client closed its data connections")
        pool = self._pools.setdefault(address, [])
        for ready in list(pool):
            if ready.done() and ready.exception() is not None:
                continue  # its holder takes it out of the pool
            # Shielded: a caller given up does not end the dial the others wait for.
            connection = await asyncio.shield(ready)
            if connection.has_room:
                return connection
        ready = asyncio.get_running_loop().create_future()
        pool.append(ready)
        holder = asyncio.create_task(self._hold(address, ready))
        self._holders.add(holder)
        holder.add_done_callback(self._holders.discard)
        return await asyncio.shield(ready)

    async def _hold(self, address: str, ready: asyncio.Future[DataConnection]) -> None:
        try:
            async with framed.connect(address, self.transport) as connection:
                ready.set_result(connection)
                await connection.wait_failed()
        except CallError as error:
            if not ready.done():
                ready.set_exception(error)
        finally:
            if not ready.done():
                ready.set_exception(CallError(StatusCode.CANCELLED, "the connection was closed"))
            if not ready.cancelled() and ready.exception() is not None:
                ready.exception()  # retrieved: a dial nobody waits for any more is no error
            pool = self._pools.get(address, [])
            if ready in pool:
                pool.remove(ready)
            if not pool:
                self._pools.pop(address, None)

    async def close(self) -> None:
        """Ends every connection (their calls end with CANCELLED)."""
        self.closed = True
        holders = list(self._holders)
        for holder in holders:
            holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*holders, return_exceptions=True)
