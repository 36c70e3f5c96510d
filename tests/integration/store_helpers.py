"""Talking to a real store process in tests: entries, write streams, subscriptions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc

from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.tools.harness import ServerProcess, make_store
from streamengine.v1 import entry_pb2, segment_store_pb2, segment_store_pb2_grpc

# A master address nothing listens on: the store must serve without its master.
NO_MASTER = "127.0.0.1:1"


@contextmanager
def lone_store(root: Path, extra_args: list[str] | None = None) -> Iterator[ServerProcess]:
    store = make_store(root, 0, NO_MASTER, extra_args=extra_args)
    try:
        yield store.start()
    finally:
        store.kill()


def seg(stream_id: int = 7, epoch: int = 3) -> entry_pb2.SegmentId:
    return entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch, stream="t/s")


def entry(
    index: int, epoch: int = 3, payload: bytes | None = None, kind: EntryKind = EntryKind.EVENT
) -> entry_pb2.Entry:
    if payload is None:
        payload = b"e%d" % index if kind == EntryKind.EVENT else b""
    made = StoredEntry.make(index, kind, epoch, payload)
    return entry_pb2.Entry(
        index=made.index,
        kind=int(made.kind),  # type: ignore[arg-type]
        epoch=made.epoch,
        payload=made.payload,
        crc32c=made.crc32c,
    )


def entries(first: int, last: int, epoch: int = 3, size: int = 0) -> list[entry_pb2.Entry]:
    return [
        entry(i, epoch, (b"%08d" % i).ljust(size, b"x") if size else None)
        for i in range(first, last + 1)
    ]


def write_request(
    segment: entry_pb2.SegmentId,
    writer_epoch: int,
    acked: int,
    batch: Iterable[entry_pb2.Entry],
    request_id: int = 0,
    report_held: bool = False,
) -> segment_store_pb2.WriteRequest:
    return segment_store_pb2.WriteRequest(
        segment=segment,
        writer_epoch=writer_epoch,
        acked_index=acked,
        entries=list(batch),
        request_id=request_id,
        report_held=report_held,
    )


@asynccontextmanager
async def store_stub(address: str) -> AsyncIterator[segment_store_pb2_grpc.SegmentStoreAsyncStub]:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        yield segment_store_pb2_grpc.SegmentStoreStub(channel)


async def write_all(
    stub: segment_store_pb2_grpc.SegmentStoreAsyncStub,
    requests: list[segment_store_pb2.WriteRequest],
) -> list[segment_store_pb2.WriteReply]:
    """Send every request on one Write stream; the replies, in order."""

    async def produce() -> AsyncIterator[segment_store_pb2.WriteRequest]:
        for request in requests:
            yield request

    call = stub.Write(produce())
    return [reply async for reply in call]


async def state(
    stub: segment_store_pb2_grpc.SegmentStoreAsyncStub, segment: entry_pb2.SegmentId
) -> segment_store_pb2.SegmentStateReply:
    return await stub.GetSegmentState(segment_store_pb2.GetSegmentStateRequest(segment=segment))


async def read_all(
    stub: segment_store_pb2_grpc.SegmentStoreAsyncStub,
    segment: entry_pb2.SegmentId,
    from_index: int = 1,
    to_index: int = 0,
    acked_only: bool = False,
) -> list[entry_pb2.Entry]:
    call = stub.Read(
        segment_store_pb2.ReadRequest(
            segment=segment, from_index=from_index, to_index=to_index, acked_only=acked_only
        )
    )
    return [e async for reply in call for e in reply.entries]


def subscribe_start(
    segment: entry_pb2.SegmentId, from_index: int = 1, keepalive_ms: int = 0, batch: int = 0
) -> segment_store_pb2.SubscribeRequest:
    return segment_store_pb2.SubscribeRequest(
        start=segment_store_pb2.SubscribeStart(
            segment=segment,
            from_index=from_index,
            keepalive_interval_ms=keepalive_ms,
            max_batch_entries=batch,
        )
    )


async def next_reply(
    call: grpc.aio.StreamStreamCall[
        segment_store_pb2.SubscribeRequest, segment_store_pb2.SubscribeReply
    ],
    timeout_s: float = 5.0,
) -> segment_store_pb2.SubscribeReply:
    reply = await asyncio.wait_for(call.read(), timeout_s)
    assert isinstance(reply, segment_store_pb2.SubscribeReply), "the stream ended"
    return reply
