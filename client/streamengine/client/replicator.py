"""One store's bidirectional Write stream for the writer: reopened while it leads, each
request serialized once (`client.wire`), each answer a core event."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type

from streamengine.client.core.replicator import (
    SendWrite,
    StoreConnected,
    StoreDisconnected,
    WriteReplied,
)
from streamengine.client.core.writer import (
    FencedByStore,
    Replica,
)
from streamengine.client.errors import fence_of
from streamengine.client.wire import serialize_write
from streamengine.protocol.backoff import STORE_STREAM_REOPEN, TRANSIENT_CALL, tenacity_wait
from streamengine.protocol.status import FENCE_METADATA_KEY, FENCE_UNKNOWN
from streamengine.v1 import segment_store_pb2

if TYPE_CHECKING:
    from streamengine.client.writer import Writer

log = logging.getLogger(__name__)

# Waiting for a channel to connect, per attempt.
CONNECT_TIMEOUT_S = 2.0

_WriteReply = segment_store_pb2.WriteReply
_REFUSED_FOR_NOW = (segment_store_pb2.REFUSED_BUSY, segment_store_pb2.REFUSED_QUOTA)


class StoreLink:
    """One store's bidirectional Write stream, reopened while the writer leads."""

    def __init__(self, writer: Writer, replica: Replica, channel: grpc.aio.Channel) -> None:
        self.writer = writer
        self.replica = replica
        # Write with requests already serialized (see `BatchCache`).
        self.write_method: grpc.aio.StreamStreamMultiCallable[bytes, _WriteReply] = (
            channel.stream_stream(
                "/streamengine.v1.SegmentStore/Write",
                request_serializer=None,
                response_deserializer=segment_store_pb2.WriteReply.FromString,
            )
        )
        self.channel = channel
        self.queue: asyncio.Queue[SendWrite] = asyncio.Queue()
        self.connected = False

    def send(self, action: SendWrite) -> None:
        self.queue.put_nowait(action)

    async def run(self) -> None:
        failures = 0
        store = self.replica.store_id
        fenced: int | None = None
        while self.writer.leading and fenced is None:
            call: grpc.aio.StreamStreamCall[bytes, _WriteReply] | None = None
            try:
                await self._connect()
                failures = 0
                call = self.write_method()
                self.connected = True
                self.writer.step(StoreConnected(store))
                async with asyncio.TaskGroup() as streams:
                    streams.create_task(self._send_loop(call))
                    await self._receive_loop(call)
                    raise _StreamEnded()
            except* _StreamEnded:
                log.info("store %s ended its Write stream", store)
            except* _Refused as group:
                refused = group.exceptions[0]
                assert isinstance(refused, _Refused)
                fenced = refused.fence
                log.info("store %s refused a write: %s", store, refused)
            except* grpc.aio.AioRpcError as group:
                error = group.exceptions[0]
                assert isinstance(error, grpc.aio.AioRpcError)
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    fence = fence_of(error)
                    fenced = fence if fence is not None else FENCE_UNKNOWN
                log.info("store %s Write stream failed: %s", store, error.code().name)
            except* (TimeoutError, grpc.aio.UsageError, asyncio.InvalidStateError) as group:
                log.info("store %s unreachable: %r", store, group.exceptions[0])
            finally:
                if call is not None:
                    call.cancel()
            self._disconnected()
            if fenced is not None:
                self.writer.step(FencedByStore(store, fenced))
                return
            failures += 1
            await asyncio.sleep(STORE_STREAM_REOPEN.delay_ms(failures) / 1000)

    def _disconnected(self) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
        if self.connected:
            self.connected = False
            self.writer.step(StoreDisconnected(self.replica.store_id))

    async def _connect(self) -> None:
        """Wait for the channel to connect, retrying with backoff for as long as the
        writer leads (stepping down cancels this)."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(TimeoutError),
            wait=tenacity_wait(TRANSIENT_CALL, random.random),
            reraise=True,
        ):
            with attempt:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await self.channel.channel_ready()

    async def _send_loop(self, call: grpc.aio.StreamStreamCall[bytes, _WriteReply]) -> None:
        cache = self.writer.batch_cache
        while True:
            send = await self.queue.get()
            await call.write(serialize_write(send, cache))

    async def _receive_loop(self, call: grpc.aio.StreamStreamCall[bytes, _WriteReply]) -> None:
        store = self.replica.store_id
        async for reply in call:
            if reply.status == segment_store_pb2.REFUSED:
                raise _Refused(reply.error)
            self.writer.step(
                WriteReplied(
                    store,
                    reply.request_id,
                    # Over its tenant's quota: held back the same way.
                    busy=reply.status in _REFUSED_FOR_NOW,
                    matched_index=reply.matched_index,
                    acked_index=reply.acked_index,
                    first_index=reply.first_index,
                    last_index=reply.last_index,
                )
            )


class _StreamEnded(Exception):
    """The store closed its side of the Write stream."""


class _Refused(Exception):
    """The store refused a request (`WriteReply.error`): below its fence the writer is
    fenced (`fence`); anything else ends this stream, which is opened again."""

    def __init__(self, error: segment_store_pb2.WriteError) -> None:
        self.fence: int | None = None
        if error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
            fence = error.metadata.get(FENCE_METADATA_KEY)
            self.fence = int(fence) if fence else FENCE_UNKNOWN
        super().__init__(f"{error.code} {error.details}")


