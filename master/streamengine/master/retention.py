"""Trims and removals: the shell of `core/retention.py` over the master's records.

Trims (by hand or by a stream's retention limits) mark the oldest sealed segments for
removal after the grace; `remove_due` drops what is due, deleted streams included.
A section of the master's state (`master.state`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch
from streamengine.master.core import retention
from streamengine.master.core.model import SegmentKey, SegmentState, StreamRecord
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX

if TYPE_CHECKING:
    from streamengine.master.state import MasterState

# A trim's transaction: its segments and the stream record.
assert retention.TRIMS_PER_COMMIT_MAX + 1 <= OPS_PER_TRANSACTION_MAX


@dataclass(frozen=True, slots=True)
class Trimmed:
    """Segments a trim took now (by hand or by retention)."""

    stream: str
    epochs: tuple[int, ...]
    entries: int  # up to each bridge
    bytes: int  # as the stores last reported
    first_retained_sequence: int
    removal_at_ms: int


@dataclass(frozen=True, slots=True)
class PendingRemoval:
    """Data the stores still hold that goes at `removal_at_ms`: a deleted stream
    (`segment_epoch` 0) or one trimmed segment."""

    stream: str
    segment_epoch: int
    removal_at_ms: int
    bytes: int


class Retention:
    """Trims by hand and by retention, and the removals they lead to."""

    def __init__(self, state: MasterState) -> None:
        self.state = state

    def trim_stream(self, name: str, before_sequence: int, now_ms: int) -> Trimmed:
        """Trim by hand every segment whose events all sort before `before_sequence`
        (each must be sealed: NotTrimmable otherwise, nothing trimmed)."""
        record = self.state.usable_stream(name)
        epochs = retention.trims_before(self._facts(record.stream_id), before_sequence)
        return self._trim(record, epochs, now_ms)

    def apply_retention(self, now_ms: int) -> list[Trimmed]:
        """One retention pass over every stream with a limit: what it trimmed."""
        out = []
        for name in sorted(self.state.limited):
            look = self.state.retention_looks.get(name)
            if look is not None and now_ms < look:
                continue
            record = self.state.streams[name]
            facts = self._facts(record.stream_id)
            age_ms, bytes_max = record.retention_age_ms, record.retention_bytes
            epochs = retention.retention_trims(facts, age_ms, bytes_max, now_ms)
            if epochs:
                # Its segments change: the next pass looks again.
                out.append(self._trim(record, epochs, now_ms))
            else:
                looks = retention.next_look_ms(facts, age_ms, bytes_max, now_ms)
                self.state.retention_looks[name] = looks
        return out

    def remove_due(self, now_ms: int) -> tuple[list[str], list[SegmentKey]]:
        """The second phase: drop deleted streams and trimmed segments whose grace has
        passed; their replicas are garbage from now on (`StoreRegistry._garbage`).
        Returns the streams and segments removed."""
        streams = sorted(
            name for name, until in self.state.deleted.items() if retention.due(until, now_ms)
        )
        for name in streams:
            self.state.tenancy.remove_stream(name)
        due = sorted(key for key, at in self.state.trimmed.items() if retention.due(at, now_ms))
        due = due[: retention.TRIMS_PER_COMMIT_MAX]
        if due:
            batch = Batch()
            for key in due:
                batch.drop_segment(key)
            self.state.catalog.commit(batch)
            for key in due:
                self.state.drop_segment(key)
            self.state.durability.forget(due)
        return streams, due

    def pending_removals(self) -> list[PendingRemoval]:
        """Deleted streams and trimmed segments the stores still hold, soonest first."""
        out = [
            PendingRemoval(
                r.name,
                0,
                r.deleted_until_ms,
                sum(
                    self.state.segment_bytes(s.key) for s in self.state.stream_segments(r.stream_id)
                ),
            )
            for r in map(self.state.streams.__getitem__, self.state.deleted)
        ]
        out += [
            PendingRemoval(s.stream, s.epoch, s.removal_at_ms, self.state.segment_bytes(s.key))
            for s in map(self.state.segments.__getitem__, self.state.trimmed)
        ]
        return sorted(out, key=lambda p: (p.removal_at_ms, p.stream, p.segment_epoch))

    def _facts(self, stream_id: int) -> list[retention.SegmentFacts]:
        return [
            retention.SegmentFacts(
                epoch=s.epoch,
                sealed=s.state == SegmentState.SEALED,
                sealed_at_ms=s.sealed_at_ms,
                final_index=s.final_index,
                bytes=self.state.segment_bytes(s.key),
            )
            for s in self.state.retained_segments(stream_id)
        ]

    def _trim(self, record: StreamRecord, epochs: list[int], now_ms: int) -> Trimmed:
        """Mark `epochs` (the oldest retained segments, sealed) trimmed, durably, in
        transactions of at most TRIMS_PER_COMMIT_MAX segments, each leaving a trimmed
        prefix behind."""
        removal = retention.removal_at_ms(now_ms, self.state.delete_grace_ms)
        entries = size = 0
        for start in range(0, len(epochs), retention.TRIMS_PER_COMMIT_MAX):
            chunk = epochs[start : start + retention.TRIMS_PER_COMMIT_MAX]
            trimmed = [
                replace(self.state.segments[(record.stream_id, e)], removal_at_ms=removal)
                for e in chunk
            ]
            assert all(
                t.state == SegmentState.SEALED and not self.state.segments[t.key].removal_at_ms
                for t in trimmed
            )
            assert record.trimmed_through_epoch < chunk[0]
            record = replace(record, trimmed_through_epoch=chunk[-1])
            batch = Batch().stream(record)
            for segment in trimmed:
                batch.segment(segment)
            self.state.catalog.commit(batch)
            self.state.put_stream(record)
            for segment in trimmed:
                self.state.put_segment(segment)
                self.state.unconfirmed.discard(segment.key)
                entries += max(segment.final_index - 1, 0)
                size += self.state.segment_bytes(segment.key)
        return Trimmed(
            record.name, tuple(epochs), entries, size, self.state.first_retained(record), removal
        )
