"""New epochs: planned, committed in bounded transactions, then applied.

A heartbeat that wins a lease and a leader's roll each open the stream's next epoch
(`master.leadership`): its stream record, the segment it writes (placed by
`core/placement.py`) and the open segment it turns SEALING. A batch of them is committed
in as few metadata transactions as the metadata's bound takes (`transactions`: etcd
refuses a transaction of more than `--max-txn-ops` operations, `OPS_PER_TRANSACTION_MAX`),
each epoch whole in one, and each is applied to the master's state, with its lease, once
its transaction is committed, never before.
A section of the master's state (`master.state`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from streamengine.master.batches import in_transactions
from streamengine.master.catalog import Batch
from streamengine.master.core import placement
from streamengine.master.core.errors import NotEnoughStores
from streamengine.master.core.leadership import Lease
from streamengine.master.core.model import SegmentRecord, SegmentState, StoreView, StreamRecord
from streamengine.protocol.limits import UNSEALED_SEGMENTS_MAX

if TYPE_CHECKING:
    from streamengine.master.state import MasterState


@dataclass(frozen=True, slots=True)
class NewEpoch:
    """An epoch a batch opens: what it writes, persisted with the others before any of
    them is applied, and the lease that holds it."""

    record: StreamRecord
    lease: Lease
    segments: tuple[SegmentRecord, ...]

    @property
    def opened(self) -> SegmentRecord | None:
        """The segment the epoch writes (None: granted without one)."""
        return next((s for s in self.segments if s.epoch == self.lease.epoch), None)


def transactions(plans: list[NewEpoch]) -> list[list[NewEpoch]]:
    """`plans` in runs that each fit one metadata transaction (one for a batch of up to
    `OPS_PER_TRANSACTION_MAX // 3` epochs)."""
    return in_transactions(plans, lambda plan: 1 + len(plan.segments))


class Epochs:
    """Plans new epochs and persists them."""

    def __init__(self, state: MasterState) -> None:
        self.state = state

    def plan(
        self,
        record: StreamRecord,
        lease: Lease,
        exclude: tuple[str, ...],
        now_ms: int,
        allow_no_segment: bool,
        views: dict[str, StoreView],
    ) -> NewEpoch:
        """The new epoch's stream record and the segments it writes (the new one, and
        the open one turned SEALING), to persist: no segment when two are unsealed
        already, nor when too few stores are usable to place one while something is left
        to seal (the new leader seals and recovers it, which needs only R stores of its
        own copy set, and asks for a segment once stores allow: a stream whose stores are
        too few to place a copy set still gets its last segment sealed and read)."""
        assert lease.epoch == record.epoch + 1
        unsealed = self.state.unsealed(record.stream_id)
        segment = None
        copy_set: tuple[str, ...] | None = None
        if len(unsealed) < UNSEALED_SEGMENTS_MAX or not allow_no_segment:
            try:
                copy_set = placement.choose_copy_set(views.values(), record.replicas, exclude)
            except NotEnoughStores:
                if not (allow_no_segment and unsealed):
                    raise
        if copy_set is not None:
            segment = SegmentRecord(
                stream_id=record.stream_id,
                stream=record.name,
                epoch=lease.epoch,
                copy_set=copy_set,
                state=SegmentState.OPEN,
                final_index=0,
                created_at_ms=now_ms,
                sealed_at_ms=0,
                settled_at_ms=now_ms,
            )
        updated = replace(
            record,
            epoch=lease.epoch,
            leader_id=lease.holder,
            leader_secret_sha256=lease.secret_sha256.hex(),
            leader_principal=lease.principal,
        )
        sealing = [
            replace(s, state=SegmentState.SEALING) for s in unsealed if s.state == SegmentState.OPEN
        ]
        return NewEpoch(updated, lease, (*sealing, *([segment] if segment else [])))

    def persist(self, plans: list[NewEpoch]) -> None:
        """Commit `plans` in as few transactions as fit them (`transactions`), applying
        each transaction's epochs, with their leases, once it is committed. A commit
        that fails raises: what earlier ones committed stands, applied."""
        for run in transactions(plans):
            batch = Batch()
            for plan in run:
                batch.stream(plan.record)
                for segment in plan.segments:
                    batch.segment(segment)
            self.state.catalog.commit(batch)
            for plan in run:
                self.state.put_stream(plan.record)
                for segment in plan.segments:
                    self.state.put_segment(segment)
                self.state.leases[plan.record.name] = plan.lease
