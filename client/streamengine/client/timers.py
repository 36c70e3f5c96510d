"""One timer for every writer of a client, where each writer held a task of its own
waiting for its core's next deadline (issue #38: at 1,000 writers appending, those
tasks and their timeouts were a tenth of the client's time, and each woke for a
deadline its writer had since moved, to step a `Tick` that did nothing).

After every step a writer tells the timers when its core next wants the time
(`Leader.deadline_ms`, None for never). The timers keep each writer's latest deadline
and a heap of them, with one loop timer armed for the earliest. When it fires, every
writer whose deadline has come is told (`on_time`, which steps a `Tick`), once, in
deadline order; a heap entry whose writer has since asked for another time is dropped
as it comes up, and the heap is rebuilt from the deadlines when such entries outnumber
the live ones, so it stays within a few entries a writer.

A writer is told on the loop, never inside one of its steps (the loop calls the timer,
and no step awaits). A firing tells the writers whose deadline had passed when the
timer was armed, or the one it was armed for; a deadline that passed since (while
the loop stepped writers on answers) waits for the next turn of the loop, so the tasks
those steps woke run first: the appends an ack wakes go out before the same writer's
`Tick`, and its acked index rides on them rather than going alone
(`client.core.replicator`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Protocol

from streamengine.protocol.clock import monotonic_ms

# Heap entries per live deadline (each writer's latest), or at least this many, past
# which the heap is rebuilt from the live ones: a writer that keeps moving its deadline
# later leaves a stale entry each time, until its old time comes.
STALE_ENTRIES_PER_LIVE_MAX = 4
STALE_ENTRIES_MIN = 64


class Timed(Protocol):
    """What the timers need of a writer."""

    def on_time(self) -> None:
        """Its deadline came: step the time into its core."""


class WriterTimers:
    """The client's one timer for all its writers; see the module docstring."""

    def __init__(self) -> None:
        self._deadlines: dict[Timed, int] = {}
        self._heap: list[tuple[int, int, Timed]] = []
        self._order = itertools.count()  # ties in deadline go in the order asked
        self._armed: asyncio.TimerHandle | None = None
        self._armed_ms: int | None = None
        # What the armed timer tells: deadlines up to this (module docstring).
        self._due_through_ms = 0
        self._firing = False  # telling writers the time: the timer is armed after
        self._closed = False

    def __len__(self) -> int:
        """Writers waiting for a deadline."""
        return len(self._deadlines)

    def schedule(self, owner: Timed, deadline_ms: int | None) -> None:
        """`owner` wants the time at `deadline_ms` (None: it needs no time), replacing
        what it asked before."""
        if deadline_ms is None:
            self._deadlines.pop(owner, None)
            return
        if self._closed or self._deadlines.get(owner) == deadline_ms:
            return
        self._deadlines[owner] = deadline_ms
        heapq.heappush(self._heap, (deadline_ms, next(self._order), owner))
        if len(self._heap) > max(STALE_ENTRIES_MIN, STALE_ENTRIES_PER_LIVE_MAX * len(self)):
            self._rebuild()
        if not self._firing:
            self._rearm()

    def close(self) -> None:
        """The client closes: no writer is told the time again."""
        self._closed = True
        self._deadlines.clear()
        self._heap.clear()
        self._disarm()

    # ---- internals ----

    def _rebuild(self) -> None:
        self._heap = [
            (deadline_ms, next(self._order), owner)
            for owner, deadline_ms in self._deadlines.items()
        ]
        heapq.heapify(self._heap)

    def _rearm(self) -> None:
        """Arm the timer for the earliest live deadline, unless it is armed sooner."""
        heap = self._heap
        while heap and self._deadlines.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)  # that writer asked for another time since
        if not heap or self._closed:
            return
        deadline_ms = heap[0][0]
        if self._armed_ms is not None and self._armed_ms <= deadline_ms:
            return
        if self._armed is not None:
            self._armed.cancel()
        delay_s = max(0, deadline_ms - monotonic_ms()) / 1000
        self._armed = asyncio.get_running_loop().call_later(delay_s, self._fire)
        self._armed_ms = deadline_ms
        self._due_through_ms = max(deadline_ms, monotonic_ms())

    def _disarm(self) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed = None
        self._armed_ms = None

    def _fire(self) -> None:
        self._armed = None
        self._armed_ms = None
        through_ms = min(monotonic_ms(), self._due_through_ms)
        due = []
        heap = self._heap
        while heap and heap[0][0] <= through_ms:
            deadline_ms, _, owner = heapq.heappop(heap)
            if self._deadlines.get(owner) == deadline_ms:
                del self._deadlines[owner]
                due.append(owner)
        self._firing = True
        try:
            for owner in due:
                owner.on_time()  # steps, and asks for its next time
        finally:
            self._firing = False
            self._rearm()
