"""Masters on the in-memory etcd (tests/sim/runtime/etcd.py), running the shipped
election and HA (`master.election`, `master.ha`, `master.etcd_metadata`), three stores
and the SDK's writers, on one thread in virtual time. While a writer appends and a
second one asks for the lease, the active master of three is killed, cut off from etcd
and the stores, or stopped cleanly; a lone master is killed and restarted; etcd goes
down and comes back. A master serves again within the design's bound, every batch
lands, never two masters serve at once, epochs only grow and none is granted over a
running lease; a seed replays the run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamengine import StreamClient
from streamengine.master.election import ELECTION_TTL_S_DEFAULT, KEEPALIVES_PER_TTL, POLL_S
from streamengine.master.etcd import parse_etcd_url
from streamengine.protocol.clock import wall_ms
from streamengine.testing import wait_until
from tests.sim.checkers import MasterChecker
from tests.sim.faults import Faults
from tests.sim.runtime.etcd import LEASE_CHECK_MS, SimEtcd
from tests.sim.runtime.loop import run
from tests.sim.runtime.master import SimElectedMaster
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import SimNetwork, node_context

STREAM = "t/orders"
BATCHES = 24
EVENTS_PER_BATCH = 4
FAIL_AT_BATCH = 4
BATCH_INTERVAL_S = 0.1
# How often the checker looks at every master (virtual time: costs little).
CHECK_INTERVAL_S = 0.005
# The design's bound ("Masters", and `--election-ttl-s`): the dead master's last lease
# runs out a TTL after its last keepalive, etcd's lessor notices within one check, a
# standby within one poll; plus a few message delays for the poll and the load.
TAKEOVER_S_MAX = ELECTION_TTL_S_DEFAULT + LEASE_CHECK_MS / 1000 + POLL_S + 0.05
ETCD_DOWN_S = 2.0
# Delays, reordering and duplicated unary calls; loss (which breaks calls and streams,
# and costs the takeover bound retries) is left to the world's seeds.
FAULTS = Faults(loss=0.0, duplicate=0.02, delay_ms_max=5, slow=0.0, slow_delay_ms_max=5)


@dataclass
class LeaseWatch:
    """Looks at every master every few ms with the worlds' `MasterChecker`: often
    enough, with two writers of one stream, to see every release."""

    masters: list[SimElectedMaster]
    checker: MasterChecker

    def look(self) -> None:
        now = wall_ms()
        active = [m for m in self.masters if m.active(now)]
        state = active[0].state if active else None
        self.checker.look([m.name for m in active], state, self.masters[0].lease_ms)

    async def run(self) -> None:
        while True:
            self.look()
            await asyncio.sleep(CHECK_INTERVAL_S)


@dataclass
class HaCluster:
    network: SimNetwork
    etcd: SimEtcd
    masters: list[SimElectedMaster]
    stores: list[SimStore]
    watch: LeaseWatch

    @property
    def addresses(self) -> str:
        return ",".join(m.address for m in self.masters)

    def active(self) -> SimElectedMaster | None:
        now = wall_ms()
        return next((m for m in self.masters if m.active(now)), None)


Act = Callable[[HaCluster, SimElectedMaster], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Failure:
    """What happens to the active master, and what later undoes it."""

    fail: Act
    recover: Act
    takeover_s_max: float = TAKEOVER_S_MAX
    # Whether a standby takes over (else the cluster serves again once recovered).
    handed_over: bool = True


def _simulate(seed: int, data_dir: Path, failure: Failure, masters_n: int = 3) -> list[str]:
    async def main() -> list[str]:
        network = SimNetwork(asyncio.get_running_loop(), FAULTS)
        etcd = SimEtcd(network)
        masters = [SimElectedMaster(network, f"m{n}", etcd.url()) for n in range(1, masters_n + 1)]
        addresses = ",".join(m.address for m in masters)
        stores = [
            SimStore(network, f"store{n}", master_address=addresses, data_dir=data_dir)
            for n in range(3)
        ]
        checker = MasterChecker(parse_etcd_url(etcd.url()), sees_every_release=True)
        cluster = HaCluster(network, etcd, masters, stores, LeaseWatch(masters, checker))
        etcd.txn_observers.append(checker.commit_applied)
        with network.installed():
            async with asyncio.TaskGroup() as group:
                etcd.start(group)
                await etcd.serving.wait()
                # The first started is the first active: its key is the oldest.
                for master in masters:
                    master.start(group)
                    await wait_until(lambda: cluster.active() is not None, 10, "a master active")
                nodes = [
                    group.create_task(store.serve(), context=node_context(store.store_id))
                    for store in stores
                ]
                await wait_until(lambda: _joined(cluster), 30, "the stores joined")
                nodes.append(group.create_task(cluster.watch.run()))
                scenario = _write_across(cluster, failure)
                trace = await group.create_task(scenario, context=node_context("w1"))
                for node in nodes:
                    node.cancel()
                for process in [*masters, etcd]:
                    if process.running:
                        await process.crash()
        assert checker.commits > 0, "the checker saw commits"
        return trace

    return run(main(), seed)


def _joined(cluster: HaCluster) -> bool:
    active = cluster.active()
    if active is None or active.state is None:
        return False
    views = active.state.store_views(wall_ms()).values()
    return sum(view.alive for view in views) == len(cluster.stores) and all(
        store.core is not None and store.core.catalog.cluster_id() for store in cluster.stores
    )


async def _write_across(cluster: HaCluster, failure: Failure) -> list[str]:
    """The writer appends batch after batch; before batch `FAIL_AT_BATCH` the active
    master fails (`failure`), the time until another serves is measured, and the failed
    one comes back as a standby. A second writer (node `w2`) asks for the lease all along
    and leads once the first left."""
    loop = asyncio.get_running_loop()
    trace = []
    taking_over: asyncio.Task[str] | None = None
    async with StreamClient(cluster.addresses) as client:
        await client.create_stream(STREAM, replicas=3, write_quorum=2)
        async with client.writer(STREAM) as writer:
            contending = asyncio.create_task(
                _contend(cluster.addresses), context=node_context("w2")
            )
            for batch in range(BATCHES):
                if batch == FAIL_AT_BATCH:
                    old = cluster.active()
                    assert old is not None
                    await failure.fail(cluster, old)
                    taking_over = asyncio.create_task(_take_over(cluster, old, failure))
                first = batch * EVENTS_PER_BATCH
                events = [b"event %d" % n for n in range(first, first + EVENTS_PER_BATCH)]
                sequences = await writer.append_batch(events)
                trace.append(
                    f"{loop.time() - 1000:.3f} appended {sequences[0]}..{sequences[-1]} "
                    f"epoch {writer.epoch}"
                )
                await asyncio.sleep(BATCH_INTERVAL_S)
        trace.append(await contending)
    assert taking_over is not None
    trace.append(await taking_over)
    checker = cluster.watch.checker
    trace.append(f"masters serving in turn: {' '.join(checker.serving)}")
    trace.append(f"epochs granted: {sorted(epoch for epoch, _ in checker.leases[STREAM])}")
    return trace


async def _contend(addresses: str) -> str:
    async with StreamClient(addresses) as client, client.writer(STREAM) as writer:
        sequence = (await writer.append_batch([b"second writer"]))[0]
        return f"w2 leads epoch {writer.epoch} once w1 left: wrote {sequence}"


async def _take_over(cluster: HaCluster, old: SimElectedMaster, failure: Failure) -> str:
    loop = asyncio.get_running_loop()
    failed_s = loop.time()
    # Alone, nobody else can serve: it comes back at once, and waits for its old key
    # to go.
    comes_back = len(cluster.masters) == 1 or not failure.handed_over
    if comes_back:
        await failure.recover(cluster, old)

    def new_active() -> bool:
        active = cluster.active()
        return active is not None and (comes_back or active is not old)

    await wait_until(new_active, 10, "a standby serving", interval_s=CHECK_INTERVAL_S)
    took_s = loop.time() - failed_s
    assert took_s <= failure.takeover_s_max, f"took over after {took_s:.3f} s"
    new = cluster.active()
    assert new is not None
    taken = f"{new.name} took over from {old.name} after {took_s:.3f} s"
    if comes_back:
        return taken
    await failure.recover(cluster, old)
    await wait_until(lambda: _stands_by_for(old, new), 10, f"{old.name} standing by")
    return f"{taken}; {old.name} stands by"


def _stands_by_for(master: SimElectedMaster, active: SimElectedMaster) -> bool:
    role = master.role
    return role is not None and role.state is None and role.active_address == active.address


async def _crash(cluster: HaCluster, master: SimElectedMaster) -> None:
    await master.crash()


async def _stop(cluster: HaCluster, master: SimElectedMaster) -> None:
    await master.stop()


async def _restart(cluster: HaCluster, master: SimElectedMaster) -> None:
    master.restart()


async def _cut_off(cluster: HaCluster, master: SimElectedMaster) -> None:
    """Partitioned from etcd and every store; the writer still reaches it."""
    for node in [cluster.etcd.name, *(store.store_id for store in cluster.stores)]:
        cluster.network.cut(master.name, node)


async def _heal(cluster: HaCluster, master: SimElectedMaster) -> None:
    cluster.network.heal()


async def _crash_etcd(cluster: HaCluster, master: SimElectedMaster) -> None:
    await cluster.etcd.crash()


async def _restart_etcd_later(cluster: HaCluster, master: SimElectedMaster) -> None:
    await asyncio.sleep(ETCD_DOWN_S)
    cluster.etcd.restart()


KILL = Failure(_crash, _restart)
CUT_OFF = Failure(_cut_off, _heal)
# A clean stop gives the lease back: the next standby wins at its next poll.
STOP = Failure(_stop, _restart, takeover_s_max=POLL_S + 0.05)
# etcd down and back with its data: its leases refreshed, the active master's next
# keepalive (within a third of a TTL) confirms it again.
ETCD_RESTART = Failure(
    _crash_etcd,
    _restart_etcd_later,
    takeover_s_max=ETCD_DOWN_S + ELECTION_TTL_S_DEFAULT / KEEPALIVES_PER_TTL + 0.05,
    handed_over=False,
)


def _check(trace: list[str]) -> None:
    appended = [line for line in trace if " appended " in line]
    assert len(appended) == BATCHES, trace
    ranges = [line.split(" appended ")[1].split(" ")[0].split("..") for line in appended]
    sequences = [int(n) for pair in ranges for n in pair]
    assert sequences == sorted(set(sequences)), "every batch, in order"
    epochs = [int(line.rpartition(" epoch ")[2]) for line in appended]
    assert epochs == sorted(epochs), "the writer's epoch never goes back"
    second = next(line for line in trace if line.startswith("w2 leads epoch "))
    assert int(second.split()[3]) > epochs[-1], "the second writer leads a later epoch"


def test_a_killed_active_master_is_replaced_within_the_bound(tmp_path: Path) -> None:
    trace = _simulate(1, tmp_path, KILL)
    _check(trace)
    assert "took over from m1" in trace[-3] and "m1 stands by" in trace[-3], trace
    assert trace[-2].startswith("masters serving in turn: m1 m"), trace


def test_an_active_master_cut_off_from_etcd_and_the_stores_is_replaced(
    tmp_path: Path,
) -> None:
    trace = _simulate(2, tmp_path, CUT_OFF)
    _check(trace)
    assert "took over from m1" in trace[-3] and "m1 stands by" in trace[-3], trace


def test_a_stopped_active_master_hands_over_at_the_next_poll(tmp_path: Path) -> None:
    trace = _simulate(6, tmp_path, STOP)
    _check(trace)
    assert "took over from m1" in trace[-3] and "m1 stands by" in trace[-3], trace


def test_etcd_restarted_under_the_writer_leaves_the_same_master_serving(tmp_path: Path) -> None:
    trace = _simulate(7, tmp_path, ETCD_RESTART)
    _check(trace)
    assert trace[-3].startswith("m1 took over from m1 after"), trace
    assert trace[-2] == "masters serving in turn: m1", trace


def test_a_lone_master_killed_and_restarted_serves_again_within_the_bound(
    tmp_path: Path,
) -> None:
    trace = _simulate(5, tmp_path, KILL, masters_n=1)
    _check(trace)
    assert "m1 took over from m1" in trace[-3], trace


def test_a_seed_replays_the_failover(tmp_path: Path) -> None:
    first = _simulate(3, tmp_path, KILL)
    assert first == _simulate(3, tmp_path, KILL)
    assert first != _simulate(4, tmp_path, KILL)
