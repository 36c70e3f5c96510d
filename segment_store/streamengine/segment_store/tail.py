"""The follower's call: Subscribe, a live tail of one segment. The shell of `core.tail`:
a pump asks the core what to do and fills a buffer, a sender drains it to the wire, a
receiver notes the client's keepalives.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from streamengine.protocol.auth import Principal
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.entry import CorruptEntry
from streamengine.protocol.limits import WRITE_BATCH_ENTRIES_MAX
from streamengine.protocol.logs import segment_fields
from streamengine.segment_store import metrics
from streamengine.segment_store.core import tail
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import BadRequest, StoreError
from streamengine.segment_store.core.keys import SegmentMeta
from streamengine.segment_store.reads import read_entries
from streamengine.segment_store.refusals import TAIL_DROP_STATUS, Refused, abort
from streamengine.segment_store.store_context import StoreContext, segment_key
from streamengine.v1 import segment_store_pb2

# Subscribe: how long the first message may take (its caller was proven and counted
# when the stream opened); the live tail's own limits and decisions are in `core.tail`.
SUBSCRIBE_START_TIMEOUT_S = 10.0

log = logging.getLogger("streamengine.store")


class TailCalls:
    """Subscribe."""

    def __init__(self, store: StoreContext) -> None:
        self.store = store

    def methods(self) -> dict[str, Callable[..., Any]]:
        return {"Subscribe": self.subscribe}

    async def subscribe(
        self,
        request_iterator: AsyncIterator[segment_store_pb2.SubscribeRequest],
        context: grpc.aio.ServicerContext[
            segment_store_pb2.SubscribeRequest, segment_store_pb2.SubscribeReply
        ],
        caller: Principal,
    ) -> None:
        requests = aiter(request_iterator)
        try:
            first = await asyncio.wait_for(anext(requests), SUBSCRIBE_START_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            await abort(context, BadRequest("Subscribe must begin with a start message"))
        try:
            if first.WhichOneof("message") != "start":
                raise BadRequest("Subscribe must begin with a start message")
            segment = segment_key(first.start.segment)
            self.store.check_reader(caller, "Subscribe", segment)
            self.store.authority.check_not_deleted(segment.stream_id)
        except StoreError as error:
            await abort(context, error)
        follower = _Tail(self.store, segment, first.start, requests, context)
        metrics.SUBSCRIBERS.inc()
        try:
            refusal = await follower.run()
        finally:
            metrics.SUBSCRIBERS.dec()
        if refusal is not None:
            await abort(context, refusal)


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
        context: grpc.aio.ServicerContext[
            segment_store_pb2.SubscribeRequest, segment_store_pb2.SubscribeReply
        ],
    ) -> None:
        self.store = store
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
        self.context = context
        # Bounded by the core, which never asks for more than `buffer_messages`.
        self.buffer: asyncio.Queue[segment_store_pb2.SubscribeReply] = asyncio.Queue()
        self.room = asyncio.Event()

    async def run(self) -> Exception | None:
        tasks = [
            asyncio.create_task(self._pump()),
            asyncio.create_task(self._send()),
            asyncio.create_task(self._receive()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
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
            meta = self.store.core.catalog.meta(self.segment) or SegmentMeta()
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
        waiters = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(self.room.wait())]
        try:
            timeout_s = max(until_ms - monotonic_ms(), 0) / 1000
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _send(self) -> Exception | None:
        while True:
            reply = await self.buffer.get()
            self.room.set()
            await self.context.write(reply)

    async def _receive(self) -> Exception | None:
        async for _request in self.requests:
            self.stream.on_heard(monotonic_ms())
        return None  # the client closed its side: the stream ends


def _position_reply(position: tail.Position) -> segment_store_pb2.SubscribeReply:
    return segment_store_pb2.SubscribeReply(
        position=segment_store_pb2.Position(
            acked_index=position.acked_index,
            fence=position.fence,
            bridge_index=position.bridge_index,
        )
    )
