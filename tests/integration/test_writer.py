"""The writer against real processes: a master and three stores (W=2).

Appends are checked on the stores themselves with their Read RPC (everything held, in
order), not through the SDK's own reader.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from streamengine.client import (
    AppendFailed,
    AppendInDoubt,
    AppendTimedOut,
    EventTooLarge,
    Fenced,
    InvalidArgument,
    LeadershipLost,
    NotFound,
    StreamClient,
    Unavailable,
)
from streamengine.client.core.replicator import ENTRY_MEMORY_BYTES, Append, ReplicatorLimits
from streamengine.client.core.writer import FencedByStore
from streamengine.client.sync import SyncStreamClient
from streamengine.client.writer import Writer
from streamengine.protocol import framed_read
from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.protocol.limits import EVENT_BYTES_MAX
from streamengine.protocol.sequence import unpack_sequence
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing import Cluster, wait_for, wait_until
from streamengine.v1 import entry_pb2, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.integration.authority_helpers import signed_grant

COUNT = 20_000


def payload(number: int) -> bytes:
    return b"event-%06d-" % number + b"x" * 88


async def read_store(data_address: str, stream_id: int, epoch: int) -> list[entry_pb2.Entry]:
    request = segment_store_pb2.ReadRequest(
        segment=entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch), from_index=1
    )
    entries: list[entry_pb2.Entry] = []
    async for reply in framed_read.read(data_address, PLAINTEXT, request, 30):
        entries.extend(reply.entries)
    return entries


async def segment_state(
    address: str, stream_id: int, epoch: int
) -> segment_store_pb2.SegmentStateReply:
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = store_grpc.SegmentStoreStub(channel)
        request = segment_store_pb2.GetSegmentStateRequest(
            segment=entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch)
        )
        return await stub.GetSegmentState(request, timeout=5)


async def assert_held_in_order(
    cluster: Cluster, stream_id: int, epoch: int, payloads: list[bytes], stores: int = 3
) -> None:
    held = 0
    for store in cluster.stores:
        entries = await read_store(store.data_address, stream_id, epoch)
        if len(entries) < len(payloads):
            continue
        assert [e.index for e in entries] == list(range(1, len(payloads) + 1))
        assert all(e.kind == entry_pb2.EVENT and e.epoch == epoch for e in entries)
        assert [e.payload for e in entries] == payloads
        held += 1
    assert held >= stores


async def test_twenty_thousand_single_appends_are_acked_and_held_in_order(
    cluster: Cluster,
) -> None:
    payloads = [payload(n) for n in range(COUNT)]
    async with StreamClient(cluster.master_address) as client:
        info = await client.create_stream("acme/single", replicas=3, write_quorum=2)
        async with client.writer("acme/single", leadership_timeout_s=10) as writer:
            epoch = writer.epoch
            sequences: list[int] = []
            # Single appends, many outstanding at once (each its own call and future).
            for start in range(0, COUNT, 2000):
                chunk = payloads[start : start + 2000]
                sequences += await asyncio.gather(*(writer.append(p) for p in chunk))
            stats = writer.statistics()
        assert [unpack_sequence(s) for s in sequences] == [(epoch, i) for i in range(1, COUNT + 1)]
        assert stats.acked_index == COUNT and stats.in_flight_bytes == 0
    await assert_held_in_order(cluster, info.stream_id, epoch, payloads)


async def test_twenty_thousand_batched_appends_are_acked_and_held_in_order(
    cluster: Cluster,
) -> None:
    payloads = [payload(n) for n in range(COUNT)]
    async with StreamClient(cluster.master_address) as client:
        info = await client.create_stream("acme/batched")
        async with client.writer("acme/batched", leadership_timeout_s=10) as writer:
            epoch = writer.epoch
            batches = [payloads[i : i + 500] for i in range(0, COUNT, 500)]
            results = await asyncio.gather(*(writer.append_batch(b) for b in batches))
            # Bad input is refused before anything is sent, and changes nothing.
            with pytest.raises(EventTooLarge):
                await writer.append(b"x" * (EVENT_BYTES_MAX + 1))
            with pytest.raises(InvalidArgument):
                await writer.append("text")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="split it"):
                await writer.append_batch([b"x" * EVENT_BYTES_MAX] * 17)
            assert writer.statistics().last_index == COUNT
            # Every store holds everything and knows it is acked: readers see it all.
            assert await writer.flush()
            for store in cluster.stores:
                state = await segment_state(store.address, info.stream_id, epoch)
                assert (state.matched_index, state.acked_index) == (COUNT, COUNT)
        sequences = [s for batch in results for s in batch]
        assert [unpack_sequence(s) for s in sequences] == [(epoch, i) for i in range(1, COUNT + 1)]

        # Leaving the block gave the lease back, through the lease session: the close
        # hands its release over and does not wait for the master's answer.
        async def released() -> bool:
            return (await client.describe_stream("acme/batched")).leader_id == ""

        await wait_until(released, timeout_s=5, message="the lease given back")
        assert (await client.describe_stream("acme/batched")).epoch == epoch
    await assert_held_in_order(cluster, info.stream_id, epoch, payloads)


async def append_continuously(writer: Writer, payloads: list[bytes], stop: asyncio.Event) -> None:
    """Batches of 100 with up to 8 in flight, until `stop`."""
    in_flight: set[asyncio.Task[list[int]]] = set()
    number = 0
    while not stop.is_set():
        batch = [payload(number + i) for i in range(100)]
        number += 100
        payloads += batch
        in_flight.add(asyncio.create_task(writer.append_batch(batch)))
        if len(in_flight) >= 8:
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
    for task in in_flight:
        await task


async def test_appends_go_on_while_a_store_is_killed_and_it_is_caught_up(
    cluster: Cluster,
) -> None:
    # All the store misses while down (its restart takes seconds on a loaded machine,
    # with appends at full speed) must fit the resend buffer: past it the store is
    # detached instead (a clean-clone run did so at the default 64 MiB), which the next
    # test covers.
    limits = ReplicatorLimits(retained_bytes_max=1 << 30)
    async with StreamClient(cluster.master_address) as client:
        info = await client.create_stream("acme/kill")
        async with client.writer("acme/kill", leadership_timeout_s=10, limits=limits) as writer:
            epoch = writer.epoch
            payloads: list[bytes] = []
            stop = asyncio.Event()
            appender = asyncio.create_task(append_continuously(writer, payloads, stop))
            await wait_until(lambda: writer.statistics().acked_index >= 2000, 20, "2000 acked")
            victim = cluster.stores[1]
            victim.kill()
            killed_at = writer.statistics().acked_index
            # W=2 of the two left: appends go on.
            await wait_until(
                lambda: writer.statistics().acked_index >= killed_at + 5000, 30, "appends go on"
            )
            assert appender.done() is False
            matched_while_down = writer.statistics().matched_index["store1"]
            await asyncio.to_thread(victim.start)
            # The restarted store gets everything it missed, from its matched index.
            await wait_until(
                lambda: writer.statistics().matched_index["store1"] >= killed_at + 5000,
                30,
                "store1 caught up",
            )
            stop.set()
            await appender
            # Leaving the block waits only a bounded time for stores to catch up: wait
            # for the restarted one here, so the check below does not race the machine.
            await wait_until(
                lambda: writer.statistics().matched_index["store1"] >= len(payloads),
                30,
                "store1 holds every append",
            )
            stats = writer.statistics()
            assert stats.acked_index == len(payloads)
            assert matched_while_down < killed_at + 5000
            assert not stats.detached
        state = await segment_state(victim.address, info.stream_id, epoch)
        assert state.matched_index == len(payloads)
    await assert_held_in_order(cluster, info.stream_id, epoch, payloads)


async def test_appends_go_on_past_a_stopped_store_in_bounded_memory(cluster: Cluster) -> None:
    limits = ReplicatorLimits(unacked_bytes_max=2 << 20, retained_bytes_max=4 << 20)
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("acme/stop")
        async with client.writer("acme/stop", limits=limits, leadership_timeout_s=10) as writer:
            payloads: list[bytes] = []
            stop = asyncio.Event()
            appender = asyncio.create_task(append_continuously(writer, payloads, stop))
            await wait_until(lambda: writer.statistics().acked_index >= 1000, 20, "1000 acked")
            victim = cluster.stores[2]
            victim.stop()
            try:
                stopped_at = writer.statistics().acked_index
                # 12 MiB of events pass while the store hangs: three times what the
                # writer may keep.
                peak = 0
                deadline = time.monotonic() + 60
                while writer.statistics().acked_index < stopped_at + 100_000:
                    stats = writer.statistics()
                    peak = max(peak, stats.retained_bytes)
                    assert time.monotonic() < deadline, stats
                    await asyncio.sleep(0.01)
                stop.set()
                await appender
            finally:
                victim.cont()
            stats = writer.statistics()
            assert stats.acked_index == len(payloads)
            assert stats.detached == ("store2",)
            assert peak <= limits.retained_bytes_max + 2 * limits.batch_bytes_max


async def test_a_writer_cut_off_from_master_and_quorum_times_appends_out_and_goes_on(
    cluster: Cluster,
) -> None:
    # Small enough that appends soon wait for room: those are never sent anywhere.
    limits = ReplicatorLimits(unacked_bytes_max=(1 << 20) + 4096, retained_bytes_max=2 << 20)
    name = "acme/cutoff"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name)
        async with client.writer(name, limits=limits, append_timeout_s=2) as writer:
            epoch = writer.epoch
            assert len(await writer.append_batch([payload(n) for n in range(100)])) == 100
            # Cut the writer off from the master and from two stores of three: its
            # appends reach one store only (never a quorum), and no master answers to
            # roll away from the others.
            for process in (cluster.master, cluster.stores[1], cluster.stores[2]):
                process.stop()
            try:
                batches = [[b"%d-%d" % (k, n) + b"y" * 10_000 for n in range(50)] for k in range(4)]
                pending = [asyncio.create_task(writer.append_batch(b)) for b in batches]
                results = await asyncio.wait_for(
                    asyncio.gather(*pending, return_exceptions=True), timeout=15
                )
                # Not a step-down: the writer still leads, and says how long the master
                # has been silent.
                stats = writer.statistics()
                assert stats.role == "leading", stats
                assert stats.master_silent_s is not None and stats.master_silent_s >= 1.5
            finally:
                for process in (cluster.master, cluster.stores[1], cluster.stores[2]):
                    process.cont()
            assert all(isinstance(r, AppendTimedOut) for r in results), results
            timed_out = [r for r in results if isinstance(r, AppendTimedOut)]
            # The first batch went to the one store left: in doubt, it stays in the
            # segment. The last one waited for room and was never sent.
            assert timed_out[0].in_doubt and not timed_out[-1].in_doubt, results
            # Once the stores are back the writer goes on, at the same epoch.
            after = await writer.append(b"after")
            assert unpack_sequence(after)[0] == epoch
            assert writer.statistics().role == "leading"
        # What was in doubt is in the stream exactly once, before "after"; what was
        # never sent is not.
        in_doubt = {
            p for r, b in zip(results, batches, strict=True) if r.in_doubt for p in b  # type: ignore[union-attr]
        }
        events = [e.payload async for e in client.read(name)]
        assert len(events) == len(set(events))
        assert events[:100] == [payload(n) for n in range(100)]
        assert set(events[100:-1]) == in_doubt and events[-1] == b"after"


def test_the_blocking_wrapper_appends_and_releases(cluster: Cluster) -> None:
    with SyncStreamClient(cluster.master_address) as client:
        client.create_stream("acme/sync")
        with client.writer("acme/sync", leadership_timeout_s=10) as writer:
            first = writer.append(b"one")
            rest = writer.append_batch([b"two", b"three"])
            assert [unpack_sequence(s) for s in [first, *rest]] == [
                (writer.epoch, 1),
                (writer.epoch, 2),
                (writer.epoch, 3),
            ]
            assert writer.statistics().acked_index == 3
            with pytest.raises(EventTooLarge):
                writer.append(b"x" * (EVENT_BYTES_MAX + 1))
        # The close hands the release to the lease session and does not wait for it.
        wait_for(
            lambda: client.describe_stream("acme/sync").leader_id == "",
            timeout_s=5,
            message="the lease given back",
        )


async def test_a_store_fenced_above_the_writer_ends_its_leadership(cluster: Cluster) -> None:
    async with StreamClient(cluster.master_address) as client:
        info = await client.create_stream("acme/fence")
        async with client.writer("acme/fence", leadership_timeout_s=10) as writer:
            await writer.append_batch([b"a", b"b"])
            # What a later leader's seal does: two stores of three, so no append of this
            # writer can reach a quorum any more (under the grant the master would give).
            stores = [store.name for store in cluster.stores]
            later = signed_grant(
                cluster, info.stream_id, writer.epoch + 1, {writer.epoch: stores}, "acme"
            )
            for store in cluster.stores[:2]:
                async with grpc.aio.insecure_channel(store.address, options=CLIENT_OPTIONS) as ch:
                    sealed = await store_grpc.SegmentStoreStub(ch).Seal(
                        segment_store_pb2.SealRequest(
                            segment=entry_pb2.SegmentId(
                                stream_id=info.stream_id, epoch=writer.epoch
                            ),
                            new_epoch=writer.epoch + 1,
                            grant=later,
                        ),
                        timeout=5,
                    )
                assert sealed.fence == writer.epoch + 1
            with pytest.raises(LeadershipLost) as caught:
                await writer.append(b"c")
            # Either the writer already heard of the fence (an idle acked broadcast was
            # refused with FAILED_PRECONDITION and `se-fence`), or `c` went out, was
            # refused by the fenced stores, and the third one may hold it.
            assert isinstance(caught.value, Fenced | AppendInDoubt), caught.value
            assert writer.statistics().role == "finished"
            with pytest.raises(Fenced):
                await writer.append(b"d")


async def test_a_second_writer_waits_for_the_lease_and_says_who_holds_it(
    cluster: Cluster,
) -> None:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("acme/two")
        async with client.writer("acme/two", client_id="first", leadership_timeout_s=10):
            with pytest.raises(Unavailable, match="leading: first"):
                async with client.writer("acme/two", leadership_timeout_s=0.5):
                    pass
        with pytest.raises(NotFound):
            async with client.writer("acme/none", leadership_timeout_s=5):
                pass


async def test_an_error_in_the_block_goes_on_unwrapped_and_the_lease_is_given_back(
    cluster: Cluster,
) -> None:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("acme/oops")
        with pytest.raises(ZeroDivisionError):
            async with client.writer("acme/oops", leadership_timeout_s=10) as writer:
                await writer.append(b"x")
                raise ZeroDivisionError("the caller's own bug")

        # The release leaves with the client's lease session, once any heartbeat batch
        # of the stream in flight is answered (a late grant waits out its grace).
        async def released() -> bool:
            return (await client.describe_stream("acme/oops")).leader_id == ""

        await wait_until(released, timeout_s=5, message="the lease given back")


async def test_an_append_admitted_as_its_writer_is_fenced_still_ends(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two appends wait for room; the first is admitted, then a store's fence above the
    writer arrives right as the second is admitted: the first must end (in doubt if it
    was sent, failed if it reached no store), not hang."""
    limits = ReplicatorLimits(unacked_bytes_max=EVENT_BYTES_MAX + ENTRY_MEMORY_BYTES + 32)
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("acme/admitted", replicas=3, write_quorum=2)
        async with client.writer("acme/admitted", limits=limits) as writer:
            core = writer._core
            step = core.step
            fenced = [False]

            def step_then_fence(now: int, event: Any) -> Any:
                result = step(now, event)
                if isinstance(event, Append) and event.payloads == (b"second",):
                    fenced[0] = True  # a later leader's fence arrives with this step
                    step(now, FencedByStore("s-test", core.epoch + 1))
                return result

            monkeypatch.setattr(core, "step", step_then_fence)
            first = asyncio.create_task(writer.append(b"x" * EVENT_BYTES_MAX))
            second = asyncio.create_task(writer.append(b"second"))
            third = asyncio.create_task(writer.append(b"third"))
            try:
                await asyncio.sleep(0)  # all three run up to their waits
                assert writer.statistics().waiting_appends == 2
                await asyncio.wait({first, second, third}, timeout=10)
                assert first.done() and second.done() and third.done(), "an append hangs"
            finally:
                for task in (first, second, third):
                    task.cancel()
            assert fenced[0], "the second append was never admitted"
            assert first.exception() is None
            down = writer._core.finish
            assert down is not None and down.acked_index == 1
            sent = down.sent_through >= 2
            expected = AppendInDoubt if sent else AppendFailed
            assert type(second.exception()) is expected, (down, second.exception())
            assert type(third.exception()) is AppendFailed, third.exception()
