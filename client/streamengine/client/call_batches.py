"""Many writers' calls of one kind to the master, as one batch call per short window.

A `CallBatcher` takes calls that each writer makes on its own (a roll: `RollSegment`)
and sends those asked within a short window (`window_ms`: the lease session's
`LEASE_BATCH_WINDOW_MS`) as one batch call (`RollSegments`;
several when more than `LEASE_BATCH_ENTRIES_MAX` wait), so that a fault that makes
hundreds of writers of a process call at once costs the master a few calls and a few
metadata commits, not hundreds (issue #38). Each caller still gets its own answer, or
its own error, as the lone call would have given it: the batch's answer for its entry,
the batch call's error when the call as a whole failed, or DEADLINE_EXCEEDED once its
own timeout passed (a batch not yet sent then leaves it out; one under way answers
nobody for it, as a lone call that timed out after the master read it).

A master that does not know the batch call (UNIMPLEMENTED: older than the client) gets
lone calls, each with its own timeout, for `LONE_CALLS_MS`; the batch call is then
tried again, in case a newer master took over.

The loop and the calls in flight are tasks of the owner's TaskGroup (`start`), which
`close` ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from streamengine.protocol.limits import LEASE_BATCH_ENTRIES_MAX

log = logging.getLogger(__name__)

# How long a master that answered the batch call UNIMPLEMENTED gets lone calls before
# the batch call is tried again.
LONE_CALLS_MS = 60_000

Request = TypeVar("Request")
Reply = TypeVar("Reply")
# A batch call: the requests and the call's timeout in, one answer per request out
# (its reply, or the error its lone call would have raised).
BatchCall = Callable[[list[Request], float], Awaitable[list[Reply | grpc.aio.AioRpcError]]]
LoneCall = Callable[[Request, float], Awaitable[Reply]]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass(slots=True)
class _Waiting(Generic[Request, Reply]):
    request: Request
    answer: asyncio.Future[Reply]
    deadline: float  # loop time


class CallBatcher(Generic[Request, Reply]):
    """See the module docstring. `what` names the calls in logs and errors."""

    def __init__(
        self,
        what: str,
        batch_call: BatchCall[Request, Reply],
        lone_call: LoneCall[Request, Reply],
        window_ms: int,
        entries_max: int = LEASE_BATCH_ENTRIES_MAX,
    ) -> None:
        assert entries_max >= 1 and window_ms >= 0
        self._window_ms = window_ms
        self._what = what
        self._batch_call = batch_call
        self._lone_call = lone_call
        self._entries_max = entries_max
        self._waiting: list[_Waiting[Request, Reply]] = []
        self._wake = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Loop time until which the master gets lone calls (it lacks the batch call).
        self._lone_until = 0.0
        self.batches_sent = 0
        self.entries_sent = 0
        self.lone_sent = 0

    def start(self, group: asyncio.TaskGroup) -> None:
        self._group = group
        self._spawn(self._send_batches())

    def close(self) -> None:
        """End the loop and the calls in flight; every caller waiting is cancelled."""
        self._group = None
        for task in list(self._tasks):
            task.cancel()
        for waiting in self._waiting:
            waiting.answer.cancel()
        self._waiting.clear()

    async def call(self, request: Request, timeout_s: float) -> Reply:
        """The answer to `request`, sent with the next batch; raises the AioRpcError its
        lone call would have (DEADLINE_EXCEEDED after `timeout_s`)."""
        if self._group is None:
            raise rpc_error(grpc.StatusCode.CANCELLED, "the client is closed")
        loop = asyncio.get_running_loop()
        waiting = _Waiting[Request, Reply](request, loop.create_future(), loop.time() + timeout_s)
        self._waiting.append(waiting)
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(waiting.answer)
        except TimeoutError:
            raise rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to the {self._what} in time"
            ) from None
        finally:
            waiting.answer.cancel()  # given up on: a batch not yet sent leaves it out

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        assert self._group is not None
        task = self._group.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_batches(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._window_ms / 1000)  # let the window fill
            self._wake.clear()
            waiting = [w for w in self._waiting if not w.answer.done()]
            self._waiting.clear()
            for start in range(0, len(waiting), self._entries_max):
                self._spawn(self._send(waiting[start : start + self._entries_max]))

    async def _send(self, batch: list[_Waiting[Request, Reply]]) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() < self._lone_until:
            await asyncio.gather(*(self._send_alone(w) for w in batch))
            return
        timeout_s = max(0.0, max(w.deadline for w in batch) - loop.time())
        self.batches_sent += 1
        self.entries_sent += len(batch)
        try:
            answers = await self._batch_call([w.request for w in batch], timeout_s)
        except asyncio.CancelledError:
            for waiting in batch:
                waiting.answer.cancel()
            raise
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the master lacks the batch of %ss: lone calls", self._what)
                self._lone_until = loop.time() + LONE_CALLS_MS / 1000
                await asyncio.gather(*(self._send_alone(w) for w in batch))
                return
            answers = [error] * len(batch)
        if len(answers) != len(batch):
            log.warning("a batch of %d %ss answered %d", len(batch), self._what, len(answers))
            missing = rpc_error(grpc.StatusCode.INTERNAL, f"the batch answered no {self._what}")
            answers = [*answers[: len(batch)], *[missing] * (len(batch) - len(answers))]
        for waiting, answer in zip(batch, answers, strict=True):
            _settle(waiting.answer, answer)

    async def _send_alone(self, waiting: _Waiting[Request, Reply]) -> None:
        if waiting.answer.done():
            return
        timeout_s = max(0.0, waiting.deadline - asyncio.get_running_loop().time())
        self.lone_sent += 1
        try:
            answer: Reply | grpc.aio.AioRpcError = await self._lone_call(waiting.request, timeout_s)
        except grpc.aio.AioRpcError as error:
            answer = error
        _settle(waiting.answer, answer)


def _settle(future: asyncio.Future[Reply], answer: Reply | grpc.aio.AioRpcError) -> None:
    if future.done():
        return  # its caller gave up on it
    if isinstance(answer, grpc.aio.AioRpcError):
        future.set_exception(answer)
    else:
        future.set_result(answer)
