"""`StreamClient`: the SDK's entry point, one per process and master.

```python
async with StreamClient("127.0.0.1:7070") as client:
    await client.create_stream("acme/orders", replicas=3, write_quorum=2)
    async with client.writer("acme/orders") as w:
        seq = await w.append(b"...")
    async for event in client.subscribe("acme/orders", start=0):
        ...
```

It owns one pool of gRPC channels (options in `client.channels`) shared by writers
and readers; control calls retry transient failures (`client.retrying`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import TypeVar

import grpc
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

from client import subscription
from client.channels import ChannelPool
from client.core.cursor import Event
from client.core.replicator import ReplicatorLimits
from client.errors import from_rpc_error
from client.retrying import retry_unary
from client.writer import Writer

T = TypeVar("T")


class StreamClient:
    """A connection to one cluster, through its master."""

    def __init__(self, master_address: str) -> None:
        self.master_address = master_address
        self._channels = ChannelPool()
        self._master: master_pb2_grpc.MasterAsyncStub | None = None

    async def __aenter__(self) -> StreamClient:
        self._master = master_pb2_grpc.MasterStub(self._channels.get(self.master_address))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        self._master = None
        await self._channels.close()

    @property
    def master(self) -> master_pb2_grpc.MasterAsyncStub:
        if self._master is None:
            raise RuntimeError("use StreamClient as `async with StreamClient(...) as client`")
        return self._master

    @property
    def channels(self) -> ChannelPool:
        return self._channels

    async def create_stream(
        self,
        name: str,
        replicas: int = 3,
        write_quorum: int = 2,
        segment_bytes: int = 0,
        segment_age_ms: int = 0,
    ) -> master_pb2.StreamInfo:
        """Create `tenant/stream` (and the tenant on first use). `segment_bytes` and
        `segment_age_ms` are the roll thresholds; 0 takes the master's defaults. Creating
        a stream that exists with the same policy returns it."""
        request = master_pb2.CreateStreamRequest(
            name=name,
            policy=entry_pb2.ReplicationPolicy(replicas=replicas, write_quorum=write_quorum),
            segment_bytes=segment_bytes,
            segment_age_ms=segment_age_ms,
            create_tenant=True,
        )

        async def create() -> master_pb2.StreamInfo:
            return await self.master.CreateStream(request, timeout=5.0)

        return await self._control(create)

    async def describe_stream(self, name: str) -> master_pb2.StreamInfo:
        async def describe() -> master_pb2.StreamInfo:
            return await self.master.DescribeStream(
                master_pb2.DescribeStreamRequest(name=name), timeout=5.0
            )

        return await self._control(describe)

    async def list_segments(self, name: str, from_epoch: int = 0) -> master_pb2.ListSegmentsReply:
        async def list_() -> master_pb2.ListSegmentsReply:
            return await self.master.ListSegments(
                master_pb2.ListSegmentsRequest(stream=name, from_epoch=from_epoch), timeout=5.0
            )

        return await self._control(list_)

    def writer(
        self,
        name: str,
        *,
        limits: ReplicatorLimits | None = None,
        leadership_timeout_s: float | None = None,
        client_id: str | None = None,
    ) -> Writer:
        """`async with client.writer(name) as w:` waits for leadership of `name`."""
        return Writer(
            self.master,
            self._channels,
            name,
            limits=limits,
            leadership_timeout_s=leadership_timeout_s,
            client_id=client_id,
        )

    def subscribe(self, name: str, start: subscription.Start = 0) -> AsyncIterator[Event]:
        """Every acked event of `name` from `start` (a sequence, or "end"), forever."""
        return subscription.subscribe(self.master, self._channels, name, start)

    def read(self, name: str, start: int = 0, end: int | None = None) -> AsyncIterator[Event]:
        """Acked events in `[start, end)`; `end=None` stops at the acked end now."""
        return subscription.read(self.master, self._channels, name, start, end)

    async def _control(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await retry_unary(call)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from error
