"""The follower's call: Subscribe, a live tail of one segment, or (multiplexed) of many,
served on the store's data port (`data_plane.py`, docs/data-plane.md). The shell of
`core.tail`: a pump asks the core what to do and fills a buffer, a sender drains it to
the wire (as the follower's credit allows: a follower that does not take what it is sent
holds the sender back, the buffer fills, and the core drops it as too slow), a receiver
notes the client's keepalives (and, multiplexed, its starts and stops). Three tasks per
call, however many tails it carries.

A call proves its caller once, when it opens; the pump checks the caller's token
against the store's revocations at each turn (at least every keepalive interval), so a
revocation ends an open tail as it ends a Write stream. What ends a call with a status
is raised as `RequestEnds`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from streamengine.protocol.auth import Principal
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.entry import CorruptEntry
from streamengine.protocol.limits import WRITE_BATCH_ENTRIES_MAX
from streamengine.protocol.logs import segment_fields
from streamengine.protocol.waiting import wait_any
from streamengine.segment_store import metrics
from streamengine.segment_store.core import tail
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import BadRequest, StoreError
from streamengine.segment_store.reads import read_entries
from streamengine.segment_store.refusals import TAIL_DROP_STATUS, Refused, RequestEnds, refusal_of
from streamengine.segment_store.store_context import StoreContext, segment_key
from streamengine.v1 import entry_pb2, segment_store_pb2

# Subscribe: how long the first message may take (its caller was proven and counted
# when the stream opened); the live tail's own limits and decisions are in `core.tail`.
SUBSCRIBE_START_TIMEOUT_S = 10.0

log = logging.getLogger("streamengine.store")

SendReply = Callable[[segment_store_pb2.SubscribeReply], Awaitable[None]]


class TailCalls:
    """Subscribe."""

    def __init__(self, store: StoreContext) -> None:
        self.store = store

    async def subscribe(
        self,
        request_iterator: AsyncIterator[segment_store_pb2.SubscribeRequest],
        send: SendReply,
        caller: Principal,
    ) -> None:
        """Serves one Subscribe call of `caller` until the client ends it; raises
        RequestEnds for what ends it with a status."""
        requests = aiter(request_iterator)
        try:
            async with asyncio.timeout(SUBSCRIBE_START_TIMEOUT_S):  # see protocol.waiting
                first = await anext(requests)
        except (StopAsyncIteration, TimeoutError):
            raise RequestEnds(BadRequest("Subscribe must begin with a start message")) from None
        if first.WhichOneof("message") == "start" and first.start.tail:
            await self._multiplexed(first.start, requests, send, caller)
            return
        try:
            if first.WhichOneof("message") != "start":
                raise BadRequest("Subscribe must begin with a start message")
            segment = segment_key(first.start.segment)
            self.store.check_reader(caller, "Subscribe", segment)
            self.store.authority.check_not_deleted(segment.stream_id)
        except StoreError as error:
            raise RequestEnds(error) from None
        follower = _Tail(self.store, segment, first.start, requests, send, caller)
        metrics.SUBSCRIBERS.inc()
        try:
            refusal = await follower.run()
        finally:
            metrics.SUBSCRIBERS.dec()
        if refusal is not None:
            raise RequestEnds(refusal)

    async def _multiplexed(
        self,
        first: segment_store_pb2.SubscribeStart,
        requests: AsyncIterator[segment_store_pb2.SubscribeRequest],
        send: SendReply,
        caller: Principal,
    ) -> None:
        call = _Tails(self.store, first, requests, send, caller)
        metrics.SUBSCRIBERS.inc()
        try:
            refusal = await call.run()
        finally:
            call.close()
            metrics.SUBSCRIBERS.dec()
        if refusal is not None:
            raise RequestEnds(refusal)


class _Tail:
    """One Subscribe stream: the shell of `core.tail.TailStream`. A pump asks
    the core what to do and fills a buffer, a sender drains it to the wire, a receiver
    notes the client's keepalives. The first of them to end ends the stream."""

    def __init__(
        self,
        store: StoreContext,
        segment: SegmentKey,
        start: segment_store_pb2.SubscribeStart,
        requests: AsyncIterator[segment_store_pb2.SubscribeRequest],
        send: SendReply,
        caller: Principal,
    ) -> None:
        self.store = store
        self.caller = caller
        self.segment = segment
        self.start = start
        settings = tail.TailSettings.asked(
            start.max_batch_entries,
            start.keepalive_interval_ms,
            WRITE_BATCH_ENTRIES_MAX,
            store.config.subscribe_buffer_batches,
            store.config.subscribe_stall_ms,
        )
        self.stream = tail.TailStream(start.from_index, settings, monotonic_ms())
        self.requests = requests
        self.send = send
        # Bounded by the core, which never asks for more than `buffer_messages`.
        self.buffer: asyncio.Queue[segment_store_pb2.SubscribeReply] = asyncio.Queue()
        self.room = asyncio.Event()

    async def run(self) -> Exception | None:
        tasks, done = await _until_one_ends(self._pump(), self._send(), self._receive())
        for task in done:
            if task.cancelled():
                continue
            error = task.exception()
            if isinstance(error, Refused):
                return error
            if isinstance(error, CorruptEntry):
                log.error(
                    "DATA_LOSS serving a subscriber: %s",
                    error,
                    extra=segment_fields(self.start.segment.stream, self.segment.epoch),
                )
                return Refused(grpc.StatusCode.DATA_LOSS, str(error))
            if error is not None and task is tasks[0]:
                log.error("tail of %s failed", self.segment, exc_info=error)
                return Refused(grpc.StatusCode.INTERNAL, f"tail failed: {error!r}")
            if error is not None:
                # The wire broke (the client went away): nothing left to tell it.
                log.debug("subscriber to %s ended: %r", self.segment, error)
                continue
            result: Exception | None = task.result()
            if result is not None:
                return result
        return None

    async def _pump(self) -> Exception | None:
        watch = self.store.watch
        stream = self.stream
        while True:
            changed = watch.event(self.segment)
            try:
                self.store.authority.check_not_revoked(self.caller)
                meta = self.store.core.held_meta(self.segment)
            except StoreError as error:
                return error
            position = tail.Position(meta.acked_index, meta.fence, meta.bridge_index)
            action = stream.step(position, self.buffer.qsize(), monotonic_ms())
            if isinstance(action, tail.ReadBatch):
                await self._read(action)
            elif isinstance(action, tail.SendPosition):
                self.buffer.put_nowait(_position_reply(action.position))
            elif isinstance(action, tail.SendKeepalive):
                keepalive = segment_store_pb2.Keepalive(sent_at_ms=wall_ms())
                self.buffer.put_nowait(segment_store_pb2.SubscribeReply(keepalive=keepalive))
            elif isinstance(action, tail.Drop):
                metrics.SUBSCRIBERS_DROPPED.labels(action.reason).inc()
                code = TAIL_DROP_STATUS[action.reason]
                return Refused(code, action.detail)
            else:
                await self._wait(changed, action.until_ms)

    async def _read(self, read: tail.ReadBatch) -> None:
        entries = await self.store.in_thread(
            functools.partial(
                read_entries,
                self.store.core,
                self.segment,
                read.from_index,
                read.to_index,
                True,
                read.entries_max,
                verify=False,  # followers verify every entry they receive
            )
        )
        if entries:
            metrics.READ_ENTRIES.labels("subscribe").inc(len(entries))
            batch = segment_store_pb2.EntryBatch(entries=entries, token=entries[-1].index)
            self.buffer.put_nowait(segment_store_pb2.SubscribeReply(batch=batch))
        last = entries[-1].index if entries else read.from_index - 1
        self.stream.on_read(read, last, monotonic_ms())

    async def _wait(self, changed: asyncio.Event, until_ms: int) -> None:
        """Until the segment changes, the sender makes room, or `until_ms`."""
        self.room.clear()
        await wait_any((changed, self.room), max(until_ms - monotonic_ms(), 0) / 1000)

    async def _send(self) -> Exception | None:
        while True:
            reply = await self.buffer.get()
            self.room.set()
            await self.send(reply)

    async def _receive(self) -> Exception | None:
        async for _request in self.requests:
            self.stream.on_heard(monotonic_ms())
        return None  # the client closed its side: the stream ends


@dataclass
class _Running:
    """A tail of a multiplexed call."""

    segment: SegmentKey
    start: segment_store_pb2.SubscribeStart
    tail: tail.SegmentTail


class _Tails:
    """A multiplexed Subscribe call: many segments' `core.tail.SegmentTail`s under one
    `core.tail.CallLiveness`. The pump steps the tails marked ready (started, their
    segment changed, or more to read) in turn, so a busy segment cannot starve the
    others; an idle tail costs nothing until the watch marks it."""

    def __init__(
        self,
        store: StoreContext,
        first: segment_store_pb2.SubscribeStart,
        requests: AsyncIterator[segment_store_pb2.SubscribeRequest],
        send: SendReply,
        caller: Principal,
    ) -> None:
        self.store = store
        self.settings = tail.TailSettings.asked(
            first.max_batch_entries,
            first.keepalive_interval_ms,
            WRITE_BATCH_ENTRIES_MAX,
            store.config.subscribe_buffer_batches,
            store.config.subscribe_stall_ms,
        )
        self.liveness = tail.CallLiveness(self.settings, monotonic_ms())
        self.first = first
        self.requests = requests
        self.send = send
        self.caller = caller
        self.running: dict[int, _Running] = {}
        self.listeners: dict[SegmentKey, Callable[[], None]] = {}
        self.tails_of: dict[SegmentKey, list[int]] = {}
        # Tails to step, in turn (a dict keeps the order and drops repeats).
        self.ready: dict[int, None] = {}
        self.wake = asyncio.Event()
        # Bounded by `settings.buffer_messages`: the pump waits for room beyond it, and
        # so do starts (`_wait_for_room`); each start adds one reply at most.
        self.buffer: asyncio.Queue[segment_store_pb2.SubscribeReply] = asyncio.Queue()
        self.room = asyncio.Event()
        # Set at every reply the sender takes (the pump clears `room` for itself).
        self.taken = asyncio.Event()

    async def run(self) -> Exception | None:
        self._start(self.first)
        tasks, done = await _until_one_ends(self._pump(), self._send(), self._receive())
        for task in done:
            if task.cancelled():
                continue
            error = task.exception()
            if isinstance(error, Refused | StoreError):
                return error  # dropped, or its token revoked
            if error is not None and task is tasks[0]:
                log.error("multiplexed tail failed", exc_info=error)
                return Refused(grpc.StatusCode.INTERNAL, f"tail failed: {error!r}")
            if error is not None:
                log.debug("multiplexed subscriber ended: %r", error)
                continue
            result: Exception | None = task.result()
            if result is not None:
                return result
        return None

    def close(self) -> None:
        for segment, listener in self.listeners.items():
            self.store.watch.unlisten(segment, listener)
        self.listeners.clear()
        metrics.TAILS.dec(len(self.running))
        self.running.clear()

    # ---- the client's side ----

    async def _receive(self) -> Exception | None:
        async for request in self.requests:
            self.liveness.on_heard(monotonic_ms())
            kind = request.WhichOneof("message")
            if kind == "start":
                # A start may be answered at once (`TailEnded`): none is taken while the
                # buffer is full, so starts sent without reading cannot grow it.
                await self._wait_for_room()
                self._start(request.start)
            elif kind == "stop":
                self._stop(request.stop.tail)
        return None  # the client closed its side: the call ends

    async def _wait_for_room(self) -> None:
        """Until the buffer is below its bound (a call kept full is dropped as too slow
        by the pump within `stall_ms`, which ends this wait with the call)."""
        while self.buffer.qsize() >= self.settings.buffer_messages:
            self.taken.clear()
            if self.buffer.qsize() >= self.settings.buffer_messages:
                await self.taken.wait()

    def _start(self, start: segment_store_pb2.SubscribeStart) -> None:
        """Add a tail, or answer at once why it cannot run (`TailEnded`)."""
        try:
            if not start.tail:
                raise BadRequest("a multiplexed Subscribe names every tail (tail > 0)")
            if start.tail in self.running:
                raise BadRequest(f"tail {start.tail} is running already")
            if len(self.running) >= tail.MULTIPLEXED_TAILS_MAX:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a call runs at most {tail.MULTIPLEXED_TAILS_MAX} tails",
                )
            segment = segment_key(start.segment)
            self.store.check_reader(self.caller, "Subscribe", segment)
            self.store.authority.check_not_deleted(segment.stream_id)
        except (StoreError, Refused) as error:
            self._ended(start.tail, error, start.segment)
            return
        segment_tail = tail.SegmentTail(start.from_index, self.settings.batch_entries)
        self.running[start.tail] = _Running(segment, start, segment_tail)
        metrics.TAILS.inc()
        tails = self.tails_of.setdefault(segment, [])
        tails.append(start.tail)
        if segment not in self.listeners:
            listener = functools.partial(self._changed, segment)
            self.listeners[segment] = listener
            self.store.watch.listen(segment, listener)
        self._mark(start.tail)

    def _stop(self, tail_id: int) -> None:
        running = self.running.pop(tail_id, None)
        if running is None:
            return
        metrics.TAILS.dec()
        tails = self.tails_of[running.segment]
        tails.remove(tail_id)
        if not tails:
            del self.tails_of[running.segment]
            self.store.watch.unlisten(running.segment, self.listeners.pop(running.segment))
        self.ready.pop(tail_id, None)

    def _changed(self, segment: SegmentKey) -> None:
        for tail_id in self.tails_of.get(segment, ()):
            self._mark(tail_id)

    def _mark(self, tail_id: int) -> None:
        self.ready[tail_id] = None
        self.wake.set()

    def _ended(
        self, tail_id: int, error: Exception, segment: entry_pb2.SegmentId | None = None
    ) -> None:
        """Tell the client that tail `tail_id` ended (counted and logged as a refused
        call is); the call goes on."""
        self._stop(tail_id)
        refusal = refusal_of(error, segment)
        metrics.TAILS_ENDED.labels(refusal.code.name).inc()
        ended = segment_store_pb2.TailEnded(code=refusal.code.value[0], detail=refusal.details)
        self.buffer.put_nowait(segment_store_pb2.SubscribeReply(ended=ended, tail=tail_id))

    # ---- the store's side ----

    async def _pump(self) -> Exception | None:
        while True:
            now_ms = monotonic_ms()
            self.store.authority.check_not_revoked(self.caller)  # raised: the call ends
            blocked = self.liveness.check(self.buffer.qsize(), now_ms)
            if isinstance(blocked, tail.Drop):
                metrics.SUBSCRIBERS_DROPPED.labels(blocked.reason).inc()
                return Refused(TAIL_DROP_STATUS[blocked.reason], blocked.detail)
            if blocked is not None:
                await self._wait(blocked.until_ms)
            elif self.ready:
                tail_id = next(iter(self.ready))
                del self.ready[tail_id]
                await self._step(tail_id)
            else:
                idle = self.liveness.idle(now_ms)
                if isinstance(idle, tail.SendKeepalive):
                    keepalive = segment_store_pb2.Keepalive(sent_at_ms=wall_ms())
                    self.buffer.put_nowait(segment_store_pb2.SubscribeReply(keepalive=keepalive))
                else:
                    await self._wait(idle.until_ms)

    async def _step(self, tail_id: int) -> None:
        running = self.running.get(tail_id)
        if running is None:
            return  # stopped since it was marked
        try:
            meta = self.store.core.held_meta(running.segment)
        except StoreError as error:
            self._ended(tail_id, error, running.start.segment)
            return
        position = tail.Position(meta.acked_index, meta.fence, meta.bridge_index)
        action = running.tail.step(position)
        if action is None:
            return  # caught up: the watch marks it at the segment's next change
        if isinstance(action, tail.SendPosition):
            reply = _position_reply(action.position)
            reply.tail = tail_id
            self.buffer.put_nowait(reply)
        else:
            try:
                await self._read(tail_id, running, action)
            except (StoreError, CorruptEntry) as error:
                if self.running.get(tail_id) is running:
                    self._ended(tail_id, error, running.start.segment)
                return
        self.liveness.on_sent(monotonic_ms())
        self._mark(tail_id)  # more to read, or a position to send once caught up

    async def _read(self, tail_id: int, running: _Running, read: tail.ReadBatch) -> None:
        entries = await self.store.in_thread(
            functools.partial(
                read_entries,
                self.store.core,
                running.segment,
                read.from_index,
                read.to_index,
                True,
                read.entries_max,
                verify=False,  # followers verify every entry they receive
            )
        )
        if self.running.get(tail_id) is not running:
            return  # stopped while reading: its batch is not wanted
        if entries:
            metrics.READ_ENTRIES.labels("subscribe").inc(len(entries))
            batch = segment_store_pb2.EntryBatch(entries=entries, token=entries[-1].index)
            self.buffer.put_nowait(segment_store_pb2.SubscribeReply(batch=batch, tail=tail_id))
        last = entries[-1].index if entries else read.from_index - 1
        running.tail.on_read(read, last)

    async def _wait(self, until_ms: int) -> None:
        """Until a tail is marked, the sender makes room, or `until_ms`."""
        self.room.clear()
        self.wake.clear()
        if self.ready and self.buffer.qsize() < self.settings.buffer_messages:
            return
        await wait_any((self.wake, self.room), max(until_ms - monotonic_ms(), 0) / 1000)

    async def _send(self) -> Exception | None:
        while True:
            reply = await self.buffer.get()
            self.room.set()
            self.taken.set()
            await self.send(reply)


async def _until_one_ends(
    *parts: Coroutine[Any, Any, Exception | None],
) -> tuple[list[asyncio.Task[Exception | None]], set[asyncio.Task[Exception | None]]]:
    """A call's pump, sender and receiver as tasks, until the first of them ends: the
    others are cancelled and waited for. Returns every task (in the order given) and
    those that had ended."""
    tasks = [asyncio.create_task(part) for part in parts]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tasks, done


def _position_reply(position: tail.Position) -> segment_store_pb2.SubscribeReply:
    return segment_store_pb2.SubscribeReply(
        position=segment_store_pb2.Position(
            acked_index=position.acked_index,
            fence=position.fence,
            bridge_index=position.bridge_index,
        )
    )
