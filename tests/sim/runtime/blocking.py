"""Synchronous code on the simulated loop: a thread that takes turns with it.

Spark's driver and executors (`client/spark.py`) and `SyncStreamClient` are synchronous:
they block in gRPC's blocking channels (`Transport.channel`), in runners of
`protocol.loop_thread` (a coroutine run on a loop of their own: `SyncStreamClient`,
`framed_read.read_sync`, a Spark write task) and in `time.sleep`. `BlockingThread.run`
runs such code, unmodified, in a thread of its own that takes turns with the loop's:

- while the synchronous code runs, the loop's thread waits for it, so one thread runs
  at a time and the run stays as deterministic as the loop alone;
- each blocking call it makes becomes an awaitable that the task which called `run`
  awaits on the loop (its node's calls, under its node's partitions), the synchronous
  thread waiting meanwhile; the outcome, a result or an exception, is handed back;
- virtual time stands still while the synchronous code computes, as it does for the
  loop's callbacks.

`installed(network)` sets the seams (`transport.channel_factory`, `loop_thread.factory`,
`time.sleep`) for as long as the simulation runs. A blocking call made from a thread
that is not a `BlockingThread` (nothing in the simulated processes should make one) is
an error, and so is synchronous code that blocks on anything else for
`TURN_WAIT_S_MAX` of real time: the simulation would otherwise hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from streamengine.protocol import loop_thread, transport

if TYPE_CHECKING:
    from tests.sim.runtime.transport import SimNetwork

T = TypeVar("T")

# Real seconds the loop's thread waits for synchronous code to finish or make its next
# blocking call: code computing longer than this blocks on something the simulation
# cannot see (a real socket, a lock held by the loop's thread).
TURN_WAIT_S_MAX = 120.0

_current = threading.local()


class Abandoned(BaseException):
    """Raised in synchronous code whose caller's task was cancelled (its node crashed or
    stopped): each blocking call it makes from then on raises it too, so that it unwinds
    through its `finally` blocks without waiting for anything."""


class BlockingThread:
    """Runs synchronous functions on the simulated loop: see the module doc."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._to_loop: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._to_thread: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` run in a thread of its own, its blocking calls awaited by the
        calling task. Cancelling the task abandons the function (`Abandoned`)."""
        context = contextvars.copy_context()

        def body() -> None:
            _current.thread = self
            try:
                result = context.run(function, *args)
            except BaseException as error:  # handed to the loop's thread, raised there
                self._to_loop.put(("raised", error))
            else:
                self._to_loop.put(("returned", result))

        thread = threading.Thread(target=body, name=f"sim-{self.name}", daemon=True)
        thread.start()
        cancelled: asyncio.CancelledError | None = None
        while True:
            kind, value = self._take_turn()
            if kind != "await":
                thread.join()
                if cancelled is not None:
                    raise cancelled
                if kind == "raised":
                    raise value
                return value
            if cancelled is not None:
                self._to_thread.put((False, Abandoned(self.name)))
                continue
            try:
                outcome: tuple[bool, Any] = (True, await value())
            except asyncio.CancelledError as error:
                cancelled = error
                outcome = (False, Abandoned(self.name))
            except Exception as error:
                outcome = (False, error)
            self._to_thread.put(outcome)

    def _take_turn(self) -> tuple[str, Any]:
        try:
            return self._to_loop.get(timeout=TURN_WAIT_S_MAX)
        except queue.Empty:
            raise RuntimeError(
                f"{self.name}: synchronous code ran {TURN_WAIT_S_MAX} s without a blocking "
                "call the simulation sees (a real socket, a lock, a thread of its own?)"
            ) from None

    def wait(self, awaitable: Callable[[], Awaitable[T]]) -> T:
        """In the synchronous thread: the outcome of `awaitable()`, made and awaited on
        the loop by the task running this thread."""
        self._to_loop.put(("await", awaitable))
        ok, value = self._to_thread.get()
        if ok:
            return value
        raise value


def current() -> BlockingThread:
    """The `BlockingThread` running the calling thread."""
    thread = getattr(_current, "thread", None)
    if thread is None:
        raise RuntimeError("a blocking call outside a BlockingThread in the simulation")
    assert isinstance(thread, BlockingThread)
    return thread


class _Runner:
    """`loop_thread.Runner` on the simulated loop: each coroutine awaited there by the
    task running the calling thread; what it started lives on there."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        try:
            return current().wait(lambda: asyncio.wait_for(coroutine, timeout_s))
        except Abandoned:
            coroutine.close()  # never awaited, or over: either way nothing more runs
            raise

    def close(self) -> None:
        """Nothing to stop: the loop is the simulation's."""


class UnaryChannel(grpc.Channel):
    """A blocking channel that makes unary calls only (what the simulated processes'
    blocking callers make): streaming calls and connectivity raise when used."""

    def _streaming(self, method: str, *args: Any, **kwargs: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"{method}: blocking streaming calls are not simulated")

        return call  # a stub makes one for every method, called or not

    unary_stream = stream_unary = stream_stream = _streaming

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        raise NotImplementedError("channel connectivity of a blocking channel")

    def unsubscribe(self, callback: Any) -> None:
        raise NotImplementedError("channel connectivity of a blocking channel")

    def __enter__(self) -> UnaryChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SimBlockingCallChannel(UnaryChannel):
    """`Transport.channel` in the simulation: unary calls made on a `SimChannel` of the
    node running the synchronous code, its thread waiting for each one's end."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def unary_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        callable_ = self._channel.unary_unary(method, request_serializer, response_deserializer)

        def call(
            request: Any,
            timeout: float | None = None,
            metadata: Any = None,
            **kwargs: Any,
        ) -> Any:
            async def made() -> Any:
                return await callable_(request, timeout=timeout, metadata=metadata)

            return current().wait(made)

        return call

    def close(self) -> None:
        current().wait(self._channel.close)


def _sleep_in_virtual_time(real_sleep: Callable[[float], None]) -> Callable[[float], None]:
    def sleep(seconds: float) -> None:
        if getattr(_current, "thread", None) is None:
            real_sleep(seconds)  # the test runner's own threads
            return
        current().wait(lambda: asyncio.sleep(seconds))

    return sleep


@contextlib.contextmanager
def installed(network: SimNetwork) -> Iterator[None]:
    """The blocking seams lead to `network` and its loop meanwhile (a part of
    `SimNetwork.installed`)."""
    assert transport.channel_factory is None and loop_thread.factory is None

    def channel(credentials: transport.Transport, address: str, options: Any) -> grpc.Channel:
        return SimBlockingCallChannel(network.channel_for(credentials, address, options))

    real_sleep = time.sleep
    transport.channel_factory = channel
    loop_thread.factory = _Runner
    time.sleep = _sleep_in_virtual_time(real_sleep)  # type: ignore[assignment]
    try:
        yield
    finally:
        transport.channel_factory = None
        loop_thread.factory = None
        time.sleep = real_sleep
