"""A data-plane server (`protocol.framed_server.DataServer`) on a free port of
127.0.0.1, for the unit tests of the framed protocol and its clients."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from streamengine.protocol import auth
from streamengine.protocol.framed_server import DataServer, ServerCall
from streamengine.protocol.framing import Kind
from streamengine.testing.ports import free_port

# A test's exchanges end well within this; its server goes after twice as long.
DEADLINE_S = 5.0

Handler = Callable[[ServerCall], Awaitable[None]]
Accept = Callable[[auth.Principal, str | None], auth.Principal | auth.Denial]


def accept_known(known: auth.Principal, _token: str | None) -> auth.Principal:
    """Every caller as its connection made it known."""
    return known


@contextlib.asynccontextmanager
async def serving(
    handlers: Mapping[Kind, Handler],
    accept: Accept = accept_known,
    context: Any = None,
    **options: Any,
) -> AsyncIterator[str]:
    """The address of a server with `handlers` (`context`: its TLS, None for plain TCP),
    stopped when the block ends."""
    server = DataServer(dict(handlers), accept, **options)
    port = await server.start(f"127.0.0.1:{free_port()}", context)
    try:
        async with asyncio.timeout(DEADLINE_S * 2):
            yield f"127.0.0.1:{port}"
    finally:
        await server.stop()
