"""Blocking wrappers for scripts: the async SDK on its own event loop in a thread.

```python
with SyncStreamClient("127.0.0.1:7070") as client:
    client.create_stream("acme/orders")
    with client.writer("acme/orders") as w:
        seq = w.append(b"...")
```

The async API is the primary one; this only carries calls over to the loop thread and
waits. A writer's `async with` block lives in one task of that loop for as long as the
`with` block, so its background loops and their failures behave as in the async API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from streamengine.client.core.replicator import ReplicatorLimits
from streamengine.client.stream_client import StreamClient
from streamengine.client.types import SegmentInfo, StreamInfo
from streamengine.client.writer import Writer, WriterStatistics
from streamengine.protocol import loop_thread

T = TypeVar("T")


class SyncStreamClient:
    def __init__(
        self,
        master_address: str,
        *,
        certs_dir: str | Path | None = None,
        token: str | None = None,
    ) -> None:
        self._runner = loop_thread.start("streamengine-sdk")
        self._closed = False
        self._client = StreamClient(master_address, certs_dir=certs_dir, token=token)
        self.run(self._client.__aenter__())

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the SDK's loop and wait for its result."""
        return self._runner.run(coroutine, timeout_s)

    def __enter__(self) -> SyncStreamClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.run(self._client.close())
        finally:
            self._runner.close()

    def create_stream(
        self,
        name: str,
        replicas: int = 3,
        write_quorum: int = 2,
        segment_bytes: int = 0,
        segment_age_ms: int = 0,
        retention_age_ms: int = 0,
        retention_bytes: int = 0,
    ) -> StreamInfo:
        return self.run(
            self._client.create_stream(
                name,
                replicas,
                write_quorum,
                segment_bytes,
                segment_age_ms,
                retention_age_ms,
                retention_bytes,
            )
        )

    def create_streams(
        self,
        names: Sequence[str],
        replicas: int = 3,
        write_quorum: int = 2,
        segment_bytes: int = 0,
        segment_age_ms: int = 0,
        retention_age_ms: int = 0,
        retention_bytes: int = 0,
    ) -> list[StreamInfo]:
        return self.run(
            self._client.create_streams(
                names,
                replicas,
                write_quorum,
                segment_bytes,
                segment_age_ms,
                retention_age_ms,
                retention_bytes,
            )
        )

    def describe_stream(self, name: str) -> StreamInfo:
        return self.run(self._client.describe_stream(name))

    def list_streams(
        self, tenant: str = "", name_prefix: str = "", page_size: int = 0
    ) -> list[StreamInfo]:
        """Every stream `StreamClient.list_streams` yields, page after page."""

        async def every() -> list[StreamInfo]:
            return [
                info async for info in self._client.list_streams(tenant, name_prefix, page_size)
            ]

        return self.run(every())

    def list_segments(self, name: str, from_epoch: int = 0) -> list[SegmentInfo]:
        return self.run(self._client.list_segments(name, from_epoch))

    def writer(
        self,
        name: str,
        *,
        limits: ReplicatorLimits | None = None,
        leadership_timeout_s: float | None = None,
    ) -> SyncWriter:
        return SyncWriter(
            self,
            self._client.writer(name, limits=limits, leadership_timeout_s=leadership_timeout_s),
        )


class SyncWriter:
    """`with client.writer(name) as w:` waits for leadership; see `client.writer.Writer`."""

    def __init__(self, client: SyncStreamClient, writer: Writer) -> None:
        self._client = client
        self._writer = writer
        self._closing: asyncio.Event | None = None
        self._holder: asyncio.Task[None] | None = None

    async def _hold(self, ready: asyncio.Future[None], closing: asyncio.Event) -> None:
        try:
            async with self._writer:
                ready.set_result(None)
                await closing.wait()
        except BaseException as error:
            if not ready.done():
                ready.set_exception(error)
            raise

    async def _enter(self) -> None:
        """The writer's `async with` begun in a task of its own, which holds it until
        `_exit`; returns once it leads, or raises why it never will."""
        ready = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._holder = asyncio.get_running_loop().create_task(self._hold(ready, self._closing))
        try:
            await ready
        except BaseException:
            await asyncio.gather(self._holder, return_exceptions=True)  # the same error
            raise

    async def _exit(self) -> None:
        assert self._holder is not None and self._closing is not None
        self._closing.set()
        await self._holder

    def __enter__(self) -> SyncWriter:
        self._client.run(self._enter())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._client.run(self._exit())

    def append(self, payload: bytes) -> int:
        return self._client.run(self._writer.append(payload))

    def append_batch(self, payloads: Sequence[bytes]) -> list[int]:
        return self._client.run(self._writer.append_batch(payloads))

    def flush(self, timeout_s: float = 1.0) -> bool:
        return self._client.run(self._writer.flush(timeout_s))

    def statistics(self) -> WriterStatistics:
        async def snapshot() -> WriterStatistics:  # taken on the loop, not mid-step
            return self._writer.statistics()

        return self._client.run(snapshot())

    @property
    def epoch(self) -> int:
        return self._writer.epoch
