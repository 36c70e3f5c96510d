"""The client's one timer for all its writers (`client.timers`): each writer told once
its latest deadline comes, never before, in deadline order, and the heap bounded however
often deadlines move."""

from __future__ import annotations

import asyncio

from streamengine.client.timers import STALE_ENTRIES_MIN, WriterTimers
from streamengine.protocol.clock import monotonic_ms

# Each test ends within this long, or fails.
TEST_TIMEOUT_S = 5.0


class Told(list[tuple[str, int]]):
    """Who was told the time, and when; `grew` is set at each."""

    def __init__(self) -> None:
        super().__init__()
        self.grew = asyncio.Event()


class Owner:
    def __init__(self, name: str, told: Told, timers: WriterTimers) -> None:
        self.name = name
        self.told = told
        self.timers = timers
        self.deadline_ms: int | None = None
        self.again_ms: int | None = None  # what it asks for once told, if anything

    def ask(self, deadline_ms: int | None) -> None:
        self.deadline_ms = deadline_ms
        self.timers.schedule(self, deadline_ms)

    def on_time(self) -> None:
        now_ms = monotonic_ms()
        assert self.deadline_ms is not None and now_ms >= self.deadline_ms, self.name
        self.told.append((self.name, now_ms))
        self.told.grew.set()
        again, self.again_ms = self.again_ms, None
        self.ask(again)


async def _until(told: Told, count: int) -> None:
    async with asyncio.timeout(TEST_TIMEOUT_S):
        while len(told) < count:
            told.grew.clear()
            await told.grew.wait()


def test_writers_are_told_once_their_deadline_comes_in_deadline_order() -> None:
    async def run() -> list[str]:
        timers = WriterTimers()
        told = Told()
        start = monotonic_ms()
        owners = {name: Owner(name, told, timers) for name in ("late", "first", "middle")}
        owners["late"].ask(start + 30)
        owners["first"].ask(start + 10)
        owners["middle"].ask(start + 20)
        await _until(told, 3)
        await asyncio.sleep(0.03)  # nothing more comes
        assert len(told) == 3 and len(timers) == 0
        return [name for name, _ in told]

    assert asyncio.run(run()) == ["first", "middle", "late"]


def test_a_moved_deadline_is_the_one_kept() -> None:
    async def run() -> list[str]:
        timers = WriterTimers()
        told = Told()
        start = monotonic_ms()
        later, never, sooner = (Owner(n, told, timers) for n in ("later", "never", "sooner"))
        later.ask(start + 5)
        later.ask(start + 40)  # moved later: not told at 5
        never.ask(start + 5)
        never.ask(None)  # needs no time any more
        sooner.ask(start + 60)
        sooner.ask(start + 20)  # moved sooner: the timer is armed again
        await _until(told, 2)
        await asyncio.sleep(0.05)
        assert told[0][1] >= start + 20 and told[1][1] >= start + 40
        return [name for name, _ in told]

    assert asyncio.run(run()) == ["sooner", "later"]


def test_a_writer_asking_again_when_told_is_told_again() -> None:
    async def run() -> int:
        timers = WriterTimers()
        told = Told()
        owner = Owner("w", told, timers)
        owner.again_ms = monotonic_ms() + 10
        owner.ask(monotonic_ms())
        await _until(told, 2)
        return len(timers)

    assert asyncio.run(run()) == 0


def test_the_heap_stays_bounded_while_deadlines_keep_moving_later() -> None:
    async def run() -> int:
        timers = WriterTimers()
        told = Told()
        owners = [Owner(f"w{n}", told, timers) for n in range(3)]
        far = monotonic_ms() + 60_000
        for step in range(10_000):
            owners[step % 3].ask(far + step)
        size = len(timers._heap)
        timers.close()
        return size

    assert asyncio.run(run()) <= STALE_ENTRIES_MIN + 1


def test_nothing_is_told_after_close() -> None:
    async def run() -> list[tuple[str, int]]:
        timers = WriterTimers()
        told = Told()
        owner = Owner("w", told, timers)
        owner.ask(monotonic_ms() + 5)
        timers.close()
        owner.ask(monotonic_ms() + 5)
        await asyncio.sleep(0.03)
        return told

    assert asyncio.run(run()) == []


def test_a_deadline_passed_while_writers_were_stepped_waits_for_the_tasks_they_woke() -> None:
    """The loop is late to the first deadline, past the second: telling `first` wakes
    a task, which runs before `second` is told, as an append an ack wakes goes before
    its writer's tick."""

    async def run() -> list[str]:
        timers = WriterTimers()
        told = Told()
        order: list[str] = []
        first, second = Owner("first", told, timers), Owner("second", told, timers)
        loop = asyncio.get_running_loop()

        def step_first() -> None:
            Owner.on_time(first)
            order.append("first")
            loop.call_soon(order.append, "woken task")

        first.on_time = step_first  # type: ignore[method-assign]

        def step_second() -> None:
            Owner.on_time(second)
            order.append("second")

        second.on_time = step_second  # type: ignore[method-assign]
        start = monotonic_ms()
        first.ask(start + 1)
        second.ask(start + 3)
        while monotonic_ms() < start + 10:
            pass  # the loop busy (stepping writers) past both deadlines
        await _until(told, 2)
        return order

    assert asyncio.run(run()) == ["first", "woken task", "second"]
