"""Talking to a real store process in tests: entries, write streams, subscriptions.

A store run without a master (`lone_store`, `lone_store_process`) trusts `TEST_KEY`
(`--trust-signing-key`): the tests sign the grants its writes and seals need
(`granted`), as a master would. `write_all` shows each Write stream the grant of every
(stream, epoch) it writes under once, and `seal_request` carries one. A Write stream
answers a refused request in its reply and goes on: `write_all` then raises the first
refusal as `WriteRefused`, which reads as the call's error would (`code`, `details`,
`trailing_metadata`), so `client.errors` takes it as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc

from bench.segment_driver import WriteRefused as WriteRefused  # re-exported for the tests
from bench.segment_driver import write_stream
from streamengine.client.data_connections import DataConnections
from streamengine.protocol import codec, framed, framed_read, framing
from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.limits import REPLICAS_MAX
from streamengine.protocol.signing import SigningKey
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.testing import ServerProcess, make_store
from streamengine.v1 import entry_pb2, segment_store_pb2, segment_store_pb2_grpc

# A master address nothing listens on: the store must serve without its master.
NO_MASTER = "127.0.0.1:1"

# Signs the grants of stores run without a master (fixed: a failure replays).
TEST_KEY = SigningKey(bytes(range(7, 39)))
TEST_SIGNER = GrantSigner(TEST_KEY)
# Every store a test starts is `store<N>`: the grants list them all.
TEST_COPY_SET = tuple(f"store{number}" for number in range(REPLICAS_MAX))
TEST_TENANT = "t"


def trust_args(root: Path) -> list[str]:
    """Flags making a store trust `TEST_KEY`."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "test-signing-key.pub"
    path.write_text(TEST_KEY.public_key.hex() + "\n")
    return ["--trust-signing-key", str(path)]


def lone_store_process(
    root: Path, number: int = 0, extra_args: list[str] | None = None
) -> ServerProcess:
    """A store without a master that takes the tests' grants (not started)."""
    return make_store(root, number, NO_MASTER, extra_args=[*trust_args(root), *(extra_args or [])])


@contextmanager
def copy_pair(root: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two lone stores, serving: a copy's source (store1) and its target (store2)."""
    source = lone_store_process(root, 1)
    target = lone_store_process(root, 2)
    try:
        source.start(wait=False)
        target.start()
        source.wait_serving()
        yield source, target
    finally:
        source.kill()
        target.kill()


@contextmanager
def lone_store(root: Path, extra_args: list[str] | None = None) -> Iterator[ServerProcess]:
    store = lone_store_process(root, 0, extra_args)
    try:
        yield store.start()
    finally:
        store.kill()


def granted(segment: entry_pb2.SegmentId, epoch: int) -> bytes:
    """A grant of `epoch` for `segment`'s stream, listing the segment on every test store."""
    listed = (GrantSegment(segment.epoch, TEST_COPY_SET),)
    grant = Grant(segment.stream_id, epoch, TEST_TENANT, "test-writer", listed, 1 << 62)
    return TEST_SIGNER.sign(grant)


def seal_request(segment: entry_pb2.SegmentId, new_epoch: int) -> segment_store_pb2.SealRequest:
    """A seal under the grant of `new_epoch` (none when the request is malformed)."""
    valid = segment.stream_id > 0 and 0 < segment.epoch <= new_epoch < 1 << 31
    return segment_store_pb2.SealRequest(
        segment=segment, new_epoch=new_epoch, grant=granted(segment, new_epoch) if valid else b""
    )


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
    grant: bytes = b"",
) -> segment_store_pb2.WriteRequest:
    return codec.write_request(
        codec.entries_from_pb(batch),
        segment=segment,
        writer_epoch=writer_epoch,
        acked_index=acked,
        request_id=request_id,
        report_held=report_held,
        grant=grant,
    )


class SubscribeCall:
    """A Subscribe call on a store's data plane, read as the gRPC call was: `read()`
    gives a reply or `grpc.aio.EOF`, and raises the call's end as gRPC's error
    (`as_rpc_error`); `async for`; `cancel()`. The messages of `requests` are sent as
    the store's credit allows, then End. Each reply read grants its bytes back: a test
    that stops reading holds the store to its credit. A connection of its own."""

    def __init__(
        self,
        data_address: str,
        requests: AsyncIterator[segment_store_pb2.SubscribeRequest],
        transport: Transport = PLAINTEXT,
    ) -> None:
        self._connections = DataConnections(transport)
        self._sender: asyncio.Task[None] | None = None
        self._opened = asyncio.ensure_future(self._open(data_address, requests))

    async def _open(
        self, data_address: str, requests: AsyncIterator[segment_store_pb2.SubscribeRequest]
    ) -> framed.ClientCall:
        call = await self._connections.call(data_address, framing.SUBSCRIBE)
        self._sender = asyncio.create_task(self._send(call, requests))
        return call

    @staticmethod
    async def _send(
        call: framed.ClientCall, requests: AsyncIterator[segment_store_pb2.SubscribeRequest]
    ) -> None:
        with contextlib.suppress(CallError):  # the call's end reaches `read`
            async for request in requests:
                await call.send(request)
            await call.end()

    async def read(self) -> object:
        try:
            call = await asyncio.shield(self._opened)
            reply = await call.receive()
        except CallError as error:
            raise as_rpc_error(error) from None
        return grpc.aio.EOF if reply is None else reply

    @property
    def buffered_bytes(self) -> int:
        """Reply frames the store sent that were not read yet (0 before the call opens)."""
        if not self._opened.done() or self._opened.exception() is not None:
            return 0
        return self._opened.result().buffered_bytes

    async def __aiter__(self) -> AsyncIterator[segment_store_pb2.SubscribeReply]:
        while (reply := await self.read()) is not grpc.aio.EOF:
            assert isinstance(reply, segment_store_pb2.SubscribeReply)
            yield reply

    def cancel(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        if self._opened.done() and self._opened.exception() is None:
            self._opened.result().cancel()
        self._opened.cancel()
        closing = asyncio.ensure_future(self._connections.close())
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)


_CLOSING: set[asyncio.Future[None]] = set()


def subscribe_first(
    data_address: str,
    requests: list[segment_store_pb2.SubscribeRequest],
    transport: Transport = PLAINTEXT,
    timeout_s: float = 5.0,
) -> segment_store_pb2.SubscribeReply:
    """The first reply of a Subscribe of `requests` (kept open until it comes), from a
    synchronous test; the call's end raises as gRPC's error (`as_rpc_error`)."""

    async def first() -> segment_store_pb2.SubscribeReply:
        answered = asyncio.Event()

        async def held_open() -> AsyncIterator[segment_store_pb2.SubscribeRequest]:
            for request in requests:
                yield request
            await answered.wait()

        call = SubscribeCall(data_address, held_open(), transport)
        try:
            async with asyncio.timeout(timeout_s):
                reply = await call.read()
        finally:
            answered.set()
            call.cancel()
            await asyncio.sleep(0)  # the connection's close under way
        assert isinstance(reply, segment_store_pb2.SubscribeReply), "the call ended at once"
        return reply

    return asyncio.run(first())


class StoreStub:
    """A store's gRPC calls, and where its data plane serves Write (`write_replies`) and
    Read (`Read`, as the gRPC stub's was) and Subscribe (`Subscribe`, a `SubscribeCall`)."""

    def __init__(self, channel: grpc.aio.Channel, data_address: str) -> None:
        stub = segment_store_pb2_grpc.SegmentStoreStub(channel)
        self.data_address = data_address
        self.Seal = stub.Seal
        self.CopySegment = stub.CopySegment
        self.Digest = stub.Digest
        self.Delete = stub.Delete
        self.GetSegmentState = stub.GetSegmentState
        self.ListSegmentRecords = stub.ListSegmentRecords

    def Subscribe(
        self, requests: AsyncIterator[segment_store_pb2.SubscribeRequest]
    ) -> SubscribeCall:
        return SubscribeCall(self.data_address, requests)

    def Read(
        self, request: segment_store_pb2.ReadRequest, timeout: float | None = None
    ) -> AsyncIterator[segment_store_pb2.ReadReply]:
        return read_replies(self.data_address, request, timeout)


async def read_replies(
    data_address: str, request: segment_store_pb2.ReadRequest, timeout_s: float | None = None
) -> AsyncIterator[segment_store_pb2.ReadReply]:
    """A Read on the store's data plane; one ended with a status raises as the gRPC call
    did (`as_rpc_error`)."""
    try:
        async for reply in framed_read.read(data_address, PLAINTEXT, request, timeout_s):
            yield reply
    except CallError as error:
        raise as_rpc_error(error) from None


@asynccontextmanager
async def store_stub(store: ServerProcess) -> AsyncIterator[StoreStub]:
    async with grpc.aio.insecure_channel(store.address, options=CLIENT_OPTIONS) as channel:
        yield StoreStub(channel, store.data_address)


def with_grants(
    requests: Iterable[segment_store_pb2.WriteRequest],
) -> Iterator[segment_store_pb2.WriteRequest]:
    """The requests of one Write stream, the first of each (stream, writer epoch) with
    its grant (as a leader sends them), unless it carries one already."""
    shown: set[tuple[int, int]] = set()
    for request in requests:
        key = (request.segment.stream_id, request.writer_epoch)
        valid = key[0] > 0 and 0 < request.segment.epoch <= key[1] < 1 << 31
        if key not in shown and valid and not request.grant:
            request.grant = granted(request.segment, request.writer_epoch)
        shown.add(key)
        yield request


async def write_replies(
    stub: StoreStub, requests: list[segment_store_pb2.WriteRequest]
) -> list[segment_store_pb2.WriteReply]:
    """Send every request on one Write stream (`with_grants`), on the store's data
    plane; the replies, in order, refused ones included. A stream ended with a status
    raises as the gRPC call did (`as_rpc_error`)."""
    try:
        return await write_stream(stub.data_address, with_grants(requests))
    except CallError as error:
        raise as_rpc_error(error) from None


def as_rpc_error(error: CallError) -> grpc.aio.AioRpcError:
    """A data-plane call's end as gRPC's error of the same status and metadata."""
    code = next(c for c in grpc.StatusCode if c.value[0] == error.code)
    trailing = grpc.aio.Metadata(*error.metadata.items())
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, error.details)


async def stream_writes(
    data_address: str,
    requests: AsyncIterator[segment_store_pb2.WriteRequest],
    on_reply: Callable[[segment_store_pb2.WriteReply], None],
) -> None:
    """One Write stream sending `requests` while it hears each reply (`on_reply`), until
    the store ends it; raises framed.CallError when it ends otherwise (the store died)."""
    async with framed.connect(data_address, PLAINTEXT) as connection:
        call = await connection.call(framing.WRITE)

        async def send() -> None:
            with contextlib.suppress(CallError):  # the receiving side says what happened
                async for request in requests:
                    await call.send(request)
                await call.end()

        ended: CallError | None = None  # raised as it is, not in the TaskGroup's group
        async with asyncio.TaskGroup() as tasks:
            sender = tasks.create_task(send())
            try:
                while (reply := await call.receive()) is not None:
                    assert isinstance(reply, segment_store_pb2.WriteReply)
                    on_reply(reply)
            except CallError as error:
                ended = error
            finally:
                sender.cancel()
        if ended is not None:
            raise ended


async def write_all(
    stub: StoreStub,
    requests: list[segment_store_pb2.WriteRequest],
) -> list[segment_store_pb2.WriteReply]:
    """`write_replies`, raising the first refusal (`WriteRefused`) once every request
    is answered."""
    replies = await write_replies(stub, requests)
    assert len(replies) == len(requests), "a refusal ends no Write stream"
    refused = [r for r in replies if r.status == segment_store_pb2.REFUSED]
    if refused:
        raise WriteRefused(refused[0])
    return replies


async def state(
    stub: StoreStub, segment: entry_pb2.SegmentId
) -> segment_store_pb2.SegmentStateReply:
    return await stub.GetSegmentState(segment_store_pb2.GetSegmentStateRequest(segment=segment))


async def read_all(
    stub: StoreStub,
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
    call: SubscribeCall, timeout_s: float = 5.0
) -> segment_store_pb2.SubscribeReply:
    reply = await asyncio.wait_for(call.read(), timeout_s)
    assert isinstance(reply, segment_store_pb2.SubscribeReply), "the stream ended"
    return reply
