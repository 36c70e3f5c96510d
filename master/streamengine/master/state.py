"""The master's state: catalog records in memory, written through to the metadata store.

Every method is synchronous and runs on the server's event loop, so each one is atomic
with respect to the others. A mutation is built as a `Batch`, committed durably, and
only then applied to memory and answered: a crash between the two loses nothing that
was answered, and a commit that fails (`metadata.MetadataError`) changes nothing in
memory. Time comes in as `now_ms`; decisions come from the pure cores (`leadership`,
`placement`, `repair`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from streamengine.master.catalog import Batch, Catalog
from streamengine.master.core import authority, integrity, leadership, placement, repair, retention
from streamengine.master.core.durability import DurabilityLedger, Exposure
from streamengine.master.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotEnoughStores,
    NotFound,
    NotLeader,
    QuotaExceeded,
    RebuildUnfinished,
    SealConflict,
    StreamDeleted,
    TooManyUnsealed,
    WrongCluster,
)
from streamengine.master.core.leadership import Lease, Outcome
from streamengine.master.core.model import (
    Held,
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StoreRecord,
    StoreView,
    StreamRecord,
    TokenRecord,
    validate_name_part,
    validate_stream_name,
)
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX
from streamengine.protocol.auth import Role
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.grants import Grant, GrantSigner
from streamengine.protocol.limits import (
    INDEX_MAX,
    TENANT_STREAMS_MAX_DEFAULT,
    UNSEALED_SEGMENTS_MAX,
)
from streamengine.protocol.policy import InvalidPolicy, ReplicationPolicy
from streamengine.protocol.retention import first_retained_sequence
from streamengine.protocol.signing import SigningKey, Verifier
from streamengine.protocol.tokens import (
    TOKEN_ID_CHARS,
    TOKEN_TTL_MS_DEFAULT,
    TOKEN_TTL_MS_MAX,
    TOKEN_TTL_MS_MIN,
    Revocations,
    TokenClaims,
)

# Roll thresholds when a stream is created without its own.
SEGMENT_BYTES_DEFAULT = 256 << 20
SEGMENT_AGE_MS_DEFAULT = 60 * 60 * 1000

# Stores heartbeat a few times per timeout (so one lost heartbeat is not a death), and
# at least once a second (repair reads acked indexes from these reports).
STORE_HEARTBEATS_PER_TIMEOUT = 4
STORE_HEARTBEAT_MS_MAX = 1000
STORE_HEARTBEAT_MS_MIN = 50

ADDRESS_CHARS_MAX = 255
# Replicas a store is asked to scrub first, per store, awaiting its next heartbeat.
SCRUB_FIRST_PER_STORE_MAX = 64
# Scrub reports of replicas whose segment the master has not sealed yet, kept for its
# seal (`replica_reported`); beyond this many the oldest go.
EARLY_REPORTS_MAX = 4096
# Expired token records dropped with each token created or revoked: enough to keep up
# with any rate of creation, few enough for one metadata transaction.
EXPIRED_TOKENS_DROPPED_PER_COMMIT = 64
# A trim's transaction: its segments and the stream record.
assert retention.TRIMS_PER_COMMIT_MAX + 1 <= OPS_PER_TRANSACTION_MAX


@dataclass
class StoreLive:
    """What the master knows of a store since it started (not persisted)."""

    last_seen_ms: int
    reported_at_ms: int = 0
    used_bytes: int = 0
    free_bytes: int = 0
    held: dict[SegmentKey, Held] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WriterView:
    """The answer to a writer heartbeat or a roll."""

    stream: StreamRecord
    leads: bool
    lease: Lease
    segment: SegmentRecord | None
    unsealed: tuple[SegmentRecord, ...]
    roll_reason: str

    def grant(self) -> Grant:
        """The grant of the epoch this view makes its holder lead (LEADER only)."""
        assert self.leads
        return authority.grant_of(
            self.stream, self.lease.epoch, self.lease.holder, self.segment, self.unsealed
        )


@dataclass(frozen=True, slots=True)
class Registered:
    """A store's registration: its heartbeat interval, the cluster id to keep ("" while
    a rebuild has not adopted one), and the replicas its earlier incarnation held."""

    heartbeat_ms: int
    cluster_id: str
    lost: tuple[SegmentKey, ...]


def new_cluster_id() -> str:
    return f"cluster-{uuid.uuid4().hex[:16]}"


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


@dataclass(frozen=True, slots=True)
class LeaderReport:
    """What a stream's leader last said of its open segment (the segment of `epoch`).
    Kept after the lease ends: it stays true of that segment."""

    epoch: int
    acked_index: int
    segment_bytes: int


class MasterState:
    def __init__(
        self,
        catalog: Catalog,
        now_ms: int,
        lease_ms: int,
        store_timeout_ms: int,
        bridge_grace_ms: int | None = None,
        make_signing_key: Callable[[], SigningKey] = SigningKey.generate,
        tenant_streams_max: int = TENANT_STREAMS_MAX_DEFAULT,
        delete_grace_ms: int = retention.DELETE_GRACE_MS_DEFAULT,
        make_cluster_id: Callable[[], str] | None = new_cluster_id,
    ):
        """`make_signing_key` makes the master's key at its first start (when the
        catalog holds none), `make_cluster_id` its cluster id (None: a rebuild adopts
        the stores' id instead, `adopt_cluster_id`); `tenant_streams_max` 0 means no
        limit; `delete_grace_ms`: how long deleted streams and trimmed segments stay on
        the stores."""
        assert delete_grace_ms >= 0
        self.catalog = catalog
        self.delete_grace_ms = delete_grace_ms
        self.tenant_streams_max = tenant_streams_max
        self.lease_ms = lease_ms
        self.store_timeout_ms = store_timeout_ms
        self.bridge_grace_ms = store_timeout_ms if bridge_grace_ms is None else bridge_grace_ms
        self.started_ms = now_ms
        loaded = catalog.load()
        if loaded.rebuilding:
            raise RebuildUnfinished(
                "the metadata holds a rebuild from the stores that stopped halfway: empty "
                "it and run `master --rebuild` again"
            )
        self.next_stream_id = loaded.next_stream_id
        if loaded.signing_key is None:
            self.signing_key = make_signing_key()
            self.catalog.commit(Batch().signing_key(self.signing_key.private_bytes))
        else:
            self.signing_key = SigningKey(loaded.signing_key)
        self.cluster_id = loaded.cluster_id
        if not self.cluster_id and make_cluster_id is not None:
            self.adopt_cluster_id(make_cluster_id())
        # While the id is not known yet (a rebuild): the ids registering stores keep.
        self.store_cluster_ids: dict[str, str] = {}
        # Signs each distinct grant once; verifies the grants callers show it.
        self.grant_signer = GrantSigner(self.signing_key)
        self.verifier = Verifier([self.signing_key.public_key])
        self.tokens = loaded.tokens
        self.revocations = Revocations(
            {t.token_id: t.expires_at_ms for t in self.tokens.values() if t.revoked_at_ms},
            loaded.revocations_version,
        )
        self.tenants = loaded.tenants
        self.streams = loaded.streams
        self.segments: dict[SegmentKey, SegmentRecord] = {}
        # Indexes kept by `_put_segment` / `_drop_segment`, so a heartbeat or a repair
        # tick costs what changed, not the size of the whole catalog.
        self.epochs: dict[int, set[int]] = {}
        self.unsealed_epochs: dict[int, set[int]] = {}
        self.members: dict[str, set[SegmentKey]] = {}
        # Sealed segments not (or no longer) seen with every member good: the only ones,
        # with those on a dead or draining store, the repairer looks at.
        self.unconfirmed: set[SegmentKey] = set()
        # Members whose store came back as a new incarnation, of segments not sealed
        # yet: their leaders are asked to roll (memory only: after a master restart the
        # segment just runs on without that replica until it rolls).
        self.lost_members: dict[SegmentKey, set[str]] = {}
        # Time and bytes sealed segments spent below N good replicas (durability.py),
        # observed by the server's loop.
        self.durability = DurabilityLedger()
        # What stores reported of their sealed replicas (`integrity`): seeded with the
        # members each record keeps as verified, the rest learned since the start.
        self.checks: dict[SegmentKey, integrity.SegmentChecks] = {}
        for record in loaded.segments.values():
            self._put_segment(record)
        self.stores = loaded.stores
        self.deletes = loaded.deletes
        self.names = {s.stream_id: s.name for s in self.streams.values()}
        # Rebuilt from the stores (`master.rebuild`): an unknown stream id up to this one
        # may be a stream only stores that missed the rebuild hold, so it is no garbage.
        self.rebuilt_through = loaded.rebuilt_through
        # No lease for one lease period after a start: the last holder may still lead.
        self.leases = {
            name: leadership.recovered_lease(s.epoch, s.leader_id, now_ms, lease_ms)
            for name, s in self.streams.items()
        }
        self.live = {sid: StoreLive(last_seen_ms=now_ms) for sid in self.stores}
        self.leader_reports: dict[str, LeaderReport] = {}
        # Operator roll requests: stream id -> epoch of the open segment to roll. Kept in
        # memory only: a request lost to a master restart is simply asked again.
        self.roll_requests: dict[int, int] = {}
        # (store, segment) pairs a repair is copying to right now: never garbage.
        self.copying: set[tuple[str, SegmentKey]] = set()
        # Where the last repair window ended (`plan_repairs`).
        self._repair_cursor: SegmentKey = (0, 0)
        # The replicas each store is to check first at its next heartbeat.
        self.scrub_first: dict[str, list[SegmentKey]] = {}
        # Scrub reports that came before the segment's seal, judged at the seal:
        # (segment, store) -> report. Memory only, as the checks are.
        self.early_reports: dict[tuple[SegmentKey, str], integrity.Report] = {}

    # ---- queries ----

    def granting_leases(self, now_ms: int) -> bool:
        return now_ms >= self.started_ms + self.lease_ms

    def stream(self, name: str) -> StreamRecord:
        validate_stream_name(name)
        record = self.streams.get(name)
        if record is None:
            raise NotFound(f"stream {name!r} does not exist")
        return record

    def usable_stream(self, name: str) -> StreamRecord:
        """The stream, unless it is deleted pending removal (StreamDeleted)."""
        record = self.stream(name)
        if record.deleted_until_ms:
            raise StreamDeleted(
                f"stream {name!r} is deleted: its data goes at {record.deleted_until_ms} "
                "(wall-clock ms) unless it is undeleted before",
                record.deleted_until_ms,
            )
        return record

    def retained_segments(self, stream_id: int) -> list[SegmentRecord]:
        """The stream's segments readers may see (none trimmed), oldest first."""
        return [s for s in self.stream_segments(stream_id) if not s.removal_at_ms]

    def first_retained(self, record: StreamRecord) -> int:
        """Where a reader asking for the earliest event starts (0: nothing trimmed)."""
        epochs = [s.epoch for s in self.retained_segments(record.stream_id)]
        return first_retained_sequence(record.trimmed_through_epoch, epochs)

    def _put_segment(self, record: SegmentRecord) -> None:
        key = record.key
        old = self.segments.get(key)
        for member in old.copy_set if old else ():
            self.members[member].discard(key)
        for member in record.copy_set:
            self.members.setdefault(member, set()).add(key)
        self.segments[key] = record
        if record.verified and key not in self.checks:
            # Loaded at start: matched before, when is not kept (0).
            self.checks[key] = integrity.SegmentChecks(verified=dict.fromkeys(record.verified, 0))
        self.epochs.setdefault(record.stream_id, set()).add(record.epoch)
        unsealed = self.unsealed_epochs.setdefault(record.stream_id, set())
        if record.state == SegmentState.SEALED:
            unsealed.discard(record.epoch)
            self.unconfirmed.add(key)
            self.lost_members.pop(key, None)
        else:
            unsealed.add(record.epoch)

    def _drop_segment(self, key: SegmentKey) -> None:
        self.checks.pop(key, None)
        for early in [k for k in self.early_reports if k[0] == key]:
            del self.early_reports[early]
        record = self.segments.pop(key)
        for member in record.copy_set:
            self.members[member].discard(key)
        self.epochs[record.stream_id].discard(record.epoch)
        self.unsealed_epochs[record.stream_id].discard(record.epoch)
        self.unconfirmed.discard(key)
        self.lost_members.pop(key, None)

    def stream_segments(self, stream_id: int) -> list[SegmentRecord]:
        return [self.segments[(stream_id, e)] for e in sorted(self.epochs.get(stream_id, ()))]

    def unsealed(self, stream_id: int) -> list[SegmentRecord]:
        epochs = sorted(self.unsealed_epochs.get(stream_id, ()))
        return [self.segments[(stream_id, e)] for e in epochs]

    def store_views(self, now_ms: int) -> dict[str, StoreView]:
        views = {}
        for sid, record in sorted(self.stores.items()):
            live = self.live[sid]
            views[sid] = StoreView(
                store_id=sid,
                zone=record.zone,
                used_bytes=live.used_bytes,
                alive=now_ms - live.last_seen_ms <= self.store_timeout_ms,
                draining=record.draining,
                segments=len(self.members.get(sid, ())),
                reported_at_ms=live.reported_at_ms,
            )
        return views

    def repair_candidates(self, views: dict[str, StoreView]) -> list[SegmentRecord]:
        """Sealed segments that may lack a good replica: not confirmed since they last
        changed, or with a member on a store now dead, draining or unknown."""
        keys = set(self.unconfirmed)
        for member, segment_keys in self.members.items():
            view = views.get(member)
            if view is None or not view.usable:
                keys |= segment_keys
        segments = (self.segments[k] for k in sorted(keys))
        # A trimmed segment's data is going: not worth a copy.
        return [s for s in segments if s.state == SegmentState.SEALED and not s.removal_at_ms]

    def confirm(self, key: SegmentKey) -> None:
        """Every member of this sealed segment was judged good."""
        self.unconfirmed.discard(key)

    def held_for(self, segments: Iterable[SegmentRecord]) -> dict[SegmentKey, dict[str, Held]]:
        """What each member last reported of each segment."""
        held: dict[SegmentKey, dict[str, Held]] = {}
        for segment in segments:
            copies = held.setdefault(segment.key, {})
            for member in segment.copy_set:
                live = self.live.get(member)
                if live is not None and segment.key in live.held:
                    copies[member] = live.held[segment.key]
        return held

    def segment_bytes(self, key: SegmentKey) -> int:
        return max(
            (live.held[key].bytes for live in self.live.values() if key in live.held), default=0
        )

    def segment_acked_index(self, segment: SegmentRecord) -> int:
        """The largest acked index known for a segment: what its leader last reported
        (while open) or the highest any copy-set store reported, whichever is higher.
        Both only grow while the segment is written, so an operator sees it move."""
        stores = (
            self.live[m].held[segment.key].acked_index
            for m in segment.copy_set
            if m in self.live and segment.key in self.live[m].held
        )
        report = self.leader_reports.get(segment.stream)
        leader = report.acked_index if report is not None and report.epoch == segment.epoch else 0
        return max(leader, *stores, 0)

    def stream_acked_index(self, stream_id: int) -> tuple[int, int]:
        """(epoch, acked index) of the stream's latest segment, (0, 0) before any."""
        epochs = self.epochs.get(stream_id)
        if not epochs:
            return 0, 0
        latest = self.segments[(stream_id, max(epochs))]
        return latest.epoch, self.segment_acked_index(latest)

    def address(self, store_id: str) -> str:
        record = self.stores.get(store_id)
        return record.address if record else ""

    def pending_deletes(self) -> dict[SegmentKey, list[str]]:
        out: dict[SegmentKey, list[str]] = {}
        for sid, key in sorted(self.deletes):
            out.setdefault(key, []).append(sid)
        return out

    def stream_name(self, stream_id: int) -> str:
        return self.names.get(stream_id, "")

    # ---- tenants and streams ----

    def create_tenant(self, tenant: str, now_ms: int) -> bool:
        validate_name_part("tenant", tenant)
        if tenant in self.tenants:
            return False
        self.catalog.commit(Batch().tenant(tenant, now_ms))
        self.tenants[tenant] = now_ms
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
        tenant, _ = validate_stream_name(name)
        try:
            ReplicationPolicy(replicas, write_quorum)
        except InvalidPolicy as error:
            raise InvalidArgument(f"impossible policy: {error}") from None
        retention.validate_retention(retention_age_ms, retention_bytes)
        segment_bytes = segment_bytes or SEGMENT_BYTES_DEFAULT
        segment_age_ms = segment_age_ms or SEGMENT_AGE_MS_DEFAULT
        existing = self.streams.get(name)
        if existing is None and self.tenant_streams_max:
            count = sum(1 for s in self.streams.values() if s.tenant == tenant)
            if count >= self.tenant_streams_max:
                raise QuotaExceeded(
                    f"tenant {tenant!r} holds {count} streams, its quota "
                    f"(--tenant-streams-max {self.tenant_streams_max})"
                )
        if existing is not None:
            if existing.deleted_until_ms:
                raise AlreadyExists(
                    f"stream {name!r} is deleted, pending removal at "
                    f"{existing.deleted_until_ms}: undelete it, or create it after"
                )
            same = (
                existing.replicas,
                existing.write_quorum,
                existing.segment_bytes,
                existing.segment_age_ms,
                existing.retention_age_ms,
                existing.retention_bytes,
            )
            asked = (
                replicas,
                write_quorum,
                segment_bytes,
                segment_age_ms,
                retention_age_ms,
                retention_bytes,
            )
            if same != asked:
                raise AlreadyExists(f"stream {name!r} exists with another policy")
            return existing
        batch = Batch()
        if tenant not in self.tenants:
            if not create_tenant:
                raise NotFound(f"tenant {tenant!r} does not exist (set create_tenant)")
            batch.tenant(tenant, now_ms)
        record = StreamRecord(
            name=name,
            stream_id=self.next_stream_id,
            replicas=replicas,
            write_quorum=write_quorum,
            segment_bytes=segment_bytes,
            segment_age_ms=segment_age_ms,
            epoch=0,
            leader_id="",
            created_at_ms=now_ms,
            retention_age_ms=retention_age_ms,
            retention_bytes=retention_bytes,
        )
        self.catalog.commit(batch.stream(record).next_stream_id(record.stream_id + 1))
        self.tenants.setdefault(tenant, now_ms)
        self.next_stream_id = record.stream_id + 1
        self.streams[name] = record
        self.names[record.stream_id] = name
        # A new stream never had a leader: nothing to wait for, even right after a start.
        self.leases[name] = Lease(0, "", 0)
        return record

    def list_streams(self, tenant: str) -> list[StreamRecord]:
        if tenant:
            validate_name_part("tenant", tenant)
        return [s for name, s in sorted(self.streams.items()) if not tenant or s.tenant == tenant]

    def update_stream(
        self, name: str, retention_age_ms: int | None, retention_bytes: int | None
    ) -> StreamRecord:
        """Change a stream's retention limits (None: unchanged); the next retention
        pass applies them."""
        record = self.usable_stream(name)
        updated = replace(
            record,
            retention_age_ms=record.retention_age_ms
            if retention_age_ms is None
            else retention_age_ms,
            retention_bytes=record.retention_bytes if retention_bytes is None else retention_bytes,
        )
        retention.validate_retention(updated.retention_age_ms, updated.retention_bytes)
        if updated != record:
            self.catalog.commit(Batch().stream(updated))
            self.streams[name] = updated
        return updated

    def delete_stream(self, name: str, now_ms: int) -> tuple[int, int]:
        """Record the intent to delete: the stream is refused from now on, and its
        records and data go once the grace has passed (`remove_due`), unless it is
        undeleted before. Returns (segments, when they go). Deleting a stream already
        deleted changes nothing."""
        record = self.stream(name)
        segments = len(self.stream_segments(record.stream_id))
        if record.deleted_until_ms:
            return segments, record.deleted_until_ms
        deleted = replace(
            record, deleted_until_ms=retention.removal_at_ms(now_ms, self.delete_grace_ms)
        )
        self.catalog.commit(Batch().stream(deleted))
        self.streams[name] = deleted
        self.roll_requests.pop(record.stream_id, None)
        return segments, deleted.deleted_until_ms

    def undelete_stream(self, name: str) -> StreamRecord:
        """Bring a deleted stream back within its grace: same id, segments and epochs.
        The lease starts afresh (its holder, if alive, renews it)."""
        record = self.stream(name)
        if not record.deleted_until_ms:
            raise InvalidArgument(f"stream {name!r} is not deleted")
        restored = replace(record, deleted_until_ms=0)
        self.catalog.commit(Batch().stream(restored))
        self.streams[name] = restored
        return restored

    def _remove_stream(self, name: str) -> int:
        """Drop the stream and its segments. Stores are not told one replica at a time:
        a stream id below the next one that no stream has is garbage wherever it is
        reported (`_garbage`), so the removal is one small transaction however long
        the stream."""
        record = self.stream(name)
        assert record.deleted_until_ms, "only a deleted stream is removed"
        segments = self.stream_segments(record.stream_id)
        self.catalog.commit(Batch().drop_stream(name).drop_segments_of(record.stream_id))
        for segment in segments:
            self._drop_segment(segment.key)
        del self.streams[name]
        # Replicas of an unknown stream id are garbage to every store that reports them.
        self.names.pop(record.stream_id, None)
        self.leases.pop(name, None)
        self.leader_reports.pop(name, None)
        self.durability.forget(s.key for s in segments)
        return len(segments)

    # ---- retention and trims ----

    def _facts(self, stream_id: int) -> list[retention.SegmentFacts]:
        return [
            retention.SegmentFacts(
                epoch=s.epoch,
                sealed=s.state == SegmentState.SEALED,
                sealed_at_ms=s.sealed_at_ms,
                final_index=s.final_index,
                bytes=self.segment_bytes(s.key),
            )
            for s in self.retained_segments(stream_id)
        ]

    def trim_stream(self, name: str, before_sequence: int, now_ms: int) -> Trimmed:
        """Trim by hand every segment whose events all sort before `before_sequence`
        (each must be sealed: NotTrimmable otherwise, nothing trimmed)."""
        record = self.usable_stream(name)
        epochs = retention.trims_before(self._facts(record.stream_id), before_sequence)
        return self._trim(record, epochs, now_ms)

    def apply_retention(self, now_ms: int) -> list[Trimmed]:
        """One retention pass over every stream with a limit: what it trimmed."""
        out = []
        for _, record in sorted(self.streams.items()):
            if record.deleted_until_ms or not (record.retention_age_ms or record.retention_bytes):
                continue
            epochs = retention.retention_trims(
                self._facts(record.stream_id),
                record.retention_age_ms,
                record.retention_bytes,
                now_ms,
            )
            if epochs:
                out.append(self._trim(record, epochs, now_ms))
        return out

    def _trim(self, record: StreamRecord, epochs: list[int], now_ms: int) -> Trimmed:
        """Mark `epochs` (the oldest retained segments, sealed) trimmed, durably, in
        transactions of at most TRIMS_PER_COMMIT_MAX segments, each leaving a trimmed
        prefix behind."""
        removal = retention.removal_at_ms(now_ms, self.delete_grace_ms)
        entries = size = 0
        for start in range(0, len(epochs), retention.TRIMS_PER_COMMIT_MAX):
            chunk = epochs[start : start + retention.TRIMS_PER_COMMIT_MAX]
            trimmed = [
                replace(self.segments[(record.stream_id, e)], removal_at_ms=removal) for e in chunk
            ]
            assert all(
                t.state == SegmentState.SEALED and not self.segments[t.key].removal_at_ms
                for t in trimmed
            )
            assert record.trimmed_through_epoch < chunk[0]
            record = replace(record, trimmed_through_epoch=chunk[-1])
            batch = Batch().stream(record)
            for segment in trimmed:
                batch.segment(segment)
            self.catalog.commit(batch)
            self.streams[record.name] = record
            for segment in trimmed:
                self._put_segment(segment)
                self.unconfirmed.discard(segment.key)
                entries += max(segment.final_index - 1, 0)
                size += self.segment_bytes(segment.key)
        return Trimmed(
            record.name, tuple(epochs), entries, size, self.first_retained(record), removal
        )

    def remove_due(self, now_ms: int) -> tuple[list[str], list[SegmentKey]]:
        """The second phase: drop deleted streams and trimmed segments whose grace has
        passed; their replicas are garbage from now on (`_garbage`). Returns the streams
        and segments removed."""
        streams = sorted(
            name
            for name, r in self.streams.items()
            if r.deleted_until_ms and retention.due(r.deleted_until_ms, now_ms)
        )
        for name in streams:
            self._remove_stream(name)
        due = sorted(
            key
            for key, s in self.segments.items()
            if s.removal_at_ms and retention.due(s.removal_at_ms, now_ms)
        )
        due = due[: retention.TRIMS_PER_COMMIT_MAX]
        if due:
            batch = Batch()
            for key in due:
                batch.drop_segment(key)
            self.catalog.commit(batch)
            for key in due:
                self._drop_segment(key)
            self.durability.forget(due)
        return streams, due

    def pending_removals(self) -> list[PendingRemoval]:
        """Deleted streams and trimmed segments the stores still hold, soonest first."""
        out = [
            PendingRemoval(
                name,
                0,
                r.deleted_until_ms,
                sum(self.segment_bytes(s.key) for s in self.stream_segments(r.stream_id)),
            )
            for name, r in self.streams.items()
            if r.deleted_until_ms
        ]
        out += [
            PendingRemoval(s.stream, s.epoch, s.removal_at_ms, self.segment_bytes(key))
            for key, s in self.segments.items()
            if s.removal_at_ms
        ]
        return sorted(out, key=lambda p: (p.removal_at_ms, p.stream, p.segment_epoch))

    # ---- tokens ----

    def create_token(
        self, token_id: str, tenant: str, role: int, ttl_ms: int, now_ms: int
    ) -> TokenClaims:
        """Record a new token (the tenant created if it does not exist); returns its
        claims, for the caller to sign. `token_id` is random, made by the caller."""
        validate_name_part("tenant", tenant)
        if role not in {int(r) for r in Role}:
            raise InvalidArgument(f"unknown token role {role}")
        ttl_ms = ttl_ms or TOKEN_TTL_MS_DEFAULT
        if not TOKEN_TTL_MS_MIN <= ttl_ms <= TOKEN_TTL_MS_MAX:
            raise InvalidArgument(
                f"token lifetime {ttl_ms} ms outside {TOKEN_TTL_MS_MIN}..{TOKEN_TTL_MS_MAX}"
            )
        assert len(token_id) == TOKEN_ID_CHARS and token_id not in self.tokens, token_id
        record = TokenRecord(token_id, tenant, role, now_ms, now_ms + ttl_ms)
        expired = self._expired_tokens(now_ms)
        batch = Batch().token(record)
        for old in expired:
            batch.drop_token(old)
        if tenant not in self.tenants:
            batch.tenant(tenant, now_ms)
        self.catalog.commit(batch)
        for old in expired:
            del self.tokens[old]
        self.tenants.setdefault(tenant, now_ms)
        self.tokens[token_id] = record
        return TokenClaims(token_id, tenant, Role(role), now_ms, record.expires_at_ms)

    def revoke_token(self, token_id: str, now_ms: int) -> bool:
        """Revoke an unexpired token; False when none has this id (or it is revoked)."""
        record = self.tokens.get(token_id)
        if record is None or record.revoked_at_ms or record.expires_at_ms <= now_ms:
            return False
        revoked = replace(record, revoked_at_ms=now_ms)
        version = self.revocations.version + 1
        expired = self._expired_tokens(now_ms)
        batch = Batch().token(revoked).revocations_version(version)
        for old in expired:
            batch.drop_token(old)
        self.catalog.commit(batch)
        for old in expired:
            del self.tokens[old]
        self.tokens[token_id] = revoked
        self.revocations.replace(
            [*self.revocations.items(), (token_id, record.expires_at_ms)], version
        )
        return True

    def current_revocations(self, now_ms: int) -> Revocations:
        """The revocations of unexpired tokens (expired ones are refused anyway)."""
        self.revocations.prune(now_ms)
        return self.revocations

    def _expired_tokens(self, now_ms: int) -> list[str]:
        """Tokens expired by now, a bounded number (one transaction has a bound on its
        operations): refused anyway, so their records can go."""
        expired = sorted(t for t, r in self.tokens.items() if r.expires_at_ms <= now_ms)
        return expired[:EXPIRED_TOKENS_DROPPED_PER_COMMIT]

    # ---- writers ----

    def writer_heartbeat(
        self,
        name: str,
        client_id: str,
        epoch: int,
        acked_index: int,
        segment_bytes: int,
        now_ms: int,
    ) -> WriterView:
        record = self.usable_stream(name)
        decision = leadership.heartbeat(self.leases[name], client_id, epoch, now_ms, self.lease_ms)
        if decision.outcome is Outcome.GRANTED:
            record = self._open_epoch(record, decision.lease, (), now_ms, allow_no_segment=True)
        self.leases[name] = decision.lease
        if decision.leads and epoch == decision.lease.epoch:
            self.leader_reports[name] = LeaderReport(epoch, acked_index, segment_bytes)
        return self._writer_view(record, decision.leads, decision.lease, now_ms)

    def roll_segment(
        self, name: str, client_id: str, epoch: int, exclude: Iterable[str], now_ms: int
    ) -> WriterView:
        record = self.usable_stream(name)
        lease = leadership.roll(self.leases[name], client_id, epoch, now_ms, self.lease_ms)
        if len(self.unsealed(record.stream_id)) >= UNSEALED_SEGMENTS_MAX:
            raise TooManyUnsealed(
                f"{name}: {UNSEALED_SEGMENTS_MAX} segments unsealed; seal them before rolling"
            )
        record = self._open_epoch(record, lease, tuple(exclude), now_ms, allow_no_segment=False)
        self.leases[name] = lease
        return self._writer_view(record, True, lease, now_ms)

    def release_lease(self, name: str, client_id: str, epoch: int, now_ms: int) -> bool:
        self.stream(name)
        released = leadership.release(self.leases[name], client_id, epoch, now_ms)
        if released is None:
            return False
        self.leases[name] = released
        return True

    def holder_gone(self, name: str, client_id: str, epoch: int, now_ms: int) -> bool:
        """The call the holder of `epoch` held open ended: whether its lease ended now
        (`leadership.holder_gone`)."""
        lease = self.leases.get(name)
        ended = None if lease is None else leadership.holder_gone(lease, client_id, epoch, now_ms)
        if ended is None:
            return False
        self.leases[name] = ended
        return True

    def _open_epoch(
        self,
        record: StreamRecord,
        lease: Lease,
        exclude: tuple[str, ...],
        now_ms: int,
        allow_no_segment: bool,
    ) -> StreamRecord:
        """Persist the new epoch and its segment: none when two are unsealed already,
        nor when too few stores are usable to place one while something is left to
        seal (the new leader seals and recovers it, which needs only R stores of its own
        copy set, and asks for a segment once stores allow: a stream whose stores are
        too few to place a copy set still gets its last segment sealed and read)."""
        assert lease.epoch == record.epoch + 1
        unsealed = self.unsealed(record.stream_id)
        segment = None
        copy_set: tuple[str, ...] | None = None
        if len(unsealed) < UNSEALED_SEGMENTS_MAX or not allow_no_segment:
            try:
                copy_set = placement.choose_copy_set(
                    self.store_views(now_ms).values(), record.replicas, exclude
                )
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
        updated = replace(record, epoch=lease.epoch, leader_id=lease.holder)
        sealing = [
            replace(s, state=SegmentState.SEALING) for s in unsealed if s.state == SegmentState.OPEN
        ]
        batch = Batch().stream(updated)
        for s in [*sealing, *([segment] if segment else [])]:
            batch.segment(s)
        self.catalog.commit(batch)
        self.streams[record.name] = updated
        for s in [*sealing, *([segment] if segment else [])]:
            self._put_segment(s)
        return updated

    def _writer_view(
        self, record: StreamRecord, leads: bool, lease: Lease, now_ms: int
    ) -> WriterView:
        if not leads:
            return WriterView(record, False, lease, None, (), "")
        segment = self.segments.get((record.stream_id, lease.epoch))
        unsealed = tuple(s for s in self.unsealed(record.stream_id) if s.epoch < lease.epoch)
        reason = ""
        if segment is not None and segment.state == SegmentState.OPEN:
            reason = repair.roll_reason(segment.copy_set, self.store_views(now_ms))
            if not reason and self.roll_requests.get(record.stream_id) == segment.epoch:
                reason = "an operator asked for a roll"
            lost = sorted(self.lost_members.get(segment.key, ()))
            if not reason and lost:
                reason = f"{', '.join(lost)} lost its replica (a new incarnation)"
        return WriterView(record, True, lease, segment, unsealed, reason)

    def request_roll(self, name: str, now_ms: int) -> tuple[str, int]:
        """Ask the leader of `name` to roll its open segment; returns (leader, epoch of
        that segment). With no running lease nothing is asked: ("", open epoch)."""
        record = self.usable_stream(name)
        open_epochs = [
            s.epoch for s in self.unsealed(record.stream_id) if s.state == SegmentState.OPEN
        ]
        open_epoch = max(open_epochs, default=0)
        lease = self.leases.get(name)
        if lease is None or not lease.holder or not lease.running(now_ms):
            return "", open_epoch
        if open_epoch:
            self.roll_requests[record.stream_id] = open_epoch
        return lease.holder, open_epoch

    # ---- segments ----

    def list_segments(
        self, name: str, from_epoch: int, to_epoch: int = 0
    ) -> tuple[StreamRecord, list[SegmentRecord]]:
        """The retained segments (never a trimmed one) from `from_epoch` to
        `to_epoch` (0: no bound)."""
        record = self.usable_stream(name)
        return record, [
            s
            for s in self.retained_segments(record.stream_id)
            if s.epoch >= from_epoch and (to_epoch == 0 or s.epoch <= to_epoch)
        ]

    def seal_segment(
        self,
        name: str,
        segment_epoch: int,
        writer_epoch: int,
        final_index: int,
        now_ms: int,
        certificate: Certificate | None = None,
        lost_from_index: int = 0,
    ) -> SegmentRecord:
        """Seal at `final_index`, recording the sealing leader's certificate (if it
        knew the whole content) in the same catalog write, and the range a recovery that
        accepted loss declares lost (`lost_from_index`..`final_index`)."""
        record = self.usable_stream(name)
        segment = self.segments.get((record.stream_id, segment_epoch))
        if segment is None:
            raise NotFound(f"{name}: no segment of epoch {segment_epoch}")
        if not 1 <= final_index <= INDEX_MAX:
            raise InvalidArgument(f"final index {final_index} outside 1..{INDEX_MAX}")
        if certificate is not None and certificate.final_index != final_index:
            raise InvalidArgument(
                f"the certificate ends at {certificate.final_index}, not at {final_index}"
            )
        if lost_from_index > final_index:
            raise InvalidArgument(
                f"lost range from {lost_from_index} starts past the bridge at {final_index}"
            )
        if segment.state == SegmentState.SEALED:
            if segment.final_index != final_index:
                raise SealConflict(
                    f"{name}: segment {segment_epoch} is sealed at {segment.final_index},"
                    f" not {final_index}"
                )
            # A retried seal carries the same certificate; another one is a contradiction
            # (the first seal alone records one).
            if (
                certificate is not None
                and segment.certified_by == integrity.WRITER
                and certificate != segment.certificate
            ):
                raise SealConflict(
                    f"{name}: segment {segment_epoch} was sealed with another certificate"
                )
            return segment
        if writer_epoch <= segment_epoch:
            raise NotLeader(
                f"sealing segment {segment_epoch} needs a later epoch than {writer_epoch}"
            )
        if writer_epoch > record.epoch:
            raise NotLeader(f"epoch {writer_epoch} was never granted (latest {record.epoch})")
        sealed = replace(
            segment,
            state=SegmentState.SEALED,
            final_index=final_index,
            sealed_at_ms=now_ms,
            settled_at_ms=now_ms,
            certificate=certificate,
            certified_by=integrity.WRITER if certificate is not None else "",
            lost_from_index=lost_from_index,
        )
        self.catalog.commit(Batch().segment(sealed))
        self._put_segment(sealed)
        for member in sealed.copy_set:
            early = self.early_reports.pop((sealed.key, member), None)
            if early is not None:
                self.replica_reported(member, sealed.key, early, now_ms)
        return self.segments[sealed.key]

    # ---- integrity ----

    def checks_of(self, key: SegmentKey) -> integrity.SegmentChecks:
        return self.checks.setdefault(key, integrity.SegmentChecks())

    def replica_reported(
        self, store_id: str, key: SegmentKey, report: integrity.Report, now_ms: int
    ) -> integrity.Judgement:
        """A store's scrub read its replica of `key` back: judge it against the
        certificate (`integrity.judge`) and record the outcome durably."""
        segment = self.segments.get(key)
        if segment is None:
            return integrity.Judgement(note="not a segment")
        if segment.state != SegmentState.SEALED:
            # A store scrubs a replica once it is sealed there and acked up to its
            # bridge, which its leader does before it seals the segment here: the report
            # may come first. Dropped, it would not come again before the store's
            # re-check (10 minutes), and the segment would count as under-replicated
            # until then (repair, drain and rebalance wait for it).
            if store_id in segment.copy_set:
                self.early_reports.pop((key, store_id), None)
                self.early_reports[(key, store_id)] = report
                while len(self.early_reports) > EARLY_REPORTS_MAX:
                    del self.early_reports[next(iter(self.early_reports))]
            return integrity.Judgement(note="kept until the segment is sealed")
        if isinstance(report, integrity.Clean) and (
            report.certificate.final_index != segment.final_index
        ):
            return integrity.Judgement(note=f"{store_id} read to another final index")
        stream = self.streams.get(self.names.get(segment.stream_id, ""))
        if stream is None:
            return integrity.Judgement(note="the stream is gone")
        judgement = integrity.judge(
            segment.certificate,
            segment.certified_by,
            self.checks_of(key),
            segment.copy_set,
            stream.write_quorum,
            store_id,
            report,
            now_ms,
        )
        self._record_judgement(segment, judgement)
        return judgement

    def _verified_members(self, segment: SegmentRecord) -> tuple[str, ...]:
        """The members whose replica matched the certificate, as the record keeps them."""
        checks = self.checks.get(segment.key)
        if checks is None:
            return ()
        return tuple(sorted(m for m in checks.verified if m in segment.copy_set))

    def _record_judgement(self, segment: SegmentRecord, judgement: integrity.Judgement) -> None:
        bad = tuple(sorted(set(segment.bad) | set(judgement.bad)))
        updated = segment
        if judgement.certificate is not None:
            updated = replace(
                updated, certificate=judgement.certificate, certified_by=integrity.REPLICAS
            )
        if bad != segment.bad:
            updated = replace(updated, bad=bad)
        verified = self._verified_members(segment)
        if verified != segment.verified:
            updated = replace(updated, verified=verified)
        if updated is not segment:
            self.catalog.commit(Batch().segment(updated))
            self._put_segment(updated)

    def report_replica(self, name: str, segment_epoch: int, address: str) -> str:
        """A reader found the replica at `address` suspect: its store checks it first.
        Returns the store id, "" when the address names no member of the sealed
        segment's copy set (the report is ignored)."""
        record = self.stream(name)
        segment = self.segments.get((record.stream_id, segment_epoch))
        if segment is None or segment.state != SegmentState.SEALED:
            return ""
        member = next((m for m in segment.copy_set if self.address(m) == address), "")
        if member:
            self.ask_scrub_first(member, segment.key)
        return member

    def ask_scrub_first(self, store_id: str, key: SegmentKey) -> None:
        queued = self.scrub_first.setdefault(store_id, [])
        if key not in queued and len(queued) < SCRUB_FIRST_PER_STORE_MAX:
            queued.append(key)

    def take_scrub_first(self, store_id: str) -> list[SegmentKey]:
        """The replicas `store_id` is to check first, handed out once."""
        return self.scrub_first.pop(store_id, [])

    # ---- stores ----

    def register_store(
        self,
        store_id: str,
        address: str,
        zone: str,
        free_bytes: int,
        now_ms: int,
        incarnation: int = 0,
        cluster_id: str = "",
    ) -> Registered:
        """Register a store (again). Refused (WrongCluster) when it keeps another
        cluster's id. A new incarnation of a known store holds none of its earlier
        replicas: those are `Registered.lost`, the store is told so and refuses to seal
        or write them, the open ones roll, and repair refills the sealed ones."""
        validate_name_part("store id", store_id)
        if not address or len(address) > ADDRESS_CHARS_MAX or ":" not in address:
            raise InvalidArgument(f"store address {address!r} must be host:port")
        if zone and len(zone) > ADDRESS_CHARS_MAX:
            raise InvalidArgument("zone label too long")
        if len(cluster_id) > ADDRESS_CHARS_MAX:
            raise InvalidArgument("cluster id too long")
        if cluster_id and self.cluster_id and cluster_id != self.cluster_id:
            raise WrongCluster(
                f"store {store_id} belongs to cluster {cluster_id}, this master's cluster "
                f"is {self.cluster_id}"
            )
        if not self.cluster_id:
            self.store_cluster_ids[store_id] = cluster_id
        existing = self.stores.get(store_id)
        draining = existing.draining if existing else False
        known = existing.incarnation if existing else 0
        lost: list[SegmentKey] = []
        if known and incarnation and incarnation != known:
            lost = sorted(self.members.get(store_id, ()))
            for key in lost:
                if self.segments[key].state != SegmentState.SEALED:
                    self.lost_members.setdefault(key, set()).add(store_id)
        record = StoreRecord(store_id, address, zone, draining, incarnation or known)
        if record != existing:
            self.catalog.commit(Batch().store(record))
            self.stores[store_id] = record
        live = self.live.setdefault(store_id, StoreLive(last_seen_ms=now_ms))
        live.last_seen_ms = now_ms
        live.free_bytes = free_bytes
        if lost:
            # What it reported of them was its old incarnation's, and what it matched too.
            gone = set(lost)
            live.held = {k: v for k, v in live.held.items() if k not in gone}
            sealed = [k for k in lost if self.segments[k].state == SegmentState.SEALED]
            self.unconfirmed.update(sealed)
            unverified = []
            for key in sealed:
                checks = self.checks.get(key)
                if checks is not None and checks.verified.pop(store_id, None) is not None:
                    segment = self.segments[key]
                    unverified.append(replace(segment, verified=self._verified_members(segment)))
            if unverified:
                batch = Batch()
                for segment in unverified:
                    batch.segment(segment)
                self.catalog.commit(batch)
                for segment in unverified:
                    self._put_segment(segment)
        return Registered(self.store_heartbeat_ms(), self.cluster_id, tuple(lost))

    def adopt_cluster_id(self, cluster_id: str) -> None:
        """Keep `cluster_id` as the cluster's (once: it never changes after)."""
        assert cluster_id and not self.cluster_id, "a cluster id is adopted once"
        self.catalog.commit(Batch().cluster_id(cluster_id))
        self.cluster_id = cluster_id

    def store_heartbeat_ms(self) -> int:
        every = self.store_timeout_ms // STORE_HEARTBEATS_PER_TIMEOUT
        return max(STORE_HEARTBEAT_MS_MIN, min(STORE_HEARTBEAT_MS_MAX, every))

    def store_heartbeat(
        self,
        store_id: str,
        used_bytes: int,
        free_bytes: int,
        held: dict[SegmentKey, Held],
        now_ms: int,
    ) -> list[SegmentKey] | None:
        """Record a store's report; returns the segments it should delete, or None when
        it must register again."""
        if store_id not in self.stores:
            return None
        live = self.live.setdefault(store_id, StoreLive(last_seen_ms=now_ms))
        live.last_seen_ms = now_ms
        live.reported_at_ms = now_ms
        live.used_bytes = used_bytes
        live.free_bytes = free_bytes
        live.held = dict(held)
        # A member that no longer holds the bridge makes its segment suspect again.
        for key in self.members.get(store_id, ()):
            segment = self.segments[key]
            if segment.state == SegmentState.SEALED and key not in self.unconfirmed:
                copy = held.get(key)
                if copy is None or copy.acked_index < segment.final_index:
                    self.unconfirmed.add(key)
        # A pending delete the store no longer reports is done.
        done = sorted((sid, k) for sid, k in self.deletes if sid == store_id and k not in held)
        # Each record is independent: a long list goes in several transactions, and
        # memory follows each one that committed.
        for start in range(0, len(done), OPS_PER_TRANSACTION_MAX):
            chunk = done[start : start + OPS_PER_TRANSACTION_MAX]
            batch = Batch()
            for sid, key in chunk:
                batch.replica_deleted(sid, key)
            self.catalog.commit(batch)
            self.deletes -= set(chunk)
        return sorted(key for key in held if self._garbage(store_id, key))

    def _garbage(self, store_id: str, key: SegmentKey) -> bool:
        if (store_id, key) in self.deletes:
            return True
        if (store_id, key) in self.copying:
            return False
        stream_id, _ = key
        if stream_id not in self.names:
            # Ids are never reused: one below the next id that no stream has was deleted.
            return self.rebuilt_through < stream_id < self.next_stream_id
        segment = self.segments.get(key)
        if segment is None:
            # Trims take whole segments from the head: a segment of a trimmed epoch
            # whose record is gone was removed after its grace.
            stream = self.streams[self.names[stream_id]]
            return key[1] <= stream.trimmed_through_epoch
        return segment.state == SegmentState.SEALED and store_id not in segment.copy_set

    def drain_refusal(self, store_id: str, now_ms: int) -> str:
        """Why draining `store_id` would leave a stream without stores for N replicas
        (`placement.drain_refusal`), "" when it would not."""
        if store_id not in self.stores:
            raise NotFound(f"store {store_id!r} is not registered")
        replicas = {r.name: r.replicas for r in self.streams.values() if not r.deleted_until_ms}
        return placement.drain_refusal(self.store_views(now_ms).values(), store_id, replicas)

    def set_draining(self, store_id: str, now_ms: int, draining: bool = True) -> StoreRecord:
        """Drain `store_id` (refused with NotEnoughStores when that would leave a stream
        without stores for its replicas), or end its drain (`draining` False)."""
        record = self.stores.get(store_id)
        if record is None:
            raise NotFound(f"store {store_id!r} is not registered")
        if draining and not record.draining:
            refusal = self.drain_refusal(store_id, now_ms)
            if refusal:
                raise NotEnoughStores(f"drain of {store_id} refused: {refusal}")
        if record.draining != draining:
            record = replace(record, draining=draining)
            self.catalog.commit(Batch().store(record))
            self.stores[store_id] = record
        return record

    # ---- repair ----

    def begin_copy(self, store_id: str, key: SegmentKey) -> None:
        self.copying.add((store_id, key))
        if (store_id, key) in self.deletes:
            self.catalog.commit(Batch().replica_deleted(store_id, key))
            self.deletes.discard((store_id, key))

    def end_copy(self, store_id: str, key: SegmentKey) -> None:
        self.copying.discard((store_id, key))

    def swap_replica(
        self, key: SegmentKey, replaced: str, target: str, held: Held, now_ms: int
    ) -> SegmentRecord:
        """Put `target` in `replaced`'s place in a sealed segment's copy set, durably,
        and have `replaced` delete its copy."""
        segment = self.segments.get(key)
        if segment is None or segment.state != SegmentState.SEALED:
            raise NotFound(f"segment {key} is gone or not sealed")
        if replaced not in segment.copy_set:
            raise NotFound(f"store {replaced} left segment {key}'s copy set meanwhile")
        if target != replaced and target in segment.copy_set:
            raise AlreadyExists(f"store {target} already holds segment {key}")
        copy_set = tuple(target if m == replaced else m for m in segment.copy_set)
        # The target's copy was verified (against the certificate when there is one).
        bad = tuple(m for m in segment.bad if m in copy_set and m != target)
        checks = self.checks_of(key)
        if target != replaced:
            checks.forget(replaced)
        if segment.certificate is not None:
            condemned = integrity.copy_verified(checks, copy_set, target, now_ms)
            bad = tuple(sorted(set(bad) | set(condemned)))
        swapped = replace(segment, copy_set=copy_set, settled_at_ms=now_ms, bad=bad)
        swapped = replace(swapped, verified=self._verified_members(swapped))
        batch = Batch().segment(swapped)
        if target != replaced:
            batch.delete_replica(replaced, key)
        self.catalog.commit(batch)
        self._put_segment(swapped)
        if target != replaced:
            self.deletes.add((replaced, key))
        if target in self.live:
            self.live[target].held[key] = held
        return swapped

    def plan_repairs(
        self,
        now_ms: int,
        busy: set[SegmentKey],
        slots: int,
        failed_sources: dict[SegmentKey, set[str]] | None = None,
    ) -> list[repair.Task]:
        """Repairs for the segments that may need one; segments seen with every member
        good are confirmed and left alone until something about them changes.
        `failed_sources`: per segment, sources whose copies failed lately (the repair
        queue's): the next copy is made from another replica."""
        views = self.store_views(now_ms)
        candidates = self._repair_window(self.repair_candidates(views))
        held = self.held_for(candidates)
        for segment in candidates:
            verdict = repair.judge(segment, views, held[segment.key], now_ms, self.bridge_grace_ms)
            if len(verdict.good) == len(segment.copy_set) and segment.key not in busy:
                self.confirm(segment.key)
        return repair.plan_tasks(
            candidates,
            views,
            held,
            now_ms,
            self.bridge_grace_ms,
            busy,
            slots,
            self.pending_deletes(),
            failed_sources,
        )

    def _repair_window(self, candidates: list[SegmentRecord]) -> list[SegmentRecord]:
        """At most JUDGED_PER_TICK candidates, resuming after the last one judged, so a
        tick stays short (it runs on the loop that answers heartbeats) and every
        candidate gets its turn."""
        if len(candidates) <= repair.JUDGED_PER_TICK:
            return candidates
        start = next((i for i, s in enumerate(candidates) if s.key > self._repair_cursor), 0)
        window = (candidates[start:] + candidates[:start])[: repair.JUDGED_PER_TICK]
        self._repair_cursor = window[-1].key
        return window

    def under_replicated(self, now_ms: int) -> list[SegmentRecord]:
        """Sealed segments with fewer than N good replicas."""
        return [self.segments[exposure.segment] for exposure in self.exposures(now_ms)]

    def exposures(self, now_ms: int) -> list[Exposure]:
        """Sealed segments with fewer than N good replicas now, for the durability
        ledger (the segments `under_replicated` lists, with how many are good)."""
        views = self.store_views(now_ms)
        candidates = self.repair_candidates(views)
        held = self.held_for(candidates)
        out = []
        for segment in candidates:
            stream = self.streams[self.names[segment.stream_id]]
            verdict = repair.judge(
                segment, views, held[segment.key], now_ms, self.bridge_grace_ms
            )
            good = len(verdict.good)
            if good < stream.replicas:
                out.append(
                    Exposure(
                        segment.key,
                        stream.name,
                        good,
                        stream.replicas,
                        stream.write_quorum,
                        self.segment_bytes(segment.key),
                        len(verdict.unverified),
                    )
                )
        return out

    def replica_verification(self) -> tuple[int, int, int]:
        """Over the sealed segments' copy-set members: how many matched the certificate
        (`integrity`), how many not yet, how many are bad."""
        matched = unmatched = bad = 0
        for key, segment in self.segments.items():
            if segment.state != SegmentState.SEALED:
                continue
            checks = self.checks.get(key)
            for member in segment.copy_set:
                if member in segment.bad:
                    bad += 1
                elif checks is not None and member in checks.verified:
                    matched += 1
                else:
                    unmatched += 1
        return matched, unmatched, bad

    def replica_bytes(self) -> dict[str, int]:
        """Bytes of the replicas each registered store is assigned, by segment size."""
        out = dict.fromkeys(sorted(self.stores), 0)
        for key, segment in self.segments.items():
            size = self.segment_bytes(key)
            for member in segment.copy_set:
                if member in out:
                    out[member] += size
        return out

    def drain_preview(
        self, store_id: str, now_ms: int
    ) -> tuple[list[repair.Task], dict[str, int], dict[str, int]]:
        """The moves draining `store_id` needs, as the repairer will pick them now."""
        views = self.store_views(now_ms)
        before = self.replica_bytes()
        after = dict(before)
        tasks = []
        pending: dict[str, int] = {}
        for key, segment in sorted(self.segments.items()):
            if segment.state != SegmentState.SEALED or store_id not in segment.copy_set:
                continue
            keep = [m for m in segment.copy_set if m != store_id]
            candidates = [
                replace(v, segments=v.segments + pending.get(v.store_id, 0)) for v in views.values()
            ]
            target = placement.choose_target(candidates, keep, avoid=[store_id])
            if target is None:
                continue
            size = self.segment_bytes(key)
            source = next((m for m in keep if views.get(m) and views[m].alive), store_id)
            tasks.append(repair.Task(key, source, target, store_id, repair.DRAIN, size))
            pending[target] = pending.get(target, 0) + 1
            after[store_id] -= size
            after[target] = after.get(target, 0) + size
        return tasks, before, after

    def rebalance_plan(
        self, now_ms: int, busy: Iterable[SegmentKey] = ()
    ) -> tuple[list[repair.Task], dict[str, int], dict[str, int]]:
        """Moves of healthy sealed replicas, none of a segment in `busy` (a copy running),
        until bytes per usable store are even."""
        skip = set(busy)
        views = self.store_views(now_ms)
        sealed = [s for s in self.segments.values() if s.state == SegmentState.SEALED]
        held = self.held_for(sealed)
        replicas = []
        for key, segment in sorted(self.segments.items()):
            if segment.state != SegmentState.SEALED or key in skip:
                continue
            verdict = repair.judge(segment, views, held.get(key, {}), now_ms, self.bridge_grace_ms)
            if len(verdict.good) == len(segment.copy_set):
                size = self.segment_bytes(key)
                replicas.append(placement.MovableSegment(key, segment.copy_set, size))
        moves, before, after = placement.plan_rebalance(views.values(), replicas)
        tasks = [
            repair.Task(m.segment, m.source, m.target, m.source, repair.REBALANCE, m.bytes)
            for m in moves
        ]
        return tasks, before, after
