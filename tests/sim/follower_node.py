"""A simulated subscriber: the real `Cursor`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamengine.client.core.cursor import (
    Cursor,
    DataLoss,
    ReadFrom,
    SegmentView,
    Wait,
)
from streamengine.master.model import SegmentRecord, SegmentState
from streamengine.segment_store.store import (
    SegmentKey,
    SegmentNotFound,
)
from tests.sim import messages as m
from tests.sim.checkers import Violation

if TYPE_CHECKING:
    from tests.sim.world import World

from tests.sim.nodes import (
    FOLLOWER_POLL_MS,
    FOLLOWER_READ_TIMEOUT_MS,
    MASTER,
    SEGMENT_LIST_REFRESH_MS,
    TAIL_ENTRIES_MAX,
    Node,
)

# ---- followers ----


class FollowerNode(Node):
    """A subscriber from the start of the stream: the real `Cursor` decides what to read
    next; reads go to stores, which serve acked entries only."""

    def __init__(self, name: str, world: World) -> None:
        super().__init__(name, world)
        self.cursor = Cursor(0)
        self.resume_at = 0
        self.waking: int | None = None
        self.tailing: tuple[int, str] | None = None
        self.segments: dict[int, SegmentKey] = {}
        self.reading = False
        self.refresh()

    def restart(self) -> None:
        super().restart()
        # A restarted subscriber resumes after the last sequence it yielded (its token).
        self.cursor = Cursor(self.resume_at)
        self.tailing = None
        self.reading = False
        self.waking = None
        self.refresh()

    def refresh(self) -> None:
        self.list_segments()
        self.timer(SEGMENT_LIST_REFRESH_MS, "refresh segments", self._periodic)

    def list_segments(self) -> None:
        def listed(result: object) -> None:
            if isinstance(result, tuple):
                views = []
                for s in result:
                    assert isinstance(s, SegmentRecord)
                    self.segments[s.epoch] = SegmentKey(s.stream_id, s.epoch)
                    sealed = s.state == SegmentState.SEALED
                    views.append(SegmentView(s.epoch, s.copy_set, sealed, s.final_index))
                self.cursor.on_segments(views)
            self.pump()

        self.call(
            MASTER,
            m.ListSegments(self.world.config.stream),
            listed,
            True,
            FOLLOWER_READ_TIMEOUT_MS,
            self.pump,
        )

    def _periodic(self) -> None:
        self.refresh()

    def pump(self) -> None:
        if self.reading:
            return
        now = self.world.now
        decision = self.cursor.next(now)
        if isinstance(decision, ReadFrom):
            self._read(decision)
        elif isinstance(decision, DataLoss):
            # Every store syncs every write it answers: nothing is ever lost here, so a
            # reader that gives up on a range gave up on readable data.
            raise Violation(1, f"{self.name}: spurious data loss {decision}")
        elif isinstance(decision, Wait) and decision.until_ms > now:
            self._wake_at(decision.until_ms)
        elif isinstance(decision, Wait):
            self.list_segments()

    def _wake_at(self, at_ms: int) -> None:
        if self.waking is not None and self.waking <= at_ms:
            return  # an earlier wake-up is set; it asks the cursor again
        self.waking = at_ms

        def wake() -> None:
            if self.waking == at_ms:
                self.waking = None
                self.pump()

        self.timer(at_ms - self.world.now, "wake up", wake)

    def _read(self, decision: ReadFrom) -> None:
        segment = self.segments[decision.epoch]
        self.reading = True

        def answered(result: object) -> None:
            self.reading = False
            now = self.world.now
            if isinstance(result, SegmentNotFound):
                self.tailing = None
                self.cursor.on_position(decision.epoch, decision.replica, 0, now)
                self.timer(FOLLOWER_POLL_MS, "retry", self.pump)
                return
            if not isinstance(result, m.TailReply):
                self.tailing = None
                self.cursor.on_replica_failed(decision.epoch, decision.replica, now)
                self.timer(FOLLOWER_POLL_MS, "retry", self.pump)
                return
            if self.tailing != (decision.epoch, decision.replica):
                # A subscription reports its position once, when it starts (as the
                # store's Subscribe does); polls stand in for its pushes.
                self.tailing = (decision.epoch, decision.replica)
                self.cursor.on_position(decision.epoch, decision.replica, result.acked_index, now)
            for event in self.cursor.on_entries(decision.epoch, result.entries, now):
                self.world.checker.follower_event(self.name, event.sequence, event.payload)
                self.resume_at = event.sequence + 1
            delay = 1 if result.entries else FOLLOWER_POLL_MS
            self.timer(delay, "read on", self.pump)

        def timed_out() -> None:
            self.reading = False
            self.tailing = None
            self.cursor.on_replica_failed(decision.epoch, decision.replica, self.world.now)
            self.pump()

        request = m.Tail(segment, decision.from_index, TAIL_ENTRIES_MAX)
        self.call(decision.replica, request, answered, True, FOLLOWER_READ_TIMEOUT_MS, timed_out)
