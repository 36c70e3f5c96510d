"""Async code for synchronous callers: an event loop of its own in a daemon thread.

Scripts (`client.sync`), Spark's executors (`client.spark`) and a synchronous reader of
the data plane (`framed_read.read_sync`) call the async SDK through one of these: each
call is a coroutine run on the thread's loop, the caller waiting for its outcome. What
the loop holds (a writer's tasks, a read's connection) lives on between calls, until
`close`.

`factory` is the seam the deterministic simulator sets (tests/sim/runtime), as
`transport.aio_channel_factory` is: its runners hand each coroutine to the simulated
loop, so the synchronous callers above run there unmodified.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Runner(Protocol):
    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T: ...

    def close(self) -> None: ...


class LoopThread:
    """An event loop running in a daemon thread named `name`, until `close`."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """`coroutine`'s result, run as a task of the thread's loop. Past `timeout_s`
        raises TimeoutError, the task running on."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def close(self) -> None:
        """Stop the loop and end the thread; idempotent."""
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


# Where `start` gets its runners when set: the simulator's. None, as shipped.
factory: Callable[[str], Runner] | None = None


def start(name: str) -> Runner:
    """A runner for synchronous code: a `LoopThread`, or the simulator's."""
    return LoopThread(name) if factory is None else factory(name)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coroutine)` for code that is not on a loop (a Spark task), or on the
    simulator's loop when it runs it."""
    if factory is None:
        return asyncio.run(coroutine)
    runner = factory("run")
    try:
        return runner.run(coroutine)
    finally:
        runner.close()
