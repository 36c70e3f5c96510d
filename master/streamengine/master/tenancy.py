"""Tenants and streams: created, listed, their retention changed, deleted (in two
phases, with `retention.remove_due`), undeleted and at last removed.

A section of the master's state (`master.state`): it changes the shared records
through their one commit path, commit first, memory after.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from streamengine.master.catalog import Batch
from streamengine.master.core import leadership, listing, retention, summary
from streamengine.master.core.errors import AlreadyExists, InvalidArgument, NotFound, QuotaExceeded
from streamengine.master.core.leadership import Lease
from streamengine.master.core.model import (
    SegmentRecord,
    StreamRecord,
    validate_name_part,
    validate_stream_name,
)
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX
from streamengine.protocol.limits import CREATE_STREAMS_PER_CALL_MAX
from streamengine.protocol.policy import InvalidPolicy, ReplicationPolicy

# Each stream's record and its tenant's, and the next stream id: one transaction.
assert 2 * CREATE_STREAMS_PER_CALL_MAX + 1 <= OPS_PER_TRANSACTION_MAX

if TYPE_CHECKING:
    from streamengine.master.state import MasterState

# Roll thresholds when a stream is created without its own.
SEGMENT_BYTES_DEFAULT = 256 << 20
SEGMENT_AGE_MS_DEFAULT = 60 * 60 * 1000


@dataclass(frozen=True)
class StreamSpec:
    """A stream to create, as a CreateStream request names it (0: the default)."""

    name: str
    replicas: int
    write_quorum: int
    segment_bytes: int = 0
    segment_age_ms: int = 0
    create_tenant: bool = False
    retention_age_ms: int = 0
    retention_bytes: int = 0

    def with_defaults(self) -> StreamSpec:
        return replace(
            self,
            segment_bytes=self.segment_bytes or SEGMENT_BYTES_DEFAULT,
            segment_age_ms=self.segment_age_ms or SEGMENT_AGE_MS_DEFAULT,
        )

    def policy(self) -> tuple[int, int, int, int, int, int]:
        return (
            self.replicas,
            self.write_quorum,
            self.segment_bytes,
            self.segment_age_ms,
            self.retention_age_ms,
            self.retention_bytes,
        )

    def record(self, stream_id: int, now_ms: int) -> StreamRecord:
        return StreamRecord(
            name=self.name,
            stream_id=stream_id,
            replicas=self.replicas,
            write_quorum=self.write_quorum,
            segment_bytes=self.segment_bytes,
            segment_age_ms=self.segment_age_ms,
            epoch=0,
            leader_id="",
            created_at_ms=now_ms,
            retention_age_ms=self.retention_age_ms,
            retention_bytes=self.retention_bytes,
        )


def _as_it_stands(existing: StreamRecord, spec: StreamSpec) -> StreamRecord:
    """An existing stream asked for again: itself when the policy is the same."""
    if existing.deleted_until_ms:
        raise AlreadyExists(
            f"stream {spec.name!r} is deleted, pending removal at "
            f"{existing.deleted_until_ms}: undelete it, or create it after"
        )
    held = (
        existing.replicas,
        existing.write_quorum,
        existing.segment_bytes,
        existing.segment_age_ms,
        existing.retention_age_ms,
        existing.retention_bytes,
    )
    if held != spec.policy():
        raise AlreadyExists(f"stream {spec.name!r} exists with another policy")
    return existing


class Tenancy:
    """Tenants and their streams."""

    def __init__(self, state: MasterState) -> None:
        self.state = state

    def create_tenant(self, tenant: str, now_ms: int) -> bool:
        validate_name_part("tenant", tenant)
        if tenant in self.state.tenants:
            return False
        self.state.catalog.commit(Batch().tenant(tenant, now_ms))
        self.state.tenants[tenant] = now_ms
        return True

    def create_stream(
        self,
        name: str,
        replicas: int,
        write_quorum: int,
        segment_bytes: int,
        segment_age_ms: int,
        create_tenant: bool,
        now_ms: int,
        retention_age_ms: int = 0,
        retention_bytes: int = 0,
    ) -> StreamRecord:
        spec = StreamSpec(
            name,
            replicas,
            write_quorum,
            segment_bytes,
            segment_age_ms,
            create_tenant,
            retention_age_ms,
            retention_bytes,
        )
        return self.create_streams([spec], now_ms)[0]

    def create_streams(self, specs: Sequence[StreamSpec], now_ms: int) -> list[StreamRecord]:
        """Create every stream `specs` names in one commit, or none: the first refusal
        raises before anything is written. A stream that exists with the same policy (or
        a name repeated with it) is answered as it stands. The records, in order."""
        if len(specs) > CREATE_STREAMS_PER_CALL_MAX:
            raise InvalidArgument(
                f"{len(specs)} streams in one call: at most {CREATE_STREAMS_PER_CALL_MAX}"
            )
        batch = Batch()
        created: dict[str, StreamRecord] = {}
        new_tenants: dict[str, None] = {}
        adding: Counter[str] = Counter()
        next_stream_id = self.state.next_stream_id
        records: list[StreamRecord] = []
        for spec in specs:
            tenant, _ = validate_stream_name(spec.name)
            try:
                ReplicationPolicy(spec.replicas, spec.write_quorum)
            except InvalidPolicy as error:
                raise InvalidArgument(f"impossible policy for {spec.name!r}: {error}") from None
            retention.validate_retention(spec.retention_age_ms, spec.retention_bytes)
            spec = spec.with_defaults()
            existing = created.get(spec.name) or self.state.streams.get(spec.name)
            if existing is not None:
                records.append(_as_it_stands(existing, spec))
                continue
            self._check_quota(tenant, adding[tenant])
            adding[tenant] += 1
            if tenant not in self.state.tenants and tenant not in new_tenants:
                if not spec.create_tenant:
                    raise NotFound(f"tenant {tenant!r} does not exist (set create_tenant)")
                new_tenants[tenant] = None
                batch.tenant(tenant, now_ms)
            record = spec.record(next_stream_id, now_ms)
            next_stream_id += 1
            batch.stream(record)
            created[record.name] = record
            records.append(record)
        if not created:
            return records
        self.state.catalog.commit(batch.next_stream_id(next_stream_id))
        for tenant in new_tenants:
            self.state.tenants.setdefault(tenant, now_ms)
        self.state.next_stream_id = next_stream_id
        for record in created.values():
            self.state.put_stream(record)
            # A new stream never had a leader: nothing to wait for, even right after a start.
            self.state.leases[record.name] = Lease(0, "", 0)
        return records

    def _check_quota(self, tenant: str, adding: int) -> None:
        if not self.state.tenant_streams_max:
            return
        count = self.state.tenant_streams.get(tenant, 0) + adding
        if count >= self.state.tenant_streams_max:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {count} streams, its quota "
                f"(--tenant-streams-max {self.state.tenant_streams_max})"
            )

    def list_page(
        self, tenant: str, name_prefix: str, page_token: str, page_size: int
    ) -> tuple[list[StreamRecord], str]:
        """One page of streams in name order (`core.listing`), and the token of the
        next page ("" after the last)."""
        names = self.state.sorted_names
        page = listing.list_page(names, tenant, name_prefix, page_token, page_size)
        return [self.state.streams[name] for name in page.names], page.next_page_token

    def summarise(
        self, under_replicated: Iterable[SegmentRecord], tenant: str = ""
    ) -> summary.Summary:
        """The streams as a status shows them (`core.summary`), of one tenant only or
        ("") of all: `under_replicated` are the sealed segments below N good replicas
        with a member lacking (`Replicas.below_n`)."""
        scope = f"{tenant}/" if tenant else ""
        flags = [(s.stream, summary.Health.UNDER_REPLICATED) for s in under_replicated]
        flags += [
            (self.state.stream_name(sid), summary.Health.SEALING)
            for sid in self.state.sealing
            if sid in self.state.names  # a status never fails on a segment of no stream
        ]
        flags += [(name, summary.Health.DELETED) for name in self.state.deleted]
        flagged = {n: h for n, h in summary.worst(flags).items() if n.startswith(scope)}
        totals = {t: n for t, n in self.state.tenant_streams.items() if not tenant or t == tenant}
        in_order = self.state.sorted_names
        after = itertools.islice(in_order, bisect.bisect_left(in_order, scope), None)
        names = itertools.takewhile(lambda name: name.startswith(scope), after)
        return summary.summarise(totals, flagged, names)

    def update_stream(
        self, name: str, retention_age_ms: int | None, retention_bytes: int | None
    ) -> StreamRecord:
        """Change a stream's retention limits (None: unchanged); the next retention
        pass applies them."""
        record = self.state.usable_stream(name)
        updated = replace(
            record,
            retention_age_ms=record.retention_age_ms
            if retention_age_ms is None
            else retention_age_ms,
            retention_bytes=record.retention_bytes if retention_bytes is None else retention_bytes,
        )
        retention.validate_retention(updated.retention_age_ms, updated.retention_bytes)
        if updated != record:
            self.state.catalog.commit(Batch().stream(updated))
            self.state.put_stream(updated)
        return updated

    def delete_stream(self, name: str, now_ms: int) -> tuple[int, int]:
        """Record the intent to delete: the stream is refused from now on, and its
        records and data go once the grace has passed (`Retention.remove_due`), unless
        it is undeleted before. Returns (segments, when they go). Deleting a stream
        already deleted changes nothing."""
        record = self.state.stream(name)
        segments = len(self.state.stream_segments(record.stream_id))
        if record.deleted_until_ms:
            return segments, record.deleted_until_ms
        deleted = replace(
            record, deleted_until_ms=retention.removal_at_ms(now_ms, self.state.delete_grace_ms)
        )
        self.state.catalog.commit(Batch().stream(deleted))
        self.state.put_stream(deleted)
        self.state.roll_requests.pop(record.stream_id, None)
        return segments, deleted.deleted_until_ms

    def undelete_stream(self, name: str) -> StreamRecord:
        """Bring a deleted stream back within its grace: same id, segments and epochs.
        The lease starts afresh without a holder (`leadership.undeleted`), so the next
        writer is granted an epoch above the one the stores fence as deleted
        (`DeletedStream.fenced_through_epoch`): it writes at once, before their next
        heartbeat reply stops listing the stream."""
        record = self.state.stream(name)
        if not record.deleted_until_ms:
            raise InvalidArgument(f"stream {name!r} is not deleted")
        restored = replace(
            record, deleted_until_ms=0, leader_id="", leader_secret_sha256="", leader_principal=""
        )
        self.state.catalog.commit(Batch().stream(restored))
        self.state.put_stream(restored)
        self.state.leases[name] = leadership.undeleted(self.state.leases[name])
        return restored

    def remove_stream(self, name: str) -> int:
        """Drop the stream and its segments. Stores are not told one replica at a time:
        a stream id below the next one that no stream has is garbage wherever it is
        reported (`StoreRegistry._garbage`), so the removal is one small transaction
        however long the stream."""
        record = self.state.stream(name)
        assert record.deleted_until_ms, "only a deleted stream is removed"
        segments = self.state.stream_segments(record.stream_id)
        self.state.catalog.commit(Batch().drop_stream(name).drop_segments_of(record.stream_id))
        for segment in segments:
            self.state.drop_segment(segment.key)
        # Replicas of an unknown stream id are garbage to every store that reports them.
        self.state.drop_stream(name)
        self.state.leases.pop(name, None)
        self.state.leader_reports.pop(name, None)
        self.state.durability.forget(s.key for s in segments)
        return len(segments)
