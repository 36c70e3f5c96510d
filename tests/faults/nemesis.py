"""Faults, each recorded as a window in the history (`nemesis` records, start / stop).

A nemesis is a function of a `RunContext` that injects faults at seeded random moments
until the context's deadline and leaves nothing behind: every fault it starts it also
ends (a killed process restarted, a paused one continued) before it returns, and the
run heals anything left at the end in any case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from streamengine.master.election import ELECTION_TTL_S_DEFAULT
from streamengine.protocol import framed_read
from streamengine.testing import STREAMENGINE, Cluster, ServerProcess
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.faults import disk
from tests.faults.channels import harness_transport, open_channel
from tests.faults.cluster import (
    ClientProcess,
    leader_of,
    open_copy_set,
    resume,
    under_replicated,
)
from tests.faults.history import Recorder, now
from tests.faults.netns import Hosts
from tests.faults.proxy import Link, ProxyHost
from tests.integration import damage
from tests.tree import child_env


@dataclass
class RunContext:
    cluster: Cluster
    writers: dict[str, ClientProcess]
    readers: dict[str, ClientProcess]
    streams: list[str]
    recorder: Recorder
    rng: random.Random
    lease_s: float
    deadline: float  # monotonic
    quick: bool
    hosts: Hosts | None = None  # when every process is on its own network namespace
    lazy: dict[str, disk.LazyMount] = field(default_factory=dict)  # store -> its lazy fs
    proxies: ProxyHost | None = None  # links "w1>store2": workload process to store
    # Makes another reader process (not started), reading from 0: `r3`, ...
    new_reader: Callable[[str], ClientProcess] | None = None
    disks: bool = False  # every store on its own small tmpfs (under its lazy fs, if any)
    # Choices that hold for the whole run (S14's packages share it): S12's victim store.
    chosen: dict[str, str] = field(default_factory=dict)
    # Masters on etcd: each master's proxy link to etcd, by master name.
    etcd_links: dict[str, Link] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def pause(self, seconds: float) -> bool:
        """Wait a schedule's duration; False once the run is over."""
        seconds = max(0.0, min(seconds, self.remaining()))
        return not self.stop.wait(seconds) and self.remaining() > 0

    def scaled(self, low: float, high: float) -> float:
        """A random period of the full schedule, a third of it in a quick pass."""
        factor = 0.35 if self.quick else 1.0
        return self.rng.uniform(low, high) * factor

    def skip(self, why: str) -> None:
        """A round of the schedule came due and found nothing to fault (no leader, no
        copy set, no sealed segment yet): recorded, so that a run which injected
        nothing says why (the checker's C0 makes such a run invalid)."""
        self.recorder.record("nemesis_skip", why=why)

    @contextmanager
    def window(self, fault: str, target: str, **details: object) -> Iterator[None]:
        self.recorder.record("nemesis", phase="start", fault=fault, target=target, **details)
        try:
            yield
        finally:
            self.recorder.record("nemesis", phase="stop", fault=fault, target=target)

    def store(self, store_id: str) -> ServerProcess:
        for store in self.cluster.stores:
            if store.name == store_id:
                return store
        raise KeyError(store_id)

    def links(self, store: str, processes: list[str] | None = None) -> list[Link]:
        """The proxy links from `processes` (default: every workload process) to
        `store` (or "master")."""
        assert self.proxies is not None, "the scenario runs without proxies"
        names = processes if processes is not None else [*self.writers, *self.readers]
        return [self.proxies.links[f"{name}>{store}"] for name in names]

    def leader_process(self) -> ClientProcess | None:
        """The writer process leading the first stream (client ids are `w1.3-2`)."""
        client = leader_of(self.cluster, self.streams[0])
        name = client.split(".", 1)[0]
        return self.writers.get(name)


Nemesis = Callable[[RunContext], None]


def kill_leader_loop(ctx: RunContext) -> None:
    """S2: every 10-15 s kill -9 the leading writer, restart it 2 s later; every other
    time or so also kill -9 a reader (it resumes from its last recorded token)."""
    while ctx.pause(ctx.scaled(10, 15)):
        leader = ctx.leader_process()
        if leader is None:
            ctx.skip("no leader to kill")
        else:
            with ctx.window("kill", leader.name, inc=leader.inc):
                leader.kill()
                ctx.pause(2.0)
                leader.start()
        if ctx.rng.random() < 0.5:
            kill_reader(ctx)


def kill_reader(ctx: RunContext) -> None:
    reader = ctx.readers[ctx.rng.choice(sorted(ctx.readers))]
    with ctx.window("kill", reader.name, inc=reader.inc):
        reader.kill()
        ctx.pause(1.0)
        reader.start()


def pause_leader_loop(ctx: RunContext) -> None:
    """S3: SIGSTOP the leading writer for 3 leases (the standby seals and takes over),
    then SIGCONT: the zombie's buffered appends must be fenced or end in doubt."""
    while ctx.pause(ctx.scaled(6, 10)):
        leader = ctx.leader_process()
        if leader is None:
            ctx.skip("no leader to pause")
            continue
        with ctx.window("pause", leader.name, inc=leader.inc):
            leader.stop()
            ctx.pause(3 * ctx.lease_s)
            leader.cont()


def store_crash_loop(ctx: RunContext) -> None:
    """S5: every 10-20 s kill -9 a copy-set store, restart it 5 s later; one time in
    four a second store of the same copy set 3 s after the first (writes stall)."""
    while ctx.pause(ctx.scaled(10, 20)):
        copy_set = open_copy_set(ctx.cluster, ctx.rng.choice(ctx.streams))
        if not copy_set:
            ctx.skip("no open copy set listed")
            continue
        victims = ctx.rng.sample(copy_set, 2 if ctx.rng.random() < 0.25 else 1)
        _crash_stores(ctx, [ctx.store(name) for name in victims])


def _crash_stores(ctx: RunContext, stores: list[ServerProcess]) -> None:
    down: list[ServerProcess] = []
    try:
        for number, store in enumerate(stores):
            if number:
                ctx.pause(3.0)
            # Two of a copy set down: writes stall by design (not a stall to bound).
            ctx.recorder.record("nemesis", phase="start", fault="kill", target=store.name,
                                quorum_lost=len(stores) > 1)
            store.kill()
            down.append(store)
        ctx.pause(5.0 if not ctx.quick else 3.0)
    finally:
        for store in down:
            store.start(wait=False)
            ctx.recorder.record("nemesis", phase="stop", fault="kill", target=store.name)


def master_crash_loop(ctx: RunContext) -> None:
    """S11: kill -9 the master every 20-30 s and restart it; once, SIGSTOP it for two
    leases instead."""
    paused = False
    master = ctx.cluster.master
    while ctx.pause(ctx.scaled(20, 30)):
        if not paused and ctx.rng.random() < 0.5:
            paused = True
            with ctx.window("pause", "master"):
                master.stop()
                ctx.pause(2 * ctx.lease_s)
                master.cont()
            continue
        _kill_master(ctx)


def _kill_master(ctx: RunContext) -> None:
    """kill -9 the master, restart it 0.5-2 s later."""
    master = ctx.cluster.master
    with ctx.window("kill", "master"):
        master.kill()
        ctx.pause(ctx.rng.uniform(0.5, 2.0))
        master.start(wait=False)


def store_and_master_loop(ctx: RunContext) -> None:
    """S18: every 10-15 s, in turn, kill -9 one copy-set store of a random stream
    (restarted 5 s later, as S5's) or kill -9 the master (restarted 0.5-2 s later, as
    S11's), while many streams append."""
    rounds = 0
    while ctx.pause(ctx.scaled(10, 15)):
        rounds += 1
        if rounds % 2 == 0:
            _kill_master(ctx)
            continue
        copy_set = open_copy_set(ctx.cluster, ctx.rng.choice(ctx.streams))
        if not copy_set:
            ctx.skip("no open copy set listed")
            continue
        _crash_stores(ctx, [ctx.store(ctx.rng.choice(copy_set))])


def active_master_loop(ctx: RunContext) -> None:
    """S17, masters on etcd: every 10-14 s the active master is, in turn, killed
    (kill -9, restarted 2 s later: it comes back a standby) or partitioned from etcd for
    three election leases (its proxy link blackholed: its keepalives go unanswered, it
    must step down while still serving, and a standby takes over), while the writers
    append. Grants go on across each failover: C11 holds epochs to one holder each and
    never backwards, across the masters."""
    kinds = ["kill", "partition"]
    rounds = 0
    while ctx.pause(ctx.scaled(10, 14)):
        active = ctx.cluster.active_master()
        if active is None:
            ctx.skip("no active master")
            continue
        kind = kinds[rounds % len(kinds)]
        rounds += 1
        with ctx.window(kind, active.name):
            if kind == "kill":
                active.kill()
                try:
                    ctx.pause(2.0)
                finally:
                    active.start(wait=False)
                continue
            link = ctx.etcd_links[active.name]
            link.set(blackhole=True)
            try:
                ctx.pause(3 * ELECTION_TTL_S_DEFAULT)
            finally:
                link.heal()


def reader_churn_loop(ctx: RunContext) -> None:
    """S13: SIGSTOP a reader for 30 s (the store drops it as silent; it resumes from its
    token when continued) while the leader changes hands in the middle (SIGTERM: a clean
    release, then the same writer competes again); readers also reconnect about 50
    times a minute on their own (the scenario's reader churn)."""
    while ctx.pause(ctx.scaled(3, 6)):
        reader = ctx.readers[ctx.rng.choice(sorted(ctx.readers))]
        with ctx.window("pause", reader.name, inc=reader.inc):
            reader.stop()
            try:
                ctx.pause(ctx.scaled(15, 15))
                leader = ctx.leader_process()
                if leader is not None:
                    with ctx.window("restart", leader.name, inc=leader.inc):
                        leader.terminate()
                        leader.start()
                ctx.pause(ctx.scaled(15, 15))
            finally:
                reader.cont()


def disk_loop(ctx: RunContext) -> None:
    """S9: at 30 s a copy-set store's disk fills up (ballast); at 90 s it is freed. A
    store that died of it is restarted once its disk is back (a crash loop would show).
    The read-only half of S9 needs the FUSE layer: `mount -o remount,ro` refuses with
    "mount point is busy" while RocksDB holds files open for writing."""
    scale = 0.2 if ctx.quick else 1.0
    start = time.monotonic()
    if not ctx.pause(start + 30 * scale - time.monotonic()):
        return
    full = _copy_set_store(ctx)
    # On the lazy fs, the tmpfs under it: the store's syncs then fail with ENOSPC.
    mount = ctx.lazy.get(full.name)
    where = mount.backing if mount is not None else ctx.cluster.root / full.name
    ctx.recorder.record("nemesis", phase="start", fault="disk-full", target=full.name)
    try:
        disk.fill(where)
        ctx.pause(start + 90 * scale - time.monotonic())
    finally:
        disk.free(where)
        died = not full.alive()
        if died:
            full.start(wait=False)
        ctx.recorder.record("nemesis", phase="stop", fault="disk-full", target=full.name,
                            store_had_exited=died)


def _copy_set_store(ctx: RunContext, avoid: ServerProcess | None = None) -> ServerProcess:
    names = open_copy_set(ctx.cluster, ctx.rng.choice(ctx.streams))
    candidates = [ctx.store(n) for n in names if avoid is None or n != avoid.name]
    return ctx.rng.choice(candidates or [s for s in ctx.cluster.stores if s is not avoid])


def power_loss_loop(ctx: RunContext) -> None:
    """S8 (a, b, c): every 15 s a copy-set store loses power: kill -9, its unsynced writes
    dropped, restarted. One time in four, every store of a copy set at once; now and
    then the pause-kill (`pause_kill`). With `fsync=always` nothing acked may be lost."""
    while ctx.pause(ctx.scaled(15, 15)):
        copy_set = open_copy_set(ctx.cluster, ctx.rng.choice(ctx.streams))
        if not copy_set:
            ctx.skip("no open copy set listed")
            continue
        if len(copy_set) >= 2 and ctx.rng.random() < 0.3:
            pause_kill(ctx, *(ctx.store(name) for name in ctx.rng.sample(copy_set, 2)))
            continue
        victims = copy_set if ctx.rng.random() < 0.25 else [ctx.rng.choice(copy_set)]
        stores = [ctx.store(name) for name in victims]
        # Two or more of a copy set down: writes stall by design (not a stall to bound).
        with ctx.window("power-loss", "+".join(victims), quorum_lost=len(victims) > 1):
            try:
                for store in stores:
                    store.kill()
                for store in stores:
                    ctx.lazy[store.name].drop()
                ctx.pause(1.0)
            finally:
                for store in stores:
                    store.start(wait=False)


def pause_kill(ctx: RunContext, paused: ServerProcess, killed: ServerProcess) -> None:
    """S8 (b), the NATS pause-kill: SIGSTOP one store, 20 s of writes, power loss on a
    second store, SIGCONT the first and restart the second, 20 s more."""
    with ctx.window("pause", paused.name):
        paused.stop()
        try:
            ctx.pause(ctx.scaled(20, 20))
            with ctx.window("power-loss", killed.name, quorum_lost=True):  # and one paused
                killed.kill()
                try:
                    ctx.lazy[killed.name].drop()
                finally:
                    paused.cont()
                    killed.start(wait=False)
        finally:
            paused.cont()
    ctx.pause(ctx.scaled(20, 20))


def store_loss(ctx: RunContext) -> None:
    """S6: once sealed segments piled up, a copy-set store dies for good (kill -9, its
    directory wiped); the master re-replicates its sealed segments to the other stores
    while the leader changes (kill -9). Measures repair: from the loss until the master
    lists no under-replicated segment, and the bytes the lost store held. Then the wiped
    store comes back (empty) and another copy-set store is drained under load with the
    ops CLI (`streamengine drain`): every replica moves off it, and it must end up
    holding nothing."""
    if not ctx.pause(ctx.scaled(30, 30)):
        return
    copy_set = open_copy_set(ctx.cluster, ctx.rng.choice(ctx.streams))
    victim = ctx.store(ctx.rng.choice(copy_set)) if copy_set else ctx.cluster.stores[1]
    directory = ctx.cluster.root / victim.name
    held_bytes = _store_status(ctx, victim.name).get("used_bytes")
    with ctx.window("wipe", victim.name):
        victim.kill()
        shutil.rmtree(directory)
        directory.mkdir()
        lost_at = time.monotonic()
        ctx.pause(ctx.scaled(5, 5))
        leader = ctx.leader_process()
        if leader is not None:
            with ctx.window("kill", leader.name, inc=leader.inc):
                leader.kill()
                ctx.pause(1.0)
                leader.start()
        detected, repaired = _wait_repaired(ctx, lost_at)
        ctx.recorder.record("nemesis", phase="detail", fault="wipe", target=victim.name,
                            detect_s=detected, repair_s=repaired, repair_bytes=held_bytes)
        victim.start(wait=False)
    if ctx.remaining() > 0:
        victim.wait_serving()
        drain_one(ctx, avoid=victim.name)
    if ctx.quick:
        # The pass covers each fault once: it ends once every reader has subscribed
        # again on the placement the drain left (9 s of the 30 went to waiting before).
        readers_resubscribed(ctx, since=now())
    else:
        ctx.pause(ctx.remaining())  # the workload goes on, readers re-reading old segments


def readers_resubscribed(ctx: RunContext, since: float) -> None:
    """Until every running reader has begun a subscription after `since` (the history's
    clock), or the run's end."""
    waiting = [reader for reader in ctx.readers.values() if reader.alive()]
    while waiting and ctx.pause(0.2):
        waiting = [reader for reader in waiting if not _subscribed_since(reader, since)]


# A reader records ~60 KiB of deliveries a second: a subscription begun since the last
# look (0.2 s ago) is within the file's last 256 KiB.
HISTORY_TAIL_BYTES = 256 * 1024


def _subscribed_since(reader: ClientProcess, since: float) -> bool:
    path = reader.history / f"{reader.name}.jsonl"
    with contextlib.suppress(FileNotFoundError), path.open("rb") as file:
        start = file.seek(max(0, file.seek(0, os.SEEK_END) - HISTORY_TAIL_BYTES))
        lines = file.read().splitlines()
        for line in lines[1:] if start else lines:  # a line cut by the seek is left
            if b'"type":"subscribe"' in line:
                with contextlib.suppress(ValueError):
                    if json.loads(line)["t"] >= since:
                        return True
    return False


# A drain moves every replica of a store; past this it has not finished.
DRAIN_TIMEOUT_S = 90.0


def drain_one(ctx: RunContext, avoid: str) -> None:
    """Drain a copy-set store (not `avoid`) with `streamengine drain`, then wait until
    the master places nothing on it and it holds none of the workload's segments."""
    candidates = [name for name in open_copy_set(ctx.cluster, ctx.rng.choice(ctx.streams))
                  if name != avoid] or [s.name for s in ctx.cluster.stores if s.name != avoid]
    store = ctx.store(ctx.rng.choice(candidates))
    with ctx.window("drain", store.name):
        started = time.monotonic()
        result = subprocess.run(
            [STREAMENGINE, "drain", store.name, "--master", ctx.cluster.master_address],
            capture_output=True, text=True, timeout=DRAIN_TIMEOUT_S + 30, env=child_env())
        deadline = started + DRAIN_TIMEOUT_S
        while True:
            placed = _store_status(ctx, store.name).get("segments")
            held = _segments_held(ctx, store)
            if (placed == 0 and not held) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        ctx.recorder.record("nemesis", phase="detail", fault="drain", target=store.name,
                            cli_exit=result.returncode, cli_output=result.stdout[-300:],
                            drain_s=round(time.monotonic() - started, 2),
                            placed_after=placed, held_after=held)


def _store_status(ctx: RunContext, store_id: str) -> dict[str, int]:
    """The master's view of a store: replicas placed on it, bytes it reports."""
    with open_channel(ctx.cluster.master_address) as channel:
        try:
            status = master_pb2_grpc.MasterStub(channel).GetClusterStatus(
                master_pb2.GetClusterStatusRequest(), timeout=10)
        except grpc.RpcError:
            return {}
    for store in status.stores:
        if store.store_id == store_id:
            return {"segments": store.segments, "used_bytes": store.used_bytes}
    return {}


def _segments_held(ctx: RunContext, store: ServerProcess) -> list[str]:
    """The workload's segments `store` still holds (asked of the store itself)."""
    held = []
    with open_channel(ctx.cluster.master_address) as channel, \
            open_channel(store.address) as store_channel:
        master = master_pb2_grpc.MasterStub(channel)
        stub = store_grpc.SegmentStoreStub(store_channel)
        for stream in ctx.streams:
            listing = master.ListSegments(master_pb2.ListSegmentsRequest(stream=stream),
                                          timeout=10)
            for segment in listing.segments:
                try:
                    stub.GetSegmentState(segment_store_pb2.GetSegmentStateRequest(
                        segment=entry_pb2.SegmentId(stream_id=listing.stream_id,
                                                    epoch=segment.id.epoch)), timeout=10)
                except grpc.RpcError as error:
                    if error.code() == grpc.StatusCode.NOT_FOUND:
                        continue
                held.append(f"{stream}/{segment.id.epoch}")
    return held


def _wait_repaired(ctx: RunContext, since: float) -> tuple[float | None, float | None]:
    """Seconds from `since` until the master lists segments under-replicated (it
    noticed the loss: its store timeout) and until it lists none again (repaired);
    None for what did not happen before the run's end."""
    detected = None
    while ctx.pause(0.1):
        under = under_replicated(ctx.cluster)
        if under is None:
            continue
        if under and detected is None:
            detected = round(time.monotonic() - since, 2)
        elif not under and detected is not None:
            return detected, round(time.monotonic() - since, 2)
    return detected, None


def corruption_loop(ctx: RunContext) -> None:
    """S12: six rounds; in each, the victim store (always the same one: a minority) is
    killed, one of its RocksDB files damaged at rest (2 bits flipped in a random 4 KiB
    chunk of an SST or WAL file, or the WAL's tail cut), and restarted. Readers must
    never get a bad payload."""
    # One victim for the whole run, across S14's packages too: damage on two stores
    # could together destroy more than N - W copies of a range, or leave too few stores
    # to place a copy set, outside what the system promises to survive.
    if "corruption" not in ctx.chosen:
        ctx.chosen["corruption"] = ctx.rng.choice(ctx.cluster.stores).name
    store = ctx.store(ctx.chosen["corruption"])
    for _ in range(6):
        if not ctx.pause(ctx.scaled(8, 14)):
            return
        with ctx.window("corrupt", store.name):
            store.kill()
            try:
                damage = corrupt_files(ctx.rng, ctx.cluster.root / store.name)
                ctx.recorder.record("nemesis", phase="detail", fault="corrupt",
                                    target=store.name, **damage)
            finally:
                store.start(wait=False)


def corrupt_files(rng: random.Random, directory: Path) -> dict[str, object]:
    """Damage one SST or WAL file under `directory`; says what was done."""
    files = sorted(p for p in directory.rglob("*") if p.suffix in (".sst", ".log")
                   and p.is_file() and p.stat().st_size > 0 and p.name != "LOG")
    if not files:
        return {"damage": "none: no SST or WAL file yet"}
    victim = rng.choice(files)
    size = victim.stat().st_size
    if victim.suffix == ".log" and rng.random() < 0.3:
        cut = rng.randint(1, min(size, 4096))
        os.truncate(victim, size - cut)
        return {"file": victim.name, "damage": f"WAL tail cut by {cut} bytes"}
    chunk = rng.randrange(0, max(1, size // 4096)) * 4096
    flips = []
    with victim.open("r+b") as file:
        for _ in range(2):
            offset = min(size - 1, chunk + rng.randrange(4096))
            file.seek(offset)
            byte = file.read(1)[0]
            bit = rng.randrange(8)
            file.seek(offset)
            file.write(bytes([byte ^ (1 << bit)]))
            flips.append([offset, bit])
        file.flush()
        os.fsync(file.fileno())
    return {"file": victim.name, "damage": "2 bits flipped", "flips": flips}


FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def faketime_env(spec_file: Path, spec: str) -> dict[str, str]:
    """Environment running a process on a fake clock read from `spec_file` (rewritten
    while it runs for jumps; re-read at most once a second). The monotonic clock is
    faked too: faking wall time alone with a rate makes Python's sleep fail (EINVAL)."""
    spec_file.write_text(spec + "\n")
    return {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME_TIMESTAMP_FILE": str(spec_file),
        "FAKETIME_CACHE_DURATION": "1",
    }


def clock_loop(ctx: RunContext) -> None:
    """S4: the master runs 1.5x fast, writer w1 0.5x slow, store0 on a file clock (set
    up by the scenario); a lease contest (the leader killed) every 20 s; halfway, the
    master's clock jumps forward an hour and, 2 L + 1 s later, store0's back 30 s.

    The gap lets the master's jump (every lease ends at once, the writers contest
    again) settle within its own window: with store0's jump right after it, a quick
    pass counted that contest as store0's stall."""
    half = time.monotonic() + ctx.remaining() / 2
    jumped = False
    while True:
        wait = ctx.scaled(20, 20)
        until_half = half - time.monotonic()
        if not jumped and until_half < wait:
            if not ctx.pause(until_half):
                return
            jumped = True
            with ctx.window("clock-jump", "master", to="+3600 x1.5"):
                (ctx.cluster.root / "master.faketime").write_text("+3600 x1.5\n")
                ctx.pause(1.0)
            if not ctx.pause(2 * ctx.lease_s + 1.0):
                return
            with ctx.window("clock-jump", "store0", to="-30"):
                (ctx.cluster.root / "store0.faketime").write_text("-30\n")
                ctx.pause(1.0)
            continue
        if not ctx.pause(wait):
            return
        leader = ctx.leader_process()
        if leader is None:
            ctx.skip("no leader for a lease contest")
        else:
            with ctx.window("kill", leader.name, inc=leader.inc):
                leader.kill()
                ctx.pause(1.0)
                leader.start()


def soak(ctx: RunContext) -> None:
    """S14: seeded packages of faults rotated every 60 s, about a quarter of the periods
    quiet (Jepsen's package generator). Packages: S2, S3, S5, S11, S12, S13, S15, and
    what the run's topology allows: S10 through the proxy, S7 on namespaces, S8 and S9b
    on the lazy fs, S9 on a tmpfs per store (S14 has them all). The first period is
    never quiet."""
    packages: dict[str, Nemesis] = {
        "S2": kill_leader_loop, "S3": pause_leader_loop, "S5": store_crash_loop,
        "S11": master_crash_loop, "S12": corruption_loop, "S13": reader_churn_loop,
    }
    if ctx.proxies is not None:
        packages["S10"] = slow_network_loop
    packages["S15"] = bad_input_loop
    if ctx.hosts is not None:
        packages["S7"] = partition_loop
    if ctx.lazy:
        packages["S8"] = power_loss_loop
        packages["S9b"] = read_only_loop
    if ctx.disks:
        packages["S9"] = disk_loop
    period = 8.0 if ctx.quick else 60.0
    first = True
    while ctx.remaining() > 0 and not ctx.stop.is_set():
        end = min(ctx.deadline, time.monotonic() + period)
        # Never the first period quiet: a quick pass has two, and a run that injected
        # nothing is invalid (C0).
        quiet = ctx.rng.random() < 0.25 and not first
        first = False
        name = "quiet" if quiet else ctx.rng.choice(sorted(packages))
        ctx.recorder.record("nemesis", phase="detail", fault="package", target=name)
        if name == "quiet":
            ctx.pause(end - time.monotonic())
        else:
            packages[name](dataclasses.replace(ctx, deadline=end))


def host_of(process: str) -> str:
    """Network host of a workload process: w1 -> writer1, r2 -> reader2."""
    return {"w": "writer", "r": "reader"}[process[0]] + process[1:]


def partition_loop(ctx: RunContext) -> None:
    """S7: rotate partitions (every kind once, in a seeded order, then again), each for
    10 s with a pause between: (a) a copy-set store
    isolated; (b) the leader cut from the master only; (c) a copy-set store blackholed
    (iptables DROP, silent) only towards the standby writer, and the leader killed, so
    the standby takes over and seals with that store silent to it alone; (d) a bridge:
    one store sees only w1, another only w2, the rest both; (e) a store drops what the
    leader sends it (one way); (f) the master isolated. Where the workload reaches the
    stores through the fault proxy (S14), a writer and a store are cut apart on their
    proxy links (blackholed), and (e), which the proxy cannot do one way, is left out."""
    hosts = ctx.hosts
    assert hosts is not None, "S7 runs on network namespaces"
    kinds = ["isolate-store", "leader-from-master", "seal-blackhole", "bridge",
             "oneway-store", "isolate-master"]
    if ctx.proxies is not None:
        kinds.remove("oneway-store")
    kinds = ctx.rng.sample(kinds, len(kinds))
    cut_links: list[Link] = []

    def writer_apart(server: str, writer_host: str) -> None:
        """A store or the master and a writer cut apart: on the hosts, or on the proxy
        link between them where the writer reaches it through the proxy."""
        if ctx.proxies is None:
            hosts.partition(server, writer_host)
            return
        links = ctx.links(server, ["w" + writer_host.removeprefix("writer")])
        for link in links:
            link.set(blackhole=True)
        cut_links.extend(links)

    rotation = 0
    while ctx.pause(ctx.scaled(4, 8)):
        kind = kinds[rotation % len(kinds)]
        rotation += 1
        leader = ctx.leader_process()
        leader_host = host_of(leader.name if leader else "w1")
        standby_host = "writer2" if leader_host == "writer1" else "writer1"
        stores = open_copy_set(ctx.cluster, ctx.rng.choice(ctx.streams)) or ["store0"]
        store = ctx.rng.choice(stores)
        with ctx.window("partition", _target(kind, store, leader_host, standby_host),
                        kind=kind):
            try:
                if kind == "isolate-store":
                    hosts.cut(store)
                elif kind == "leader-from-master":
                    writer_apart("master", leader_host)
                elif kind == "seal-blackhole":
                    writer_apart(store, standby_host)
                    if leader is not None:
                        _seal_by_standby(ctx, leader)
                        continue
                elif kind == "bridge":
                    one, two = ctx.rng.sample(sorted(s.name for s in ctx.cluster.stores), 2)
                    writer_apart(one, "writer2")
                    writer_apart(two, "writer1")
                elif kind == "oneway-store":
                    hosts.oneway(store, leader_host)
                else:
                    hosts.cut("master")
                ctx.pause(ctx.scaled(10, 10) if ctx.quick else 10.0)
            finally:
                hosts.heal()
                for link in cut_links:
                    link.heal()
                cut_links.clear()


def _seal_by_standby(ctx: RunContext, leader: ClientProcess) -> None:
    """The leader dies (kill -9) for the partition's 10 s: the standby's lease waits the
    old one out, then it seals and recovers the open segments and appends."""
    with ctx.window("kill", leader.name, inc=leader.inc):
        leader.kill()
        try:
            ctx.pause(ctx.scaled(10, 10) if ctx.quick else 10.0)
        finally:
            leader.start()


def _target(kind: str, store: str, leader_host: str, standby_host: str) -> str:
    return {
        "isolate-store": store,
        "leader-from-master": f"{leader_host}|master",
        "seal-blackhole": f"{store}|{standby_host}",
        "bridge": "bridge",
        "oneway-store": f"{store}<{leader_host}",
        "isolate-master": "master",
    }[kind]


def heal(ctx: RunContext) -> None:
    """End every fault: heal partitions and proxy links, continue paused processes,
    restart dead ones."""
    if ctx.hosts is not None:
        ctx.hosts.heal()
    if ctx.proxies is not None:
        ctx.proxies.heal()
    for link in ctx.etcd_links.values():
        link.heal()
    for master in ctx.cluster.masters:
        resume(master)
    for store in ctx.cluster.stores:
        resume(store)
    for process in [*ctx.writers.values(), *ctx.readers.values()]:
        process.cont()
        if not process.alive():
            process.start()
    for master in ctx.cluster.masters:
        master.wait_serving()
    for store in ctx.cluster.stores:
        try:
            store.wait_serving()
        except (RuntimeError, TimeoutError) as error:
            # A store that cannot come back (its disk damaged) is left out; the checks
            # decide whether the data survived without it.
            ctx.recorder.record("nemesis", phase="unhealed", fault="heal", target=store.name,
                                error=str(error)[-300:])
    ctx.recorder.record("nemesis", phase="heal", fault="heal", target="all")


# S10's link troubles: 10 % of packets lost (on namespaces), or else a thin pipe
# throughout, and windows of 256 kbit/s.
LOSSY_PERCENT = 10.0
THIN_PIPE_BYTES_PER_S = 256 * 1024
NARROW_WINDOW_BYTES_PER_S = 256_000 // 8


def slow_network_loop(ctx: RunContext) -> None:
    """S10, through the fault proxy: three stores of a copy set, each with its own
    trouble, on every workload process's link to it. One is far away (delayed 50-200
    ms ± 50 ms, a new delay every 10 s); one loses 10 % of its packets to and from the
    proxies throughout (iptables, at random, each way; TCP retransmits), or, run without
    namespaces (S14's package), sits behind a thin pipe instead; one comes and goes: 30 s
    windows throttled to 256 kbit/s and blackholed (a stalled peer: its connections
    hang), with clean periods between. The master is a little far from every workload
    process throughout (20-80 ms ± 20 ms: heartbeats, rolls and seals answered late).
    Reader r2 consumes slowly all along (the scenario's slow reader)."""
    stores = open_copy_set(ctx.cluster, ctx.streams[0])
    if len(stores) < 3:
        stores = sorted(s.name for s in ctx.cluster.stores)
    far, thin, flaky = ctx.rng.sample(stores, 3)
    hosts = ctx.hosts
    thin_trouble = (ctx.window("loss", thin, percent=LOSSY_PERCENT) if hosts is not None
                    else ctx.window("throttle", thin, bytes_per_s=THIN_PIPE_BYTES_PER_S))
    master_delay_s = round(ctx.rng.uniform(0.02, 0.08), 3)
    with ctx.window("delay", far), thin_trouble, ctx.window("delay", "master",
                                                            delay_s=master_delay_s):
        for link in ctx.links("master"):
            link.set(delay_s=master_delay_s, jitter_s=0.02)
        if hosts is not None:
            hosts.lossy(thin, LOSSY_PERCENT, "harness")
        else:
            for link in ctx.links(thin):
                link.set(rate_bytes_per_s=THIN_PIPE_BYTES_PER_S)
        try:
            phases = ["narrow", "clean", "blackhole", "clean"]
            phase = 0
            while ctx.remaining() > 0 and not ctx.stop.is_set():
                kind = phases[phase % len(phases)]
                phase += 1
                # A quick pass goes through every phase once.
                until = time.monotonic() + (3.5 if ctx.quick else 30.0)
                if kind == "clean":
                    _vary_delay(ctx, far, until)
                    continue
                changes = ({"blackhole": True} if kind == "blackhole"
                           else {"rate_bytes_per_s": NARROW_WINDOW_BYTES_PER_S})
                with ctx.window(kind, flaky, **changes):
                    for link in ctx.links(flaky):
                        link.set(**changes)
                    try:
                        _vary_delay(ctx, far, until)
                    finally:
                        for link in ctx.links(flaky):
                            link.heal()
        finally:
            for link in ctx.links(far) + ctx.links(thin) + ctx.links("master"):
                link.heal()
            if hosts is not None:
                hosts.heal_host(thin)


def _vary_delay(ctx: RunContext, store: str, until: float) -> None:
    """Until `until`, a new delay (50-200 ms, jitter 50 ms) on every link to `store`
    about every 10 s."""
    while time.monotonic() < until:
        delay_s = round(ctx.rng.uniform(0.05, 0.2), 3)
        ctx.recorder.record("nemesis", phase="detail", fault="delay", target=store,
                            delay_s=delay_s, jitter_s=0.05)
        for link in ctx.links(store):
            link.set(delay_s=delay_s, jitter_s=0.05)
        if not ctx.pause(min(ctx.scaled(10, 10), until - time.monotonic())):
            return


# S15: fuzz calls per second beside the workload (each a synchronous RPC).
FUZZ_CALLS_PER_S = 20


def bad_input_loop(ctx: RunContext) -> None:
    """S15: once the workload has a sealed segment, every row of `badinput.ROWS` (in a
    seeded order), then random bytes and mutated requests to random RPCs of the master
    and the stores until the deadline; the workload's metadata and sealed replicas
    digested before and after, every server's health after."""
    from tests.faults import badinput

    cluster = ctx.cluster
    stores = [store.name for store in cluster.stores]
    addresses = {"master": cluster.master_address,
                 **{store.name: store.address for store in cluster.stores}}
    live = None
    while live is None:
        live = badinput.live_segments(cluster.master_address, ctx.streams)
        if live is None and not ctx.pause(0.2):
            ctx.skip("no sealed segment to aim bad input at")
            return

    def digest(phase: str) -> None:
        ctx.recorder.record(
            "digest", phase=phase,
            master=badinput.master_digest(cluster.master_address, ctx.streams, stores),
            stores=badinput.store_digests(cluster.master_address, ctx.streams))

    tenants = sorted({stream.split("/")[0] for stream in ctx.streams})
    callers = badinput.callers(cluster.master_address, tenants, cluster.root)
    rows = [row for row in badinput.ROWS if callers.tls or not row.tls_only]
    not_mutated = set() if callers.tls else badinput.NOT_MUTATED
    by_name = {(server, method.name): method for server, method in badinput.methods()}
    templates = badinput.fuzz_templates()
    # A server already down (a store an earlier package of S14 left damaged) is not
    # sent anything: whether bad input stops a server is judged on those serving now.
    serving_before = badinput.serving(addresses)
    targets = [s for s in cluster.stores if serving_before.get(s.name)] or cluster.stores
    digest("before")
    try:
        with ctx.window("bad-input", "servers"):
            for row in ctx.rng.sample(rows, len(rows)):
                if row.client == badinput.REVOKED_TOKEN:
                    ctx.pause(callers.revoked_at + badinput.REVOCATION_REACHES_STORES_S
                              - time.monotonic())
                live = badinput.live_segments(cluster.master_address, ctx.streams) or live
                target = live.sealed if row.segment == "sealed" else live.open
                address = cluster.master_address if row.server == "master" else target.address
                tenant = live.sealed.stream.split("/")[0]
                got, details = badinput.call_as(callers, row.client, tenant, address,
                                                target.data_address,
                                                by_name[(row.server, row.method)],
                                                badinput.serialized(row.request(live)))
                ctx.recorder.record("bad", kind="row", case=row.case, server=row.server,
                                    method=row.method, client=row.client,
                                    expected=row.expected_on(callers.tls).name, got=got,
                                    details=details)
            # The rows' channels go (a plaintext or wrong-CA one would keep reconnecting).
            callers.close()
            while ctx.pause(1 / FUZZ_CALLS_PER_S):
                server = ctx.rng.choice(sorted(by_name))
                method = by_name[server]
                data, mutated = badinput.fuzzed_request(ctx.rng, method, templates, not_mutated)
                parses = badinput.parses(method, data)
                store = ctx.rng.choice(targets)
                address = cluster.master_address if server[0] == "master" else store.address
                # On a TLS cluster as a tenant: every RPC is mutated, none may pass.
                fuzzer = badinput.TENANT if callers.tls else badinput.HARNESS
                got, details = badinput.call_as(callers, fuzzer, ctx.rng.choice(tenants),
                                                address, store.data_address, method, [data])
                ctx.recorder.record(
                    "bad", kind="mutated" if mutated else "random", server=server[0],
                    method=method.name, case=data.hex(),
                    expected="INVALID_ARGUMENT" if not parses else "parsed",
                    streaming=method.server_streaming, got=got, details=details)
    finally:
        callers.close()
        digest("after")
        serving_after = badinput.serving(addresses)
        ctx.recorder.record("serving", servers={
            name: up for name, up in serving_after.items() if serving_before.get(name, True)})


def data_loss_loop(ctx: RunContext) -> None:
    """S16 (C14): beyond what the system promises to survive. Twice (once per stream),
    every copy of a sealed segment holding events is destroyed, so more than N - W
    copies of its range are really gone: on the first stream by each replica's Delete
    (at once), on the second by damage at rest (every replica's store killed, its first
    copy's bytes changed under the old crc32c in the files, restarted: correlated
    damage, as a bad batch of disks or a bug writing to all of them). A fresh reader
    (r3, r4) then starts from 0. Every reader that comes to the range must get a
    data-loss error naming it, and none may pass it silently."""
    for number, stream in enumerate(ctx.streams[:2]):
        if not ctx.pause(ctx.scaled(10, 14)):
            return
        victim = _destroyable_segment(ctx, stream)
        while victim is None:  # not two sealed segments yet
            if not ctx.pause(0.2):
                ctx.skip(f"no sealed segment of {stream} to destroy")
                return
            victim = _destroyable_segment(ctx, stream)
        stream_id, epoch, final_index, replicas = victim
        segment = entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch, stream=stream)
        events = _event_indexes(replicas[0][2], segment, final_index)
        stores = [r[0] for r in replicas]
        how = "delete" if number == 0 else "damage"
        with ctx.window("destroy", f"{stream}/{epoch}", stores=stores, how=how,
                        quorum_lost=how == "damage"):
            if how == "delete":
                for _store, address, _data_address in replicas:
                    with open_channel(address) as channel:
                        store_grpc.SegmentStoreStub(channel).Delete(
                            segment_store_pb2.DeleteRequest(segment=segment), timeout=10)
            else:
                _damage_every_copy(ctx, stores, stream_id, epoch)
        ctx.recorder.record("lost", stream=stream, epoch=epoch, final_index=final_index,
                            events=events, stores=stores, how=how)
        if ctx.new_reader is not None:
            name = f"r{3 + number}"
            reader = ctx.readers[name] = ctx.new_reader(name)
            reader.start()


def _damage_every_copy(ctx: RunContext, stores: list[str], stream_id: int, epoch: int) -> None:
    """Kill every store in `stores`, change the payload of their copy of index 1 of the
    segment under its old crc32c (what a flipped bit in a value does), restart them."""
    processes = [ctx.store(name) for name in stores]
    try:
        for process in processes:
            process.kill()
        for process in processes:
            damage.rewrite_copy(ctx.cluster.root / process.name, stream_id, epoch, 1,
                                b"damaged at rest", valid_crc=False)
    finally:
        for process in processes:
            process.start(wait=False)


def _destroyable_segment(ctx: RunContext, stream: str
                         ) -> tuple[int, int, int, list[tuple[str, str, str]]] | None:
    """A sealed segment of `stream` with events, not the newest sealed one (readers
    that tail the stream have read it): stream id, epoch, final index, replicas."""
    with open_channel(ctx.cluster.master_address) as channel:
        listing = master_pb2_grpc.MasterStub(channel).ListSegments(
            master_pb2.ListSegmentsRequest(stream=stream), timeout=10)
    sealed = [s for s in listing.segments if s.state == entry_pb2.SEALED and s.final_index > 1]
    if len(sealed) < 2:
        return None
    chosen = ctx.rng.choice(sealed[:-1])
    return (listing.stream_id, chosen.id.epoch, chosen.final_index,
            [(r.store_id, r.address, r.data_address) for r in chosen.copy_set])


def _event_indexes(data_address: str, segment: entry_pb2.SegmentId, final_index: int
                   ) -> list[int]:
    """Indexes of the events a segment holds below its bridge (read from a replica)."""
    indexes: list[int] = []
    request = segment_store_pb2.ReadRequest(segment=segment, from_index=1, to_index=final_index)
    for reply in framed_read.read_sync(data_address, harness_transport(), request, 30):
        indexes.extend(e.index for e in reply.entries
                       if e.kind == entry_pb2.EVENT and e.index < final_index)
    return indexes


def read_only_loop(ctx: RunContext) -> None:
    """S9 (read-only half; stores on the lazy fs): at 30 % of the run a copy-set store's
    file system turns read-only under it (every write and sync fails with EROFS, as a
    file system that remounted itself read-only after a device error), for a third of
    the run; then it takes writes again. The leader must go on without that store; a
    store that died of it is restarted once its disk is back (a crash loop would show)."""
    length = ctx.remaining()
    if not ctx.pause(0.3 * length):
        return
    store = _copy_set_store(ctx)
    mount = ctx.lazy[store.name]
    ctx.recorder.record("nemesis", phase="start", fault="read-only", target=store.name)
    try:
        mount.read_only(True)
        ctx.pause(length / 3)
    finally:
        mount.read_only(False)
        writable_at = _wal_sizes(mount.backing)
        died = not store.alive()
        if died:
            store.start(wait=False)
        ctx.recorder.record("nemesis", phase="stop", fault="read-only", target=store.name,
                            store_had_exited=died)
    if ctx.quick:
        # The pass covers each fault once: it ends once the store has synced writes to
        # its disk again (5 s of the 15 went to waiting before).
        while ctx.pause(0.2) and not _wal_grew(mount.backing, writable_at):
            pass
    else:
        ctx.pause(ctx.remaining())


def _wal_sizes(directory: Path) -> dict[Path, int]:
    """The bytes of each RocksDB write-ahead log under `directory` (the lazy fs's backing
    dir: what was synced)."""
    sizes = {}
    for wal in directory.rglob("*.log"):
        with contextlib.suppress(FileNotFoundError):  # a log RocksDB is done with goes
            sizes[wal] = wal.stat().st_size
    return sizes


def _wal_grew(directory: Path, before: dict[Path, int]) -> bool:
    return any(size > before.get(wal, 0) for wal, size in _wal_sizes(directory).items())


def power_loss_all_loop(ctx: RunContext) -> None:
    """S8 (c) for every store at once, every 10-15 s: kill -9 all of them, drop every
    unsynced write, restart. With `fsync=always` nothing acked may be lost; with
    `fsync=never` (S8d) what is lost is the window the docs must state."""
    while ctx.pause(ctx.scaled(10, 15)):
        stores = ctx.cluster.stores
        with ctx.window("power-loss", "+".join(store.name for store in stores),
                        quorum_lost=True):
            try:
                for store in stores:
                    store.kill()
                for store in stores:
                    ctx.lazy[store.name].drop()
                ctx.pause(1.0)
            finally:
                for store in stores:
                    store.start(wait=False)
