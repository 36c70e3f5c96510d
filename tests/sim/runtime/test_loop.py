"""The deterministic loop: a seed replays, seeds differ, virtual time costs nothing, and
asyncio's timeouts and cancellation behave as on the default loop."""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
import uuid

import pytest

from streamengine.protocol import clock
from tests.sim.runtime.loop import (
    MONOTONIC_START_S,
    WALL_START_S,
    SimLoop,
    SimulationStalled,
    run,
)

WORKERS = 5


async def _interleaving() -> list[str]:
    """Workers racing through zero sleeps, ties of timers and a shared queue: the trace
    records who ran when, so any change of order shows."""
    loop = asyncio.get_running_loop()
    trace: list[str] = []
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def worker(number: int) -> None:
        for step in range(3):
            await asyncio.sleep(0)
            trace.append(f"{number}.{step}")
            await asyncio.sleep(0.01 * (step % 2))  # ties: several wake at one instant
            queue.put_nowait(number)

    async def consumer() -> None:
        for _ in range(3 * WORKERS):
            trace.append(f"got {await queue.get()} at {loop.time() - MONOTONIC_START_S:.2f}")

    async with asyncio.TaskGroup() as group:
        for number in range(WORKERS):
            group.create_task(worker(number))
        group.create_task(consumer())
    # Done together: their order in a set is their order of creation, not of address.
    tasks = [asyncio.ensure_future(asyncio.sleep(0.5, result=n)) for n in range(4)]
    done, _ = await asyncio.wait(tasks)
    trace.append(" ".join(str(task.result()) for task in done))
    trace.append(f"random {random.random():.6f} {uuid.uuid4()}")
    return trace


def test_a_seed_replays_its_trace() -> None:
    assert run(_interleaving(), 7) == run(_interleaving(), 7)


def test_seeds_choose_different_orders_of_what_is_ready() -> None:
    traces = {tuple(run(_interleaving(), seed)) for seed in range(4)}
    assert len(traces) == 4


def test_an_hour_of_sleeps_takes_no_real_time() -> None:
    async def hour() -> tuple[float, float, int, int]:
        started = (time.monotonic(), clock.monotonic_ms(), clock.wall_ms())
        for _ in range(3600):
            await asyncio.sleep(1)
        return (
            time.monotonic() - started[0],
            asyncio.get_running_loop().time() - MONOTONIC_START_S,
            clock.monotonic_ms() - started[1],
            clock.wall_ms() - started[2],
        )

    def process_clocks() -> tuple[object, ...]:
        return (time.monotonic, time.monotonic_ns, time.time, time.time_ns, uuid.uuid4)

    before = process_clocks()
    real_started = time.perf_counter()
    elapsed_s, loop_elapsed_s, monotonic_elapsed_ms, wall_elapsed_ms = run(hour(), 1)
    assert time.perf_counter() - real_started < 2.0
    assert elapsed_s == pytest.approx(3600)
    assert loop_elapsed_s == pytest.approx(3600)
    assert monotonic_elapsed_ms == pytest.approx(3_600_000, abs=1)
    assert wall_elapsed_ms == pytest.approx(3_600_000, abs=1)
    # The process's clocks are its own again once the loop stops.
    assert process_clocks() == before


def test_the_wall_clock_starts_at_a_fixed_date() -> None:
    async def now() -> int:
        return clock.wall_ms()

    assert run(now(), 3) == run(now(), 4) == int(WALL_START_S * 1000)


def test_timeouts_fire_at_their_virtual_time() -> None:
    async def timeouts() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        seen: list[tuple[str, float]] = []
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), timeout=2.5)
        seen.append(("wait_for", round(loop.time() - start, 6)))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1):
                await asyncio.Event().wait()
        seen.append(("timeout", round(loop.time() - start, 6)))
        assert await asyncio.wait_for(asyncio.sleep(1, result="in time"), timeout=2) == "in time"
        seen.append(("in time", round(loop.time() - start, 6)))
        fired = loop.create_future()
        loop.call_later(0.25, fired.set_result, loop.time() + 0.25)
        assert await fired == loop.time()
        seen.append(("call_later", round(loop.time() - start, 6)))
        return seen

    assert run(timeouts(), 1) == [
        ("wait_for", 2.5),
        ("timeout", 3.5),
        ("in time", 4.5),
        ("call_later", 4.75),
    ]


def test_cancellation_reaches_the_task_and_its_task_group() -> None:
    async def cancellations() -> list[str]:
        seen: list[str] = []

        async def sleeper(name: str) -> None:
            try:
                await asyncio.sleep(100)
            except asyncio.CancelledError:
                seen.append(f"{name} cancelled")
                raise

        async def failing() -> None:
            await asyncio.sleep(1)
            raise ValueError("boom")

        task = asyncio.ensure_future(sleeper("alone"))
        await asyncio.sleep(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ExceptionGroup) as failed:
            async with asyncio.TaskGroup() as group:
                group.create_task(sleeper("sibling"))
                group.create_task(failing())
        seen.append(repr(failed.value.exceptions))
        # A future cancelled while awaited raises in its awaiter.
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(1, future.cancel)
        with pytest.raises(asyncio.CancelledError):
            await future
        seen.append("future cancelled")
        return seen

    assert run(cancellations(), 2) == [
        "alone cancelled",
        "sibling cancelled",
        "(ValueError('boom'),)",
        "future cancelled",
    ]


def test_executor_work_runs_inline_in_order_with_the_rest() -> None:
    async def offloaded() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        result = await asyncio.to_thread(sum, range(10))
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(None, lambda: 1 / 0)
        return result, loop.time() - start

    assert run(offloaded(), 1) == (45, 0.0)


def test_a_deadlock_is_reported_not_waited_out() -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimulationStalled, match="seed 5: nothing ready and no timer"):
        run(stuck(), 5)


NODE: contextvars.ContextVar[str] = contextvars.ContextVar("test_node")


def test_a_blocked_node_waits_while_the_others_run_and_an_executor_blocks_alone() -> None:
    """A node's loop blocked in a call runs nothing until the call is over; another node
    ticks on meanwhile; a function run in an executor that blocks hands its result over
    after its block, and its caller's loop is free meanwhile."""

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, SimLoop)
        loop.node_var = NODE
        trace: list[str] = []

        def at() -> str:
            return f"{loop.time() - MONOTONIC_START_S:.2f}"

        async def ticker(name: str) -> None:
            for _ in range(4):
                trace.append(f"{at()} {name} ticks")
                await asyncio.sleep(0.1)

        async def blocker() -> None:
            await asyncio.sleep(0.05)
            loop.block(0.2)  # a blocking call of 200 ms at 0.05 s
            trace.append(f"{at()} a blocked")
            await asyncio.sleep(0)
            trace.append(f"{at()} a runs again")

        def slow_read() -> str:
            loop.block(0.3)
            return "read"

        async def reader() -> None:
            result = await asyncio.to_thread(slow_read)
            trace.append(f"{at()} c got {result}")

        def as_node(name: str) -> contextvars.Context:
            context = contextvars.copy_context()
            context.run(NODE.set, name)
            return context

        async with asyncio.TaskGroup() as group:
            group.create_task(ticker("a"), context=as_node("a"))
            group.create_task(blocker(), context=as_node("a"))
            group.create_task(ticker("b"), context=as_node("b"))
            group.create_task(reader(), context=as_node("c"))
            group.create_task(ticker("c"), context=as_node("c"))
        return sorted(trace, key=lambda line: float(line.split()[0]))

    trace = run(main(), 1)
    assert "0.05 a blocked" in trace and "0.25 a runs again" in trace
    assert [line for line in trace if line.endswith("a ticks")] == [
        "0.00 a ticks",
        "0.25 a ticks",  # due at 0.10, held until the call is over
        "0.35 a ticks",
        "0.45 a ticks",
    ]
    assert [line for line in trace if line.endswith("b ticks")] == [
        "0.00 b ticks",
        "0.10 b ticks",
        "0.20 b ticks",
        "0.30 b ticks",
    ]
    assert "0.30 c got read" in trace
    assert "0.10 c ticks" in trace and "0.20 c ticks" in trace
