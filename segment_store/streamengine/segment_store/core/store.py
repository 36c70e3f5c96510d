"""A segment store's core over a narrow KV: what it holds, how it reads, how it changes.
No gRPC, no asyncio, no clock.

Theory of operation. Every mutation is a command (`commands`). `plan(commands)` checks
each against the published state plus what the earlier commands of the same plan did
(the rules are in `writes`), and returns the KV ops of every command that succeeded,
the resulting per-segment metadata, and one outcome per command. `write_plan` applies
the ops as one atomic KV batch; `publish` makes the new metadata what readers see
(`catalog`). The server gathers concurrent commands into one plan, writes it, syncs
once, then publishes and answers (group commit); `apply` does both for one plan.
Plans must be published in the order they were made, and a plan must be made only
after the previous one was published.

The parts: `catalog` (the published state: segments, tenants, records, identity,
damage), `reader` (entries, runs, digests, certificates), and this class, which owns the
plan/write/publish cycle and decides whether the store takes part in a writer's write
or seal at all.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamengine.protocol.limits import EVENT_BYTES_MAX
from streamengine.segment_store.core import writes
from streamengine.segment_store.core.catalog import StoreCatalog
from streamengine.segment_store.core.commands import (
    Command,
    Plan,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.errors import (
    BelowFence,
    NotJoined,
    ReplicaLost,
)
from streamengine.segment_store.core.keys import SegmentMeta
from streamengine.segment_store.core.kv import KV
from streamengine.segment_store.core.reads import SegmentReader


class SegmentStoreCore:
    """Segments over a KV; see the module doc for the parts and the plan/publish cycle."""

    def __init__(self, kv: KV, entry_bytes_max: int = EVENT_BYTES_MAX, joins_cluster: bool = False):
        """`joins_cluster`: take no writes or seals before `JoinCommand` (a store with a
        master; the core alone, in tests and the simulator, takes them at once)."""
        assert 0 < entry_bytes_max <= EVENT_BYTES_MAX, "the writer's limit bounds the store's"
        self.kv = kv
        self.joins_cluster = joins_cluster
        self.entry_bytes_max = entry_bytes_max
        self.catalog = StoreCatalog(kv)
        self.reader = SegmentReader(kv, self.catalog)

    def recover(self) -> None:
        """After a refused write: have the KV take writes again and reload what it holds
        (a write reported as refused may have reached its log after all; whole, since
        entries and metadata share one batch). Raises while the KV cannot recover."""
        self.kv.recover()
        self.catalog.reload()

    # ---- the plan/write/publish cycle ----

    def plan(self, commands: Iterable[Command]) -> Plan:
        return writes.plan(self.kv, self.catalog, commands, self.entry_bytes_max)

    def write_plan(self, plan: Plan, sync: bool) -> None:
        """The KV half of a plan; safe off the thread that publishes."""
        if plan.ops:
            self.kv.write(plan.ops, sync)

    def publish(self, plan: Plan) -> None:
        self.catalog.publish(plan)

    def apply(self, plan: Plan, sync: bool = True) -> None:
        self.write_plan(plan, sync)
        self.publish(plan)

    # ---- a writer's write or seal, before it becomes a command ----

    def check_takes_part(self, segment: SegmentKey) -> None:
        """Refuse (NotJoined, ReplicaLost) a writer's write or seal of `segment` that
        this store must not take part in."""
        if self.joins_cluster and not self.catalog.cluster_id():
            raise NotJoined("this store has not registered with its master yet")
        self.held_meta(segment)

    def held_meta(self, segment: SegmentKey) -> SegmentMeta:
        """What this store holds of `segment` (what its writes build on and its tails
        follow): its metadata, or an empty open segment's while nothing of it came yet;
        raises ReplicaLost for a replica an earlier incarnation of this store lost,
        which no write fills again (a follower waiting on it would wait for good: it
        reads another replica instead)."""
        meta = self.catalog.meta(segment)
        if meta is not None:
            return meta
        if self.catalog.is_lost(segment):
            raise ReplicaLost(
                f"the replica of {segment.stream_id}/{segment.epoch} here was lost with an "
                "earlier incarnation of this store"
            )
        return SegmentMeta()

    def refused_busy(self, command: WriteCommand) -> WriteResult | BelowFence:
        """The answer to a write refused because the store is busy (nothing written):
        what the segment holds, so the leader resends from its matched index. Below the
        fence it is the fence instead, as for any write: the matched index of a segment
        fenced above the writer counts a later leader's recovery copies, and a writer
        taking it for its own entries would ack what a recovery replaced (a paused
        leader waking up did, simulator seed 10179)."""
        meta = self.catalog.meta(command.segment) or SegmentMeta()
        if command.writer_epoch < meta.fence:
            return BelowFence(meta.fence)
        return WriteResult(meta.matched_index, meta.acked_index, meta.fence, ())
