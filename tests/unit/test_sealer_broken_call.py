"""The sealer's shell when a store's Write call breaks between its write and its
half-close: grpc.aio raises its ExecuteBatchError from `done_writing`, which is not an
AioRpcError. Found by the fault suite's S18 (38 "Task exception was never retrieved"
in a writer's log): the request must end as no answer, which the core may ask again."""

from __future__ import annotations

import asyncio
from typing import Any

from grpc._cython import cygrpc  # type: ignore[attr-defined]

from streamengine.client import recovery
from streamengine.client.core import recovery as sr
from streamengine.client.core.replicator import SegmentRef
from streamengine.v1 import entry_pb2


class _BrokenWriteCall:
    async def write(self, request: Any) -> None:
        return None

    async def done_writing(self) -> None:
        raise cygrpc.ExecuteBatchError('Failed "execute_batch"')

    def cancel(self) -> bool:
        return True


class _Stub:
    def Write(self, timeout: float) -> _BrokenWriteCall:
        return _BrokenWriteCall()


def test_a_write_call_broken_at_its_half_close_is_no_answer() -> None:
    sealer = recovery.SegmentSealer.__new__(recovery.SegmentSealer)
    sealer.segment = SegmentRef(stream_id=1, epoch=1, stream="t/s")
    sealer.new_epoch = 2
    sealer.grant = b""
    sealer._segment_id = entry_pb2.SegmentId(stream_id=1, epoch=1, stream="t/s")
    sealer._stubs = {"store0": _Stub()}  # type: ignore[dict-item]
    answer = asyncio.run(sealer._attempt(sr.SendAcked("store0", 0)))
    assert answer is None
