"""A simulated subscriber: the real `Cursor` over the Subscribe push protocol.

The shell does what `streamengine.client.subscription` does: it lists the segments at the master,
subscribes to the replica the cursor names (a stream: the store pushes the position,
batches and keepalives; this end sends keepalives), feeds the cursor what arrives, and
asks it after every message and at `Cursor.wake_at_ms` whether to go on; a broken or
dropped stream is a failure of that replica unless it served something (then it
resumes from the position). Every wait comes from the cursor's `FollowerTiming.fast()`.

A bounded reader (`end`) is `read`: it ends when the cursor says `Finished`, having read
every acked event of its range (the checker holds it to that), or when it says
`Unreachable`, as the shell raises Unavailable. With the flaw `short_read` it takes
giving up for the end of its range, as reads once did (issue #36).

A range sealed accepting loss is `DataLoss` to the cursor: the reader is told (the
checker holds what it is told against what the master declared, and excuses the acked
events it covers), then goes on from the loss's resume sequence with a new cursor, as
a user goes on from `DataLossError.resume_sequence`. With the flaw `loss_ends_at_final`
the loss told ends at the segment's bridge, as `DataLossError` once said.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamengine.client.core.replicas import FollowerTiming
from streamengine.client.core.subscription import (
    SUBSCRIBE_BATCH_ENTRIES,
    Cursor,
    DataLoss,
    Finished,
    ReadFrom,
    SegmentView,
    Unreachable,
    Wait,
)
from streamengine.master.core.model import SegmentRecord, SegmentState
from streamengine.segment_store.core.commands import SegmentKey
from tests.sim import messages as m
from tests.sim import subscribe as sub
from tests.sim.checkers import Violation
from tests.sim.network import Message
from tests.sim.nodes import MASTER, Node

if TYPE_CHECKING:
    from tests.sim.world import World

TIMING = FollowerTiming.fast()


@dataclass(slots=True)
class _Subscription:
    read: ReadFrom
    stream: int
    start_position: int


class FollowerNode(Node):
    """A subscriber from the start of the stream, or a reader of `[0, end)`."""

    def __init__(self, name: str, world: World, end: int | None = None) -> None:
        super().__init__(name, world)
        self.end = end
        self.ended = False  # a bounded read finished or gave up
        self.cursor = Cursor(0, end, TIMING)
        self.resume_at = 0
        self.segments: dict[int, SegmentKey] = {}
        self.subscription: _Subscription | None = None
        self.listing = False
        self.waking: int | None = None
        self.list_segments()

    def restart(self) -> None:
        super().restart()
        # A restarted subscriber resumes after the last sequence it yielded (its token).
        self.cursor = Cursor(self.resume_at, self.end, TIMING)
        self.subscription = None
        self.listing = False
        self.waking = None
        self.list_segments()

    # ---- the master's list ----

    def list_segments(self) -> None:
        if self.listing:
            return
        self.listing = True

        def listed(result: object) -> None:
            self.listing = False
            if isinstance(result, tuple):
                views = []
                for s in result:
                    assert isinstance(s, SegmentRecord)
                    self.segments[s.epoch] = SegmentKey(s.stream_id, s.epoch)
                    sealed = s.state == SegmentState.SEALED
                    views.append(
                        SegmentView(
                            s.epoch,
                            s.copy_set,
                            sealed,
                            s.final_index,
                            s.certificate,
                            s.bad,
                            lost_from_index=s.lost_from_index,
                        )
                    )
                self.cursor.on_segments(views, self.world.now)
            self.pump()

        def timed_out() -> None:
            self.listing = False
            self.cursor.on_list_failed(self.world.now)
            self.pump()

        request = m.ListSegments(self.world.config.stream)
        self.call(MASTER, request, listed, True, TIMING.list_timeout_ms, timed_out)

    # ---- deciding ----

    def pump(self) -> None:
        """Ask the cursor what to do: go on with the subscription, or start another."""
        now = self.world.now
        if self.ended:
            return
        if self.subscription is not None:
            if self.cursor.refresh_due(now):
                self.list_segments()
            if Cursor.continues(self.cursor.next(now), self.subscription.read):
                self._wake_at(self.cursor.wake_at_ms(self.listing))
                return
            self._end_subscription()
        decision = self.cursor.next(now)
        if isinstance(decision, ReadFrom):
            self._subscribe(decision)
        elif isinstance(decision, DataLoss):
            self._data_loss(decision)
        elif isinstance(decision, Finished | Unreachable):
            self._read_ended(decision)
        elif isinstance(decision, Wait) and decision.until_ms > now:
            self._wake_at(decision.until_ms, relist=True)
        elif isinstance(decision, Wait):
            self.list_segments()

    def _data_loss(self, loss: DataLoss) -> None:
        """Told `DataLossError`: go on past the range, as a user does."""
        if not loss.accepted:
            # Every store syncs every write it answers and keeps at least one replica of
            # every sealed segment: a reader that gives up on a range that no operator
            # declared lost gave up on readable data.
            raise Violation(1, f"{self.name}: told a loss no operator declared: {loss}")
        through_end = "loss_ends_at_final" not in self.world.config.flaws
        self.world.checker.loss_told(
            self.name, SegmentKey(self.world.checker.stream_id, loss.epoch), loss, through_end
        )
        self.world.stats["losses told"] += 1
        self.world.note(f"{self.name} told {loss}")
        self.resume_at = loss.resume_sequence
        self.cursor = Cursor(self.resume_at, self.end, TIMING)
        self.list_segments()

    def _read_ended(self, decision: Finished | Unreachable) -> None:
        assert self.end is not None, f"{self.name}: a subscription ended: {decision}"
        self.ended = True
        if isinstance(decision, Unreachable) and "short_read" not in self.world.config.flaws:
            self.world.stats["bounded reads gave up"] += 1
            self.world.note(f"{self.name} gives up: {decision.describe(self.world.config.stream)}")
            return
        self.world.stats["bounded reads finished"] += 1
        self.world.checker.bounded_read_finished(self.name, self.end)

    def _wake_at(self, at_ms: int, relist: bool = False) -> None:
        if self.waking is not None and self.world.now < self.waking <= at_ms:
            return  # an earlier wake-up is set; it asks the cursor again
        self.waking = at_ms

        def wake() -> None:
            if self.waking == at_ms:
                self.waking = None
                self.list_segments() if relist else self.pump()

        self.timer(max(at_ms - self.world.now, 0), "wake up", wake)

    # ---- the subscription ----

    def _subscribe(self, read: ReadFrom) -> None:
        net = self.world.net
        incarnation = self.incarnation
        number = 0

        def broken() -> None:
            self.world.run_on(self, incarnation, lambda: self._ended(number, "broke"))

        number = net.open_stream(self.name, read.replica, broken, lambda: None)
        self.subscription = _Subscription(read, number, self.cursor.position)
        start = sub.SubscribeStart(
            self.segments[read.epoch],
            read.from_index,
            SUBSCRIBE_BATCH_ENTRIES,
            TIMING.keepalive_interval_ms,
        )
        net.stream_send(number, self.name, read.replica, start)
        self._keepalive(number)
        self._wake_at(self.cursor.wake_at_ms(self.listing))

    def _keepalive(self, number: int) -> None:
        subscription = self.subscription
        if subscription is None or subscription.stream != number:
            return
        replica = subscription.read.replica
        self.world.net.stream_send(number, self.name, replica, sub.SubscriberKeepalive())
        self.timer(TIMING.keepalive_interval_ms, "keepalive", lambda: self._keepalive(number))

    def _end_subscription(self) -> None:
        subscription, self.subscription = self.subscription, None
        if subscription is not None:
            self.world.net.break_stream(subscription.stream)  # a cancelled call

    def _ended(self, number: int, how: str) -> None:
        """The stream broke or the store dropped it (a gRPC error, as the shell sees)."""
        subscription = self.subscription
        if subscription is None or subscription.stream != number:
            return
        self.subscription = None
        self.world.net.break_stream(number)
        if self.cursor.position == subscription.start_position:
            read = subscription.read
            self.cursor.on_replica_failed(read.epoch, read.replica, self.world.now)
        self.pump()

    def handle(self, message: Message) -> None:
        subscription = self.subscription
        if subscription is None or message.stream != subscription.stream:
            return  # a stream this follower left
        body = message.body
        read = subscription.read
        now = self.world.now
        if isinstance(body, sub.PushedBatch):
            for event in self.cursor.on_entries(read.epoch, body.entries, now):
                self.world.checker.follower_event(self.name, event.sequence, event.payload)
                self.resume_at = event.sequence + 1
            # Only a replica the world forged may differ from its certificate.
            for report in self.cursor.take_reports():
                segment = self.segments[report.epoch]
                self.world.checker.reader_reported(
                    self.name, report.replica, segment, report.problem
                )
        elif isinstance(body, sub.PushedPosition):
            acked = body.position.acked_index
            self.cursor.on_position(read.epoch, read.replica, acked, now)
        elif isinstance(body, sub.PushedKeepalive):
            self.cursor.on_keepalive(read.epoch, read.replica, now)
        elif isinstance(body, sub.Dropped):
            self._ended(subscription.stream, body.reason)
            return
        self.pump()
