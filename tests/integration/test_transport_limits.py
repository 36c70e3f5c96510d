"""Bad input costs the servers nothing at the transport: oversized messages and batches
are refused before they are parsed or built, abandoned Write streams are closed, and a
writer whose idle streams were closed goes on appending."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from pathlib import Path

import grpc
import pytest

from bench.segment_driver import write_stream
from streamengine.client.stream_client import StreamClient
from streamengine.protocol import framed, framing
from streamengine.protocol.framed import CallError
from streamengine.protocol.framed_peer import split_address
from streamengine.protocol.framing import Kind, StatusCode
from streamengine.protocol.limits import (
    FRAME_PAYLOAD_BYTES_MAX,
    GRPC_MESSAGE_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
)
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing import free_port, metric_value, running_cluster, wait_until
from streamengine.v1 import data_plane_pb2, segment_store_pb2
from tests.integration.store_helpers import (
    entries,
    entry,
    granted,
    lone_store,
    seg,
    state,
    store_stub,
    write_all,
    write_request,
)

IDLE_MS = 400
IDLE_CLOSED = "streamengine_store_write_streams_idle_closed_total"


async def test_a_message_over_the_limit_is_refused_and_the_store_serves_on(
    tmp_path: Path,
) -> None:
    with lone_store(tmp_path) as store:
        async with store_stub(store) as stub:
            # Refused from its header, before any of its payload is read.
            hello = data_plane_pb2.Hello(
                version_min=1,
                version_max=1,
                stream_credit_bytes=framing.HEADER.size + FRAME_PAYLOAD_BYTES_MAX,
            )
            too_long = struct.pack(  # a header alone
                "!IBBHQ", FRAME_PAYLOAD_BYTES_MAX + 1, Kind.WRITE_REQUEST, 0, 0, 1
            )
            wire = framing.encode(Kind.HELLO, 0, hello) + too_long
            frames = await _exchange(store.data_address, wire)
            error = framing.parse_control(frames[-1])
            assert isinstance(error, data_plane_pb2.Error)
            assert error.code == StatusCode.RESOURCE_EXHAUSTED
            # A client refuses to send one at all.
            huge = write_request(seg(), 3, 0, [entry(1, payload=b"x" * GRPC_MESSAGE_BYTES_MAX)])
            with pytest.raises(CallError) as refused:
                await write_stream(store.data_address, [huge])
            assert refused.value.code is StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as absent:
                await state(stub, seg())
            assert absent.value.code() == grpc.StatusCode.NOT_FOUND


async def _exchange(address: str, data: bytes) -> list[framing.Frame]:
    """What a store's data port answers `data` with before it closes the connection."""
    host, port = split_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    decoder = framing.FrameDecoder(FRAME_PAYLOAD_BYTES_MAX)
    frames: list[framing.Frame] = []
    async with asyncio.timeout(10):
        while chunk := await reader.read(1 << 16):
            frames += decoder.feed(chunk)
    writer.close()
    return frames


async def test_a_batch_of_too_many_entries_is_refused_before_it_is_built(
    tmp_path: Path,
) -> None:
    with lone_store(tmp_path) as store:
        many = entries(1, WRITE_BATCH_ENTRIES_MAX + 1)
        # Refused in its reply: the stream carries other segments' writes.
        replies = await write_stream(store.data_address, [write_request(seg(), 3, 0, many)])
        assert [r.status for r in replies] == [segment_store_pb2.REFUSED]
        assert replies[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert str(WRITE_BATCH_ENTRIES_MAX) in replies[0].error.details


async def test_an_abandoned_write_stream_is_closed_after_the_idle_timeout(
    tmp_path: Path,
) -> None:
    with lone_store(tmp_path, ["--write-stream-idle-ms", str(IDLE_MS)]) as store:
        async with (
            asyncio.timeout(10 * IDLE_MS / 1000),
            framed.connect(store.data_address, PLAINTEXT) as connection,
        ):
            call = await connection.call(framing.WRITE)
            await call.send(write_request(seg(), 3, 0, [entry(1)], grant=granted(seg(), 3)))
            replies = []
            # Never ended by this side: it ends when the store closes the stream.
            while (reply := await call.receive()) is not None:
                replies.append(reply)
        assert [r.matched_index for r in replies] == [1]  # type: ignore[attr-defined]


async def test_a_writer_goes_on_after_its_idle_streams_were_closed(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    with running_cluster(
        tmp_path,
        stores=3,
        store_args=["--write-stream-idle-ms", str(IDLE_MS)],
        store_args_for=lambda n: ["--metrics-port", str(ports[n])],
    ) as cluster:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream("idle/writer", replicas=3, write_quorum=2)
            async with client.writer("idle/writer") as writer:
                first = await writer.append(b"before")

                def closed_on_every_store() -> bool:
                    return all(metric_value(port, IDLE_CLOSED) >= 1 for port in ports)

                await wait_until(
                    lambda: asyncio.to_thread(closed_on_every_store),
                    20,
                    "every store closing the idle writer's stream",
                    0.1,
                )
                second = await writer.append(b"after")
                assert second > first
            events = [e.payload async for e in client.read("idle/writer")]
            assert events == [b"before", b"after"]


READ_ENTRY_BYTES = 512 << 10
READ_ENTRIES = 48  # 24 MiB: over two windows of replies


async def test_a_reader_that_grants_nothing_holds_the_store_to_its_credit(
    tmp_path: Path,
) -> None:
    """A Read of 24 MiB, a reply per entry, by a reader that reads its socket but grants
    no credit back: the store sends replies within the hello's credit and no more; once
    granted, the rest follows and the read ends."""
    segment = seg(71, 3)
    with lone_store(tmp_path) as store:
        async with store_stub(store) as stub:
            batches = [
                write_request(segment, 3, 0, entries(first, first + 7, size=READ_ENTRY_BYTES))
                for first in range(1, READ_ENTRIES + 1, 8)
            ]
            await write_all(stub, batches)
        credit = framing.HEADER.size + FRAME_PAYLOAD_BYTES_MAX
        hello = data_plane_pb2.Hello(version_min=1, version_max=1, stream_credit_bytes=credit)
        read = segment_store_pb2.ReadRequest(segment=segment, from_index=1, max_entries_per_reply=1)
        host, port = split_address(store.data_address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            framing.encode(Kind.HELLO, 0, hello)
            + framing.encode(Kind.READ_REQUEST, 1, read)
            + framing.encode(Kind.END, 1, data_plane_pb2.End())
        )
        decoder = framing.FrameDecoder(FRAME_PAYLOAD_BYTES_MAX)
        replies: list[framing.Frame] = []
        ended = False

        async def take(timeout_s: float, until_replies: int) -> None:
            nonlocal ended
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    while len(replies) < until_replies and not ended:
                        for frame in decoder.feed(await reader.read(1 << 20)):
                            assert frame.kind is not Kind.ERROR, framing.parse_control(frame)
                            ended = ended or frame.kind is Kind.END
                            if frame.kind is Kind.READ_REPLY:
                                replies.append(frame)

        try:
            replies_in_credit = credit // (framing.HEADER.size + READ_ENTRY_BYTES + 64)
            await take(10, replies_in_credit)  # what the credit holds: it comes at once
            assert len(replies) == replies_in_credit
            # Nothing more comes while no credit is granted (a bounded wait for a frame
            # that must not come).
            await take(0.5, READ_ENTRIES)
            sent = sum(frame.size for frame in replies)
            assert sent <= credit and len(replies) < READ_ENTRIES and not ended
            assert credit - sent < replies[-1].size, "the store stopped short of its credit"
            writer.write(framing.encode(Kind.CREDIT, 1, data_plane_pb2.Credit(bytes=1 << 40)))
            await take(10, READ_ENTRIES + 1)
            assert ended
            indexes = [
                entry.index
                for frame in replies
                for entry in framing.parse(frame, segment_store_pb2.ReadReply).entries
            ]
            assert indexes == list(range(1, READ_ENTRIES + 1))
        finally:
            writer.close()
