"""Registration and heartbeats to the master.

The store serves whether or not the master answers: registration retries forever with
backoff (tenacity), a failed heartbeat is logged and retried at the next tick, and a
master that forgot the store (`register_again`) gets a new registration. Segments the
master lists in a heartbeat reply are deleted. Given several masters (`--master
a:7070,b:7070`), calls follow the active one (`protocol.master_calls`); a master that
becomes active loads every registered store from the metadata, so no new registration
is needed after a failover.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.protocol.master_calls import AsyncMasters
from streamengine.segment_store import metrics
from streamengine.segment_store.store import SegmentKey, SegmentStoreCore
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

log = logging.getLogger("streamengine.store")

# Until the master says otherwise.
HEARTBEAT_MS_DEFAULT = 1000
# Bounds on what the master may ask for: never a busy loop, never silent for minutes.
HEARTBEAT_MS_MIN = 50
HEARTBEAT_MS_MAX = 30_000
MASTER_CALL_TIMEOUT_S = 2.0
REGISTER_BACKOFF_MAX_S = 2.0


@dataclass(frozen=True)
class StoreIdentity:
    store_id: str
    address: str
    zone: str
    data_dir: Path


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class MasterLink:
    def __init__(
        self,
        master_address: str,
        identity: StoreIdentity,
        core: SegmentStoreCore,
        delete_segment: Callable[[SegmentKey], Awaitable[bool]],
    ) -> None:
        self.master_address = master_address
        self.identity = identity
        self.core = core
        self.delete_segment = delete_segment
        self.interval_s = HEARTBEAT_MS_DEFAULT / 1000
        self.registered = False

    async def run(self) -> None:
        channels: dict[str, grpc.aio.Channel] = {}

        def channel(address: str) -> grpc.aio.Channel:
            if address not in channels:
                channels[address] = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
            return channels[address]

        stub = AsyncMasters(self.master_address, channel).stub
        try:
            while True:
                if not self.registered:
                    await self._register(stub)
                try:
                    await self._heartbeat(stub)
                except grpc.aio.AioRpcError as error:
                    metrics.HEARTBEAT_FAILURES.inc()
                    log.info("heartbeat to master %s failed: %s", self.master_address, error.code())
                except Exception:
                    # Whatever went wrong with the master or a delete it asked for, the
                    # store goes on serving; the next heartbeat tries again.
                    metrics.HEARTBEAT_FAILURES.inc()
                    log.exception("heartbeat to master %s failed", self.master_address)
                await asyncio.sleep(self.interval_s)
        finally:
            for open_channel in channels.values():
                await open_channel.close()

    async def _register(self, stub: master_pb2_grpc.MasterAsyncStub) -> None:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(grpc.aio.AioRpcError),
            wait=wait_exponential_jitter(multiplier=0.05, max=REGISTER_BACKOFF_MAX_S, jitter=0.1),
            before_sleep=lambda state: metrics.HEARTBEAT_FAILURES.inc(),
            reraise=True,
        ):
            with attempt:
                reply = await stub.RegisterStore(
                    master_pb2.RegisterStoreRequest(
                        store_id=self.identity.store_id,
                        address=self.identity.address,
                        zone=self.identity.zone,
                        free_bytes=_free_bytes(self.identity.data_dir),
                    ),
                    timeout=MASTER_CALL_TIMEOUT_S,
                )
        interval_ms = reply.heartbeat_interval_ms or HEARTBEAT_MS_DEFAULT
        self.interval_s = min(max(interval_ms, HEARTBEAT_MS_MIN), HEARTBEAT_MS_MAX) / 1000
        self.registered = True
        log.info("registered with master %s as %s", self.master_address, self.identity.store_id)

    async def _heartbeat(self, stub: master_pb2_grpc.MasterAsyncStub) -> None:
        metas = self.core.metas()
        request = master_pb2.StoreHeartbeatRequest(
            store_id=self.identity.store_id,
            address=self.identity.address,
            zone=self.identity.zone,
            used_bytes=sum(m.payload_bytes for m in metas.values()),
            free_bytes=_free_bytes(self.identity.data_dir),
            segments=[
                master_pb2.HeldSegment(
                    segment=entry_pb2.SegmentId(stream_id=s.stream_id, epoch=s.epoch),
                    fence=m.fence,
                    acked_index=m.acked_index,
                    last_index=m.last_index,
                    bytes=m.payload_bytes,
                )
                for s, m in sorted(metas.items())
            ],
        )
        reply = await stub.StoreHeartbeat(request, timeout=MASTER_CALL_TIMEOUT_S)
        if reply.register_again:
            self.registered = False
        for segment in reply.delete_segments:
            key = SegmentKey(segment.stream_id, segment.epoch)
            if key.stream_id and key.epoch:
                existed = await self.delete_segment(key)
                log.info(
                    "deleted segment %s/%s at the master's request (held: %s)",
                    key.stream_id,
                    key.epoch,
                    existed,
                )
