"""The sealer's shell when a store's Write, on the data plane, gives no answer or ends
with a status: a store unreachable or a call broken is no answer (the core may ask
again, found by the fault suite's S18 when the call was gRPC's), a write below the
fence ends the recovery as fenced, with the fence the store named, and a write refused
for now (busy, or over the tenant's quota) is the core's `StoreBusy`, resent after a
pause."""

from __future__ import annotations

import pytest

from streamengine.client import recovery
from streamengine.client.channels import ChannelPool
from streamengine.client.core import recovery as sr
from streamengine.client.core.replicator import SegmentRef
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.framed_server import ServerCall
from streamengine.protocol.framing import Kind, StatusCode
from streamengine.protocol.status import FENCE_METADATA_KEY
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing.ports import free_port
from streamengine.v1 import entry_pb2, segment_store_pb2
from tests.unit import data_servers


def sealer_of(data_address: str) -> recovery.SegmentSealer:
    sealer = recovery.SegmentSealer.__new__(recovery.SegmentSealer)
    sealer.segment = SegmentRef(stream_id=1, epoch=1, stream="t/s")
    sealer.new_epoch = 2
    sealer.grant = b""
    sealer._segment_id = entry_pb2.SegmentId(stream_id=1, epoch=1, stream="t/s")
    sealer._stubs = {}
    sealer._channels = ChannelPool(PLAINTEXT)
    sealer._data_addresses = {"store0": data_address}
    return sealer


async def test_a_store_unreachable_is_no_answer() -> None:
    sealer = sealer_of(f"127.0.0.1:{free_port()}")
    assert await sealer._attempt(sr.SendAcked("store0", 0)) is None


async def test_a_write_broken_before_its_answer_is_no_answer() -> None:
    async def broken(call: ServerCall) -> None:
        await call.receive()
        raise CallError(StatusCode.UNAVAILABLE, "shutting down")

    async with data_servers.serving({Kind.WRITE_REQUEST: broken}) as address:
        assert await sealer_of(address)._attempt(sr.SendAcked("store0", 0)) is None


async def test_a_write_below_the_fence_fences_the_recovery() -> None:
    async def fenced(call: ServerCall) -> None:
        await call.receive()
        raise CallError(StatusCode.FAILED_PRECONDITION, "below", {FENCE_METADATA_KEY: "7"})

    async with data_servers.serving({Kind.WRITE_REQUEST: fenced}) as address:
        answer = await sealer_of(address)._attempt(sr.SendAcked("store0", 0))
    assert answer == sr.RecoveryFenced("store0", 7)


REFUSED_FOR_NOW = [segment_store_pb2.REFUSED_BUSY, segment_store_pb2.REFUSED_QUOTA]


@pytest.mark.parametrize("status", REFUSED_FOR_NOW)
async def test_a_rewrite_refused_for_now_waits_out_the_busy_pause(
    status: segment_store_pb2.WriteStatus.ValueType,
) -> None:
    """Over quota as when busy, nothing is written: a refusal over quota was taken for
    an answer holding nothing, and the core sent the batch again at once, as fast as
    the store answered (the simulator's stores under pressure)."""

    async def refused(call: ServerCall) -> None:
        request = await call.receive()
        assert isinstance(request, segment_store_pb2.WriteRequest)
        await call.send(
            segment_store_pb2.WriteReply(
                request_id=request.request_id,
                status=status,
                first_index=request.first_index,
                last_index=request.first_index,
            )
        )
        assert await call.receive() is None

    rewrite = sr.SendRewrite("store0", (StoredEntry.make(3, EntryKind.HOLE, 2),), 2)
    async with data_servers.serving({Kind.WRITE_REQUEST: refused}) as address:
        answer = await sealer_of(address)._attempt(rewrite)
    assert answer == sr.StoreBusy("store0", 3)
