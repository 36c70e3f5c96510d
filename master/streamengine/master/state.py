"""The master's state: the catalog's records in memory, their indexes, and the queries
every part of the master reads.

What changes the records sits in one section each, every section sharing this state and
its one commit path (`catalog`): `tenancy` (tenants and streams), `retention` (trims and
removals), `tokens` (tokens issued), `keys` (signing keys), `cert_revocations`
(certificates revoked), `leadership` (leases and epochs), `integrity` (seals and scrub
reports), `stores` (registrations, heartbeats, drains) and `replicas` (copies, swaps,
repair and rebalance plans). `MasterState` builds them: `state.tenancy`,
`state.retention`, `state.issuer`, `state.keys`, `state.revoker`, `state.leadership`,
`state.integrity`, `state.registry`, `state.replicas`.

Every method is synchronous and runs on the server's event loop, so each one is atomic
with respect to the others. A mutation is built as a `Batch`, committed durably, and
only then applied to memory and answered: a crash between the two loses nothing that
was answered, and a commit that fails (`metadata.MetadataError`) changes nothing in
memory. Time comes in as `now_ms`; decisions come from the pure cores (`leadership`,
`placement`, `repair`).
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Callable, Iterable

from streamengine.master.catalog import Catalog
from streamengine.master.cert_revocations import CertRevoker
from streamengine.master.core import authority, integrity, leadership, repair, retention
from streamengine.master.core.durability import DurabilityLedger
from streamengine.master.core.errors import NotFound, RebuildUnfinished, StreamDeleted
from streamengine.master.core.leader_acked import LeaderAckedOwed
from streamengine.master.core.model import (
    Held,
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StoreView,
    StreamRecord,
    validate_stream_name,
)
from streamengine.master.integrity import Integrity
from streamengine.master.keys import SigningKeys
from streamengine.master.leadership import LeaderReport, Leadership
from streamengine.master.replicas import Replicas
from streamengine.master.retention import Retention
from streamengine.master.stores import StoreLive, StoreRegistry
from streamengine.master.tenancy import Tenancy
from streamengine.master.tokens import TokenIssuer
from streamengine.master.unrecorded import UnrecordedStreams
from streamengine.protocol.cert_revocations import CertRevocations
from streamengine.protocol.grants import GRANT_MS_DEFAULT
from streamengine.protocol.limits import TENANT_STREAMS_MAX_DEFAULT
from streamengine.protocol.retention import first_retained_sequence
from streamengine.protocol.signing import SigningKey, Verifier
from streamengine.protocol.tokens import Revocations

# Stores heartbeat a few times per timeout (so one lost heartbeat is not a death), and
# at least once a second (repair reads acked indexes from these reports).
STORE_HEARTBEATS_PER_TIMEOUT = 4
STORE_HEARTBEAT_MS_MAX = 1000
STORE_HEARTBEAT_MS_MIN = 50


def new_cluster_id() -> str:
    return f"cluster-{uuid.uuid4().hex[:16]}"


class MasterState:
    """The records in memory, their indexes and queries, and the sections that change them."""

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
        grant_ms: int = GRANT_MS_DEFAULT,
    ):
        """`make_signing_key` makes the master's keys (at its first start, when the
        catalog holds none, and at each rotation), `make_cluster_id` its cluster id
        (None: a rebuild adopts the stores' id instead, `StoreRegistry.adopt_cluster_id`);
        `tenant_streams_max`
        0 means no limit; `delete_grace_ms`: how long deleted streams and trimmed
        segments stay on the stores; `grant_ms`: how long a grant is good for
        (`protocol.grants`)."""
        assert delete_grace_ms >= 0
        authority.check_grant_ms(grant_ms, lease_ms)
        self.grant_ms = grant_ms
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
        self.cluster_id = loaded.cluster_id
        # While the id is not known yet (a rebuild): the ids registering stores keep.
        self.store_cluster_ids: dict[str, str] = {}
        # The keys that sign and verify grants and tokens.
        self.keys = SigningKeys(self, loaded, make_signing_key, now_ms)
        self.tokens = loaded.tokens
        self.revocations = Revocations(
            {t.token_id: t.expires_at_ms for t in self.tokens.values() if t.revoked_at_ms},
            loaded.revocations_version,
        )
        self.cert_revocations = CertRevocations.of(loaded.revoked_certs)
        self.tenants = loaded.tenants
        self.streams = loaded.streams
        self.names = {s.stream_id: s.name for s in self.streams.values()}
        # Indexes kept by `put_stream` / `drop_stream`, so that a page of a listing, a
        # quota check, a retention pass or a store's heartbeat reply costs what it
        # touches, not the number of streams.
        self.sorted_names: list[str] = sorted(self.streams)
        self.tenant_streams: dict[str, int] = {}
        # Deleted streams pending removal -> when their data goes.
        self.deleted: dict[str, int] = {}
        # Streams with a retention limit, not deleted: the only ones a pass looks at.
        self.limited: dict[str, None] = {}
        # When a retention pass next looks at a limited stream that nothing trimmed
        # (`retention.next_look_ms`); forgotten whenever the stream or one of its
        # segments changes. Absent: at the next pass.
        self.retention_looks: dict[str, int] = {}
        # What the cluster view carries of the streams no store keeps a record of.
        self.unrecorded = UnrecordedStreams()
        # Names this state among those a server loads in turn (a view's cache key).
        self.loaded = object()
        for stream in self.streams.values():
            self._index_stream(None, stream)
        self.segments: dict[SegmentKey, SegmentRecord] = {}
        # Trimmed segments -> when their data goes (`removal_at_ms`).
        self.trimmed: dict[SegmentKey, int] = {}
        # Streams (ids) with more than one segment not sealed: a roll or a recovery
        # not finished (`core.summary.Health.SEALING`).
        self.sealing: dict[int, None] = {}
        # Indexes kept by `put_segment` / `drop_segment`, so a heartbeat or a repair
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
        # Acked indexes leaders gave back that stores may not know, from the records.
        self.leader_acked = LeaderAckedOwed()
        self._index_loaded_segments(loaded.segments)
        self.stores = loaded.stores
        self.deletes = loaded.deletes
        # Rebuilt from the stores (`master.rebuild`): an unknown stream id up to this one
        # may be a stream only stores that missed the rebuild hold, so it is no garbage.
        self.rebuilt_through = loaded.rebuilt_through
        # No lease for one lease period after a start: the last holder may still lead.
        self.leases = {
            name: leadership.recovered_lease(
                s.epoch,
                s.leader_id,
                bytes.fromhex(s.leader_secret_sha256),
                s.leader_principal,
                now_ms,
                lease_ms,
            )
            for name, s in self.streams.items()
        }
        self.live = {sid: StoreLive(last_seen_ms=now_ms) for sid in self.stores}
        self.leader_reports: dict[str, LeaderReport] = {}
        # Operator roll requests: stream id -> epoch of the open segment to roll. Kept in
        # memory only: a request lost to a master restart is simply asked again.
        self.roll_requests: dict[int, int] = {}
        # (store, segment) pairs a repair is copying to right now: never garbage.
        self.copying: set[tuple[str, SegmentKey]] = set()
        # Scrub reports that came before the segment's seal, judged at the seal:
        # (segment, store) -> report. Memory only, as the checks are.
        self.early_reports: dict[tuple[SegmentKey, str], integrity.Report] = {}
        # The sections that change the records, each through `catalog`.
        self.tenancy = Tenancy(self)
        self.retention = Retention(self)
        self.issuer = TokenIssuer(self)
        self.revoker = CertRevoker(self)
        self.leadership = Leadership(self)
        self.integrity = Integrity(self)
        self.registry = StoreRegistry(self)
        self.replicas = Replicas(self)
        if not self.cluster_id and make_cluster_id is not None:
            self.registry.adopt_cluster_id(make_cluster_id())

    @property
    def verifier(self) -> Verifier:
        """Verifies grants and tokens callers show, with every key not retired."""
        return self.keys.verifier

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

    def put_stream(self, record: StreamRecord) -> None:
        """A stream created or changed (its record committed), with its indexes."""
        old = self.streams.get(record.name)
        if old is None:
            bisect.insort(self.sorted_names, record.name)
        else:
            assert old.stream_id == record.stream_id, "a stream keeps its id"
        self.streams[record.name] = record
        self.names[record.stream_id] = record.name
        self._index_stream(old, record)

    def drop_stream(self, name: str) -> StreamRecord:
        """A stream removed (its records deleted), from every index."""
        record = self.streams.pop(name)
        at = bisect.bisect_left(self.sorted_names, name)
        assert self.sorted_names[at] == name
        del self.sorted_names[at]
        left = self.tenant_streams[record.tenant] - 1
        if left:
            self.tenant_streams[record.tenant] = left
        else:
            del self.tenant_streams[record.tenant]
        self.deleted.pop(name, None)
        self.limited.pop(name, None)
        self.retention_looks.pop(name, None)
        self.names.pop(record.stream_id, None)
        self.unrecorded.left(record.stream_id)
        return record

    def _index_stream(self, old: StreamRecord | None, record: StreamRecord) -> None:
        name = record.name
        if old is None:
            self.tenant_streams[record.tenant] = self.tenant_streams.get(record.tenant, 0) + 1
        if record.deleted_until_ms:
            self.deleted[name] = record.deleted_until_ms
        else:
            self.deleted.pop(name, None)
        if (record.retention_age_ms or record.retention_bytes) and not record.deleted_until_ms:
            self.limited[name] = None
        else:
            self.limited.pop(name, None)
        self.retention_looks.pop(name, None)
        self.unrecorded.indexed(old, record)

    def put_segment(self, record: SegmentRecord) -> None:
        key = record.key
        if record.removal_at_ms:
            self.trimmed[key] = record.removal_at_ms
        else:
            self.trimmed.pop(key, None)
        self.retention_looks.pop(record.stream, None)
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
        self._index_sealing(record.stream_id)

    def _index_loaded_segments(self, segments: dict[SegmentKey, SegmentRecord]) -> None:
        """Every index `put_segment` keeps, built in one pass over the segments a start
        loads (put one by one, they cost twice as much at 200,000 segments). Sealed
        segments `repair.trusted_at_start` are not left unconfirmed."""
        assert not self.segments, "only into an empty state"
        self.segments = segments
        members: dict[str, set[SegmentKey]] = self.members
        for key, record in segments.items():
            stream_id, epoch = key
            if record.removal_at_ms:
                self.trimmed[key] = record.removal_at_ms
            for member in record.copy_set:
                held = members.get(member)
                if held is None:
                    held = members[member] = set()
                held.add(key)
            if record.verified:
                self.checks[key] = integrity.SegmentChecks(
                    verified=dict.fromkeys(record.verified, 0)
                )
            epochs = self.epochs.get(stream_id)
            if epochs is None:
                epochs = self.epochs[stream_id] = set()
                self.unsealed_epochs[stream_id] = set()
            epochs.add(epoch)
            if record.state != SegmentState.SEALED:
                self.unsealed_epochs[stream_id].add(epoch)
                if record.released_acked_index and record.state == SegmentState.OPEN:
                    self.leader_acked.released(key, record.copy_set, record.released_acked_index)
            elif not repair.trusted_at_start(record):
                self.unconfirmed.add(key)
        for stream_id, unsealed in self.unsealed_epochs.items():
            if len(unsealed) > 1:
                self.sealing[stream_id] = None

    def drop_segment(self, key: SegmentKey) -> None:
        self.checks.pop(key, None)
        for early in [k for k in self.early_reports if k[0] == key]:
            del self.early_reports[early]
        record = self.segments.pop(key)
        self.trimmed.pop(key, None)
        self.retention_looks.pop(record.stream, None)
        for member in record.copy_set:
            self.members[member].discard(key)
        self.epochs[record.stream_id].discard(record.epoch)
        self.unsealed_epochs[record.stream_id].discard(record.epoch)
        self._index_sealing(record.stream_id)
        self.unconfirmed.discard(key)
        self.lost_members.pop(key, None)

    def _index_sealing(self, stream_id: int) -> None:
        if len(self.unsealed_epochs.get(stream_id, ())) > 1:
            self.sealing[stream_id] = None
        else:
            self.sealing.pop(stream_id, None)

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
        (while open) or handed over with its lease, or the highest any copy-set store
        reported, whichever is higher. All only grow while the segment is written, so
        an operator sees it move."""
        stores = (
            self.live[m].held[segment.key].acked_index
            for m in segment.copy_set
            if m in self.live and segment.key in self.live[m].held
        )
        report = self.leader_reports.get(segment.stream)
        leader = report.acked_index if report is not None and report.epoch == segment.epoch else 0
        return max(leader, segment.released_acked_index, *stores)

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

    def list_segments(
        self, name: str, from_epoch: int, to_epoch: int = 0, segments_max: int = 0
    ) -> tuple[StreamRecord, list[SegmentRecord]]:
        """The retained segments (never a trimmed one) from `from_epoch` to
        `to_epoch` (0: no bound), the first `segments_max` of them (0: all)."""
        record = self.usable_stream(name)
        listed = [
            s
            for s in self.retained_segments(record.stream_id)
            if s.epoch >= from_epoch and (to_epoch == 0 or s.epoch <= to_epoch)
        ]
        return record, listed[:segments_max] if segments_max else listed

    def checks_of(self, key: SegmentKey) -> integrity.SegmentChecks:
        return self.checks.setdefault(key, integrity.SegmentChecks())

    def verified_members(self, segment: SegmentRecord) -> tuple[str, ...]:
        """The members whose replica matched the certificate, as the record keeps them."""
        checks = self.checks.get(segment.key)
        if checks is None:
            return ()
        return tuple(sorted(m for m in checks.verified if m in segment.copy_set))

    def store_heartbeat_ms(self) -> int:
        every = self.store_timeout_ms // STORE_HEARTBEATS_PER_TIMEOUT
        return max(STORE_HEARTBEAT_MS_MIN, min(STORE_HEARTBEAT_MS_MAX, every))
