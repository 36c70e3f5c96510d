"""Waiting with a timeout that never loses a cancellation.

Python 3.11's `asyncio.wait_for` returns the inner awaitable's outcome when it completed
in the same step its waiter was cancelled: the cancellation is lost, and a loop that
waits that way (a repair tick, an HA poll) runs on after its task was cancelled, so a
server stopping then never ends. The runtime simulator found it twice (the election's
keepalive, then the repair loop of a master stopped at the end of a run). Shipped code
waits with `asyncio.timeout` instead, through `wait_set` for an event.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """True if `event` is set within `timeout_s`; a cancellation always propagates."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def wait_any(events: tuple[asyncio.Event, ...], timeout_s: float) -> None:
    """Until one of `events` is set or `timeout_s` passed, whichever comes first."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
