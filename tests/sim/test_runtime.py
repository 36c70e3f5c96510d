"""The shipped writer end to end on the simulator's runtime (tests/sim/runtime): the SDK's
`StreamClient` and `client/writer.py` leading a stream and appending through the real
store service on three stores and the real master service, unmodified, on one thread in
virtual time; a seed replays the run."""

from __future__ import annotations

import asyncio
from pathlib import Path

from streamengine import StreamClient
from streamengine.protocol.clock import wall_ms
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.testing import wait_until
from tests.sim.network import Faults
from tests.sim.runtime.loop import run
from tests.sim.runtime.master import SimMaster
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import SimNetwork, node_context

STREAM = "t/orders"
EVENTS = 40
# Loss and delays a real network could have: streams break and reopen now and then.
MILD = Faults(loss=0.002, duplicate=0.01, delay_ms_max=8, slow=0.01, slow_delay_ms_max=200)


def _appended(seed: int, data_dir: Path, faults: Faults | None = None) -> list[str]:
    """Three stores and a master; the writer appends `EVENTS` events in batches, closes,
    and the trace tells what each store holds of the segment and what the master says."""

    async def main() -> list[str]:
        network = SimNetwork(asyncio.get_running_loop(), faults)
        master = SimMaster(network)
        stores = [
            SimStore(network, f"store{n}", master_address=master.address, data_dir=data_dir)
            for n in range(3)
        ]
        with network.installed():
            async with asyncio.TaskGroup() as group:
                nodes = [group.create_task(master.serve(), context=node_context(master.name))]
                nodes += [
                    group.create_task(store.serve(), context=node_context(store.store_id))
                    for store in stores
                ]
                await wait_until(lambda: _joined(master, stores), timeout_s=30)
                trace = await group.create_task(_write(master, stores), context=node_context("w"))
                for node in nodes:
                    node.cancel()
        return trace

    return run(main(), seed)


def _joined(master: SimMaster, stores: list[SimStore]) -> bool:
    if master.state is None:
        return False
    alive = [view.alive for view in master.state.store_views(wall_ms()).values()]
    return alive.count(True) == len(stores) and all(
        store.core is not None and store.core.catalog.cluster_id() for store in stores
    )


async def _write(master: SimMaster, stores: list[SimStore]) -> list[str]:
    loop = asyncio.get_running_loop()
    trace = []
    async with StreamClient(master.address) as client:
        await client.create_stream(STREAM, replicas=3, write_quorum=2)
        # The SDK names the writer itself (`uuid4`, drawn from the seed): it replays too.
        async with client.writer(STREAM) as writer:
            for first in range(0, EVENTS, 8):
                batch = [b"event %d" % n for n in range(first, first + 8)]
                sequences = await writer.append_batch(batch)
                trace.append(f"{loop.time() - 1000:.3f} appended {sequences[0]}..{sequences[-1]}")
        segments = await client.list_segments(STREAM)
    for segment in segments:
        trace.append(f"segment {segment.epoch} {segment.state.name} acked {segment.acked_index}")
        for store in stores:
            assert store.core is not None
            meta = store.core.catalog.meta(SegmentKey(segment.stream_id, segment.epoch))
            held = "nothing" if meta is None else f"{meta.last_index} acked {meta.acked_index}"
            trace.append(f"  {store.store_id} holds {held}")
    return trace


def test_the_shipped_writer_appends_through_the_shipped_services(tmp_path: Path) -> None:
    trace = _appended(1, tmp_path)
    assert trace[: EVENTS // 8] == [
        line for line in trace if " appended " in line
    ], "every batch was appended, in order"
    holds = [line for line in trace if " holds " in line]
    assert len(holds) == 3
    # Every event on a write quorum at least, and the acked index known to the stores.
    assert sum(f"holds {EVENTS} acked" in line for line in holds) >= 2, trace


def test_a_seed_replays_the_shipped_writer_under_faults(tmp_path: Path) -> None:
    first = _appended(5, tmp_path, MILD)
    assert first == _appended(5, tmp_path, MILD)
    assert first != _appended(6, tmp_path, MILD)
