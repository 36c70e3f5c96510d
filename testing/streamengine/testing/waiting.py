"""Waiting for a condition with a deadline: tests never sleep blindly."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Hopeless(RuntimeError):
    """Raised by a condition that can no longer be met (the server it waits for has
    exited): `wait_for` raises it at once rather than polling on to its deadline, as
    it does with any other error of the condition."""


def wait_for(
    condition: Callable[[], T | None],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    message: str = "condition",
) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Hopeless:
            raise
        except Exception as error:
            last_error = error
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{message} not reached in {timeout_s}s (last error: {last_error!r})"
            )
        time.sleep(interval_s)


async def wait_until(
    condition: Callable[[], object],
    timeout_s: float = 30.0,
    message: str = "condition",
    interval_s: float = 0.02,
) -> None:
    """`wait_for` for async tests: poll `condition` (awaiting its result when it is
    awaitable) without blocking the event loop; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} not reached in {timeout_s}s")
        await asyncio.sleep(interval_s)
