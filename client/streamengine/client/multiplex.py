"""`subscribe_many`: one reader following many streams, with few tasks and one call per
store. The shell of `client.core.multiplex`.

Each stream keeps its `Follower` (its segment lists, start, trims, reports) and its
`Cursor` (every per-stream decision); nothing per stream runs on its own. Tasks:

- the caller's own, in the generator (`_Multiplexer.events`): it takes what arrived,
  feeds the cursors, looks at the cursors due (`WakeSchedule`) and hands out events,
  those released in a turn before the turn's error (a stream's loss, trim or refusal):
  their cursors moved past them (runtime seed 450 dropped a segment's last two);
- one per store (`_StoreCall`): a multiplexed `Subscribe` carrying the tail of every
  segment read on that store, on the client's connection to its data port, whose
  replies it queues for the generator (and a sender of its starts, stops and
  keepalives);
- `LIST_CALLS_MAX` list workers (segment lists, the first of each stream, reports to the
  master) and one discovery loop (the master's stream list, `DISCOVERY_MS`).

Flow control: the generator takes replies only as fast as its caller takes events; the
queue of replies is bounded (`INBOX_ITEMS_MAX` replies, each at most a store's reply:
`DATA_REPLY_BYTES_MAX` and one event), so the store calls stop reading, stop granting
the store credit (the data plane's window of one largest frame per request), and the
store holds its own bounded buffer (`subscribe_buffer_batches`) and drops a call that
stays full for `subscribe_stall_ms`; every tail it carried then starts again, on the
same replica, from its cursor's position. Nothing grows with how slow the caller is.

Why one long module: the generator, the store calls and the list workers all work on
the multiplexer's state (the followed streams, the inbox, the wake schedule); apart,
each would reach into the others'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from streamengine.client.channels import ChannelPool
from streamengine.client.core.multiplex import (
    DISCOVERY_MS,
    LIST_BACKSTOP_MS,
    LIST_CALLS_MAX,
    STALLED_RELIST_MS,
    Directory,
    Selection,
    StreamSummary,
    WakeSchedule,
)
from streamengine.client.core.replicas import FollowerTiming
from streamengine.client.core.subscription import (
    SUBSCRIBE_BATCH_ENTRIES,
    Cursor,
    DataLoss,
    Finished,
    ReadFrom,
    StreamEvent,
    Unreachable,
    Wait,
)
from streamengine.client.errors import (
    DataLossError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StreamDeleted,
    StreamEngineError,
    Unavailable,
    from_rpc_error,
)
from streamengine.client.packed import released_events
from streamengine.client.retrying import retry_unary
from streamengine.client.subscription import Follower, Start
from streamengine.protocol import framing
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.framed import CallError, ClientCall
from streamengine.protocol.framing import StatusCode
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2

log = logging.getLogger(__name__)

# The cursors' waits when the master's stream list tells when segments change: a
# cursor's idle re-list becomes the backstop (`core.multiplex.LIST_BACKSTOP_MS`), its
# timed refresh is put off by every stream list that finds its summary unchanged, and
# an idle stream's reader moves to another replica after 30 s without entries rather
# than 5 s (10,000 idle streams would otherwise restart 2,000 tails a second).
MULTIPLEXED_TIMING = FollowerTiming(
    idle_refresh_ms=LIST_BACKSTOP_MS,
    segment_refresh_ms=10_000,
    open_replica_stall_ms=30_000,
)
# Replies, lists and stream lists waiting for the generator: the bound that makes a
# slow caller hold back the stores. A reply holds at most a store's reply
# (`DATA_REPLY_BYTES_MAX`, 1 MiB, and the event that filled it), so this holds at
# most 32 MiB; the generator drains it at once while its caller keeps up.
INBOX_ITEMS_MAX = 16
# Cursors looked at per turn, between hand-outs of events.
STEPS_PER_TURN = 1024


@dataclass
class _Followed:
    follower: Follower
    cursor: Cursor | None = None  # None until its first list
    read: ReadFrom | None = None  # the read its tail carries
    call: _StoreCall | None = None
    tail: int = 0
    listing: bool = False


@dataclass(frozen=True)
class _Reply:
    call: _StoreCall
    reply: segment_store_pb2.SubscribeReply


@dataclass(frozen=True)
class _CallEnded:
    call: _StoreCall
    error: CallError | None
    client_closed: bool = False


@dataclass(frozen=True)
class _Listed:
    stream: str
    # Whose list it is: a stream left and followed again since has another follower,
    # which this answer must not touch.
    follower: Follower
    cursor: Cursor | None
    error: StreamEngineError | None = None


@dataclass(frozen=True)
class _Streams:
    summaries: list[StreamSummary]
    now_ms: int


_Item = _Reply | _CallEnded | _Listed | _Streams


class _StoreCall:
    """One multiplexed `Subscribe` call to the store at `address` (its gRPC address, as
    cursors name replicas), on its data port at `data_address`."""

    def __init__(
        self,
        address: str,
        data_address: str,
        channels: ChannelPool,
        inbox: asyncio.Queue[_Item],
    ) -> None:
        self.address = address
        self._data_address = data_address
        self._channels = channels
        self._inbox = inbox
        self._requests: asyncio.Queue[segment_store_pb2.SubscribeRequest] = asyncio.Queue()
        self.tails: dict[int, str] = {}
        self._next_tail = 1
        self.heard_ms = monotonic_ms()
        self.ended = False

    def start(
        self, stream: str, segment: entry_pb2.SegmentId, from_index: int, keepalive_ms: int
    ) -> int:
        tail = self._next_tail
        self._next_tail += 1
        self.tails[tail] = stream
        start = segment_store_pb2.SubscribeStart(
            segment=segment,
            from_index=from_index,
            max_batch_entries=SUBSCRIBE_BATCH_ENTRIES,
            keepalive_interval_ms=keepalive_ms,
            tail=tail,
        )
        self._requests.put_nowait(segment_store_pb2.SubscribeRequest(start=start))
        return tail

    def stop(self, tail: int) -> None:
        if self.tails.pop(tail, None) is not None and not self.ended:
            stop = segment_store_pb2.SubscribeStop(tail=tail)
            self._requests.put_nowait(segment_store_pb2.SubscribeRequest(stop=stop))

    async def run(self, keepalive_ms: int) -> None:
        """Read the call's replies into the inbox until it ends; never raises: what
        ends it reaches the generator as `_CallEnded`."""
        call: ClientCall | None = None
        sender: asyncio.Task[None] | None = None
        ended: _CallEnded
        try:
            call = await self._channels.data_call(self._data_address, framing.SUBSCRIBE)
            sender = asyncio.create_task(self._send(call, keepalive_ms))
            while (reply := await call.receive()) is not None:
                assert isinstance(reply, segment_store_pb2.SubscribeReply)
                await self._inbox.put(_Reply(self, reply))
            ended = _CallEnded(self, None)
        except CallError as error:
            # The data plane ends the calls of a client that closes with CANCELLED.
            ended = _CallEnded(self, error, client_closed=self._channels.closed)
        except StreamEngineError:
            ended = _CallEnded(self, None, client_closed=True)
        finally:
            if sender is not None:
                sender.cancel()
            if call is not None:
                call.cancel()
        self.ended = True
        await self._inbox.put(ended)

    async def _send(self, call: ClientCall, keepalive_ms: int) -> None:
        """The starts and stops queued, and a keepalive whenever an interval passes
        without one; ends quietly with the call (its receiver hears why)."""
        # One get stays pending across keepalives: cancelling it could drop a request.
        pending: asyncio.Future[segment_store_pb2.SubscribeRequest] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(self._requests.get())
                done, _ = await asyncio.wait({pending}, timeout=keepalive_ms / 1000)
                if done:
                    request, pending = pending.result(), None
                else:
                    keepalive = segment_store_pb2.Keepalive(sent_at_ms=wall_ms())
                    request = segment_store_pb2.SubscribeRequest(keepalive=keepalive)
                await call.send(request)
        except CallError:
            return
        finally:
            if pending is not None:
                pending.cancel()


@dataclass
class _Multiplexer:
    master: master_pb2_grpc.MasterAsyncStub
    channels: ChannelPool
    selection: Selection
    start: Start
    positions: Mapping[str, int]
    timing: FollowerTiming = MULTIPLEXED_TIMING
    directory: Directory = field(init=False)
    followed: dict[str, _Followed] = field(default_factory=dict)
    calls: dict[str, _StoreCall] = field(default_factory=dict)
    schedule: WakeSchedule = field(default_factory=WakeSchedule)
    inbox: asyncio.Queue[_Item] = field(default_factory=lambda: asyncio.Queue(INBOX_ITEMS_MAX))
    jobs: asyncio.Queue[tuple[str, str]] = field(default_factory=asyncio.Queue)
    # Owned here, ended by `close`; none raises (each reports through the inbox), so
    # none needs a group to carry its failure to the caller.
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.directory = Directory(self.selection)

    # ---- the start ----

    async def begin(self) -> None:
        """Follow the streams selected now, each from its start; start the workers."""
        if self.selection.prefix is None:
            self.directory.follow(self.selection.names)
            for name in self.selection.names:
                self._follow(name, self.positions.get(name, self.start))
        else:
            summaries = await self._list_streams(retry=True)
            changes = self.directory.on_streams(summaries, monotonic_ms())
            for name in changes.added:
                self._follow(name, self.positions.get(name, self.start))
        for _ in range(LIST_CALLS_MAX):
            self._spawn(self._work())
        self._spawn(self._discover())

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self.tasks = [task for task in self.tasks if not task.done()]
        self.tasks.append(asyncio.create_task(coroutine))

    async def close(self) -> None:
        """End every task, and wait for them (their calls are cancelled with them)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []

    def _follow(self, name: str, start: Start) -> None:
        follower = Follower(self.master, self.channels, name, start, None, False, self.timing)
        self.followed[name] = _Followed(follower)
        self._list(name)

    # ---- the generator's loop ----

    async def events(self) -> AsyncIterator[list[StreamEvent]]:
        while True:
            item = await self._next_item()
            events: list[StreamEvent] = []
            delivered: list[Cursor] = []
            failure: StreamEngineError | None = None
            try:
                while item is not None:
                    self._take(item, events, delivered)
                    if len(events) >= SUBSCRIBE_BATCH_ENTRIES or self.inbox.empty():
                        break  # hand these out first (what waits stays in the inbox)
                    item = self.inbox.get_nowait()
                for name in self.schedule.due(monotonic_ms(), STEPS_PER_TURN):
                    self._step(name)
            except StreamEngineError as error:
                failure = error  # raised after the events released before it
            if events:
                yield events
                now_ms = monotonic_ms()
                for cursor in delivered:
                    cursor.on_delivered(now_ms)
            if failure is not None:
                raise failure

    async def _next_item(self) -> _Item | None:
        """What arrived, waiting until the next cursor is due at the latest."""
        if not self.inbox.empty():
            return self.inbox.get_nowait()
        next_ms = self.schedule.next_ms()
        timeout_s = None if next_ms is None else max(next_ms - monotonic_ms(), 0) / 1000
        if timeout_s == 0:
            return None
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: see protocol.waiting
                return await self.inbox.get()
        except TimeoutError:
            return None

    def _take(self, item: _Item, events: list[StreamEvent], delivered: list[Cursor]) -> None:
        if isinstance(item, _Reply):
            self._on_reply(item.call, item.reply, events, delivered)
        elif isinstance(item, _CallEnded):
            self._on_call_ended(item)
        elif isinstance(item, _Listed):
            self._on_listed(item)
        else:
            self._on_streams(item)

    def _on_reply(
        self,
        call: _StoreCall,
        reply: segment_store_pb2.SubscribeReply,
        events: list[StreamEvent],
        delivered: list[Cursor],
    ) -> None:
        now_ms = monotonic_ms()
        call.heard_ms = now_ms
        name = call.tails.get(reply.tail)
        followed = self.followed.get(name) if name is not None else None
        if name is None or followed is None:
            return  # the call's keepalive, or a tail stopped since
        cursor, read = followed.cursor, followed.read
        assert cursor is not None and read is not None
        kind = reply.WhichOneof("message")
        if kind == "batch":
            for part in followed.follower.batch_released(cursor, read, reply.batch):
                events.extend(released_events(part, name))
            delivered.append(cursor)
        elif kind == "position":
            position = reply.position
            cursor.on_position(
                read.epoch, read.replica, position.acked_index, now_ms, position.bridge_index
            )
        elif kind == "ended":
            self._on_tail_ended(followed, reply.ended)
        self.schedule.wake(name, now_ms)

    def _on_tail_ended(self, followed: _Followed, ended: segment_store_pb2.TailEnded) -> None:
        cursor, read = followed.cursor, followed.read
        assert cursor is not None and read is not None
        followed.call, followed.tail = None, 0
        code = grpc.StatusCode.UNKNOWN
        for status in grpc.StatusCode:
            if status.value[0] == ended.code:
                code = status
        name = followed.follower.stream
        log.info("%s: tail on %s ended: %s %s", name, read.replica, code.name, ended.detail)
        if code == grpc.StatusCode.DATA_LOSS:
            cursor.on_replica_damaged(read.epoch, read.replica, f"DATA_LOSS: {ended.detail}")
            self._jobs("report", name)
        elif code == grpc.StatusCode.PERMISSION_DENIED:
            raise PermissionDenied(f"{name}: {ended.detail}")
        elif code == grpc.StatusCode.FAILED_PRECONDITION:
            self._list(name)  # deleted, most likely: its list says so
        else:
            cursor.on_replica_failed(read.epoch, read.replica, monotonic_ms())

    def _on_call_ended(self, ended: _CallEnded) -> None:
        call = ended.call
        if self.calls.get(call.address) is call:
            del self.calls[call.address]
        if ended.client_closed:
            self.channels.check_open()
        code = ended.error.code if ended.error is not None else None
        now_ms = monotonic_ms()
        for name in list(call.tails.values()):
            followed = self.followed.get(name)
            if followed is None or followed.call is not call:
                continue
            cursor, read = followed.cursor, followed.read
            assert cursor is not None and read is not None
            followed.call, followed.tail = None, 0
            # Dropped as too slow (or ended by a restart): resume on the same replica,
            # from the position; else the replica failed every tail it carried.
            if code not in (None, StatusCode.RESOURCE_EXHAUSTED):
                cursor.on_replica_failed(read.epoch, read.replica, now_ms)
            self.schedule.wake(name, now_ms)
        if code is not None:
            log.info("subscription call to %s ended: %s", call.address, code.name)

    def _on_listed(self, listed: _Listed) -> None:
        followed = self.followed.get(listed.stream)
        if followed is None or followed.follower is not listed.follower:
            return
        followed.listing = False
        if listed.error is not None:
            gone = isinstance(listed.error, NotFound | StreamDeleted)
            if gone and (followed.cursor is not None or self.selection.prefix is not None):
                log.info("%s: no longer followed: %s", listed.stream, listed.error)
                self._forget(listed.stream)
                return
            raise listed.error
        if listed.cursor is not None:
            followed.cursor = listed.cursor
        self.schedule.wake(listed.stream, monotonic_ms())

    def _on_streams(self, streams: _Streams) -> None:
        changes = self.directory.on_streams(streams.summaries, streams.now_ms)
        for name in changes.added:
            # Created after the subscription began: all of it is new.
            self._follow(name, self.positions.get(name, "earliest"))
        for name, position in changes.resumed:
            log.info("%s: undeleted, followed again from %d", name, position)
            self._follow(name, position)
        for name in changes.removed:
            log.info("%s: deleted, no longer followed", name)
            self._forget(name)
        for name in changes.changed:
            self.schedule.wake(name, monotonic_ms())

    def _forget(self, name: str) -> None:
        followed = self.followed.pop(name, None)
        cursor = followed.cursor if followed is not None else None
        self.directory.forget(name, cursor.position if cursor is not None else None)
        self.schedule.cancel(name)
        if followed is not None and followed.call is not None:
            followed.call.stop(followed.tail)

    # ---- one stream's turn ----

    def _step(self, name: str) -> None:
        followed = self.followed.get(name)
        if followed is None or followed.cursor is None:
            return
        cursor, now_ms = followed.cursor, monotonic_ms()
        if followed.call is not None and followed.read is not None:
            read = followed.read
            cursor.on_keepalive(read.epoch, read.replica, followed.call.heard_ms)
        decision = cursor.next(now_ms)
        if isinstance(decision, DataLoss):
            raise DataLossError(
                name, decision.epoch, decision.first_index, decision.last_index, decision.accepted
            )
        if isinstance(decision, Unreachable):
            raise Unavailable(decision.describe(name))  # a bounded read's only
        if isinstance(decision, Finished):
            self._forget(name)  # a subscription has no end: not reached
            return
        if isinstance(decision, Wait):
            self._stop_tail(followed)
            self._wait(name, cursor, decision, now_ms)
            return
        running = followed.read if followed.call is not None else None
        if running is None or not Cursor.continues(decision, running):
            self._stop_tail(followed)
            self._start_tail(followed, decision)
        if cursor.refresh_due(now_ms):
            unchanged_ms = self.directory.unchanged_since_ms(name)
            if unchanged_ms is not None and not self.directory.relist_due(name, now_ms):
                cursor.on_list_unchanged(unchanged_ms)
            else:
                self._list(name)
        if cursor.reports_pending:
            self._jobs("report", name)
        self.schedule.wake(name, cursor.wake_at_ms(listing=followed.listing))

    def _wait(self, name: str, cursor: Cursor, wait: Wait, now_ms: int) -> None:
        """Nothing to read now: read the list again if it may be stale, else look again
        at `wait.until_ms` (a replica's backoff), or once the list is due."""
        backstop_ms = STALLED_RELIST_MS if cursor.segment_listed else LIST_BACKSTOP_MS
        if wait.relist or self.directory.relist_due(name, now_ms, backstop_ms):
            self._list(name)  # its answer wakes the stream
            return
        relist_ms = self.directory.relist_at_ms(name, backstop_ms) or now_ms + backstop_ms
        self.schedule.wake(name, wait.until_ms if wait.until_ms > now_ms else relist_ms)

    def _start_tail(self, followed: _Followed, read: ReadFrom) -> None:
        call = self.calls.get(read.replica)
        if call is None:
            data_address = followed.follower.data_address(read.replica)
            call = _StoreCall(read.replica, data_address, self.channels, self.inbox)
            self.calls[read.replica] = call
            self._spawn(call.run(self.timing.keepalive_interval_ms))
        segment = followed.follower.segment_id(read.epoch)
        name, keepalive_ms = followed.follower.stream, self.timing.keepalive_interval_ms
        followed.tail = call.start(name, segment, read.from_index, keepalive_ms)
        followed.call, followed.read = call, read

    @staticmethod
    def _stop_tail(followed: _Followed) -> None:
        if followed.call is not None:
            followed.call.stop(followed.tail)
        followed.call, followed.tail = None, 0

    # ---- the master ----

    def _list(self, name: str) -> None:
        followed = self.followed.get(name)
        if followed is None or followed.listing:
            return
        followed.listing = True
        self.directory.on_list_started(name, monotonic_ms())
        self._jobs("list", name)

    def _jobs(self, kind: str, name: str) -> None:
        self.jobs.put_nowait((kind, name))

    async def _work(self) -> None:
        """Segment lists and reports, one at a time; never raises."""
        while True:
            kind, name = await self.jobs.get()
            followed = self.followed.get(name)
            if followed is None:
                continue
            cursor = followed.cursor
            if kind == "report":
                if cursor is not None:
                    await followed.follower.report(cursor)
                continue
            follower = followed.follower
            try:
                if cursor is None:
                    listed = _Listed(name, follower, await follower.open_cursor())
                else:
                    await follower.refresh(cursor)
                    listed = _Listed(name, follower, None)
            except StreamEngineError as error:
                listed = _Listed(name, follower, None, error)
            await self.inbox.put(listed)

    async def _discover(self) -> None:
        """The master's stream list every `DISCOVERY_MS`; never raises."""
        while True:
            await asyncio.sleep(DISCOVERY_MS / 1000)
            try:
                summaries = await self._list_streams()
            except StreamEngineError as error:
                log.info("the master did not list the streams (%s), retrying", error)
                continue
            await self.inbox.put(_Streams(summaries, monotonic_ms()))

    async def _list_streams(self, retry: bool = False) -> list[StreamSummary]:
        async def ask() -> master_pb2.ListStreamsReply:
            return await self.master.ListStreams(
                master_pb2.ListStreamsRequest(tenant=self.selection.tenant),
                timeout=self.timing.list_timeout_ms / 1000,
            )

        try:
            reply = await (retry_unary(ask) if retry else ask())
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from error
        return [
            StreamSummary(
                s.name,
                s.epoch,
                s.open_segment_epoch,
                s.unsealed_segments,
                s.trimmed_through_epoch,
                deleted=s.deleted_until_ms != 0,
                stream_id=s.stream_id,
            )
            for s in reply.streams
        ]


async def subscribe_many(
    master: master_pb2_grpc.MasterAsyncStub,
    channels: ChannelPool,
    selection: Selection,
    start: Start,
    positions: Mapping[str, int],
) -> AsyncGenerator[StreamEvent, None]:
    """Every acked event of the selected streams, each stream's in sequence order."""
    multiplexer = _Multiplexer(master, channels, selection, start, positions)
    try:
        await multiplexer.begin()
        async for events in multiplexer.events():
            for event in events:
                yield event
    finally:
        await multiplexer.close()


def selection_of(streams: Sequence[str] | None, prefix: str | None) -> Selection:
    """What `subscribe_many` follows, or `InvalidArgument` saying what is wrong."""
    try:
        return Selection(tuple(streams or ()), prefix)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None
