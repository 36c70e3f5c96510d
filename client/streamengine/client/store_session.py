"""One store's Write stream, shared by every writer of the client: the shell of
`client.core.store_session`, which decides where each reply goes and what a refusal
means. Opened when the first segment is attached, reopened with backoff while any is,
kept for the next segment until the store closes it idle, closed with the client; each
request serialized once (`client.wire`), what is queued when the stream sends going out
in one message (`MessageParts`). What the stores tell the writers goes through the
client's `Inbox`, handed over once per turn of the loop: a writer steps once for all
the answers every store sent it meanwhile (`WritesReplied`), not once per answer.

Write goes on the store's data port, over the framed protocol (docs/data-plane.md): a
connection per store of the Write stream's own (why: `_serve`), the stream one request
on it. `write_once` is the same
call for a single request (a recovery's rewrites), on the client's pooled connection
to the store (`ChannelPool.data_call`), the one its reads and tails ride.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import grpc

from streamengine.client.channels import ChannelPool
from streamengine.client.core import store_session as store_sessions
from streamengine.client.core.replicator import (
    SegmentRef,
    SendWrite,
    StoreConnected,
    StoreDisconnected,
    WriteReplied,
)
from streamengine.client.core.store_session import (
    MessageParts,
    RouteKey,
    SessionRoutes,
    batched,
)
from streamengine.client.core.writer import FencedByStore, LeaderEvent, Replica
from streamengine.client.errors import StreamEngineError
from streamengine.client.wire import BatchCache, serialize_write, write_message_pieces
from streamengine.protocol import framed, framing
from streamengine.protocol.backoff import STORE_STREAM_REOPEN
from streamengine.protocol.framed import CallError, ClientCall
from streamengine.protocol.framed_read import OpenCall
from streamengine.protocol.status import FENCE_METADATA_KEY
from streamengine.protocol.transport import Transport
from streamengine.v1 import segment_store_pb2

log = logging.getLogger(__name__)

assert STORE_STREAM_REOPEN.max_ms <= framed.CONNECT_TIMEOUT_MS, "a timed-out dial paused enough"

_WriteReply = segment_store_pb2.WriteReply
_REFUSED_FOR_NOW = (segment_store_pb2.REFUSED_BUSY, segment_store_pb2.REFUSED_QUOTA)
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class SegmentOwner(Protocol):
    """What a session needs of a writer: its core takes the store's events."""

    def store_event(self, event: LeaderEvent) -> None: ...


# A store session's routes, as the inbox looks at them.
_Routes = SessionRoutes[SegmentOwner, tuple[SendWrite, BatchCache]]


def _key(segment: SegmentRef) -> RouteKey:
    return (segment.stream_id, segment.epoch)


class StoreSession:
    """One store's shared Write stream; see the module docstring."""

    def __init__(
        self, store_id: str, data_address: str, transport: Transport, inbox: Inbox
    ) -> None:
        self.store_id = store_id
        self._inbox = inbox
        self.data_address = data_address  # as this process dials it
        self.transport = transport
        self.routes: _Routes = SessionRoutes()
        self._queue: asyncio.Queue[tuple[SendWrite, BatchCache]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._connected = False
        self._reopens: set[asyncio.TimerHandle] = set()
        self.closed = False

    # ---- what writers call (inside their step: nothing here steps a writer) ----

    def attach(self, owner: SegmentOwner, segment: SegmentRef) -> None:
        """`owner` replicates `segment` to this store: it hears `StoreConnected` once
        the stream is up (soon after this, never inside the caller's step)."""
        assert not self.closed, "the client closed its store sessions"
        key = _key(segment)
        self.routes.attach(key, owner)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._task.add_done_callback(self._ended)
        elif self._connected:
            asyncio.get_running_loop().call_soon(self._open, key, owner)

    def detach(self, owner: SegmentOwner, segment: SegmentRef) -> None:
        """The segment's replies go nowhere from now on. The stream stays for the next
        segment attached: a store closes one idle for its `--write-stream-idle-ms`,
        and then, with no segment left, the session waits for the next attach."""
        self.routes.detach(_key(segment), owner)

    def send(self, action: SendWrite, cache: BatchCache) -> None:
        item = self.routes.send(_key(action.segment), action.request_id, (action, cache))
        if item is not None:
            self._queue.put_nowait(item)

    async def close(self) -> None:
        self.closed = True
        for handle in self._reopens:
            handle.cancel()
        self._reopens.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ---- the stream ----

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:
            # No segment is left (or the client closes): what waits to go out is
            # nobody's now, and the next attach starts a stream afresh.
            self._connected = False
            self._drop_queued()

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "store %s: the Write stream's loop failed", self.store_id, exc_info=task.exception()
            )

    async def _serve(self) -> None:
        failures = 0
        loop = asyncio.get_running_loop()
        while len(self.routes):
            dialled_at, connected = loop.time(), False
            try:
                # A connection of its own, not the client's pooled one its reads, tails
                # and recoveries share: an append's frames and answers never queue
                # behind a read's replies there, nor their frames behind a message of
                # 8 MiB here. Sharing would save a connection per store and gained
                # nothing: single appends at 100/s beside a catch-up read of the same
                # client (bench/append_beside_read.py, 6 runs each) were answered in
                # 11.8 ms at the median of p50s and 71 ms of p99s on their own
                # connection, 14.5 ms and 81 ms on the shared one (3 ms alone: the
                # client's loop, busy with the read, is most of it either way).
                async with framed.connect(self.data_address, self.transport) as connection:
                    call = await connection.call(framing.WRITE)
                    failures, connected = 0, True
                    self._connected = True
                    for key, owner in self.routes.open_all():
                        self._tell(key, owner, StoreConnected(self.store_id))
                    async with asyncio.TaskGroup() as streams:
                        streams.create_task(self._send_loop(call))
                        await self._receive_loop(call)
                        raise _StreamEnded()
            except* _StreamEnded:
                log.info("store %s ended the Write stream", self.store_id)
            except* CallError as group:
                error = group.exceptions[0]
                assert isinstance(error, CallError)
                log.info("store %s Write stream failed: %s", self.store_id, error)
            self._lost()
            failures += 1
            unanswered = loop.time() - dialled_at >= framed.CONNECT_TIMEOUT_MS / 1000
            pause_ms = store_sessions.reopen_pause_ms(failures, not connected and unanswered)
            if pause_ms:
                await asyncio.sleep(pause_ms / 1000)

    def _lost(self) -> None:
        self._connected = False
        self._drop_queued()
        for key, owner in self.routes.stream_lost():
            self._tell(key, owner, StoreDisconnected(self.store_id))

    def _drop_queued(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()

    async def _send_loop(self, call: ClientCall) -> None:
        # Each round sends what is queued by then (a lone request at once) in one message.
        left_out: tuple[bytes, int] | None = None
        while True:
            if left_out is None:
                send, cache = await self._queue.get()
                left_out = serialize_write(send, cache), len(send.payloads)
            message, parts = MessageParts(), []
            while left_out is not None and message.join(left_out[1], len(left_out[0])):
                parts.append(left_out[0])
                left_out = None
                if not self._queue.empty():
                    send, cache = self._queue.get_nowait()
                    left_out = serialize_write(send, cache), len(send.payloads)
            await call.send_parts(write_message_pieces(parts))

    async def _receive_loop(self, call: ClientCall) -> None:
        while (message := await call.receive()) is not None:
            assert isinstance(message, _WriteReply)
            for reply in message.parts or (message,):
                self._answered(reply)

    def _answered(self, reply: _WriteReply) -> None:
        key = (reply.segment.stream_id, reply.segment.epoch)
        if reply.status == segment_store_pb2.REFUSED:
            self._refused(key, reply)
            return
        owner, released = self.routes.replied(key, reply.request_id)
        for item in released:
            self._queue.put_nowait(item)
        if owner is not None:
            self._tell(
                key,
                owner,
                WriteReplied(
                    self.store_id,
                    reply.request_id,
                    # Over its tenant's quota: held back the same way.
                    busy=reply.status in _REFUSED_FOR_NOW,
                    matched_index=reply.matched_index,
                    acked_index=reply.acked_index,
                    first_index=reply.first_index,
                    last_index=reply.last_index,
                ),
            )

    def _refused(self, key: RouteKey, reply: _WriteReply) -> None:
        code = _STATUS_NAMES.get(reply.error.code, "UNKNOWN")
        fence_text = reply.error.metadata.get(FENCE_METADATA_KEY)
        refused = self.routes.refused(
            key, reply.request_id, code, int(fence_text) if fence_text else None
        )
        if refused is None:
            return
        log.info(
            "store %s refused segment %d/%d: %s %s",
            self.store_id,
            key[0],
            key[1],
            code,
            reply.error.details,
        )
        self._tell(key, refused.owner, StoreDisconnected(self.store_id))
        if refused.fence is not None:
            self._tell(key, refused.owner, FencedByStore(self.store_id, refused.fence))
            return
        handles: list[asyncio.TimerHandle] = []
        handles.append(
            asyncio.get_running_loop().call_later(
                refused.reopen_after_ms / 1000, self._reopen, key, refused.owner, handles
            )
        )
        self._reopens.add(handles[0])

    def _reopen(
        self, key: RouteKey, owner: SegmentOwner, handles: list[asyncio.TimerHandle]
    ) -> None:
        self._reopens.discard(handles[0])
        self._open(key, owner)

    def _open(self, key: RouteKey, owner: SegmentOwner) -> None:
        if self._connected and self.routes.owner(key) is owner and self.routes.open(key):
            self._tell(key, owner, StoreConnected(self.store_id))

    def _tell(self, key: RouteKey, owner: SegmentOwner, event: LeaderEvent) -> None:
        """`event` of segment `key` for `owner`, handed over by the inbox only while
        `owner` still replicates that segment here: one it detached meanwhile (a roll
        to a new segment, maybe without this store) hears nothing more of the old."""
        self._inbox.put(owner, self.store_id, key, event, self.routes)


class Inbox:
    """What the client's store sessions tell its writers, handed over once per turn of
    the loop (`client.core.store_session`, "Answers"): each writer's events in the order
    they came, its runs of answers one step each. Never inside a writer's step: the
    hand-over is a callback of the loop."""

    def __init__(self) -> None:
        # Per owner, store and segment: the events, and the routes of that store's
        # session, which say whether the owner still holds the segment there.
        self._events: dict[tuple[SegmentOwner, str, RouteKey], list[LeaderEvent]] = {}
        self._routes: dict[tuple[SegmentOwner, str, RouteKey], _Routes] = {}
        self._scheduled = False

    def put(
        self,
        owner: SegmentOwner,
        store: str,
        key: RouteKey,
        event: LeaderEvent,
        routes: _Routes,
    ) -> None:
        """`event` of segment `key` on `store` for `owner`, handed over while `routes`
        (the store session's) say the owner still replicates that segment there
        (checked before each step, since one step may roll the owner away from it)."""
        where = (owner, store, key)
        self._events.setdefault(where, []).append(event)
        self._routes.setdefault(where, routes)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._hand_over)

    def _hand_over(self) -> None:
        self._scheduled = False
        events, self._events = self._events, {}
        routes, self._routes = self._routes, {}
        for where, told in events.items():
            owner, _, key = where
            held_by = routes[where]
            for event in batched(told):
                if held_by.owner(key) is not owner:
                    break
                owner.store_event(event)


class StoreSessions:
    """The client's store sessions, one per store, made on first use; closed with the
    client (`StreamClient.close`)."""

    def __init__(self, channels: ChannelPool) -> None:
        self._channels = channels
        self._sessions: dict[tuple[str, str], StoreSession] = {}
        self._inbox = Inbox()
        self._closed = False

    def get(self, replica: Replica) -> StoreSession:
        """Raises `StreamEngineError` once the client closes (a writer granted a
        segment meanwhile then stops leading, as on a closed channel)."""
        if self._closed:
            raise StreamEngineError("the StreamClient is closed")
        key = (replica.store_id, replica.data_address)
        session = self._sessions.get(key)
        if session is None:
            self._channels.check_open()
            session = StoreSession(
                replica.store_id,
                self._channels.dial(replica.data_address),
                self._channels.transport,
                self._inbox,
            )
            self._sessions[key] = session
        return session

    def __len__(self) -> int:
        return len(self._sessions)

    async def close(self) -> None:
        self._closed = True
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


async def write_once(
    data_address: str,
    open_call: OpenCall,
    request: segment_store_pb2.WriteRequest,
    timeout_s: float,
) -> segment_store_pb2.WriteReply | None:
    """One Write request on the client's pooled connection to the store at
    `data_address` (`open_call`: `ChannelPool.data_call`), so that a recovery of many
    requests dials each store once: its reply, or None when the store ended the call
    without one. Raises CallError (DEADLINE_EXCEEDED past `timeout_s`; UNAVAILABLE when
    the store cannot be reached or the connection fails)."""
    try:
        async with asyncio.timeout(timeout_s):
            call = await open_call(data_address, framing.WRITE)
            try:
                await call.send(request)
                await call.end()
                reply = await call.receive()
            finally:
                # The reply is all it waits for: a store yet to send its End is told to
                # stop, and the slot on the shared connection is free at once.
                call.cancel()
    except TimeoutError:
        raise CallError(
            framing.StatusCode.DEADLINE_EXCEEDED, f"no answer from {data_address} in {timeout_s} s"
        ) from None
    assert reply is None or isinstance(reply, segment_store_pb2.WriteReply)
    return reply


class _StreamEnded(Exception):
    """The store closed its side of the Write stream."""
