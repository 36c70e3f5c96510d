"""`wait_set` delivers a cancellation that comes in the step its event is set, which
Python 3.11's `asyncio.wait_for` loses (the runtime simulator's seed 2: a master's
repair loop ran on after the master was stopped, and the run never ended)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from streamengine.protocol.waiting import wait_set


def cancelled_as_set(wait: Callable[[asyncio.Event], Coroutine[Any, Any, object]]) -> bool:
    async def scenario() -> bool:
        event = asyncio.Event()
        task = asyncio.create_task(wait(event))
        for _ in range(3):
            await asyncio.sleep(0)  # the waiter is parked on the event
        event.set()  # and cancelled in the same step
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    return asyncio.run(scenario())


def test_a_cancellation_in_the_step_the_event_is_set_is_delivered() -> None:
    assert cancelled_as_set(lambda event: wait_set(event, 10))


def test_a_set_event_and_a_timeout_are_told_apart() -> None:
    async def scenario() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await wait_set(event, 0.01)
        event.set()
        return timed_out, await wait_set(event, 10)

    assert asyncio.run(scenario()) == (False, True)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for is asyncio.timeout")
def test_wait_for_of_this_python_loses_it() -> None:
    """Why `wait_set` exists: here `asyncio.wait_for` swallows the cancellation."""
    assert not cancelled_as_set(lambda event: asyncio.wait_for(event.wait(), 10))
