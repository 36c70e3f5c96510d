"""CopySegment between two real store processes, paused mid-copy: the copy is fenced
before its first batch, and nothing it writes is served before its digest matched.

The source's data port sits behind a relay in the test process that forwards each Read
to it and can hold it between two replies: a slow network, not a fake store.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from streamengine.protocol import framed_read
from streamengine.protocol.entry import EntryKind
from streamengine.protocol.framed_server import DataServer, ServerCall
from streamengine.protocol.framing import Kind
from streamengine.protocol.limits import WRITE_BATCH_ENTRIES_MAX
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing import wait_until
from streamengine.v1 import segment_store_pb2
from tests.integration.store_helpers import (
    StoreStub,
    WriteRefused,
    copy_pair,
    entries,
    entry,
    lone_store_process,
    read_all,
    seal_request,
    seg,
    state,
    store_stub,
    write_all,
    write_request,
)

FINAL = 301  # the bridge; one packed Read reply carries the whole segment
SOURCE_FENCE = 4


class HeldRelay:
    """Serves Read on a data port of its own, forwarding each to the source's; a Read
    waits for `release` after its first reply."""

    def __init__(self, source_data_address: str) -> None:
        self.source_data_address = source_data_address
        self.reading = asyncio.Event()
        self.release = asyncio.Event()
        self.server = DataServer({Kind.READ_REQUEST: self.read}, lambda known, _token: known)

    async def read(self, call: ServerCall) -> None:
        request = await call.receive()
        assert isinstance(request, segment_store_pb2.ReadRequest)
        self.reading.set()
        first = True
        async for reply in framed_read.read(self.source_data_address, PLAINTEXT, request):
            await call.send(reply)
            if first:
                first = False
                await self.release.wait()


async def _sealed_source(stub: StoreStub) -> None:
    """Epoch 3 wrote 1..200; recovery at 4 wrote 201..300 as holes, then the bridge."""
    segment = seg(601, 3)
    holes = [entry(i, 4, kind=EntryKind.HOLE) for i in range(201, 301)]
    await write_all(
        stub,
        [
            write_request(segment, 3, 200, entries(1, 200)),
            write_request(segment, 4, 200, holes),
            write_request(segment, 4, FINAL, [entry(FINAL, 4, kind=EntryKind.BRIDGE)]),
        ],
    )
    await stub.Seal(seal_request(segment, SOURCE_FENCE))


@pytest.mark.parametrize("in_place", [True, False], ids=["refill-in-place", "new-store"])
async def test_a_delayed_write_of_an_old_leader_mid_copy_is_fenced_and_never_served(
    tmp_path: Path, in_place: bool
) -> None:
    segment = seg(601, 3)
    source = lone_store_process(tmp_path, 1)
    target = lone_store_process(tmp_path, 2)
    relay = HeldRelay(source.data_address)
    try:
        source.start(wait=False)
        target.start()
        source.wait_serving()
        async with (
            store_stub(source) as source_stub,
            store_stub(target) as target_stub,
        ):
            await _sealed_source(source_stub)
            wanted = await read_all(source_stub, segment, 1, FINAL)
            acked_before = 0
            if in_place:
                # The member that missed the bridge: epoch 3's events, acked up to 150.
                await write_all(target_stub, [write_request(segment, 3, 150, entries(1, 180))])
                acked_before = 150
            relay_port = await relay.server.start("127.0.0.1:0", None)
            copying = asyncio.ensure_future(
                target_stub.CopySegment(
                    segment_store_pb2.CopySegmentRequest(
                        segment=segment,
                        source_address=source.address,
                        source_data_address=f"127.0.0.1:{relay_port}",
                        final_index=FINAL,
                        fence=SOURCE_FENCE,
                    ),
                    timeout=60,
                )
            )
            await asyncio.wait_for(relay.reading.wait(), 20)

            # The old leader of epoch 3, delayed: events where recovery put holes.
            stale = [entry(i, 3, b"stale %d" % i) for i in range(201, 211)]
            with pytest.raises(WriteRefused) as fenced:
                await write_all(target_stub, [write_request(segment, 3, 0, stale)])
            assert fenced.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            # The copied entries are in; the source's stream is held before it ends, so
            # the copy has not compared its digest yet.
            async def first_batch_in() -> bool:
                return (await state(target_stub, segment)).matched_index >= 256

            await wait_until(first_batch_in, timeout_s=20, message="first copied batch")
            mid = await state(target_stub, segment)
            assert mid.fence == SOURCE_FENCE
            assert mid.acked_index == acked_before, "acked raised before the digest matched"
            served = await read_all(target_stub, segment, acked_only=True)
            assert served == wanted[: len(served)]

            relay.release.set()
            copied = await copying
            assert copied.acked_index == FINAL and copied.entries_copied == FINAL
            after = await state(target_stub, segment)
            assert (after.fence, after.acked_index, after.bridge_index) == (4, FINAL, FINAL)
            assert await read_all(target_stub, segment, 1, FINAL) == wanted
    finally:
        await relay.server.stop()
        source.kill()
        target.kill()


async def test_a_copy_that_differs_from_its_source_stays_unconfirmed(tmp_path: Path) -> None:
    """The target keeps a higher-epoch copy the source lacks: the digests differ, the
    copy is refused, and its acked index is not raised over it."""
    segment = seg(602, 3)
    with copy_pair(tmp_path) as (source, target):
        async with (
            store_stub(source) as source_stub,
            store_stub(target) as target_stub,
        ):
            bridge = entry(11, 4, kind=EntryKind.BRIDGE)
            await write_all(
                source_stub,
                [
                    write_request(segment, 4, 0, entries(1, 10)),
                    write_request(segment, 4, 11, [bridge]),
                ],
            )
            await source_stub.Seal(seal_request(segment, 4))
            await write_all(target_stub, [write_request(segment, 5, 0, [entry(5, 5, b"other")])])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await target_stub.CopySegment(
                    segment_store_pb2.CopySegmentRequest(
                        segment=segment,
                        source_address=source.address,
                        source_data_address=source.data_address,
                        final_index=11,
                        fence=4,
                    )
                )
            assert refused.value.code() == grpc.StatusCode.DATA_LOSS
            after = await state(target_stub, segment)
            assert after.acked_index == 0 and after.fence == 4
            assert await read_all(target_stub, segment, acked_only=True) == []


async def test_a_segment_larger_than_one_write_is_copied_in_pieces(tmp_path: Path) -> None:
    """A packed Read reply may hold more entries than a Write may carry: the copy writes
    it in pieces (the demo's repair once failed every try: a batch of 52,501 entries is
    over 4096)."""
    segment = seg(603, 3)
    final = 2 * WRITE_BATCH_ENTRIES_MAX + 11
    with copy_pair(tmp_path) as (source, target):
        async with (
            store_stub(source) as source_stub,
            store_stub(target) as target_stub,
        ):
            events = final - 1
            step = WRITE_BATCH_ENTRIES_MAX // 2
            writes = [
                write_request(segment, 3, 0, entries(first, min(first + step - 1, events)))
                for first in range(1, events + 1, step)
            ]
            bridge = entry(final, 4, kind=EntryKind.BRIDGE)
            await write_all(
                source_stub,
                [
                    *writes,
                    write_request(segment, 3, events, []),
                    write_request(segment, 4, final, [bridge]),
                ],
            )
            await source_stub.Seal(seal_request(segment, 4))
            copied = await target_stub.CopySegment(
                segment_store_pb2.CopySegmentRequest(
                    segment=segment,
                    source_address=source.address,
                    source_data_address=source.data_address,
                    final_index=final,
                    fence=4,
                ),
                timeout=60,
            )
            assert copied.acked_index == final and copied.entries_copied == final
            wanted = await read_all(source_stub, segment, 1, final)
            assert await read_all(target_stub, segment, 1, final) == wanted
