"""The world on the runtime: the shipped system under a seeded workload and nemesis.

Theory of operation. A seed draws a `WorldConfig` (policy, stores, client processes,
streams, faults, lease, workload, nemesis) and then everything runs on one `SimLoop`:
the shipped master (`SimMaster`) and stores (`SimStore`), client processes that each
open a `StreamClient` on their own node of the `SimNetwork` and lead their streams
through the shipped writer (rivals race for some of them), and followers reading every
stream back through the shipped subscription. Nothing here stands in for a shell.

The safety phase runs `safety_ms` of virtual time under network faults and a nemesis
on the loop's timers: stores crashing with their machine's power (fsync on or off) and
coming back, now and then with a wiped disk (a new incarnation); partitions and
connection resets; client processes crashing (cut off, their tasks cancelled; a new
incarnation takes over through the shipped recovery); the master restarting over the
same metadata. The liveness phase then heals the network, brings every node back,
stops faults, and must converge within `LIVENESS_MS`: every stream's leader gets a
marker acked, and every follower has read every event ever acked.

The checkers are `tests.sim.checkers.Checker`s, one per stream, fed with what the
shipped shells returned: acks (invariant 1 and 2, the gate on earlier segments),
events followers read, how and when each append ended (invariant 7: an append ends
within the writer's append timeout, acked or with a typed SDK error), and periodic
audits of every store's served prefix and sealed replicas against the master
(invariants 2, 4, 5).

    python -m tests.sim --runtime --seed N       # one seed, with its trace
    python -m tests.sim --runtime --soak K --first F

Flaws (`RUNTIME_FLAWS`) switch a defect back into the shipped code for one run, so
that a test can show the world still finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from unittest import mock

from streamengine import StreamClient, StreamEvent
from streamengine.client import writer as writer_shell
from streamengine.client.core import writer as writer_core
from streamengine.client.core.replicator import Replicator
from streamengine.client.errors import (
    AppendFailed,
    AppendTimedOut,
    DataLossError,
    LeadershipLost,
    StreamEngineError,
)
from streamengine.client.writer import Writer
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.sequence import unpack_sequence
from streamengine.segment_store import master_link
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.kv import MemoryKV
from streamengine.testing import wait_until
from tests.sim.checkers import Checker, Violation
from tests.sim.network import Faults
from tests.sim.runtime.loop import run
from tests.sim.runtime.master import SimMaster
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import SimNetwork, node_context
from tests.sim.world import is_documented_loss, run_outcome

# Defects the world must find, each switched back into the shipped code for one run:
# `park_forever`: a writer leading an epoch granted without a segment parks appends and
# never times them out (issue #35, defect 3); and the old world's, in the shipped shells:
# `fail_in_doubt`: a writer stepping down tells users an append failed that may be
# durable; `forget_pending`: it loses its pending appends as it steps down (they hang);
# `ack_before_seal`: a new segment acks before the earlier ones are sealed.
RUNTIME_FLAWS = ("park_forever", "fail_in_doubt", "forget_pending", "ack_before_seal")

# The safety phase lasts this much virtual time: a run's cost is about its appends
# (`appends_per_s`) and the heartbeats of its writers.
SAFETY_MS = 10_000
# The liveness phase must converge within this much virtual time.
LIVENESS_MS = 60_000
# The master link measures a real directory's free bytes; every simulated disk has this
# much, so placement replays whatever the machine's disk holds.
SIM_DISK_FREE_BYTES = 1 << 40
SIM_DATA_DIR = Path("/sim/data")
# How often the checkers audit every store and look for appends open too long.
AUDIT_EVERY_MS = 500
WATCH_EVERY_MS = 50
# An append ends within the writer's append timeout; the writer's clock task wakes at the
# deadline exactly, this leaves a few ticks for the answer to reach its caller.
APPEND_END_SLACK_MS = 20
# A writer that lost leadership (or never got it) asks again after this long.
LEAD_AGAIN_MS = 100
# A follower whose subscription failed subscribes again after this long.
FOLLOW_AGAIN_MS = 200
# How long nodes may take to end once cancelled (a writer gives its lease back).
STOP_MS_MAX = 10_000
# How long setting the cluster up may take (stores join, streams are created).
SETUP_MS_MAX = 30_000
# With `WorldConfig.wipes`, the chance that a store's crash wipes its disk.
WIPE_CHANCE = 0.5


@dataclass(frozen=True, slots=True)
class WorldConfig:
    seed: int
    policy: ReplicationPolicy
    stores: int
    processes: int  # client processes, each with its own StreamClient and node
    streams: int
    rivals: float  # the share of streams a second process races to lead
    followers: int
    faults: Faults
    lease_ms: int
    append_timeout_ms: int
    in_flight_max: int  # appends one writer has in flight at once
    batch_max: int
    appends_per_s: int  # over all streams together: the cost of a run
    chaos_every_ms: int
    store_down_ms_max: int
    safety_ms: int
    segment_bytes: int
    fsync_never: tuple[str, ...] = ()
    wipes: bool = False
    flaws: frozenset[str] = frozenset()

    @property
    def store_timeout_ms(self) -> int:
        return 2 * self.lease_ms

    @staticmethod
    def draw(seed: int, rng: random.Random, flaws: frozenset[str] = frozenset()) -> WorldConfig:
        replicas, quorum = rng.choice(((3, 2), (3, 2), (3, 3), (2, 1), (5, 3), (1, 1)))
        lease_ms = rng.choice((300, 600, 1200))
        append_timeout_ms = lease_ms * rng.choice((3, 5))
        stores = replicas + rng.choice((0, 0, 1, 2))
        fsync_never: tuple[str, ...] = ()
        if quorum > 1 and rng.random() < 1 / 3:
            names = [f"store{n}" for n in range(stores)]
            fsync_never = tuple(sorted(rng.sample(names, rng.randint(1, quorum - 1))))
        return WorldConfig(
            seed=seed,
            policy=ReplicationPolicy(replicas, quorum),
            stores=stores,
            processes=rng.choice((2, 3)),
            streams=rng.choice((2, 4, 8, 16)),
            rivals=rng.choice((0.0, 0.25, 1.0)),
            followers=rng.choice((1, 2)),
            faults=Faults.draw(rng),
            lease_ms=lease_ms,
            append_timeout_ms=append_timeout_ms,
            in_flight_max=rng.choice((1, 2, 4)),
            batch_max=rng.choice((1, 3, 8)),
            appends_per_s=rng.choice((10, 25, 50)),
            chaos_every_ms=lease_ms * rng.choice((1, 2, 4)),
            store_down_ms_max=append_timeout_ms * rng.choice((1, 3)),
            safety_ms=SAFETY_MS,
            segment_bytes=rng.choice((0, 0, 600, 3000)),
            fsync_never=fsync_never,
            wipes=rng.random() < 0.25,
            flaws=flaws,
        )

    def describe(self) -> str:
        f = self.faults
        return (
            f"seed {self.seed}: N={self.policy.replicas} W={self.policy.write_quorum} "
            f"stores={self.stores} processes={self.processes} streams={self.streams} "
            f"rivals={self.rivals} followers={self.followers} lease={self.lease_ms}ms "
            f"append timeout={self.append_timeout_ms}ms loss={f.loss} dup={f.duplicate} "
            f"delay<={f.delay_ms_max}ms slow={f.slow}/{f.slow_delay_ms_max}ms "
            f"in flight<={self.in_flight_max} batch<={self.batch_max} "
            f"{self.appends_per_s} appends/s chaos/{self.chaos_every_ms}ms "
            f"store down<={self.store_down_ms_max}ms roll at {self.segment_bytes or '-'}B"
            + (f" fsync-never={list(self.fsync_never)}" if self.fsync_never else "")
            + (" wipes" if self.wipes else "")
            + (f" flaws={sorted(self.flaws)}" if self.flaws else "")
        )


@dataclass
class WorldResult:
    config: WorldConfig
    virtual_ms: int = 0
    acked: int = 0
    read: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    error: str = ""
    trace: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    unsynced_losses: list[str] = field(default_factory=list)

    @property
    def documented_loss(self) -> bool:
        return is_documented_loss(self.violation, self.unsynced_losses)

    @property
    def ok(self) -> bool:
        return (self.violation is None or self.documented_loss) and not self.error

    def summary(self) -> str:
        outcome = run_outcome(self.violation, self.unsynced_losses, self.error)
        return (
            f"seed {self.config.seed}: {outcome}; {self.virtual_ms} ms virtual, "
            f"{self.acked} events acked, {self.read} read, {self.seconds * 1000:.0f} ms"
        )


@dataclass
class Process:
    """A client process: its streams, and its incarnation (each is its own node)."""

    name: str
    streams: tuple[str, ...]
    incarnation: int = 1

    @property
    def node(self) -> str:
        return f"{self.name}.{self.incarnation}"


Subscription = AsyncGenerator[StreamEvent, None]


class World:
    """One seed's cluster, workload, nemesis and checkers: see the module doc."""

    def __init__(
        self,
        config: WorldConfig,
        rng: random.Random,
        network: SimNetwork,
        group: asyncio.TaskGroup,
        trace: Callable[[str], None] | None,
    ) -> None:
        self.config = config
        self.rng = rng
        self.network = network
        self.loop = network.loop
        self.group = group
        self._trace = trace
        self.lines: list[str] = []
        self.master = SimMaster(
            network, lease_ms=config.lease_ms, store_timeout_ms=config.store_timeout_ms
        )
        self.stores = {
            name: SimStore(
                network,
                name,
                master_address=self.master.address,
                data_dir=SIM_DATA_DIR,
                fsync=name not in config.fsync_never,
            )
            for name in (f"store{n}" for n in range(config.stores))
        }
        self.stream_names = [f"t{n % 3}/s{n}" for n in range(config.streams)]
        self.processes = [Process(f"c{n}", ()) for n in range(1, config.processes + 1)]
        self._assign_streams()
        self.nodes: dict[str, asyncio.Task[None]] = {}
        self.checkers: dict[str, Checker] = {}
        self.phase = "setup"
        self.violation: Violation | None = None
        self.finished = asyncio.Event()
        self.markers: dict[str, bytes] = {}  # stream -> its acked liveness marker
        self.wiped: set[str] = set()
        # Client process nodes that crashed: their appends answer nobody any more.
        self.crashed: set[str] = set()
        # Streams whose liveness marker is being appended.
        self.marking: set[str] = set()
        # Every writer by its client id, for what a report says of it.
        self.writers: dict[str, Writer] = {}
        self.stats: dict[str, int] = {}
        self._payloads = 0

    def _assign_streams(self) -> None:
        """Each stream has a leading process; a share of them a rival one too."""
        wanted: dict[str, list[str]] = {p.name: [] for p in self.processes}
        names = [p.name for p in self.processes]
        for n, stream in enumerate(self.stream_names):
            first = names[n % len(names)]
            wanted[first].append(stream)
            if self.rng.random() < self.config.rivals:
                rival = self.rng.choice([name for name in names if name != first])
                wanted[rival].append(stream)
        for process in self.processes:
            process.streams = tuple(wanted[process.name])

    # ---- plumbing ----

    @property
    def now_ms(self) -> int:
        return round(self.loop.elapsed_s() * 1000)

    def note(self, text: str) -> None:
        line = f"{self.now_ms:>7} {text}"
        self.lines.append(line)
        if self._trace is not None:
            self._trace(line)

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def check(self, call: Callable[..., object], *args: Any) -> bool:
        """`call(*args)`, a check; the first violation ends the run. False once one did."""
        if self.violation is not None:
            return False
        try:
            call(*args)
        except Violation as violation:
            self.violation = violation
            self.note(f"VIOLATION {violation}")
            self.finished.set()
            return False
        return True

    def start(self, node: str, serve: Coroutine[Any, Any, None]) -> None:
        self.nodes[node] = self.group.create_task(serve, context=node_context(node))

    async def stop(self, node: str) -> None:
        task = self.nodes.pop(node)
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def stop_all(self) -> None:
        """End every node; a node still running `STOP_MS_MAX` later is a world error
        (its loop does not end when cancelled)."""
        self.phase = "stopped"
        tasks = list(self.nodes.values())
        for task in tasks:
            task.cancel()
        if tasks:
            _, running = await asyncio.wait(tasks, timeout=STOP_MS_MAX / 1000)
            if running:
                raise RuntimeError(f"nodes still running after being stopped: {running}")

    def next_payloads(self, writer_id: str, count: int) -> tuple[bytes, ...]:
        payloads = []
        for _ in range(count):
            self._payloads += 1
            payloads.append(f"{writer_id}:{self._payloads}".encode())
        return tuple(payloads)

    # ---- the run ----

    async def run(self) -> None:
        await self._set_up()
        self.phase = "safety"
        self.network.faults = self.config.faults
        for process in self.processes:
            self.start(process.node, self._process(process))
        for n in range(1, self.config.followers + 1):
            self.start(f"r{n}", self._follower(f"r{n}"))
        self.start("nemesis", self._nemesis())
        self.start("watch", self._watch())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.safety_ms / 1000):
                await self.finished.wait()
        if self.violation is not None:
            return
        await self._start_liveness()
        try:
            async with asyncio.timeout(LIVENESS_MS / 1000):
                await self.finished.wait()
        except TimeoutError:
            self.check(self._raise_stuck)
        if self.violation is None:
            followers = [f"r{n}" for n in range(1, self.config.followers + 1)]
            for _, checker in sorted(self.checkers.items()):
                self.check(self._audit, checker)
                self.check(checker.check_complete, followers)

    async def _set_up(self) -> None:
        self.start(self.master.name, self.master.serve())
        for name, store in self.stores.items():
            self.start(name, store.serve())
        async with asyncio.timeout(SETUP_MS_MAX / 1000):
            await wait_until(self._joined, timeout_s=SETUP_MS_MAX / 1000)
            await self.group.create_task(self._create_streams(), context=node_context("setup"))
        state = self.master.state
        assert state is not None
        for stream in self.stream_names:
            stream_id = state.streams[stream].stream_id
            self.checkers[stream] = Checker(stream_id, self.config.append_timeout_ms)
        self.note(f"{len(self.stores)} stores joined; {len(self.stream_names)} streams created")

    async def _create_streams(self) -> None:
        async with StreamClient(self.master.address) as client:
            for stream in self.stream_names:
                await client.create_stream(
                    stream,
                    replicas=self.config.policy.replicas,
                    write_quorum=self.config.policy.write_quorum,
                    segment_bytes=self.config.segment_bytes,
                )

    def _joined(self) -> bool:
        state = self.master.state
        if state is None:
            return False
        alive = [view.alive for view in state.store_views(wall_ms()).values()]
        return alive.count(True) == len(self.stores) and all(
            store.core is not None and store.core.catalog.cluster_id()
            for store in self.stores.values()
        )

    # ---- client processes: writers ----

    @property
    def _append_every_ms(self) -> int:
        """Per writer, at most: `appends_per_s` over all streams, twice on average."""
        return max(1, 2 * 1000 * len(self.stream_names) // self.config.appends_per_s)

    async def _process(self, process: Process) -> None:
        while self.phase != "stopped":
            try:
                async with (
                    StreamClient(self.master.address) as client,
                    asyncio.TaskGroup() as tasks,
                ):
                    for stream in process.streams:
                        tasks.create_task(self._lead(process, client, stream))
            except StreamEngineError as error:  # no first contact: the master is away
                self.count(f"process {type(error).__name__}")
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)

    async def _lead(self, process: Process, client: StreamClient, stream: str) -> None:
        attempt = 0
        while self.phase != "stopped":
            attempt += 1
            writer_id = f"{process.node}/{stream}#{attempt}"
            try:
                async with client.writer(
                    stream,
                    client_id=writer_id,
                    append_timeout_s=self.config.append_timeout_ms / 1000,
                ) as writer:
                    self.writers[writer_id] = writer
                    self.note(f"{writer_id} leads epoch {writer.epoch}")
                    await self._write(writer, writer_id, self.checkers[stream], stream)
            except StreamEngineError as error:
                self.note(f"{writer_id} ends: {type(error).__name__}: {error}")
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)

    async def _write(self, writer: Writer, writer_id: str, checker: Checker, stream: str) -> None:
        """Append batches, up to `in_flight_max` at once, until leadership ends."""
        lost = asyncio.Event()
        in_flight = asyncio.Semaphore(self.config.in_flight_max)
        # The first append at once: until a segment's first write reaches its stores,
        # readers of the stream find it nowhere and ask again and again.
        pause_ms = 0
        async with asyncio.TaskGroup() as appends:
            while not lost.is_set():
                await asyncio.sleep(pause_ms / 1000)
                pause_ms = self.rng.randint(1, self._append_every_ms)
                if self.phase == "liveness":
                    if stream in self.markers or stream in self.marking:
                        continue
                    self.marking.add(stream)
                    payloads: tuple[bytes, ...] = (f"marker:{writer_id}:{self.now_ms}".encode(),)
                else:
                    count = self.rng.randint(1, self.config.batch_max)
                    payloads = self.next_payloads(writer_id, count)
                await in_flight.acquire()
                appends.create_task(
                    self._append(writer, writer_id, checker, stream, payloads, lost, in_flight)
                )
        if writer.leading:
            return
        raise LeadershipLost(f"{writer_id}: no longer leads")

    async def _append(
        self,
        writer: Writer,
        writer_id: str,
        checker: Checker,
        stream: str,
        payloads: tuple[bytes, ...],
        lost: asyncio.Event,
        in_flight: asyncio.Semaphore,
    ) -> None:
        self.check(checker.append_started, writer_id, payloads, self.now_ms)
        try:
            sequences = await writer.append_batch(payloads)
        except StreamEngineError as error:
            self.check(checker.append_ended, writer_id, payloads)
            self._append_failed(checker, writer_id, payloads, error, lost)
            return
        finally:
            in_flight.release()
            if payloads[0].startswith(b"marker:"):
                self.marking.discard(stream)
        self.check(checker.append_ended, writer_id, payloads)
        state = self.master.state
        assert state is not None
        for sequence, payload in zip(sequences, payloads, strict=True):
            epoch, index = unpack_sequence(sequence)
            if not self.check(checker.user_acked, epoch, index, payload, state):
                return
        if payloads[0].startswith(b"marker:"):
            self.markers[stream] = payloads[0]
            self.note(f"{writer_id} marker acked at {unpack_sequence(sequences[0])}")
            if len(self.markers) == len(self.stream_names):
                self._check_converged()

    def _append_failed(
        self,
        checker: Checker,
        writer_id: str,
        payloads: tuple[bytes, ...],
        error: StreamEngineError,
        lost: asyncio.Event,
    ) -> None:
        self.count(type(error).__name__)
        definitely_failed = isinstance(error, AppendFailed) or (
            isinstance(error, AppendTimedOut) and not error.in_doubt
        )
        if definitely_failed:
            self.check(checker.appends_failed, list(payloads))
        if isinstance(error, LeadershipLost):
            lost.set()

    # ---- followers ----

    async def _follower(self, name: str) -> None:
        while self.phase != "stopped":
            try:
                async with (
                    StreamClient(self.master.address) as client,
                    asyncio.TaskGroup() as tasks,
                ):
                    for stream in self.stream_names:
                        tasks.create_task(self._follow(name, client, stream))
            except StreamEngineError as error:  # no first contact: the master is away
                self.count(f"follower {type(error).__name__}")
            await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)

    async def _follow(self, name: str, client: StreamClient, stream: str) -> None:
        checker = self.checkers[stream]
        while self.phase != "stopped":
            last = checker.followers[name].last if name in checker.followers else -1
            try:
                async with contextlib.aclosing(
                    cast(Subscription, client.subscribe(stream, start=last + 1))
                ) as events:
                    async for event in events:
                        self.check(checker.follower_event, name, event.sequence, event.payload)
                        if self.phase == "liveness":
                            self._check_converged()
            except DataLossError as error:
                self.check(self._raise_data_loss, name, error)
                return
            except StreamEngineError as error:
                self.count(f"follower {type(error).__name__}")
            await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)

    def _raise_data_loss(self, name: str, error: DataLossError) -> None:
        raise Violation(1, f"follower {name}: DataLossError: {error}")

    # ---- the nemesis ----

    async def _nemesis(self) -> None:
        while self.phase != "stopped":
            await asyncio.sleep(self.rng.randint(1, self.config.chaos_every_ms) / 1000)
            if self.phase != "safety":
                return
            roll = self.rng.random()
            if roll < 0.25:
                self.group.create_task(self._crash_store(), context=node_context("nemesis"))
            elif roll < 0.45:
                self.group.create_task(self._crash_process(), context=node_context("nemesis"))
            elif roll < 0.55:
                self.group.create_task(self._restart_master(), context=node_context("nemesis"))
            elif roll < 0.75:
                self._partition()
            else:
                self._reset()

    def _down_ms(self, most: int) -> int:
        return self.rng.randint(self.config.lease_ms // 2, max(self.config.lease_ms, most))

    async def _crash_store(self) -> None:
        name = self.rng.choice(sorted(self.stores))
        if name not in self.nodes:
            return
        store = self.stores[name]
        wipe = self.config.wipes and self._may_wipe(name) and self.rng.random() < WIPE_CHANCE
        power_loss = self.rng.random() < 0.5
        matched = self._matched(store)
        await self.stop(name)
        if wipe:
            self.wiped.add(name)
            store.kv = MemoryKV()
            self.note(f"{name} crashes; its disk is wiped")
            for checker in self.checkers.values():
                self.check(checker.store_wiped, name)
        else:
            if power_loss:
                store.power_loss()
            self.note(f"{name} crashes{' with its power' if power_loss else ''}")
        self.count("store crashes")
        await asyncio.sleep(self._down_ms(self.config.store_down_ms_max) / 1000)
        if self.phase != "safety" or name in self.nodes:
            return
        self._restart_store(name, matched if power_loss and not wipe else {})

    def _restart_store(self, name: str, matched: dict[SegmentKey, int]) -> None:
        store = self.stores[name]
        self.note(f"{name} restarts")
        self.start(name, store.serve())

        async def restarted() -> None:
            await store.serving.wait()
            assert store.core is not None
            core = store.core
            for checker in self.checkers.values():
                self.check(checker.store_restarted, name, core, not store.fsync, matched)

        if matched:
            self.group.create_task(restarted())

    @staticmethod
    def _matched(store: SimStore) -> dict[SegmentKey, int]:
        if store.core is None:
            return {}
        return {key: meta.matched_index for key, meta in store.core.catalog.metas().items()}

    def _may_wipe(self, name: str) -> bool:
        """At most min(N - W, W - 1) stores are ever wiped in a run, so every segment
        keeps the quorums its recovery needs (as in the old world)."""
        policy = self.config.policy
        most = min(policy.replicas - policy.write_quorum, policy.write_quorum - 1)
        return name in self.wiped or len(self.wiped) < most

    async def _crash_process(self) -> None:
        process = self.rng.choice(self.processes)
        node = process.node
        if node not in self.nodes:
            return
        self.note(f"{node} crashes")
        self.count("process crashes")
        # Cut off first: a dead process says nothing more (no release, no flush).
        for other in [self.master.name, *self.stores, *self._client_nodes()]:
            if other != node:
                self.network.cut(node, other)
        self.crashed.add(node)
        await self.stop(node)
        for checker in self.checkers.values():
            for writer_id in sorted(checker.open_appends):
                if writer_id.startswith(f"{node}/"):
                    checker.writer_gone(writer_id)
        await asyncio.sleep(self._down_ms(2 * self.config.lease_ms) / 1000)
        if self.phase != "safety":
            return
        process.incarnation += 1
        self.note(f"{process.node} starts")
        self.start(process.node, self._process(process))

    def _client_nodes(self) -> list[str]:
        followers = [f"r{n}" for n in range(1, self.config.followers + 1)]
        return [p.node for p in self.processes] + followers

    async def _restart_master(self) -> None:
        if self.master.name not in self.nodes:
            return
        self.note("the master restarts")
        self.count("master restarts")
        await self.stop(self.master.name)
        await asyncio.sleep(self._down_ms(self.config.lease_ms) / 1000)
        if self.phase != "safety" or self.master.name in self.nodes:
            return
        self.start(self.master.name, self.master.serve())

    def _servers(self) -> list[str]:
        return [self.master.name, *sorted(self.stores)]

    def _partition(self) -> None:
        a, b = self.rng.sample(self._servers() + self._client_nodes(), 2)
        if self.network.partitioned(a, b):
            return
        self.note(f"partition {a} | {b}")
        self.count("partitions")
        self.network.cut(a, b)
        heal_s = self.rng.randint(20, 3 * self.config.lease_ms) / 1000
        self.loop.call_later(heal_s, self._heal, a, b)

    def _heal(self, a: str, b: str) -> None:
        if self.network.partitioned(a, b) and self.phase == "safety":
            self.note(f"heal {a} | {b}")
            self.network.cuts.discard((min(a, b), max(a, b)))

    def _reset(self) -> None:
        a, b = self.rng.sample(self._servers() + self._client_nodes(), 2)
        self.note(f"reset {a} | {b}")
        self.network.reset(a, b)

    # ---- checks while running ----

    async def _watch(self) -> None:
        """Invariant 7 every `WATCH_EVERY_MS`: no append open past the writer's append
        timeout; and every `AUDIT_EVERY_MS` an audit of every store."""
        audit_at = self.now_ms + AUDIT_EVERY_MS
        while self.phase != "stopped":
            await asyncio.sleep(WATCH_EVERY_MS / 1000)
            now = self.now_ms
            for checker in self.checkers.values():
                for writer_id in sorted(checker.open_appends):
                    if writer_id.partition("/")[0] in self.crashed:
                        continue
                    late_ms = now - APPEND_END_SLACK_MS
                    if not self.check(checker.writer_running, writer_id, late_ms):
                        self._describe(writer_id)
            if now >= audit_at:
                audit_at = now + AUDIT_EVERY_MS
                for checker in self.checkers.values():
                    self.check(self._audit, checker)

    def _describe(self, writer_id: str) -> None:
        writer = self.writers.get(writer_id)
        if writer is not None:
            stats = writer.statistics()
            self.note(
                f"{writer_id}: {stats.role} epoch {stats.epoch}, last index "
                f"{stats.last_index}, acked {stats.acked_index}, "
                f"{stats.pending_appends} pending, {stats.waiting_appends} waiting, "
                f"unsealed {list(stats.unsealed_epochs)}, "
                f"{'a segment' if writer._core.replicator else 'NO SEGMENT'}"
            )

    def _audit(self, checker: Checker) -> None:
        state = self.master.state
        assert state is not None
        cores = {
            name: store.core
            for name, store in sorted(self.stores.items())
            if store.core is not None and store.serving.is_set()
        }
        for segment in state.stream_segments(checker.stream_id):
            if segment.final_index:
                key = SegmentKey(checker.stream_id, segment.epoch)
                checker.sealed_at_master(key, segment.final_index, cores)
        checker.audit(cores, state)

    # ---- liveness ----

    async def _start_liveness(self) -> None:
        self.phase = "liveness"
        self.note("liveness phase: faults off, network healed, every node back")
        self.network.faults = Faults.none()
        self.network.heal()
        if self.master.name not in self.nodes:
            self.start(self.master.name, self.master.serve())
        for name in sorted(self.stores):
            if name not in self.nodes:
                self._restart_store(name, {})
        for process in self.processes:
            if process.node not in self.nodes:
                process.incarnation += 1
                self.start(process.node, self._process(process))

    def _check_converged(self) -> None:
        if self.phase != "liveness" or len(self.markers) < len(self.stream_names):
            return
        followers = [f"r{n}" for n in range(1, self.config.followers + 1)]
        for checker in self.checkers.values():
            if any(checker.missing(name) for name in followers):
                return
        self.note("converged")
        self.finished.set()

    def _raise_stuck(self) -> None:
        followers = [f"r{n}" for n in range(1, self.config.followers + 1)]
        unmarked = [s for s in self.stream_names if s not in self.markers]
        missing = {
            f"{stream}@{name}": len(checker.missing(name))
            for stream, checker in sorted(self.checkers.items())
            for name in followers
            if checker.missing(name)
        }
        raise Violation(
            0,
            f"no convergence within {LIVENESS_MS} ms: streams without an acked marker "
            f"{unmarked[:5]}{'...' if len(unmarked) > 5 else ''}; followers missing {missing}",
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The shells log every fault the nemesis makes: the trace tells what matters."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _flaws(flaws: frozenset[str]) -> Iterator[None]:
    """Switch the named defects back into the shipped code for this run."""
    with contextlib.ExitStack() as stack:
        if "park_forever" in flaws:
            stack.enter_context(
                mock.patch.object(writer_core.Leader, "_append_held", lambda *args: None)
            )
        if "fail_in_doubt" in flaws:
            stack.enter_context(mock.patch.object(writer_shell, "AppendInDoubt", AppendFailed))
        if "ack_before_seal" in flaws:
            def acking_at_once(*args: Any, **kwargs: Any) -> Replicator:
                return Replicator(*args, **{**kwargs, "acking": True})

            stack.enter_context(mock.patch.object(writer_core, "Replicator", acking_at_once))
        if "forget_pending" in flaws:
            stepped_down = writer_shell.Writer._stepped_down

            def forgetting(writer: Writer, down: writer_core.SteppedDown) -> None:
                writer._pending.clear()
                stepped_down(writer, down)

            stack.enter_context(
                mock.patch.object(writer_shell.Writer, "_stepped_down", forgetting)
            )
        yield


def run_seed(
    seed: int,
    flaws: frozenset[str] = frozenset(),
    trace: Callable[[str], None] | None = None,
    overrides: dict[str, Any] | None = None,
) -> WorldResult:
    """One seed of the world on the runtime; `overrides` replace drawn configuration
    fields (the rest of the run still draws what the seed draws)."""
    started = time.perf_counter()
    rng = random.Random(seed)
    config = WorldConfig.draw(seed, rng, flaws)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    result = WorldResult(config)
    worlds: list[World] = []

    async def main() -> None:
        network = SimNetwork(asyncio.get_running_loop())
        with network.installed():
            async with asyncio.TaskGroup() as group:
                world = World(config, rng, network, group, trace)
                worlds.append(world)
                try:
                    await world.run()
                finally:
                    await world.stop_all()

    try:
        with (
            _quiet(),
            _flaws(config.flaws),
            mock.patch.object(master_link, "_free_bytes", lambda path: SIM_DISK_FREE_BYTES),
        ):
            run(main(), seed)
    except Exception:
        result.error = traceback.format_exc()
    if worlds:
        world = worlds[0]
        result.violation = world.violation
        result.virtual_ms = world.now_ms
        result.trace = world.lines
        result.stats = world.stats
        result.acked = sum(len(c.acked) for c in world.checkers.values())
        result.read = sum(
            len(record.seen) for c in world.checkers.values() for record in c.followers.values()
        )
        result.unsynced_losses = [
            loss for c in world.checkers.values() for loss in c.unsynced_losses
        ]
    result.seconds = time.perf_counter() - started
    return result
