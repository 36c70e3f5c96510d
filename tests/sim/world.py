"""One simulated cluster from one seed: configuration, faults, phases, the run loop.

A seed draws the configuration (policy, stores, writers, fault rates, batch sizes) and
then drives everything from the same `random.Random`: message delays and losses, which
node crashes or pauses, partitions, user appends, injected bad input. The safety phase
runs `steps` scheduler steps with faults on; the liveness phase turns faults off, heals
the network, restarts and resumes every node, and must converge: a leader acks again,
every earlier segment is sealed at the master, and every follower has read every append
ever acknowledged to a user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from unittest import mock

from streamengine.client.core import recovery as recovery_core
from streamengine.client.core.recovery_plan import RecoveryPlan, plan_recovery
from streamengine.client.core.writer import APPEND_TIMEOUT_MS
from streamengine.master.core.errors import MasterError, NotEnoughStores
from streamengine.master.core.leadership import Claim
from streamengine.master.core.model import SegmentState
from streamengine.protocol.entry import EntryKind, PackedEntries, StoredEntry, encode_value
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.limits import EPOCH_MAX, LEASE_MS_DEFAULT
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.protocol.sequence import unpack_sequence
from streamengine.protocol.signing import SigningKey
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import BadRequest, StoreError
from streamengine.segment_store.core.errors import BelowFence as StoreRefused
from streamengine.segment_store.core.keys import SegmentMeta, entry_key
from streamengine.segment_store.core.kv import Put
from tests.sim import messages as m
from tests.sim.checkers import Checker, Violation
from tests.sim.follower_node import FollowerNode
from tests.sim.master_node import MasterNode
from tests.sim.network import Faults, Message, Network, Scheduler
from tests.sim.nodes import MASTER, Node
from tests.sim.store_node import StoreNode
from tests.sim.writer_node import WriterNode

FLAWS = (
    "serve_matched",
    "skip_by_matched",
    "ack_before_seal",
    "ignore_fence",
    "fail_in_doubt",
    "copy_unfenced",
    "forget_pending",
    "ignore_grant",
    "short_read",
    "forget_lost",
    "trust_any_bridge",
    "ack_before_loss",
    "loss_ends_at_final",
    "resend_without_dedup",
    "keep_past_gap",
)

# The liveness phase must converge within this much virtual time.
LIVENESS_MS = 30_000
# How a run fails when a writer steps down because its core cannot do what a grant
# needs (never expected: the simulated writers support recovery and rolling).
UNSUPPORTED_GRANT = "a writer refused a grant it cannot lead"
# Every change is checked as it happens; a full audit of every store also runs this
# often (and at the end), in case a change escaped the incremental checks.
AUDIT_EVERY_STEPS = 250
# With `SimConfig.rot`, the chance that a chaos tick forges a copy.
ROT_CHANCE = 0.2
# With `SimConfig.bounded_reads`, a bounded read starts this often in the safety
# phase, and as a store crashes; at most this many per run (each reads from the start:
# a few seconds of virtual time hold a few hundred events).
BOUNDED_READ_EVERY_MS = 700
BOUNDED_READS_MAX = 12
# With `SimConfig.wipes`, the chance that a store's crash wipes its disk (when it may: no
# segment may lose more replicas than its quorums can spare),
# and the chance that a wiped store crashes again between its registration's answer
# and its join, or the master crashes between committing a registration and answering it
# (either way the master committed the new incarnation and the store never joined).
WIPE_CHANCE = 0.5
CRASH_BEFORE_JOIN_CHANCE = 0.3
CRASH_AFTER_REGISTERING_CHANCE = 0.3
# The band wiped disks are hunted in (`python -m tests.sim SEED --wipes`): three stores
# for N = 3, W = 2, so a wiped store is in every copy set and, back as a new
# incarnation, often among the R stores a recovery decides from.
WIPES: dict[str, Any] = {"wipes": True, "policy": ReplicationPolicy(3, 2), "stores": 3}
# With `SimConfig.accept_loss`, the chance that a chaos tick destroys one replica of
# the stream's open segment for good (as a lost disk does, the store marking it lost).
# Once more replicas of a segment are destroyed than its quorums can spare (fewer than
# R left), the operator stops the writers and seals it accepting loss: from then on
# every recovery of it accepts loss, and may be interrupted as any recovery is. One
# replica of every segment is always kept ("Known gaps": a segment that lost every
# replica cannot be sealed).
DESTROY_CHANCE = 0.15
# The chance that the replica destroyed is the one holding most (the others may then
# lack acked events: a loss to declare), not one drawn at random.
DESTROY_AHEAD_CHANCE = 0.5
# The chance that a recovery accepting loss is interrupted (its writer killed) within
# `INTERRUPT_MS_MAX` of its decision: it leaves bridges above the acked index, or
# stores raised, for the next one to find.
INTERRUPT_CHANCE = 0.5
INTERRUPT_MS_MAX = 30
# The band accepting loss is hunted in (`python -m tests.sim SEED --accept-loss`): N = 3,
# W = 2 on three stores, so two destroyed replicas leave a segment stuck with one.
ACCEPT_LOSS: dict[str, Any] = {
    "accept_loss": True,
    "policy": ReplicationPolicy(3, 2),
    "stores": 3,
    "fsync_never": (),
}
# The flaws of issue #35's defect 2, each found in the band `ACCEPT_LOSS`.
ACCEPT_LOSS_FLAWS = frozenset({"trust_any_bridge", "ack_before_loss", "loss_ends_at_final"})
# In a run with producers (`SimConfig.producers`), the share of user appends made with
# a producer id (exactly once, issue #40).
PRODUCER_SHARE = 0.5
# Flaws only runs with producers show: `resend_without_dedup` (resends as plain
# appends), `keep_past_gap` (a recovery keeps a producer's batch past a lost one).
PRODUCER_FLAWS = frozenset({"resend_without_dedup", "keep_past_gap"})
# The share of seeds whose writers append with producer ids. Drawn from a randomness of
# its own, so that a seed without producers runs as it did before producers existed
# (the schedules its regression tests pin stay theirs).
PRODUCER_SEEDS_SHARE = 0.5


def draws_producers(seed: int) -> bool:
    """Whether seed `seed`'s writers append with producer ids."""
    return random.Random(f"producers:{seed}").random() < PRODUCER_SEEDS_SHARE
# A hard bound on steps, whatever the phase, so a livelock ends the run.
STEPS_MAX = 400_000
# What a store losing acked entries (fsync never) can break: reads (1, 2), sealed
# replicas (4), and convergence (0, a bridge lost everywhere it was held). Fencing (3),
# the master (5) and bad input (6) never rest on a store's durability.
LOSS_CAN_BREAK = frozenset({0, 1, 2, 4})


def is_documented_loss(violation: Violation | None, unsynced_losses: list[str]) -> bool:
    """A violation after stores with fsync never lost acked entries in a restart, of an
    invariant such a loss can break: the documented loss, not a broken invariant."""
    return violation is not None and bool(unsynced_losses) and violation.invariant in LOSS_CAN_BREAK


def run_outcome(violation: Violation | None, unsynced_losses: list[str], error: str) -> str:
    """How a run ended, in a word and its reason (both worlds' summaries)."""
    if is_documented_loss(violation, unsynced_losses):
        return f"DOCUMENTED LOSS (fsync never: {unsynced_losses[0]}) {violation}"
    if violation is not None:
        return f"VIOLATION {violation}"
    if error:
        return f"ERROR {error.strip().splitlines()[-1]}"
    return "ok"


# Writer clocks against the master's (the world's): an offset, and a rate off by up to
# this many parts per million. A writer counts its lease from its own send time on its
# own clock; the master counts from receipt on its clock. A writer clock slow by p ppm
# makes the writer's lease last lease_ms * p / 1e6 longer in real time, which docs/design.md's
# lease rule (the writer believes its lease ends before the master does) absorbs only
# up to the one-way delay of the heartbeat, at least 1 ms here: 1000 ppm keeps that
# within 0.6 ms at the longest lease (600 ms). Leases then never overlap.
CLOCK_DRIFT_PPM_MAX = 1_000
# One seed in four draws writer clocks far beyond that (20%: a slow writer's lease
# outlives the master's by up to 150 ms), so a writer cut off from the master can
# believe it leads while the master has granted the next epoch: safety must still hold
# (it rests on epochs and fences, never on leases), and liveness too (a writer still
# heartbeats three times per lease by its clock, and its lease still runs out).
CLOCK_DRIFT_PPM_WILD = 200_000
CLOCK_OFFSET_MS_MAX = 1_000_000


@dataclass(frozen=True, slots=True)
class SimConfig:
    seed: int
    policy: ReplicationPolicy
    stores: int
    writers: int
    followers: int
    faults: Faults
    lease_ms: int
    store_timeout_ms: int
    idle_ack_ms: int
    window: int
    recovery_batch: int
    busy: float
    append_every_ms: int
    chaos_every_ms: int
    segment_bytes: int  # roll thresholds (0: the master's defaults, never reached)
    segment_age_ms: int
    flaws: frozenset[str] = frozenset()
    stream: str = "sim/stream"
    # Stores running with `--fsync never` (DESIGN: unsafe); at most W - 1 of them.
    fsync_never: tuple[str, ...] = ()
    # Damage at rest: now and then one replica of a sealed segment gets a copy forged
    # under a valid crc32c (what only the certificate tells). Off unless asked for: it
    # draws from the seed's randomness.
    rot: bool = False
    # Bounded readers (`read` to the acked end): now and then one reads from sequence 0
    # to just past the last event users saw acked, and gives up (Unreachable) or ends,
    # having read every acked event of its range. Off unless asked for (or the flaw
    # `short_read`): their messages draw from the seed's randomness.
    bounded_reads: bool = False
    # Wiped disks: now and then a store's crash loses its whole database, and it comes
    # back as a new incarnation that registers, joins with the replicas it lost, and
    # may crash before it joins. Off unless asked for (or the flaw `forget_lost`): it
    # draws from the seed's randomness.
    wipes: bool = False
    # Destroyed replicas and the operator's `seal --accept-loss` (`DESTROY_CHANCE`).
    # Off unless asked for (or one of the flaws it hunts): it draws from the seed's
    # randomness.
    accept_loss: bool = False
    # Writers appending with producer ids (half their appends) and resending what they
    # were not told was written: `draws_producers` decides, flaws that need them force it.
    producers: bool = False

    @property
    def append_timeout_ms(self) -> int:
        """The writers' append timeout, scaled with the lease as the real defaults are."""
        return self.lease_ms * APPEND_TIMEOUT_MS // LEASE_MS_DEFAULT

    @staticmethod
    def draw(seed: int, rng: random.Random, flaws: frozenset[str] = frozenset()) -> SimConfig:
        replicas, quorum = rng.choice(((3, 2), (3, 2), (3, 3), (2, 1), (5, 3), (1, 1)))
        lease_ms = rng.choice((150, 300, 600))
        return SimConfig(
            seed=seed,
            policy=ReplicationPolicy(replicas, quorum),
            stores=replicas + rng.choice((0, 1, 2)),
            writers=rng.choice((2, 3)),
            followers=rng.choice((1, 2)),
            faults=Faults.draw(rng),
            lease_ms=lease_ms,
            store_timeout_ms=lease_ms * 2,
            idle_ack_ms=rng.choice((5, 20)),
            window=rng.choice((2, 3, 8)),
            recovery_batch=rng.choice((1, 2, 3, 64)),
            busy=rng.choice((0.0, 0.05, 0.2)),
            append_every_ms=rng.choice((5, 15, 40)),
            chaos_every_ms=lease_ms * rng.choice((1, 2, 4)) // 2,
            segment_bytes=rng.choice((0, 0, 400, 2000)),
            segment_age_ms=rng.choice((0, 0, lease_ms * 3)),
            flaws=flaws,
        )

    def with_unsynced_stores(self, rng: random.Random) -> SimConfig:
        """Draw the stores that run with fsync never: in a third of the seeds, 1 to
        W - 1 of them (none when W = 1), so every write quorum holds a synced store."""
        most = self.policy.write_quorum - 1
        if most < 1 or rng.random() >= 1 / 3:
            return self
        names = [f"s{i}" for i in range(1, self.stores + 1)]
        chosen = rng.sample(names, rng.randint(1, most))
        return dataclasses.replace(self, fsync_never=tuple(sorted(chosen)))

    def describe(self) -> str:
        f = self.faults
        return (
            f"seed {self.seed}: N={self.policy.replicas} W={self.policy.write_quorum} "
            f"stores={self.stores} writers={self.writers} followers={self.followers} "
            f"lease={self.lease_ms}ms loss={f.loss} dup={f.duplicate} delay<={f.delay_ms_max}ms "
            f"slow={f.slow}/{f.slow_delay_ms_max}ms window={self.window} "
            f"recovery_batch={self.recovery_batch} busy={self.busy} "
            f"append/{self.append_every_ms}ms chaos/{self.chaos_every_ms}ms "
            f"roll at {self.segment_bytes or '-'}B/{self.segment_age_ms or '-'}ms"
            + (f" flaws={sorted(self.flaws)}" if self.flaws else "")
            + (f" fsync-never={list(self.fsync_never)}" if self.fsync_never else "")
            + (" wipes" if self.wipes else "")
            + (" accept-loss" if self.accept_loss else "")
            + (" producers" if self.producers else "")
        )


@dataclass
class RunResult:
    config: SimConfig
    steps: int = 0
    virtual_ms: int = 0
    acked: int = 0
    followers_read: int = 0
    leaders: int = 0
    checks: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    error: str = ""
    stats: Counter[str] = field(default_factory=Counter)
    # Acked entries stores with fsync never lost in a restart (the documented loss);
    # a violation after one is classified as that loss, not as a broken invariant.
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
            f"seed {self.config.seed}: {outcome}; {self.steps} steps, {self.virtual_ms} ms "
            f"virtual, {self.acked} appends acked, {self.leaders} grants, "
            f"{self.checks} checks, {self.seconds * 1000:.0f} ms"
        )


class World:
    def __init__(
        self,
        config: SimConfig,
        rng: random.Random,
        trace: Callable[[str], None] | None = None,
        probe_lost: bool = True,
    ) -> None:
        self.config = config
        self.probe_lost = probe_lost
        self.rng = rng
        self.trace = trace
        self.sched = Scheduler()
        self.net = Network(
            self.sched, rng, config.faults, self.deliver, lambda node: self.nodes[node].incarnation
        )
        self.checker = Checker(stream_id=1, append_timeout_ms=config.append_timeout_ms)
        self.phase = "safety"
        self._ids = 0
        self._steps = 0
        self._payloads = 0
        self.marker: bytes | None = None
        self.marker_by = ""
        self.stats: Counter[str] = Counter()
        # Writers that stepped down because the core cannot do what a grant needs.
        self.unsupported: list[str] = []
        self.clocks = self._draw_clocks(config)
        self.store_names = [f"s{i}" for i in range(1, config.stores + 1)]
        self.writer_names = frozenset(f"w{i}" for i in range(1, config.writers + 1))
        self.stores: dict[str, StoreNode] = {}
        self.master = MasterNode(self)
        for name in self.store_names:
            self.stores[name] = StoreNode(name, self)
        self.writers = [WriterNode(f"w{i}", self) for i in range(1, config.writers + 1)]
        self.followers = [FollowerNode(f"r{i}", self) for i in range(1, config.followers + 1)]
        self.bounded: list[FollowerNode] = []
        # Replicas destroyed for good, by segment; segments sealed accepting loss.
        self.destroyed: dict[SegmentKey, set[str]] = {}
        self.loss_accepted: set[SegmentKey] = set()
        self.nodes: dict[str, Node] = {MASTER: self.master}
        self.nodes.update(self.stores)
        self.nodes.update((w.name, w) for w in self.writers)
        self.nodes.update((f.name, f) for f in self.followers)
        clocks = ", ".join(f"{w} +{o} ms {p:+} ppm" for w, (o, p) in self.clocks.items())
        self.note(f"writer clocks: {clocks}")
        self.sched.after(config.append_every_ms, "user appends", self._user_appends)
        self.sched.after(config.chaos_every_ms, "chaos", self._chaos)
        if config.bounded_reads or "short_read" in config.flaws:
            self.sched.after(BOUNDED_READ_EVERY_MS, "bounded read", self._bounded_read)

    @staticmethod
    def _draw_clocks(config: SimConfig) -> dict[str, tuple[int, int]]:
        """(offset ms, drift ppm) per writer node, from the seed but from a generator of
        their own, so the rest of the run draws what it drew without drift."""
        rng = random.Random(config.seed * 1_000_003 + 17)
        bound = CLOCK_DRIFT_PPM_WILD if rng.random() < 0.25 else CLOCK_DRIFT_PPM_MAX
        return {
            f"w{i}": (rng.randint(0, CLOCK_OFFSET_MS_MAX), rng.randint(-bound, bound))
            for i in range(1, config.writers + 1)
        }

    # ---- plumbing ----

    @property
    def now(self) -> int:
        return self.sched.now_ms

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def note(self, text: str) -> None:
        if self.trace is not None:
            self.trace(f"{self.now:>7}   * {text}")

    def run_on(self, node: Node, incarnation: int, callback: Callable[[], None]) -> None:
        if not node.up or node.incarnation != incarnation:
            return
        if node.paused:
            node.deferred.append(lambda: self.run_on(node, incarnation, callback))
            return
        callback()

    def deliver(self, message: Message) -> None:
        node = self.nodes[message.dst]
        if not node.up:
            return
        if node.paused:
            incarnation = node.incarnation

            def late() -> None:
                if message.stream and not self.net.stream_open(message.stream):
                    return
                self.run_on(node, incarnation, lambda: node.receive(message))

            node.deferred.append(late)
            return
        node.receive(message)

    def step(self) -> bool:
        popped = self.sched.pop()
        if popped is None:
            return False
        label, callback = popped
        if self.trace is not None:
            self.trace(f"{self.now:>7} {label}")
        callback()
        self._steps += 1
        self.checker.appends_end(self.now)
        for writer in self.writers:
            writer.check_running()
        if self._steps % AUDIT_EVERY_STEPS == 0:
            self.audit()
        return True

    def audit(self) -> None:
        cores = {name: store.core for name, store in self.stores.items()}
        self.checker.audit(cores, self.master.state)

    # ---- users ----

    def _user_appends(self) -> None:
        if self.phase != "safety":
            return
        ready = [w for w in self.writers if w.can_append()]
        producing = [w for w in ready if self.config.producers and w.can_append_producer()]
        if producing and self.rng.random() < PRODUCER_SHARE:
            # A producer's events: resent after every writer change until acked.
            self.rng.choice(producing).append_producer(self.rng.choice((1, 2, 3)))
        elif ready:
            writer = self.rng.choice(ready)
            count = self.rng.choice((1, 1, 1, 2, 3))
            payloads = []
            for _ in range(count):
                self._payloads += 1
                payloads.append(f"{writer.client_id}:{self._payloads}".encode())
            writer.append(tuple(payloads))
        jitter = self.rng.randint(1, self.config.append_every_ms)
        self.sched.after(jitter, "user appends", self._user_appends)

    def _bounded_read(self) -> None:
        """Now and then a user reads to what it saw acked (`read`, `end` given)."""
        if self.phase != "safety":
            return
        self._start_bounded_read()
        self.sched.after(BOUNDED_READ_EVERY_MS, "bounded read", self._bounded_read)

    def _start_bounded_read(self) -> None:
        """A read from the start to just past the last event users saw acked."""
        if len(self.bounded) >= BOUNDED_READS_MAX or not self.checker.acked_sequences:
            return
        end = self.checker.acked_sequences[-1] + 1
        reader = FollowerNode(f"b{len(self.bounded) + 1}", self, end)
        self.note(f"{reader.name} reads to {unpack_sequence(end)}")
        self.bounded.append(reader)
        self.nodes[reader.name] = reader

    # ---- faults ----

    def _chaos(self) -> None:
        if self.phase != "safety":
            return
        roll = self.rng.random()
        if roll < 0.12:
            store = self.rng.choice(list(self.stores.values()))
            if (
                self._wipes_on
                and store.up
                and self._may_wipe(store)
                and self.rng.random() < WIPE_CHANCE
            ):
                self.note(f"{store.name}'s disk will be wiped")
                store.wipe_at_restart = True
            self._crash(store, 3 * self.config.lease_ms)
            if self.bounded:  # bounded reads are on: one starts as a store goes away
                self._start_bounded_read()
        elif roll < 0.30:
            self._crash(self._pick_writer(), self.config.lease_ms)
        elif roll < 0.40:
            self._pause(self._pick_writer())
        elif roll < 0.43:
            self._crash(self.master, 2 * self.config.lease_ms)
        elif roll < 0.47:
            self._crash(self.rng.choice(self.followers), 300)
        elif roll < 0.57:
            self._partition()
        elif roll < 0.65:
            self._inject_bad_input()
        elif roll < 0.68:
            self._operator_moves()
        if self.config.rot and self.rng.random() < ROT_CHANCE:
            self._rot()
        if self._destroys_replicas and self.rng.random() < DESTROY_CHANCE:
            self._destroy_replica()
        self.sched.after(self.config.chaos_every_ms, "chaos", self._chaos)

    # ---- destroyed replicas, and sealing accepting loss ----

    @property
    def _destroys_replicas(self) -> bool:
        return self.config.accept_loss or bool(self.config.flaws & ACCEPT_LOSS_FLAWS)

    def accepts_loss(self, segment: SegmentKey) -> bool:
        """Whether recoveries of `segment` accept loss (the operator sealing it)."""
        return segment in self.loss_accepted

    def _matched(self, store: str, segment: SegmentKey) -> int:
        meta = self.stores[store].core.catalog.meta(segment)
        return meta.matched_index if meta is not None else 0

    def interrupt_recovery(self, writer: WriterNode) -> None:
        """Now and then, kill the writer of a recovery accepting loss that just decided,
        as an operator's interrupted `seal --accept-loss`."""
        if self.phase != "safety" or self.rng.random() >= INTERRUPT_CHANCE:
            return
        incarnation = writer.incarnation

        def interrupt() -> None:
            if writer.incarnation == incarnation and writer.up:
                self.stats["recoveries accepting loss interrupted"] += 1
                self._crash(writer, self.config.lease_ms)

        self.sched.after(self.rng.randint(1, INTERRUPT_MS_MAX), "interrupt", interrupt)

    def _destroy_replica(self) -> None:
        """Destroy one replica of the stream's open segment for good, keeping one; once
        fewer than R are left, the operator stops the writers and seals accepting loss."""
        unsealed = [
            s
            for s in self.master.state.stream_segments(self.checker.stream_id)
            if s.state != SegmentState.SEALED
        ]
        if not unsealed:
            return
        record = unsealed[-1]
        segment = SegmentKey(record.stream_id, record.epoch)
        destroyed = self.destroyed.setdefault(segment, set())
        standing = [s for s in record.copy_set if s not in destroyed and self.stores[s].up]
        if len(record.copy_set) - len(destroyed) <= 1 or not standing:
            return
        victim = self.rng.choice(standing)
        if self.rng.random() < DESTROY_AHEAD_CHANCE:
            victim = max(standing, key=lambda s: self._matched(s, segment))
        self.stores[victim].destroy(segment, self.master.state.cluster_id)
        destroyed.add(victim)
        self.stats["replicas destroyed"] += 1
        self.note(f"{victim}'s replica of segment {segment.epoch} destroyed")
        left = len(record.copy_set) - len(destroyed)
        if left < self.config.policy.read_quorum and segment not in self.loss_accepted:
            self.loss_accepted.add(segment)
            self.stats["segments sealed accepting loss"] += 1
            self.note(f"operator stops the writers, seals {segment.epoch} accepting loss")
            for writer in self.writers:
                self._crash(writer, self.config.lease_ms)

    @property
    def _wipes_on(self) -> bool:
        return self.config.wipes or "forget_lost" in self.config.flaws

    def _may_wipe(self, store: StoreNode) -> bool:
        """Whether `store`'s disk may be wiped: the disks of at most min(N - W, W - 1)
        stores in a run (each as often as it comes), so that no segment loses more
        replicas for good than its quorums can spare (a recovery still finds R = N - W
        + 1 stores to decide from and W to bridge on)."""
        policy = self.config.policy
        wiped = [s for s in self.stores.values() if s.wipes or s.wipe_at_restart]
        most = min(policy.replicas - policy.write_quorum, policy.write_quorum - 1)
        return store in wiped or len(wiped) < most

    def crash_before_join(self, store: StoreNode) -> bool:
        """Whether a wiped store crashes between its registration's answer and its
        join (in the safety phase, now and then)."""
        if self.phase != "safety" or self.rng.random() >= CRASH_BEFORE_JOIN_CHANCE:
            return False
        self.stats["crashes before joining"] += 1
        self._crash(store, self.config.lease_ms)
        return True

    def crash_after_registering(self) -> bool:
        """Whether the master crashes between committing a registration and answering
        it (in the safety phase, now and then)."""
        if self.phase != "safety" or self.rng.random() >= CRASH_AFTER_REGISTERING_CHANCE:
            return False
        self.stats["crashes after registering"] += 1
        self._crash(self.master, 2 * self.config.lease_ms)
        return True

    def _rot(self) -> None:
        """Forge one copy of a sealed segment on one store, behind its back: the same
        epoch, another payload, a valid crc32c. Only on a segment whose other replicas
        (two at least) hold it at the bridge, so the data survives the damage, and that
        has a certificate: without one a repair compares its copy with the source's
        (docs/design.md, "Known gaps")."""
        checker = self.checker
        rotten = {segment for _, segment in checker.rotted}
        certified = {
            (record.stream_id, record.epoch)
            for record in self.master.state.segments.values()
            if record.certificate is not None
        }
        chances = []
        for name, store in sorted(self.stores.items()):
            if not store.up:
                continue
            for segment, final in sorted(store.core.catalog.scrub_targets().items()):
                healthy = [
                    other
                    for other_name, other in sorted(self.stores.items())
                    if other_name != name
                    and (other.core.catalog.meta(segment) or SegmentMeta()).acked_index >= final
                ]
                if (
                    segment in checker.finals
                    and (segment.stream_id, segment.epoch) in certified
                    and segment not in rotten
                    and len(healthy) >= 2
                ):
                    chances.append((name, segment, final))
        if not chances:
            return
        name, segment, final = self.rng.choice(chances)
        store = self.stores[name]
        events = [e for e in store.core.reader.read(segment, 1, final) if e.kind == EntryKind.EVENT]
        if not events:
            return
        victim = self.rng.choice(events)
        forged = StoredEntry.make(victim.index, victim.kind, victim.epoch, b"rot:" + victim.payload)
        key = entry_key(segment.stream_id, segment.epoch, victim.index)
        value = encode_value(forged.kind, forged.epoch, forged.crc32c, forged.payload)
        store.kv.write([Put(key, value)], sync=True)
        checker.rotted.add((name, segment))
        self.stats["copies rotted"] += 1
        self.note(f"rot: {name} seg{segment.epoch} index {victim.index} forged")

    def _pick_writer(self) -> WriterNode:
        leading = [w for w in self.writers if w.up and w.leading]
        if leading and self.rng.random() < 0.7:
            return self.rng.choice(leading)
        return self.rng.choice(self.writers)

    def _crash(self, node: Node, down_ms_max: int) -> None:
        if not node.up:
            return
        self.note(f"{node.name} crashes")
        node.crash()
        incarnation = node.incarnation

        def restart() -> None:
            if not node.up and node.incarnation == incarnation:
                self.note(f"{node.name} restarts")
                node.restart()

        self.sched.after(self.rng.randint(5, down_ms_max), f"{node.name} restarts", restart)

    def _pause(self, node: Node) -> None:
        if not node.up or node.paused:
            return
        self.note(f"{node.name} pauses")
        node.paused = True
        incarnation = node.incarnation
        lease = self.config.lease_ms
        self.sched.after(
            self.rng.randint(lease // 2, 3 * lease),
            f"{node.name} resumes",
            lambda: self._resume(node, incarnation),
        )

    def _resume(self, node: Node, incarnation: int) -> None:
        if node.incarnation != incarnation or not node.paused:
            return
        self.note(f"{node.name} resumes")
        node.paused = False
        deferred, node.deferred = node.deferred, []
        for callback in deferred:
            callback()

    def _partition(self) -> None:
        names = sorted(self.nodes)
        a, b = self.rng.sample(names, 2)
        if self.net.partitioned(a, b):
            return
        self.note(f"partition {a} | {b}")
        self.net.cut(a, b)
        pair = (min(a, b), max(a, b))

        def heal() -> None:
            if pair in self.net.cuts:
                self.note(f"heal {a} | {b}")
                self.net.cuts.discard(pair)

        self.sched.after(self.rng.randint(20, 2 * self.config.lease_ms), "heal", heal)

    # ---- operators: drain a store, rebalance ----

    def _operator_moves(self) -> None:
        """An operator drains a store (while enough others remain for a copy set) or
        asks for a rebalance; the master's repairer carries the moves out."""
        master = self.master
        if not master.up:
            return
        state = master.state
        if self.rng.random() < 0.5:
            usable = [sid for sid, record in sorted(state.stores.items()) if not record.draining]
            if not usable:
                return
            store = self.rng.choice(usable)
            try:
                state.registry.set_draining(store, self.now)
            except NotEnoughStores as refusal:
                self.stats["drains_refused"] += 1
                self.note(f"operator's drain refused: {refusal}")
                return
            self.stats["drains"] += 1
            self.note(f"operator drains {store}")
            return
        tasks, _, _ = state.replicas.rebalance_plan(self.now, master.repairs.running)
        master.plan_moves(tasks)
        self.stats["rebalances"] += 1
        self.note(f"operator rebalances: {len(tasks)} moves")

    # ---- invariant 6: bad input ----

    def _inject_bad_input(self) -> None:
        if self.rng.random() < 0.5:
            self._bad_store_input()
        else:
            self._bad_master_input()

    def _bad_store_input(self) -> None:
        store = self.rng.choice(list(self.stores.values()))
        segments = store.core.catalog.segments()
        if not store.up or not segments:
            return
        segment = self.rng.choice(segments)
        meta = store.core.catalog.meta(segment)
        assert meta is not None
        before = (store.kv.scan(b"", b"\xff" * 32), store.core.catalog.metas())
        index = meta.last_index + 1
        epoch = max(meta.fence, 1)
        kind = self.rng.randrange(9)
        expected: type[StoreError] = BadRequest
        if kind >= 6:
            what = self._ungranted_seal(store, segment, kind)
        elif kind == 0 and meta.fence >= 2:
            stale = meta.fence - 1
            expected = StoreRefused
            what = f"a write at stale epoch {stale} (fence {meta.fence})"
            good = StoredEntry.make(index, EntryKind.EVENT, stale, b"stale")
            result = store.write(segment, stale, 0, (good,))
            if not isinstance(result, m.Refused):
                raise Violation(6, f"store {store.name} accepted {what}")
        elif kind == 1 and meta.fence >= 2:
            expected = StoreRefused
            what = f"a seal at stale epoch {meta.fence - 1}"
            self._expect(store, what, expected, lambda: store.core.seal(segment, meta.fence - 1))
        else:
            entries, what = self._malformed(index, epoch, kind)
            self._expect(
                store, what, expected, lambda: store.core.write(segment, epoch, 0, entries)
            )
        self.note(f"bad input to {store.name}: {what}")
        after = (store.kv.scan(b"", b"\xff" * 32), store.core.catalog.metas())
        if after != before:
            raise Violation(6, f"store {store.name} changed after refusing {what}")

    def _ungranted_seal(self, store: StoreNode, segment: SegmentKey, kind: int) -> str:
        """A seal that would wedge the segment for good (the last epoch there is), with no
        grant, a forged one, or a real grant of another epoch: each refused."""
        last = EPOCH_MAX
        listed = (GrantSegment(segment.epoch, (store.name,)),)
        forged = Grant(segment.stream_id, last, "sim", "intruder", listed, 1 << 62)
        signed, what = b"", f"a seal at epoch {last} without a grant"
        if kind == 7:
            signed = GrantSigner(SigningKey(bytes(32))).sign(forged)
            what = f"a seal at epoch {last} under a grant signed by another key"
        elif kind == 8 and self.checker.grants:
            issued = self.checker.grants[max(self.checker.grants)][0]
            signed = self.master.state.keys.grant_signer(self.now).sign(issued)
            what = f"a seal at epoch {last} under the master's grant of epoch {issued.epoch}"
        result = store.seal(segment, last, signed, from_writer=False)
        if not isinstance(result, m.Denied):
            raise Violation(6, f"store {store.name} did not refuse {what}: {result}")
        return what

    def _malformed(self, index: int, epoch: int, kind: int) -> tuple[PackedEntries, str]:
        good = StoredEntry.make(index, EntryKind.EVENT, epoch, b"x")
        if kind == 2:
            bad_crc = StoredEntry(index, EntryKind.EVENT, epoch, b"x", good.crc32c ^ 1)
            return PackedEntries.of([bad_crc]), "a bad crc"
        if kind == 3:
            return PackedEntries(index, [b"\x01"]), "a value shorter than its header"
        if kind == 4:
            unknown = StoredEntry(index, cast(EntryKind, 9), epoch, b"", 0)
            return PackedEntries.of([unknown]), "an unknown kind"
        above = StoredEntry.make(index, EntryKind.EVENT, epoch + 1, b"x")
        return PackedEntries.of([above]), "a copy epoch above the writer's"

    def _expect(
        self, store: StoreNode, what: str, error: type[StoreError], call: Callable[[], object]
    ) -> None:
        try:
            call()
        except error:
            return
        raise Violation(6, f"store {store.name} did not refuse {what} with {error.__name__}")

    def _bad_master_input(self) -> None:
        master = self.master
        if not master.up:
            return
        state = master.state
        before = (dict(master.metadata.data), dict(state.leases))
        stream = self.config.stream
        record = state.streams[stream]
        now = self.now
        calls: list[tuple[str, Callable[[], object]]] = [
            (
                "a heartbeat with an epoch never granted",
                lambda: state.leadership.writer_heartbeat(
                    stream, Claim("intruder"), record.epoch + 1, 0, 0, now
                ),
            ),
            (
                "a seal at final index 0",
                lambda: state.integrity.seal_segment(
                    stream, max(record.epoch, 1), record.epoch + 1, 0, now
                ),
            ),
            (
                "an unknown stream",
                lambda: state.leadership.writer_heartbeat("sim/nope", Claim("x"), 0, 0, 0, now),
            ),
            ("a malformed stream name", lambda: state.list_segments("no-tenant", 0)),
        ]
        holder = state.leases[stream].holder or "w1.1"
        epoch = max(record.epoch, 1)
        other_key = GrantSigner(SigningKey(bytes(32)))
        forged = other_key.sign(Grant(record.stream_id, epoch, "sim", holder, (), 1 << 62))
        unheld: list[tuple[str, Callable[[], object]]] = [
            (
                "a SealSegment with the leader's published id and no grant",
                lambda: master._serve(m.SealSegment(stream, max(epoch - 1, 1), epoch, 3, holder)),
            ),
            (
                "a ReleaseLease with the leader's published id and no grant",
                lambda: master._serve(m.ReleaseLease(stream, holder, epoch)),
            ),
            (
                "a RollSegment under a forged grant",
                lambda: master._serve(m.RollSegment(stream, holder, epoch, (), forged)),
            ),
        ]
        calls += unheld
        what, call = calls[self.rng.randrange(len(calls))]
        try:
            call()
        except MasterError:
            pass
        else:
            raise Violation(6, f"the master did not refuse {what}")
        self.note(f"bad input to the master: {what}")
        if (dict(master.metadata.data), dict(state.leases)) != before:
            raise Violation(6, f"the master changed after refusing {what}")

    # ---- liveness ----

    def start_liveness(self) -> None:
        self.phase = "liveness"
        self.note("liveness phase: faults off, network healed, every node back")
        self.net.faults = Faults.none()
        self.net.heal()
        for node in self.nodes.values():
            if not node.up:
                node.restart()
            elif node.paused:
                self._resume(node, node.incarnation)

    def ready_leader(self) -> WriterNode | None:
        for writer in self.writers:
            stats = writer.leader.statistics()
            if writer.can_append() and not stats.unsealed_epochs:
                return writer
        return None

    def converged(self) -> bool:
        leader = self.ready_leader()
        if leader is None:
            return False
        if self.marker is not None and self.marker_by != leader.client_id:
            self.marker = None  # its writer stepped down: the marker is in doubt
        if (
            self.marker is not None
            and self.marker not in self.checker.acked.values()
            and not leader.awaits(self.marker)
        ):
            self.marker = None  # its append timed out: in doubt, try another
        if self.marker is None:
            self._payloads += 1
            self.marker = f"marker:{self._payloads}".encode()
            self.marker_by = leader.client_id
            leader.append((self.marker,))
            return False
        if self.marker not in self.checker.acked.values():
            return False
        state = self.master.state
        for segment in state.stream_segments(self.checker.stream_id):
            if segment.epoch < leader.leader.epoch and segment.state != SegmentState.SEALED:
                return False
        if not all(reader.ended for reader in self.bounded):
            return False
        return all(not self.checker.missing(f.name) for f in self.followers)

    def stuck(self) -> str:
        """What keeps the liveness phase from converging, for the report."""
        state = self.master.state
        segments = [
            f"{s.epoch}:{s.state.name}/{s.final_index}"
            for s in state.stream_segments(self.checker.stream_id)
        ]
        writers = [
            f"{w.client_id}:{w.leader.role.value}@{w.leader.epoch}"
            f" unsealed={list(w.leader.statistics().unsealed_epochs)}"
            for w in self.writers
        ]
        missing = {f.name: len(self.checker.missing(f.name)) for f in self.followers}
        missing.update((b.name, -1) for b in self.bounded if not b.ended)  # not ended
        lease = state.leases[self.config.stream]
        return (
            f"no convergence within {LIVENESS_MS} ms: segments {segments}; writers {writers}; "
            f"lease epoch {lease.epoch} holder {lease.holder!r}; followers missing {missing}; "
            f"marker {'acked' if self.marker in self.checker.acked.values() else 'not acked'}"
        )


def run_seed(
    seed: int,
    steps: int = 3000,
    flaws: frozenset[str] = frozenset(),
    trace: Callable[[str], None] | None = None,
    probe_lost: bool = True,
    overrides: dict[str, Any] | None = None,
) -> RunResult:
    """One seed; `overrides` replace drawn configuration fields (the draw itself, and
    so the rest of the run's randomness, stays the seed's)."""
    started = time.perf_counter()
    rng = random.Random(seed)
    config = SimConfig.draw(seed, rng, flaws).with_unsynced_stores(rng)
    producers = draws_producers(seed) or bool(flaws & PRODUCER_FLAWS)
    config = dataclasses.replace(config, producers=producers)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    result = RunResult(config)
    world: World | None = None
    flawed = contextlib.ExitStack()
    if "keep_past_gap" in flaws:
        flawed.enter_context(mock.patch.object(recovery_core, "plan_recovery", _past_gaps))
    try:
        world = World(config, rng, trace, probe_lost)
        for _ in range(steps):
            if not world.step():
                break
            result.steps += 1
        world.start_liveness()
        deadline = world.now + LIVENESS_MS
        refused = len(world.unsupported)
        while True:
            if len(world.unsupported) > refused:
                raise Violation(0, f"{UNSUPPORTED_GRANT}: {world.unsupported[-1]}")
            if result.steps % 25 == 0 and world.converged():
                break
            if world.now > deadline or result.steps >= STEPS_MAX or not world.step():
                raise Violation(0, world.stuck())
            result.steps += 1
        world.audit()
        world.checker.check_complete([f.name for f in world.followers])
    except Violation as violation:
        result.violation = violation
    except Exception:
        result.error = traceback.format_exc()
    if world is not None:
        result.virtual_ms = world.now
        result.acked = len(world.checker.acked)
        result.checks = world.checker.checks
        result.leaders = world.checker.epoch_seen
        result.stats = world.stats
        result.unsynced_losses = list(world.checker.unsynced_losses)
        result.stats["unsynced losses"] += len(result.unsynced_losses)
    flawed.close()
    result.seconds = time.perf_counter() - started
    return result


def _past_gaps(*args: Any, end_at_first_gap: bool = False, **kwargs: Any) -> RecoveryPlan:
    """The flaw `keep_past_gap`: a producer stream's recovery keeps copies past an index
    no store holds, as a plain stream's does."""
    return plan_recovery(*args, **kwargs)
