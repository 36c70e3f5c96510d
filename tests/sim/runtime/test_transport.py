"""The in-process transport: the real store and master services, called through the
generated stubs over `Transport.aio_channel`, on the deterministic loop, with the
network's faults.

Entries reach a store and leave it on its data plane (`write_stream`, `framed_read`,
`SubscribeCall`: the framed protocol over the simulated byte streams); the master's
HoldLeaseSession, a streaming gRPC call held open while its client lives, is the sample
of a streaming exchange here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
import pytest

from bench.segment_driver import write_stream
from streamengine.client.errors import fence_of
from streamengine.master import etcd
from streamengine.master.etcd import EtcdClient, parse_etcd_url
from streamengine.protocol import framed, framed_read, framing, transport
from streamengine.protocol.framed_server import ServerCall
from streamengine.protocol.limits import DATA_REPLY_BYTES_MAX
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing import wait_until
from streamengine.v1 import master_pb2, master_pb2_grpc, segment_store_pb2, segment_store_pb2_grpc
from tests.integration.store_helpers import (
    TEST_KEY,
    SubscribeCall,
    entries,
    granted,
    seal_request,
    seg,
    subscribe_start,
    write_request,
)
from tests.sim.faults import Faults
from tests.sim.runtime.loop import run
from tests.sim.runtime.master import SimMaster
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import SimNetwork, node_context

T = TypeVar("T")
Scenario = Callable[[SimNetwork, list[SimStore], SimMaster], Coroutine[Any, Any, T]]

WRITER = "writer"
# A fault profile far harsher than a real network, so that a short run meets every fault.
HARSH = Faults(loss=0.05, duplicate=0.2, delay_ms_max=20, slow=0.05, slow_delay_ms_max=400)


def simulate(seed: int, scenario: Scenario[T], faults: Faults | None = None, stores: int = 1) -> T:
    """`scenario` run as the node `writer` beside `stores` serving stores and a master
    (which the stores do not know of)."""

    async def main() -> T:
        network = SimNetwork(asyncio.get_running_loop(), faults)
        served = [SimStore(network, f"store{n}", [TEST_KEY.public_key]) for n in range(stores)]
        master = SimMaster(network)
        with network.installed():
            async with asyncio.TaskGroup() as group:
                serving = [
                    group.create_task(store.serve(), context=node_context(store.store_id))
                    for store in served
                ]
                serving.append(group.create_task(master.serve(), context=node_context(master.name)))
                for store in served:
                    await store.serving.wait()
                await master.serving.wait()
                result: T = await group.create_task(
                    scenario(network, served, master), context=node_context(WRITER)
                )
                for task in serving:
                    task.cancel()
        return result

    return run(main(), seed)


def stub_of(store: SimStore) -> Any:
    """The generated stub on a channel of the shipped `Transport` (typed as grpc.aio's)."""
    return segment_store_pb2_grpc.SegmentStoreStub(PLAINTEXT.aio_channel(store.address))


async def write(
    store: SimStore, segment: Any, first: int, last: int, acked: int
) -> list[tuple[int, int]]:
    """Entries `first`..`last` written to `store` on a Write stream of its data plane
    (with the grant the stream needs), acked up to `acked`: the (status, matched
    index) of the reply."""
    batch = entries(first, last)
    request = write_request(segment, 3, acked, batch, 1, grant=granted(segment, 3))
    replies = await write_stream(store.data_address, [request])
    return [(reply.status, reply.matched_index) for reply in replies]


def master_stub(master: SimMaster) -> Any:
    return master_pb2_grpc.MasterStub(PLAINTEXT.aio_channel(master.address))


def lease_session(master: SimMaster, name: str, timeout_s: float | None = None) -> Any:
    """A HoldLeaseSession call of its own (a session id held twice is refused)."""
    request = master_pb2.HoldLeaseSessionRequest(session=name.encode().ljust(16, b"."))
    return master_stub(master).HoldLeaseSession(request, timeout=timeout_s)


class _Requests:
    """A Subscribe's requests, sent as they are put; `end` ends them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, request: Any) -> None:
        self.queue.put_nowait(request)

    def end(self) -> None:
        self.queue.put_nowait(None)

    async def __aiter__(self) -> Any:
        while (request := await self.queue.get()) is not None:
            yield request


async def next_data(call: Any) -> Any:
    """The next reply of a Subscribe call that is not a keepalive."""
    while True:
        reply = await call.read()
        if reply is grpc.aio.EOF or reply.WhichOneof("message") != "keepalive":
            return reply


def summary(reply: Any) -> tuple[Any, ...]:
    """A Subscribe reply as a short tuple: ("position", acked, fence) or ("batch", indexes)."""
    if reply.WhichOneof("message") == "position":
        return ("position", reply.position.acked_index, reply.position.fence)
    return ("batch", [entry.index for entry in reply.batch.entries])


def test_the_seam_is_set_only_while_a_network_is_installed() -> None:
    async def inside(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> list[str]:
        client = EtcdClient(parse_etcd_url("etcd://etcd:2379"))
        channels = [
            PLAINTEXT.aio_channel(stores[0].address),
            client.aio_channel(client.member),
            client._sync_channel(client.member),
        ]
        return [type(channel).__name__ for channel in channels]

    assert simulate(1, inside) == ["SimChannel", "SimChannel", "SimBlockingChannel"]
    assert transport.aio_channel_factory is None
    assert etcd.aio_channel_factory is None and etcd.channel_factory is None


def test_unary_calls_a_data_plane_tail_and_a_lease_session_reach_the_services() -> None:
    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> list[Any]:
        store = stores[0]
        stub = stub_of(store)
        segment = seg(7, 3)
        written = await write(store, segment, 1, 3, 3)
        requests = _Requests()
        call = SubscribeCall(store.data_address, aiter(requests))
        requests.put(subscribe_start(segment))
        replies = [summary(await next_data(call)), summary(await next_data(call))]
        written += await write(store, segment, 4, 5, 5)
        replies.append(summary(await next_data(call)))
        sealed = await stub.Seal(seal_request(segment, 4))
        replies.append(summary(await next_data(call)))
        requests.end()
        assert await next_data(call) is grpc.aio.EOF
        state = await stub.GetSegmentState(
            segment_store_pb2.GetSegmentStateRequest(segment=segment)
        )
        session = lease_session(master, "sample")
        held = await session.read()
        session.cancel()
        assert await session.code() == grpc.StatusCode.CANCELLED
        return [
            written,
            replies,
            (sealed.fence, sealed.matched_index),
            (state.fence, state.last_index),
            held.held,
        ]

    accepted = segment_store_pb2.ACCEPTED
    assert simulate(1, scenario) == [
        [(accepted, 3), (accepted, 5)],
        [("position", 3, 0), ("batch", [1, 2, 3]), ("batch", [4, 5]), ("position", 5, 4)],
        (4, 5),
        (4, 5),
        True,
    ]


def test_a_read_streams_its_replies_on_the_data_plane() -> None:
    async def scenario(
        network: SimNetwork, stores: list[SimStore], master: SimMaster
    ) -> list[list[int]]:
        segment = seg(7, 3)
        await write(stores[0], segment, 1, 9, 9)
        request = segment_store_pb2.ReadRequest(
            segment=segment, from_index=1, to_index=9, max_entries_per_reply=4
        )
        read = framed_read.read(stores[0].data_address, PLAINTEXT, request)
        return [[entry.index for entry in reply.entries] async for reply in read]

    assert simulate(1, scenario) == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]


# A segment of 20 MiB, in events of 10 KiB, written in batches of 5 MiB: more than two
# packed replies held before the store bounded a reply's bytes for the data plane
# (8 MiB each), and a score of replies since.
LARGE_READ_EVENTS = 2000
LARGE_READ_EVENT_BYTES = 10 << 10
LARGE_READ_EVENTS_PER_WRITE = 500
# A reply frame of a packed read: its values (the bound, passed by one event at most),
# a length per value and the reply's other fields.
REPLY_FRAME_BYTES_MAX = DATA_REPLY_BYTES_MAX + LARGE_READ_EVENT_BYTES + (4 << 10)


def test_a_small_read_waits_behind_a_frame_or_two_of_a_large_one_on_its_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read of a whole segment and, once its replies flow, a read of one entry on the
    same connection. The store's connection sends frames whole and in turn, so from
    taking the small read to sending its reply it sends at most the large read's frame
    on the wire and the one next in line: what it holds the small read back by is
    bounded by the store's bound on a reply, never the whole segment."""
    served: list[tuple[str, int, int]] = []  # what the store's reads did, in order
    receive, send = ServerCall.receive, ServerCall.send

    async def receiving(call: ServerCall) -> Any:
        message = await receive(call)
        if message is not None and call.method is framing.READ:
            served.append(("taken", call.request_id, 0))
        return message

    async def sending(call: ServerCall, message: Any) -> None:
        await send(call, message)
        if call.method is framing.READ:
            served.append(("sent", call.request_id, message.ByteSize()))

    monkeypatch.setattr(ServerCall, "receive", receiving)
    monkeypatch.setattr(ServerCall, "send", sending)

    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> None:
        store = stores[0]
        segment = seg(7, 3)
        per_write = LARGE_READ_EVENTS_PER_WRITE
        writes = [
            write_request(
                segment,
                3,
                0,
                entries(first, first + per_write - 1, size=LARGE_READ_EVENT_BYTES),
                request_id,
                grant=granted(segment, 3),
            )
            for request_id, first in enumerate(range(1, LARGE_READ_EVENTS, per_write), 1)
        ]
        await write_stream(store.data_address, writes)
        async with framed.connect(store.data_address, PLAINTEXT) as connection:
            large = await read_call(connection, segment, LARGE_READ_EVENTS)
            assert await large.receive() is not None  # its replies flow
            small = await read_call(connection, segment, 1)
            reply = await small.receive()
            assert isinstance(reply, segment_store_pb2.ReadReply)
            assert (reply.first_index, len(reply.value_lengths)) == (1, 1)
            large.cancel()

    simulate(1, scenario)
    large_id, small_id = 1, 2
    taken = served.index(("taken", small_id, 0))
    answered = next(n for n, item in enumerate(served) if item[:2] == ("sent", small_id))
    ahead = [size for what, rid, size in served[taken:answered] if rid == large_id]
    assert sum(ahead) <= 2 * REPLY_FRAME_BYTES_MAX, f"the small read waited behind {ahead}"
    large_sent = sum(size for _, rid, size in served if rid == large_id)
    assert large_sent < LARGE_READ_EVENTS * LARGE_READ_EVENT_BYTES, "the large read had ended"


async def read_call(
    connection: framed.DataConnection, segment: Any, to_index: int
) -> framed.ClientCall:
    """A packed Read of `segment` from its first index to `to_index`, opened on
    `connection` and ended (its replies to come)."""
    call = await connection.call(framing.READ)
    await call.send(
        segment_store_pb2.ReadRequest(
            segment=segment, from_index=1, to_index=to_index, packed=True
        )
    )
    await call.end()
    return call


def test_a_server_streaming_call_streams_through_the_executor_path() -> None:
    """The master's HoldLeaseSession (one request, replies streamed): its first reply
    arrives, the same session is refused while it is held, and cancelling the call ends
    its handler at the master, which frees the session."""
    session = bytes(range(16))

    async def hold(stub: Any) -> Any:
        return stub.HoldLeaseSession(master_pb2.HoldLeaseSessionRequest(session=session))

    async def scenario(master: SimMaster) -> list[object]:
        await master.serving.wait()
        stub = master_pb2_grpc.MasterStub(PLAINTEXT.aio_channel(master.address))
        held = await hold(stub)
        first = await held.read()
        again = await hold(stub)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await again.read()
        held.cancel()
        state = master.state
        assert state is not None
        await wait_until(lambda: session not in state.leadership.sessions)
        reopened = await hold(stub)
        second = await reopened.read()
        reopened.cancel()
        return [first.held, refused.value.code().name, second.held]

    async def main() -> list[object]:
        network = SimNetwork(asyncio.get_running_loop(), None)
        master = SimMaster(network)
        with network.installed():
            async with asyncio.TaskGroup() as group:
                serving = group.create_task(master.serve(), context=node_context(master.name))
                trace = await group.create_task(scenario(master), context=node_context(WRITER))
                serving.cancel()
        return trace

    assert run(main(), 1) == [True, "ALREADY_EXISTS", True]


def test_an_abort_reaches_the_caller_as_a_real_channel_gives_it() -> None:
    async def scenario(
        network: SimNetwork, stores: list[SimStore], master: SimMaster
    ) -> grpc.aio.AioRpcError:
        stub = stub_of(stores[0])
        segment = seg(7, 3)
        await stub.Seal(seal_request(segment, 4))
        # A Seal below the fence ends its call with the fence in the trailing metadata.
        call = stub.Seal(seal_request(segment, 3))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert await call.code() == grpc.StatusCode.FAILED_PRECONDITION
        return refused.value

    error = simulate(1, scenario)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == "fenced: seal epoch 3 < fence 4"
    assert error.trailing_metadata() == grpc.aio.Metadata(("se-fence", "4"))
    assert fence_of(error) == 4  # the SDK's own reading of it


def test_a_request_that_does_not_parse_meets_the_real_interceptor() -> None:
    async def scenario(
        network: SimNetwork, stores: list[SimStore], master: SimMaster
    ) -> grpc.aio.AioRpcError:
        channel = PLAINTEXT.aio_channel(stores[0].address)
        seal: Any = channel.unary_unary("/streamengine.v1.SegmentStore/Seal")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await seal(b"\xff\xff\xff")
        return refused.value

    error = simulate(1, scenario)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "SegmentStore/Seal: the request does not parse" in (error.details() or "")


def test_a_deadline_ends_the_call_and_cancels_its_handler() -> None:
    async def scenario(
        network: SimNetwork, stores: list[SimStore], master: SimMaster
    ) -> tuple[float, str]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The master holds a session open while its client lives: the deadline ends it.
        call = lease_session(master, "deadline", timeout_s=0.5)
        assert (await call.read()).held
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await call.read()
        waited_s = loop.time() - started
        server = master.server
        assert server is not None
        await wait_until(lambda: not server.handlings)
        return round(waited_s, 6), late.value.code().name

    assert simulate(1, scenario) == (0.5, "DEADLINE_EXCEEDED")


def test_a_partition_breaks_streams_and_calls_until_healed() -> None:
    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> list[str]:
        store = stores[0]
        stub = stub_of(store)
        segment = seg(7, 3)
        await write(store, segment, 1, 1, 1)
        call = lease_session(master, "partition")
        assert (await call.read()).held
        network.cut(WRITER, master.name)
        network.cut(WRITER, store.store_id)
        seen = []
        for attempt in (call.read(), stub.Seal(seal_request(segment, 4))):
            with pytest.raises(grpc.aio.AioRpcError) as cut_off:
                await attempt
            seen.append(cut_off.value.code().name)
        network.heal()
        channel = PLAINTEXT.aio_channel(store.address)
        await channel.channel_ready()
        sealed = await segment_store_pb2_grpc.SegmentStoreStub(channel).Seal(
            seal_request(segment, 4)
        )
        seen.append(f"sealed at {sealed.matched_index}")
        return seen

    assert simulate(1, scenario) == ["UNAVAILABLE", "UNAVAILABLE", "sealed at 1"]


def test_a_server_that_stops_breaks_its_calls_and_refuses_new_ones() -> None:
    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> list[str]:
        call = lease_session(master, "stopped")
        assert (await call.read()).held
        server = master.server
        assert server is not None
        await wait_until(lambda: bool(server.handlings))
        await server.stop()
        seen = []
        listed = master_stub(master).ListStreams(master_pb2.ListStreamsRequest())
        for attempt in (call.read(), listed):
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await attempt
            seen.append(f"{gone.value.code().name}: {gone.value.details()}")
        return seen

    assert simulate(1, scenario) == [
        "UNAVAILABLE: Connection reset: master stopped",
        "UNAVAILABLE: failed to connect to master:1: connection refused",
    ]


def test_a_connection_reset_breaks_the_calls_under_way_only() -> None:
    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> list[str]:
        call = lease_session(master, "reset")
        assert (await call.read()).held
        server = master.server
        assert server is not None
        await wait_until(lambda: bool(server.handlings))
        network.reset(WRITER, master.name)
        with pytest.raises(grpc.aio.AioRpcError) as reset:
            await call.read()
        listing = master_stub(master).ListSegments(master_pb2.ListSegmentsRequest(stream="a/b"))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await listing
        return [reset.value.code().name, unknown.value.code().name]

    # The next call goes through (the master answers that it knows no such stream).
    assert simulate(1, scenario) == ["UNAVAILABLE", "NOT_FOUND"]


async def _writers(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> list[str]:
    """Writers of several streams on every store, each appending on the data plane, a
    lease session on the master held across each batch and read, and then sealing,
    recording what each call answered and when: the trace of a run."""
    loop = asyncio.get_running_loop()
    trace: list[str] = []

    def seen(what: str) -> None:
        trace.append(f"{loop.time() - 1000:.3f} {what}")

    async def writer(store: SimStore, stream_id: int) -> None:
        stub = stub_of(store)
        segment = seg(stream_id, 3)
        name = f"{store.store_id}/{stream_id}"
        for first in range(1, 10, 3):
            session = lease_session(master, f"{name}/{first}", timeout_s=1.0)
            try:
                [(_, matched)] = await write(store, segment, first, first + 2, first + 2)
                seen(f"{name} matched {matched}")
                seen(f"{name} session held {(await session.read()).held}")
            except grpc.aio.AioRpcError as error:
                seen(f"{name} session {error.code().name}")
            except framed.CallError as error:
                seen(f"{name} write {error}")
            except OSError as error:
                seen(f"{name} write {type(error).__name__}")
            finally:
                session.cancel()
        try:
            sealed = await stub.Seal(seal_request(segment, 4), timeout=1.0)
            seen(f"{name} sealed at {sealed.matched_index}")
        except grpc.aio.AioRpcError as error:
            seen(f"{name} seal {error.code().name}")

    async with asyncio.TaskGroup() as group:
        for store in stores:
            for stream_id in range(1, 6):
                group.create_task(writer(store, stream_id))
    seen(" ".join(f"{key}={value}" for key, value in sorted(network.stats.items())))
    return trace


def test_a_seed_replays_the_same_calls_under_faults() -> None:
    first = simulate(11, _writers, HARSH, stores=3)
    assert first == simulate(11, _writers, HARSH, stores=3)
    # The run met the faults it is meant to replay.
    assert any(" session UNAVAILABLE" in line for line in first)
    assert "duplicated=0" not in first[-1] and "lost=0" not in first[-1]


def test_seeds_draw_different_faults_and_orders() -> None:
    traces = {tuple(simulate(seed, _writers, HARSH, stores=3)) for seed in range(3)}
    assert len(traces) == 3
