"""The world on the runtime: the shipped system under a seeded workload and nemesis.

Theory of operation. A seed draws a `WorldConfig` (policy, stores, client processes,
streams, faults, lease, workload, nemesis) and then everything runs on one `SimLoop`:
the shipped master (`SimMaster` on in-memory metadata, or 1-3 `SimElectedMaster`s on a
`SimEtcd`, as `WorldConfig.masters` says) and stores (`SimStore`), client processes
that each open a `StreamClient` on their own node of the `SimNetwork` and lead their
streams through the shipped writer (rivals race for some of them), and followers
reading every stream back through the shipped subscription. Nothing here stands in for
a shell.

The safety phase runs `safety_ms` of virtual time under network faults and a nemesis
on the loop's timers: stores crashing with their machine's power (fsync on or off) and
coming back, now and then with a wiped disk (a new incarnation); partitions and
connection resets; client processes crashing (cut off, their tasks cancelled; a new
incarnation takes over through the shipped recovery); the master restarting over the
same metadata, or, on etcd, the active master killed, stopped cleanly, or cut off from
etcd and the stores, and etcd itself going down and back. The liveness phase then heals
the network, brings every node back, stops faults, and must converge within
`LIVENESS_MS`: every stream's leader gets a marker acked, and every follower has read
every event ever acked.

The checkers are `tests.sim.checkers.Checker`s, one per stream, fed with what the
shipped shells returned: acks (invariant 1 and 2, the gate on earlier segments),
events followers read, how and when each append ended (invariant 7: an append ends
within the writer's append timeout, acked or with a typed SDK error), and periodic
audits of every store's served prefix and sealed replicas against the master
(invariants 2, 4, 5); and a `MasterChecker` for the cluster (invariant 5: never two
masters serving, every etcd commit the active master's, epochs never going back).

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

import grpc

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
    Trimmed,
)
from streamengine.client.writer import Writer
from streamengine.master.core.retention import DELETE_GRACE_MS_DEFAULT
from streamengine.master.etcd import parse_etcd_url
from streamengine.master.state import MasterState
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.sequence import unpack_sequence
from streamengine.segment_store import master_link
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.kv import MemoryKV
from streamengine.testing import wait_until
from streamengine.v1 import master_pb2
from tests.sim.checkers import Checker, MasterChecker, Violation
from tests.sim.network import Faults
from tests.sim.runtime.etcd import SimEtcd
from tests.sim.runtime.loop import run
from tests.sim.runtime.master import SimElectedMaster, SimMaster
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.transport import SimNetwork, node_context
from tests.sim.world import draws_producers, is_documented_loss, run_outcome
from tests.sim.writer_node import ProducerOutbox

# Defects the world must find, each switched back into the shipped code for one run:
# `park_forever`: a writer leading an epoch granted without a segment parks appends and
# never times them out (issue #35, defect 3); and the old world's, in the shipped shells:
# `fail_in_doubt`: a writer stepping down tells users an append failed that may be
# durable; `forget_pending`: it loses its pending appends as it steps down (they hang);
# `ack_before_seal`: a new segment acks before the earlier ones are sealed.
RUNTIME_FLAWS = (
    "park_forever",
    "fail_in_doubt",
    "forget_pending",
    "ack_before_seal",
    "write_past_unwritten",
    "write_stale_decision",
)

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
# The share of seeds with an operator, its delete graces, how often it acts, how long a
# stream stays deleted before it undeletes it, and how long its calls may take.
OPERATOR_SHARE = 0.4
OPERATOR_GRACES_MS = (3_000, 6_000)
OPERATOR_EVERY_MS = 1_500
DELETED_MS_MAX = 600
DRAINING_MS_MAX = 3_000
OPERATOR_CALL_S = 2.0


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
    # Batches one producer keeps out at once, each at the sequences after the last
    # (a pipelined producer: its batches decide behind those held back in the writer).
    producer_batches_max: int = 1
    # 0: one master on in-memory metadata; 1-3: masters elected on an etcd.
    masters: int = 0
    # An operator making the CLI's stream calls: trims by hand, retention limits,
    # deletes undone within the grace (which is short, so trimmed segments leave).
    operator: bool = False
    delete_grace_ms: int = DELETE_GRACE_MS_DEFAULT
    # Writers with producer ids: each process resends what it was not told was written,
    # from the lowest, through each writer it makes (exactly once, issue #40).
    producers: bool = False
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
        # What the generator gained later is drawn apart, so that adding it moved no
        # seed's schedule of what it drew before.
        later = random.Random(f"{seed}/later")
        masters = later.choice((0, 0, 1, 2, 3))
        operator = later.random() < OPERATOR_SHARE
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
            masters=masters,
            operator=operator,
            delete_grace_ms=(
                later.choice(OPERATOR_GRACES_MS) if operator else DELETE_GRACE_MS_DEFAULT
            ),
            producers=draws_producers(seed),
            producer_batches_max=later.choice((1, 1, 4)),
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
            + (f" masters={self.masters} on etcd" if self.masters else "")
            + (f" operator (grace {self.delete_grace_ms}ms)" if self.operator else "")
            + (" producers" if self.producers else "")
            + (
                f" pipelined<={self.producer_batches_max}"
                if self.producers and self.producer_batches_max > 1
                else ""
            )
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


class Masters:
    """The cluster's masters: one on in-memory metadata (`WorldConfig.masters` 0), run
    as a world node and restarted over the same metadata, or 1-3 elected on an etcd
    (`SimElectedMaster` on `SimEtcd`, each its own process), which `checker` watches."""

    def __init__(self, network: SimNetwork, config: WorldConfig) -> None:
        lease_ms, store_timeout_ms = config.lease_ms, config.store_timeout_ms
        grace_ms = config.delete_grace_ms
        self.embedded: SimMaster | None = None
        self.etcd: SimEtcd | None = None
        self.elected: list[SimElectedMaster] = []
        if config.masters:
            self.etcd = SimEtcd(network)
            self.elected = [
                SimElectedMaster(
                    network,
                    f"m{n}",
                    self.etcd.url(),
                    lease_ms,
                    store_timeout_ms,
                    delete_grace_ms=grace_ms,
                )
                for n in range(1, config.masters + 1)
            ]
            self.checker = MasterChecker(parse_etcd_url(self.etcd.url()))
        else:
            self.embedded = SimMaster(network, "master", lease_ms, store_timeout_ms, grace_ms)
            self.checker = MasterChecker()
        self.lease_ms = config.lease_ms

    @property
    def address(self) -> str:
        """What stores and clients are given: every master's address."""
        if self.embedded is not None:
            return self.embedded.address
        return ",".join(master.address for master in self.elected)

    @property
    def names(self) -> list[str]:
        """The masters' nodes (and etcd's)."""
        if self.embedded is not None:
            return [self.embedded.name]
        assert self.etcd is not None
        return [master.name for master in self.elected] + [self.etcd.name]

    def active(self) -> list[SimElectedMaster]:
        now = wall_ms()
        return [master for master in self.elected if master.active(now)]

    @property
    def state(self) -> MasterState | None:
        """What the master serves from: the embedded one's (kept while it restarts, no
        other changes it), or the active elected one's (None while none is)."""
        if self.embedded is not None:
            return self.embedded.state
        active = self.active()
        return active[0].state if len(active) == 1 else None

    def look(self) -> None:
        """Invariant 5 across masters (`MasterChecker.look`)."""
        active = self.active()
        if self.embedded is not None:
            self.checker.look([self.embedded.name], self.embedded.state, self.lease_ms)
        else:
            self.checker.look([m.name for m in active], self.state, self.lease_ms)


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
        self.masters = Masters(network, config)
        if self.masters.etcd is not None:
            self.masters.etcd.txn_observers.append(self._commit_applied)
        self.stores = {
            name: SimStore(
                network,
                name,
                master_address=self.masters.address,
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
        # With `WorldConfig.producers`: what each process produced for each stream and
        # was not told is in it, kept across its writers and incarnations (an
        # application keeps its events until confirmed).
        self.outboxes: dict[str, ProducerOutbox] = {}
        # Producer events sent in a call that ended without an answer: they go again.
        self.unanswered: set[bytes] = set()

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

    def count(self, what: str, times: int = 1) -> None:
        self.stats[what] = self.stats.get(what, 0) + times

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

    def _commit_applied(self, *commit: Any) -> None:
        self.check(self.masters.checker.commit_applied, *commit)

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
        processes = [*self.masters.elected, *filter(None, [self.masters.etcd])]
        tasks = list(self.nodes.values()) + [p.task for p in processes if p.task is not None]
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
        if self.config.operator:
            self.start("operator", self._operator())
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
        await self._start_masters()
        for name, store in self.stores.items():
            self.start(name, store.serve())
        async with asyncio.timeout(SETUP_MS_MAX / 1000):
            await wait_until(self._joined, timeout_s=SETUP_MS_MAX / 1000)
            await self.group.create_task(self._create_streams(), context=node_context("setup"))
        state = self.masters.state
        assert state is not None
        for stream in self.stream_names:
            stream_id = state.streams[stream].stream_id
            self.checkers[stream] = Checker(stream_id, self.config.append_timeout_ms)
        self.note(f"{len(self.stores)} stores joined; {len(self.stream_names)} streams created")

    async def _start_masters(self) -> None:
        masters = self.masters
        if masters.embedded is not None:
            self.start(masters.embedded.name, masters.embedded.serve())
            return
        assert masters.etcd is not None
        masters.etcd.start(self.group)
        await masters.etcd.serving.wait()
        # One at a time: the first started is the first active (its key is the oldest).
        for master in masters.elected:
            master.start(self.group)
            await wait_until(
                lambda: bool(masters.active()), SETUP_MS_MAX / 1000, "a master active"
            )

    async def _create_streams(self) -> None:
        async with StreamClient(self.masters.address) as client:
            for stream in self.stream_names:
                await client.create_stream(
                    stream,
                    replicas=self.config.policy.replicas,
                    write_quorum=self.config.policy.write_quorum,
                    segment_bytes=self.config.segment_bytes,
                )

    def _joined(self) -> bool:
        state = self.masters.state
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
                    StreamClient(self.masters.address) as client,
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
                    producer_id=self._producer_id(process, stream),
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
                elif writer.producer_id is not None:
                    self._produce(writer, writer_id, checker, lost, appends)
                    continue
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
            if not writer.leading:  # it stepped down for another reason (StreamDeleted)
                lost.set()
            return
        finally:
            in_flight.release()
            if payloads[0].startswith(b"marker:"):
                self.marking.discard(stream)
        self.check(checker.append_ended, writer_id, payloads)
        state = self.masters.state
        for sequence, payload in zip(sequences, payloads, strict=True):
            epoch, index = unpack_sequence(sequence)
            if not self.check(checker.user_acked, epoch, index, payload, state):
                return
        if payloads[0].startswith(b"marker:"):
            self.markers[stream] = payloads[0]
            self.note(f"{writer_id} marker acked at {unpack_sequence(sequences[0])}")
            if len(self.markers) == len(self.stream_names):
                self._check_converged()

    def _producer_id(self, process: Process, stream: str) -> str | None:
        """The producer id of `process` on `stream` (None: a plain writer)."""
        return f"{process.name}:{stream}" if self.config.producers else None

    def _produce(
        self,
        writer: Writer,
        writer_id: str,
        checker: Checker,
        lost: asyncio.Event,
        appends: asyncio.TaskGroup,
    ) -> None:
        """New events of the writer's producer; unless its last batch is still out, one
        batch of every event not yet confirmed, from the lowest sequence (the stream
        answers those it holds from its table and writes the rest)."""
        assert writer.producer_id is not None
        out = self.outboxes.setdefault(writer.producer_id, ProducerOutbox())
        for _ in range(self.rng.randint(1, self.config.batch_max)):
            out.events[out.next_sequence] = f"p:{writer.producer_id}:{out.next_sequence}".encode()
            out.next_sequence += 1
        if out.batches_out and (
            out.resend or out.batches_out >= self.config.producer_batches_max
        ):
            return
        # From the lowest unconfirmed event (the next after those out, if any), as many
        # as run on without a gap: a batch answered after an earlier one failed in doubt
        # leaves a gap, and a batch's events take consecutive sequences.
        after = max(out.in_flight) if out.batches_out else -1
        pending = sorted(sequence for sequence in out.events if sequence > after)
        if not pending:
            return
        sequences = [pending[0]]
        for sequence in pending[1:]:
            if sequence != sequences[-1] + 1:
                break
            sequences.append(sequence)
        out.in_flight.update(sequences)
        out.batches_out += 1
        appends.create_task(
            self._append_produced(writer, writer_id, checker, out, lost, sequences)
        )

    async def _append_produced(
        self,
        writer: Writer,
        writer_id: str,
        checker: Checker,
        out: ProducerOutbox,
        lost: asyncio.Event,
        sequences: list[int],
    ) -> None:
        payloads = tuple(out.events[sequence] for sequence in sequences)
        self.check(checker.append_started, writer_id, payloads, self.now_ms)
        try:
            answered = await writer.append_batch(payloads, producer_sequence=sequences[0])
        except StreamEngineError as error:
            # Not given up: every event goes again with the next batch, or writer.
            self.check(checker.append_ended, writer_id, payloads)
            self.unanswered.update(payloads)
            self.count(f"producer {type(error).__name__}")
            out.resend = True
            if isinstance(error, LeadershipLost) or not writer.leading:
                lost.set()
            return
        finally:
            out.in_flight.difference_update(sequences)
            out.batches_out -= 1
            if not out.batches_out:
                out.resend = False
        self.check(checker.append_ended, writer_id, payloads)
        state = self.masters.state
        for producer_sequence, sequence, payload in zip(
            sequences, answered, payloads, strict=True
        ):
            del out.events[producer_sequence]
            if sequence == 0:  # durable, its position no longer kept
                self.count("producer events answered 0")
                continue
            epoch, index = unpack_sequence(sequence)
            if not self.check(checker.user_acked, epoch, index, payload, state):
                return
        resent = self.unanswered.intersection(payloads)
        self.unanswered -= resent
        self.count("producer events acked", len(payloads))
        self.count("producer events resent and acked", len(resent))

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
                    StreamClient(self.masters.address) as client,
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
            record = checker.followers.get(name)
            start = max(record.last + 1, record.trimmed_before) if record else 0
            try:
                async with contextlib.aclosing(
                    cast(Subscription, client.subscribe(stream, start=start))
                ) as events:
                    async for event in events:
                        self.check(checker.follower_event, name, event.sequence, event.payload)
                        if self.phase == "liveness":
                            self._check_converged()
            except DataLossError as error:
                self.check(self._raise_data_loss, name, error)
                return
            except Trimmed as error:
                self.count("follower Trimmed")
                told = (error.position, error.first_retained_sequence, self.masters.state)
                self.check(checker.trim_told, name, *told)
                continue
            except StreamEngineError as error:
                self.count(f"follower {type(error).__name__}")
            await asyncio.sleep(FOLLOW_AGAIN_MS / 1000)

    def _raise_data_loss(self, name: str, error: DataLossError) -> None:
        raise Violation(1, f"follower {name}: DataLossError: {error}")

    # ---- the operator ----

    async def _operator(self) -> None:
        """Now and then one of the CLI's calls: on a random stream `streamengine stream
        trim`, `update --retention-*`, `delete --yes` then `undelete`; or `drain` of a
        random store (`--cancel` a while later) or `rebalance`."""
        while self.phase == "safety":
            await asyncio.sleep(self.rng.randint(1, OPERATOR_EVERY_MS) / 1000)
            if self.phase != "safety":
                return
            stream = self.rng.choice(self.stream_names)
            roll = self.rng.random()
            if roll < 0.15:
                self.group.create_task(self._drain())
            elif roll < 0.25:
                await self._operate("rebalance", master_pb2.RebalanceRequest())
            elif roll < 0.5:
                acked = self.checkers[stream].acked_sequences
                if acked:
                    before = self.rng.choice(acked)
                    request = master_pb2.TrimStreamRequest(name=stream, before_sequence=before)
                    await self._operate(f"trim {stream} before {unpack_sequence(before)}", request)
            elif roll < 0.75:
                update = master_pb2.UpdateStreamRequest(name=stream)
                if self.rng.random() < 0.5:
                    update.retention_bytes = self.rng.choice((1, 2_000, 20_000))
                else:
                    update.retention_age_ms = self.rng.choice((500, 2_000, 5_000))
                retention = f"{update.retention_bytes} B" if update.retention_bytes else (
                    f"{update.retention_age_ms} ms"
                )
                await self._operate(f"retention of {stream}: {retention}", update)
            else:
                self.group.create_task(self._delete_and_undelete(stream))

    async def _drain(self) -> None:
        store = self.rng.choice(sorted(self.stores))
        if not await self._operate(f"drain {store}", master_pb2.DrainStoreRequest(store_id=store)):
            return
        await asyncio.sleep(self.rng.randint(1, DRAINING_MS_MAX) / 1000)
        cancel = master_pb2.DrainStoreRequest(store_id=store, cancel=True)
        # Until it takes replicas again (through the liveness phase): stores drained
        # for good could leave too few for the streams' new segments.
        while self.phase != "stopped":
            if await self._operate(f"drain {store} --cancel", cancel, retried=True):
                return
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)

    async def _delete_and_undelete(self, stream: str) -> None:
        delete = master_pb2.DeleteStreamRequest(name=stream)
        codes: list[grpc.StatusCode] = []
        if not await self._operate(f"delete {stream}", delete, codes=codes):
            return
        in_doubt = bool(codes) and codes[0] in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        await asyncio.sleep(self.rng.randint(1, DELETED_MS_MAX) / 1000)
        undelete = master_pb2.UndeleteStreamRequest(name=stream)
        # Until it is back (through the liveness phase): a stream left deleted past its
        # grace is gone, and every acked event with it.
        while self.phase != "stopped":
            if await self._operate(f"undelete {stream}", undelete, retried=True):
                break
            await asyncio.sleep(LEAD_AGAIN_MS / 1000)
        # A delete answered UNAVAILABLE may still land later (its request handled
        # after all, after the undelete said there was nothing to undo: seed 86): the
        # operator looks again until the run ends, as one would after a call in doubt.
        describe = master_pb2.DescribeStreamRequest(name=stream)
        while in_doubt and self.phase != "stopped":
            await asyncio.sleep(OPERATOR_EVERY_MS / 1000)
            async with StreamClient(self.masters.address) as client:
                try:
                    info = await client.master.DescribeStream(describe, timeout=OPERATOR_CALL_S)
                except (grpc.aio.AioRpcError, StreamEngineError):
                    continue
            if info.deleted_until_ms:
                await self._operate(f"undelete {stream} (deleted after all)", undelete)

    async def _operate(
        self,
        what: str,
        request: Any,
        retried: bool = False,
        codes: list[grpc.StatusCode] | None = None,
    ) -> bool:
        """One operator call to the masters, as the CLI makes it: whether it was done
        (`retried`: False only while it may be done on a later try); the status of a
        call that failed goes to `codes`."""
        method = type(request).__name__.removesuffix("Request")
        async with StreamClient(self.masters.address) as client:
            try:
                reply = await getattr(client.master, method)(request, timeout=OPERATOR_CALL_S)
            except grpc.aio.AioRpcError as error:
                if codes is not None:
                    codes.append(error.code())
                self.note(f"operator: {what}: {error.code().name}")
                self.count(f"operator {method} {error.code().name}")
                retry = error.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.ABORTED,
                )
                return not (retried and retry)
            except StreamEngineError as error:  # no first contact: the master is away
                self.note(f"operator: {what}: {type(error).__name__}")
                return not retried
        trimmed = getattr(reply, "trimmed_epochs", None)
        self.note(f"operator: {what}" + (f": trimmed {list(trimmed)}" if trimmed else ""))
        self.count(f"operator {method}")
        return True

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
                self.group.create_task(self._fail_master(), context=node_context("nemesis"))
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
        for other in [*self.masters.names, *self.stores, *self._client_nodes()]:
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

    async def _fail_master(self) -> None:
        embedded = self.masters.embedded
        if embedded is None:
            await self._fail_elected_master()
            return
        if embedded.name not in self.nodes:
            return
        self.note("the master restarts")
        self.count("master restarts")
        await self.stop(embedded.name)
        await asyncio.sleep(self._down_ms(self.config.lease_ms) / 1000)
        if self.phase != "safety" or embedded.name in self.nodes:
            return
        self.start(embedded.name, embedded.serve())

    async def _fail_elected_master(self) -> None:
        """The active master is killed (its lease left to expire), stopped cleanly, or
        cut off from etcd and the stores; now and then etcd itself goes down. Each comes
        back (or is healed) after a while."""
        etcd = self.masters.etcd
        assert etcd is not None
        active = self.masters.active()
        roll = self.rng.random()
        if roll < 0.1:
            if not etcd.running:
                return
            self.note("etcd crashes")
            self.count("etcd crashes")
            await etcd.crash()
            await asyncio.sleep(self._down_ms(self.config.lease_ms) / 1000)
            if self.phase == "safety" and not etcd.running:
                self.note("etcd restarts")
                etcd.restart()
            return
        if not active:
            return
        master = active[0]
        if roll < 0.4:
            self.note(f"{master.name} is cut off from etcd and the stores")
            self.count("masters cut off")
            for other in [etcd.name, *self.stores]:
                self.network.cut(master.name, other)
                heal_s = self.rng.randint(20, 4000) / 1000
                self.loop.call_later(heal_s, self._heal, master.name, other)
            return
        clean = roll < 0.6
        self.note(f"{master.name} {'stops' if clean else 'crashes'}")
        self.count("master stops" if clean else "master crashes")
        await (master.stop() if clean else master.crash())
        await asyncio.sleep(self._down_ms(2 * self.config.lease_ms) / 1000)
        if self.phase == "safety" and not master.running:
            self.note(f"{master.name} restarts")
            master.restart()

    def _servers(self) -> list[str]:
        return [*self.masters.names, *sorted(self.stores)]

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
            self.check(self.masters.look)
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
        state = self.masters.state
        if state is None:
            return  # no master serves: the next audit looks
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
        embedded = self.masters.embedded
        if embedded is not None and embedded.name not in self.nodes:
            self.start(embedded.name, embedded.serve())
        etcd = self.masters.etcd
        if etcd is not None and not etcd.running:
            etcd.restart()
        for master in self.masters.elected:
            if not master.running:
                master.restart()
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
        for writer_id in sorted(self.writers):
            if writer_id.partition("/")[2].partition("#")[0] in unmarked[:5]:
                self._describe(writer_id)
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
        if "write_past_unwritten" in flaws:
            # A producer's held batch not written leaves the ones behind it to go.
            stack.enter_context(
                mock.patch.object(
                    writer_shell.Writer, "_fail_held_producer_batches", lambda *args: None
                )
            )
        if "write_stale_decision" in flaws:
            # A held batch goes although the table it was decided by changed.
            stack.enter_context(
                mock.patch.object(writer_shell.Writer, "_stale", lambda *args: False)
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
