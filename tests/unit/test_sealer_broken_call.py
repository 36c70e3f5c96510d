"""The sealer's shell when a store's Write, on the data plane, gives no answer or ends
with a status: a store unreachable or a call broken is no answer (the core may ask
again, found by the fault suite's S18 when the call was gRPC's), and a write below the
fence ends the recovery as fenced, with the fence the store named."""

from __future__ import annotations

from streamengine.client import recovery
from streamengine.client.channels import ChannelPool
from streamengine.client.core import recovery as sr
from streamengine.client.core.replicator import SegmentRef
from streamengine.protocol.framed import CallError
from streamengine.protocol.framed_server import ServerCall
from streamengine.protocol.framing import Kind, StatusCode
from streamengine.protocol.status import FENCE_METADATA_KEY
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing.ports import free_port
from streamengine.v1 import entry_pb2
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
