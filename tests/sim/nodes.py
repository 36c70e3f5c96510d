"""The simulated processes: the master, the stores, the writers and the followers.

Each node is the thin shell the real process is, around the real core: `MasterState`
(over an in-memory catalog), `SegmentStoreCore` (over `MemoryKV`), `Leader` with its
`SegmentRecovery` operations, and `Cursor`. Shells carry actions out as messages over
the simulated network and feed answers back as events, as `streamengine.client.writer`,
`streamengine.segment_store.service` and `streamengine.master.service` do over gRPC.

A node has an incarnation: a crash bumps it, and every timer or message meant for an
earlier incarnation is dropped. A paused node (SIGSTOP) keeps what arrives and runs it,
in order, when it resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tests.sim import messages as m
from tests.sim.network import Message

if TYPE_CHECKING:
    from tests.sim.world import World

MASTER = "master"

# The stores' `--heartbeat-ms`, as configured for virtual-time runs (a setting, like the
# lease, not a protocol decision).
STORE_HEARTBEAT_MS = 100


class Node:
    def __init__(self, name: str, world: World) -> None:
        self.name = name
        self.world = world
        self.up = True
        self.paused = False
        self.incarnation = 0
        self.deferred: list[Callable[[], None]] = []
        self._calls: dict[int, tuple[Callable[[object], None], bool]] = {}

    def receive(self, message: Message) -> None:
        body = message.body
        if isinstance(body, m.Answer):
            found = self._calls.get(body.call_id)
            if found is not None:
                on_answer, once = found
                if once:
                    del self._calls[body.call_id]
                on_answer(body.result)
        else:
            self.handle(message)

    def handle(self, message: Message) -> None:
        raise NotImplementedError

    def timer(self, delay_ms: int, label: str, callback: Callable[[], None]) -> None:
        incarnation = self.incarnation
        self.world.sched.after(
            delay_ms,
            f"{self.name}: {label}",
            lambda: self.world.run_on(self, incarnation, callback),
        )

    def call(
        self,
        dst: str,
        request: object,
        on_answer: Callable[[object], None],
        once: bool = True,
        timeout_ms: int = 0,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        """Send a unary request. With `once`, only the first answer counts (a gRPC call
        completes once); without, every copy that arrives is handed on, so operations
        that must be idempotent see duplicates."""
        call_id = self.world.next_id()
        self._calls[call_id] = (on_answer, once)
        self.world.net.send(self.name, dst, m.Call(call_id, request))
        if timeout_ms and on_timeout is not None:

            def expire() -> None:
                if self._calls.pop(call_id, None) is not None:
                    on_timeout()

            self.timer(timeout_ms, f"call #{call_id} times out", expire)

    def answer(self, message: Message, result: object) -> None:
        assert isinstance(message.body, m.Call)
        self.world.net.send(self.name, message.src, m.Answer(message.body.call_id, result))

    def crash(self) -> None:
        self.up = False
        self.paused = False
        self.incarnation += 1
        self.deferred.clear()
        self._calls.clear()
        self.world.net.break_streams_of(self.name)

    def restart(self) -> None:
        self.up = True
