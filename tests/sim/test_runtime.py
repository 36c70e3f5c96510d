"""The shipped writer end to end on the simulator's runtime (tests/sim/runtime): the SDK's
`StreamClient` and `client/writer.py` leading a stream and appending through the real
store service on three stores and the real master service, and a second writer sealing
what a lost leader left through `client/recovery.py`, unmodified, on one thread in
virtual time; a seed replays the run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from streamengine import StreamClient, StreamEvent
from streamengine.client.sync import SyncStreamClient
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.sequence import pack_sequence
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.testing import wait_until
from tests.sim.faults import Faults
from tests.sim.runtime.blocking import BlockingThread
from tests.sim.runtime.loop import run
from tests.sim.runtime.master import SimMaster
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import SimNetwork, node_context

STREAM = "t/orders"
EVENTS = 40
# Loss and delays a real network could have: streams break and reopen now and then.
MILD = Faults(loss=0.002, duplicate=0.01, delay_ms_max=8, slow=0.01, slow_delay_ms_max=200)


Subscription = AsyncGenerator[StreamEvent, None]


@dataclass
class Cluster:
    """A master and three stores, each node a task of `group` running as that node."""

    network: SimNetwork
    master: SimMaster
    stores: list[SimStore]
    group: asyncio.TaskGroup
    nodes: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def start(self, name: str, serve: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.nodes[name] = self.group.create_task(serve(), context=node_context(name))

    async def crash(self, store: SimStore, power_loss: bool) -> None:
        """The store's process dies (and its machine loses power)."""
        node = self.nodes.pop(store.store_id)
        node.cancel()
        await asyncio.wait([node])
        if power_loss:
            store.power_loss()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.cancel()


Scenario = Callable[[Cluster], Coroutine[Any, Any, list[str]]]


def _simulate(
    seed: int, data_dir: Path, scenario: Scenario, faults: Faults | None = None, fsync: bool = True
) -> list[str]:
    """Three stores and a master; once the stores joined, `scenario` runs as node `w1`."""

    async def main() -> list[str]:
        network = SimNetwork(asyncio.get_running_loop(), faults)
        master = SimMaster(network)
        stores = [
            SimStore(
                network, f"store{n}", master_address=master.address, data_dir=data_dir, fsync=fsync
            )
            for n in range(3)
        ]
        with network.installed():
            async with asyncio.TaskGroup() as group:
                cluster = Cluster(network, master, stores, group)
                cluster.start(master.name, master.serve)
                for store in stores:
                    cluster.start(store.store_id, store.serve)
                await wait_until(lambda: _joined(master, stores), timeout_s=30)
                trace = await group.create_task(scenario(cluster), context=node_context("w1"))
                cluster.stop()
        return trace

    return run(main(), seed)


def _joined(master: SimMaster, stores: list[SimStore]) -> bool:
    if master.state is None:
        return False
    alive = [view.alive for view in master.state.store_views(wall_ms()).values()]
    return alive.count(True) == len(stores) and all(
        store.core is not None and store.core.catalog.cluster_id() for store in stores
    )


async def _append(cluster: Cluster) -> list[str]:
    """The writer appends `EVENTS` events in batches and closes while a follower (node
    `r1`) subscribes from the start; the trace tells what each saw, what the master says
    of the segments and what each store holds of them."""
    loop = asyncio.get_running_loop()
    master = cluster.master
    trace = []
    async with StreamClient(master.address) as client:
        await client.create_stream(STREAM, replicas=3, write_quorum=2)
        async with asyncio.TaskGroup() as group:
            following = group.create_task(_follow(master), context=node_context("r1"))
            # The SDK names the writer itself (`uuid4`, drawn from the seed): it replays too.
            async with client.writer(STREAM) as writer:
                for first in range(0, EVENTS, 8):
                    batch = [b"event %d" % n for n in range(first, first + 8)]
                    sequences = await writer.append_batch(batch)
                    at = f"{loop.time() - 1000:.3f}"
                    trace.append(f"{at} appended {sequences[0]}..{sequences[-1]}")
    trace.append(following.result())
    return trace + await _segments(cluster)


async def _follow(master: SimMaster) -> str:
    """Every event from the start, live, through `client/subscription.py`."""
    payloads = []
    async with (
        StreamClient(master.address) as client,
        # Closed on leaving, not when collected: its tasks end at a known step.
        contextlib.aclosing(cast(Subscription, client.subscribe(STREAM, start=0))) as events,
    ):
        async for event in events:
            payloads.append(event.payload)
            if len(payloads) == EVENTS:
                break
    in_order = payloads == [b"event %d" % n for n in range(EVENTS)]
    return f"followed {len(payloads)} events{' in order' if in_order else ' OUT OF ORDER'}"


async def _segments(cluster: Cluster) -> list[str]:
    trace = []
    async with StreamClient(cluster.master.address) as client:
        segments = await client.list_segments(STREAM)
    for segment in segments:
        trace.append(
            f"segment {segment.epoch} {segment.state.name} acked {segment.acked_index} "
            f"final {segment.final_index}"
        )
        for store in cluster.stores:
            assert store.core is not None
            meta = store.core.catalog.meta(SegmentKey(segment.stream_id, segment.epoch))
            held = "nothing" if meta is None else f"{meta.last_index} acked {meta.acked_index}"
            trace.append(f"  {store.store_id} holds {held}")
    return trace


def test_the_shipped_writer_appends_through_the_shipped_services(tmp_path: Path) -> None:
    trace = _simulate(1, tmp_path, _append)
    assert trace[: EVENTS // 8] == [line for line in trace if " appended " in line], (
        "every batch was appended, in order"
    )
    assert trace[EVENTS // 8] == f"followed {EVENTS} events in order"
    holds = [line for line in trace if " holds " in line]
    assert len(holds) == 3
    # Every event on a write quorum at least, and the acked index known to the stores.
    assert sum(f"holds {EVENTS} acked" in line for line in holds) >= 2, trace


def test_a_seed_replays_the_shipped_writer_under_faults(tmp_path: Path) -> None:
    first = _simulate(5, tmp_path, _append, MILD)
    assert first == _simulate(5, tmp_path, _append, MILD)
    assert first != _simulate(6, tmp_path, _append, MILD)


async def _take_over(cluster: Cluster) -> list[str]:
    """A leader appends, then its node is cut off from everyone (as a crash looks to
    them); a second writer waits out its lease, seals its segment through the real
    recovery (`client/recovery.py`) and appends in the next epoch."""
    loop = asyncio.get_running_loop()
    network, master = cluster.network, cluster.master
    trace = []
    cut_off = asyncio.Event()

    async def first_leader() -> None:
        async with StreamClient(master.address) as client:
            await client.create_stream(STREAM, replicas=3, write_quorum=2)
            async with client.writer(STREAM) as writer:
                await writer.append_batch([b"first %d" % n for n in range(16)])
                for node in [master.name, *(store.store_id for store in cluster.stores)]:
                    network.cut("w1", node)
                cut_off.set()
                await asyncio.Event().wait()  # gone, as far as anyone can tell

    async def second_leader() -> None:
        await cut_off.wait()
        started = loop.time()
        async with StreamClient(master.address) as client:
            async with client.writer(STREAM) as writer:
                trace.append(f"leads epoch {writer.epoch} after {loop.time() - started:.3f} s")
                sequences = await writer.append_batch([b"second %d" % n for n in range(8)])
                trace.append(f"appended {sequences[0]}..{sequences[-1]}")
            # Both segments read back through `client/subscription.py`, the bridge skipped.
            read = [event.payload.decode() async for event in client.read(STREAM)]
            trace.append(f"read {len(read)}: {read[0]} .. {read[15]}, {read[16]} .. {read[-1]}")

    async with asyncio.TaskGroup() as group:
        first = group.create_task(first_leader())
        await group.create_task(second_leader(), context=node_context("w2"))
        first.cancel()
    network.heal()
    return trace + await _segments(cluster)


def test_a_second_writer_recovers_what_a_lost_leader_left_unsealed(tmp_path: Path) -> None:
    trace = _simulate(2, tmp_path, _take_over)
    # The lost leader's call holding its lease broke with the cut: no lease to wait out.
    assert trace[0].startswith("leads epoch 2 after 0."), trace
    # Its 16 events sealed on every store (and the bridge after them), then the 8 new.
    assert trace[1:] == [
        f"appended {2 << 32 | 1}..{2 << 32 | 8}",
        "read 24: first 0 .. first 15, second 0 .. second 7",
        "segment 1 SEALED acked 0 final 17",
        "  store0 holds 17 acked 17",
        "  store1 holds 17 acked 17",
        "  store2 holds 17 acked 17",
        # The master knows a leader's acked index from its heartbeats (status only): the
        # second writer closed within the lease session's batching window, its last
        # heartbeat left out so that none follows its release.
        "segment 2 OPEN acked 0 final 0",
        "  store0 holds 8 acked 8",
        "  store1 holds 8 acked 8",
        "  store2 holds 8 acked 8",
    ], trace


# How long a crashed store stays down: a scenario's step, not a wait for a condition.
STORE_DOWN_S = 1.0


async def _store_crash(cluster: Cluster) -> list[str]:
    """A store's process dies in the middle of the appends, its machine losing power,
    and comes back `STORE_DOWN_S` later; the writer goes on with the other two."""
    loop = asyncio.get_running_loop()
    store = cluster.stores[1]
    trace = []
    async with StreamClient(cluster.master.address) as client:
        await client.create_stream(STREAM, replicas=3, write_quorum=2)
        async with client.writer(STREAM) as writer:
            for first in range(0, EVENTS, 8):
                if first == 16:  # after two batches of the five
                    trace.append(f"{store.store_id} dies holding {_held(store)}")
                    await cluster.crash(store, power_loss=True)
                    await asyncio.sleep(STORE_DOWN_S)
                    cluster.start(store.store_id, store.serve)
                    await store.serving.wait()
                    trace.append(f"{store.store_id} back holding {_held(store)}")
                batch = [b"event %d" % n for n in range(first, first + 8)]
                sequences = await writer.append_batch(batch)
                at = f"{loop.time() - 1000:.3f}"
                trace.append(f"{at} appended {sequences[0]}..{sequences[-1]}")
            try:
                await wait_until(lambda: _held(store).endswith(f": {EVENTS}"), timeout_s=10)
            except TimeoutError:
                trace.append("not caught up")
            trace.append(f"{loop.time() - 1000:.3f} {store.store_id} holds {_held(store)}")
    return trace + await _segments(cluster)


def _held(store: SimStore) -> str:
    assert store.core is not None
    metas = store.core.catalog.metas()
    return ", ".join(f"{key.epoch}: {meta.last_index}" for key, meta in sorted(metas.items()))


def test_a_store_back_from_a_power_loss_keeps_what_it_synced_and_catches_up(
    tmp_path: Path,
) -> None:
    trace = _simulate(3, tmp_path, _store_crash)
    assert trace[2:4] == ["store1 dies holding 1: 16", "store1 back holding 1: 16"], trace
    assert sum(" appended " in line for line in trace) == EVENTS // 8, trace
    # The writer's Write stream to it reopens and resends what it missed.
    assert trace[-5].endswith(f"store1 holds 1: {EVENTS}"), trace
    assert trace[-3:] == [f"  store{n} holds {EVENTS} acked {EVENTS}" for n in range(3)], trace


def test_a_store_without_fsync_loses_its_unsynced_writes_in_a_power_loss(
    tmp_path: Path,
) -> None:
    trace = _simulate(3, tmp_path, _store_crash, fsync=False)
    assert trace[2:4] == ["store1 dies holding 1: 16", "store1 back holding "], trace
    # The writer goes on with the other two, which hold and ack everything.
    assert sum(" appended " in line for line in trace) == EVENTS // 8, trace
    assert trace[-3] == f"  store0 holds {EVENTS} acked {EVENTS}", trace
    assert trace[-1] == f"  store2 holds {EVENTS} acked {EVENTS}", trace


async def _synchronous_client(cluster: Cluster) -> list[str]:
    def script(master: str) -> list[str]:
        with SyncStreamClient(master) as client:
            client.create_stream("t0/sync", replicas=3, write_quorum=2)
            with client.writer("t0/sync") as writer:
                first = writer.append(b"one")
                rest = writer.append_batch([b"two", b"three"])
            segments = client.list_segments("t0/sync")
        return [f"appended at {[first, *rest]}", f"segments {[s.epoch for s in segments]}"]

    return await BlockingThread("script").run(script, cluster.master.address)


def test_a_script_on_the_synchronous_client_runs_in_the_simulation(tmp_path: Path) -> None:
    """`SyncStreamClient`, unmodified, its calls taking turns with the loop."""
    trace = _simulate(5, tmp_path, _synchronous_client)
    first_epoch = trace[1].removeprefix("segments [").split("]")[0]
    assert trace == [
        f"appended at {[pack_sequence(int(first_epoch), n) for n in (1, 2, 3)]}",
        f"segments [{first_epoch}]",
    ]
    under_faults = [_simulate(5, tmp_path, _synchronous_client, MILD) for _ in (1, 2)]
    assert under_faults[0] == under_faults[1]
