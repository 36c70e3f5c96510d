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
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from streamengine.client.core.replicator import ReplicatorLimits
from streamengine.client.stream_client import StreamClient
from streamengine.client.types import SegmentInfo, StreamInfo
from streamengine.client.writer import Writer, WriterStatistics

T = TypeVar("T")


class SyncStreamClient:
    def __init__(
        self,
        master_address: str,
        *,
        certs_dir: str | Path | None = None,
        token: str | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="streamengine-sdk", daemon=True
        )
        self._thread.start()
        self._client = StreamClient(master_address, certs_dir=certs_dir, token=token)
        self.run(self._client.__aenter__())

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the SDK's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

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
        if not self._thread.is_alive():
            return
        try:
            self.run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

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
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._closing: asyncio.Event | None = None
        self._holder: concurrent.futures.Future[None] | None = None

    async def _hold(self) -> None:
        self._closing = asyncio.Event()
        try:
            async with self._writer:
                self._ready.set_result(None)
                await self._closing.wait()
        except BaseException as error:
            if not self._ready.done():
                self._ready.set_exception(error)
            raise

    def __enter__(self) -> SyncWriter:
        self._holder = asyncio.run_coroutine_threadsafe(self._hold(), self._client._loop)
        try:
            self._ready.result()
        except BaseException:
            self._holder.exception()  # the same error, already raised here
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._holder is not None and self._closing is not None
        self._client._loop.call_soon_threadsafe(self._closing.set)
        self._holder.result()

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
