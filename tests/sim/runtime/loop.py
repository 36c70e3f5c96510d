"""A deterministic asyncio event loop in virtual time, for the shipped asyncio shells.

Theory of operation. `SimLoop` is asyncio's own `BaseEventLoop` (timers, handles, tasks,
futures, cancellation, `run_until_complete`) with the one step that waits replaced:

- `time()` is a virtual clock. When nothing is ready, the loop jumps it to the next
  timer instead of sleeping, so an hour of `asyncio.sleep` costs no real time. Nothing
  ready and no timer is a deadlock: `SimulationStalled`.
- The callbacks ready at one step run in an order drawn from the loop's
  `random.Random(seed)`: their order is free (independent tasks), and a seed picks one.
  Futures and tasks hash by their creation order on this loop, not their address, so
  sets of them (`asyncio.wait`, `TaskGroup`) iterate the same way in every run.
- `run_in_executor` (and so `asyncio.to_thread`) runs the function in this thread, as a
  ready callback: no threads, no selector, no real I/O.
- A blocking call (`block(seconds)`, which the network's blocking channels call) blocks
  the thread that made it, in virtual time: a node's event loop (its callbacks, which
  `node_var` tells apart, are held until then while the rest of the world runs on), or
  an executor's thread (its result reaches the awaiting task then).
- While the loop runs, the process's clocks follow it: `time.monotonic[_ns]` is the
  virtual clock and `time.time[_ns]` a virtual wall clock (`WALL_START_S` plus the
  virtual time elapsed), which is what `streamengine.protocol.clock` reads too; the
  module `random`, and `uuid.uuid4` through it, draw from a state seeded by the loop.
  All are put back when `run_forever` returns, so the test runner around a simulation
  keeps its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import heapq
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Generator, Iterator
from contextvars import Context
from typing import Any, TypeVar

T = TypeVar("T")

# Where the virtual clocks start: not at zero, so that no "0 means never" slips by, and
# the wall clock at a fixed date (2027-01-15), so that runs replay to the millisecond.
MONOTONIC_START_S = 1000.0
WALL_START_S = 1_800_000_000.0


# How far the clock moves when the loop waits for a timer that is due already.
IDLE_TICK_S = 1e-9


class SimulationStalled(RuntimeError):
    """Nothing is ready, no timer is due and nobody stopped the loop: every task waits
    for something that cannot happen any more (a deadlock in the simulated processes)."""


class _OrderedFuture(asyncio.Future[Any]):
    """A future hashed by its creation order on the loop (see the module doc)."""

    _creation: int

    def __hash__(self) -> int:
        return self._creation


class _OrderedTask(asyncio.Task[Any]):
    """A task hashed by its creation order on the loop (see the module doc)."""

    _creation: int

    def __hash__(self) -> int:
        return self._creation


class SimLoop(asyncio.BaseEventLoop):
    """One simulated world's event loop: see the module doc."""

    # BaseEventLoop's own state, which `_run_once` drives (not in the type stubs).
    _scheduled: list[Any]
    _ready: deque[Any]
    _stopping: bool
    _timer_cancelled_count: int
    _check_closed: Callable[[], None]

    def __init__(self, seed: int, start_s: float = MONOTONIC_START_S) -> None:
        super().__init__()
        self.seed = seed
        self.rng = random.Random(seed)
        self._now_s = start_s
        self._started_s = start_s
        # Virtual time has no resolution limit: a timer is due exactly at its time.
        self._clock_resolution = 0.0
        self._created = 0
        # The module `random`'s state while this loop runs (see `_process_clocks`).
        self._process_random = random.Random(self.rng.getrandbits(64)).getstate()
        self.steps = 0
        self.set_task_factory(self._ordered_task)
        # Which node a callback runs as, read from its context (the network sets it).
        self.node_var: contextvars.ContextVar[str] | None = None
        # Threads blocked in a call (a node's loop, an executor thread), until when; the
        # callbacks held meanwhile, by when they may run.
        self._blocked_until: dict[str, float] = {}
        self._held: list[tuple[float, int, asyncio.Handle]] = []
        self._held_count = 0
        self._executor_threads = 0
        # The executor thread whose function runs now (`run_in_executor`), if any.
        self._executor_thread: str | None = None

    # ---- virtual time ----

    def time(self) -> float:
        return self._now_s

    def wall_time(self) -> float:
        return WALL_START_S + (self._now_s - self._started_s)

    def elapsed_s(self) -> float:
        """Virtual seconds since the loop was made."""
        return self._now_s - self._started_s

    # ---- futures and tasks in a reproducible order ----

    def _next_creation(self) -> int:
        self._created += 1
        return self._created

    def create_future(self) -> asyncio.Future[Any]:
        future = _OrderedFuture(loop=self)
        future._creation = self._next_creation()
        return future

    @staticmethod
    def _ordered_task(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any],
        **kwargs: Any,
    ) -> asyncio.Task[Any]:
        assert isinstance(loop, SimLoop)
        task = _OrderedTask.__new__(_OrderedTask)
        # Hashable before `Task.__init__` schedules its first step.
        task._creation = loop._next_creation()
        _OrderedTask.__init__(task, coro, loop=loop, **kwargs)
        return task

    # ---- no threads ----

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """`func(*args)` in this thread, as a ready callback (the executor is ignored),
        as an executor thread of its own: its result arrives once the blocking calls
        it made are over."""
        self._check_closed()
        future: asyncio.Future[T] = self.create_future()
        self._executor_threads += 1
        thread = f"executor-{self._executor_threads}"

        def run() -> None:
            if future.cancelled():
                return
            self._executor_thread = thread
            try:
                outcome: Callable[[], None] = functools.partial(future.set_result, func(*args))
            except Exception as error:
                outcome = functools.partial(future.set_exception, error)
            finally:
                self._executor_thread = None

            def settle() -> None:
                if not future.done():
                    outcome()

            until = self._blocked_until.pop(thread, self._now_s)
            if until > self._now_s:
                self.call_at(until, settle)
            else:
                settle()

        self.call_soon(run)
        return future

    # ---- blocking calls ----

    def block(self, seconds: float) -> None:
        """The thread running now blocks for `seconds` more (after any block it is in
        already): a node's callbacks wait until then; the rest of the world runs on.
        Outside any node (the test's own task) nothing waits."""
        thread = self._executor_thread
        if thread is None and self.node_var is not None:
            thread = self.node_var.get(None)
        if thread is None:
            return
        start = max(self._now_s, self._blocked_until.get(thread, self._now_s))
        self._blocked_until[thread] = start + seconds

    def _hold_blocked(self, batch: list[asyncio.Handle]) -> list[asyncio.Handle]:
        """`batch` without the callbacks of nodes blocked now, which wait their turn."""
        now = self._now_s
        for thread in [t for t, until in self._blocked_until.items() if until <= now]:
            del self._blocked_until[thread]
        if not self._blocked_until or self.node_var is None:
            return batch
        kept = []
        for handle in batch:
            node = handle._context.get(self.node_var)  # type: ignore[attr-defined]
            until = None if node is None else self._blocked_until.get(node)
            if until is None:
                kept.append(handle)
            else:
                self._held_count += 1
                heapq.heappush(self._held, (until, self._held_count, handle))
        return kept

    def _write_to_self(self) -> None:
        """Nothing to wake: `call_soon_threadsafe` comes from this thread too."""

    # ---- the step ----

    def run_forever(self) -> None:
        with self._process_clocks():
            super().run_forever()

    def _run_once(self) -> None:
        """Run the callbacks ready now, in a seeded order; when none is, first jump the
        clock to the next timer."""
        scheduled = self._scheduled
        while scheduled and scheduled[0]._cancelled:
            self._timer_cancelled_count -= 1
            heapq.heappop(scheduled)._scheduled = False
        held = self._held
        if not self._ready:
            if self._stopping:
                return
            if not scheduled and not held:
                raise SimulationStalled(
                    f"seed {self.seed}: nothing ready and no timer at "
                    f"{self.elapsed_s():.3f} s of virtual time"
                )
            due = [scheduled[0]._when] if scheduled else []
            due += [held[0][0]] if held else []
            next_due = min(due)
            if next_due <= self._now_s:
                # A real clock moves on while nothing runs: a timer due now again (a
                # sleep whose float delay rounded away) would otherwise spin forever.
                self._now_s += IDLE_TICK_S
            self._now_s = max(self._now_s, next_due)
        while scheduled and scheduled[0]._when <= self._now_s:
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            self._ready.append(handle)
        while held and held[0][0] <= self._now_s:
            self._ready.append(heapq.heappop(held)[2])
        batch = list(self._ready)
        self._ready.clear()
        if self._blocked_until:
            batch = self._hold_blocked(batch)
        self.rng.shuffle(batch)
        self.steps += 1
        for handle in batch:
            if not handle._cancelled:
                handle._run()

    @contextlib.contextmanager
    def _process_clocks(self) -> Iterator[None]:
        saved = (time.monotonic, time.monotonic_ns, time.time, time.time_ns, uuid.uuid4)
        outer_random = random.getstate()
        random.setstate(self._process_random)
        time.monotonic = self.time
        time.monotonic_ns = lambda: round(self._now_s * 1e9)
        time.time = self.wall_time
        time.time_ns = lambda: round(self.wall_time() * 1e9)
        uuid.uuid4 = lambda: uuid.UUID(int=random.getrandbits(128), version=4)
        try:
            yield
        finally:
            time.monotonic, time.monotonic_ns, time.time, time.time_ns, uuid.uuid4 = saved
            self._process_random = random.getstate()
            random.setstate(outer_random)


def run(main: Coroutine[Any, Any, T], seed: int, context: Context | None = None) -> T:
    """Run `main` to its end on a fresh `SimLoop(seed)`, as `asyncio.run` does."""
    with asyncio.Runner(loop_factory=lambda: SimLoop(seed)) as runner:
        return runner.run(main, context=context)
