"""A simulated process: `serve()` runs as its node's task, dies and starts again.

What outlives an incarnation (a store's KV, etcd's data) is the subclass's; the task is
one incarnation. Killing it cancels the task: its calls break, its `finally` blocks run
(they close what a dead process's peers would see closed), nothing else is flushed.
"""

from __future__ import annotations

import asyncio

from tests.sim.runtime.transport import start_node


class SimProcess:
    """One node's process; subclasses set `name` and define `serve()`."""

    name: str

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        # The incarnation a stop or crash is ending, until it has ended.
        self._ending: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, group: asyncio.TaskGroup) -> None:
        """Run `serve()` as this node, in `group`; its connections die with the task."""
        assert not self.running, f"{self.name} runs already"
        self._group = group
        self.task = start_node(group, self.name, self.serve())

    async def crash(self) -> None:
        """The process dies."""
        task = self.task
        assert task is not None, f"{self.name} was never started"
        self._ending = task
        task.cancel()
        try:
            await asyncio.wait([task])
        finally:
            if self._ending is task:
                self._ending = None
        if self.task is task:  # not a new incarnation started meanwhile
            self.task = None

    async def ended(self) -> None:
        """Until a stop or crash under way has ended (at once when none is): a process
        stopping runs its `finally` blocks first, and is `running` meanwhile. Known from
        `crash` itself, never from `Task.cancelling()`: a timeout of the process's own
        cancels its task too, for a moment, and a liveness phase starting in that moment
        waited for the master's task to end for good (runtime seed 1127)."""
        ending = self._ending
        if ending is not None:
            await asyncio.wait([ending])

    def restart(self) -> None:
        """A new incarnation, in the group of the first."""
        assert self._group is not None, "start it first"
        self.start(self._group)
