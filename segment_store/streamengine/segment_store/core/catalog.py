"""What a segment store holds, as last published: each segment's metadata, the streams'
tenants, the versions of the master's records, the damaged and lost marks, and the
store's own identity (its incarnation and its cluster).

Loaded from the KV at start (and again after a refused write, `reload`), changed only by
`publish(plan)`: readers and planners see the published state, never a plan half made.

Damage. A read that finds a stored copy damaged (its crc, or the engine's own block
checksum: `KVCorruption`) raises, and the segment is remembered as damaged until a
verified copy overwrites it or it is deleted. The store reports a damaged segment to
the master with acked index 0 (`reported_metas`): it cannot serve what it acked, so the
master counts the replica as missing the bridge and repairs it from a good one, and
readers go to another replica meanwhile. Damage is remembered in memory only: after a
restart the next read finds it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from streamengine.protocol.segment_records import record_version
from streamengine.protocol.signing import MalformedPayload
from streamengine.segment_store.core.commands import Plan, SegmentKey, check_segment
from streamengine.segment_store.core.errors import SegmentNotFound
from streamengine.segment_store.core.keys import (
    AUTHORITY_KEY,
    CLUSTER_ID_KEY,
    CLUSTER_VIEW_KEY,
    INCARNATION_KEY,
    SegmentMeta,
    decode_copy_set,
    decode_granted_stream,
    decode_u64,
    encode_u64,
    lost_range,
    meta_range,
    meta_segment,
    name_key,
    placed_key,
    record_key,
    record_range,
    tenant_range,
    tenant_stream,
)
from streamengine.segment_store.core.kv import KV, Put


@dataclass(frozen=True, slots=True)
class SegmentStateInfo:
    fence: int
    acked_index: int
    matched_index: int
    last_index: int
    bytes: int
    bridge_index: int


class StoreCatalog:
    """The published state of the store over `kv`; see the module doc."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv
        self._damaged: set[SegmentKey] = set()
        self.reload()

    def reload(self) -> None:
        """Read everything but the damage marks from the KV again (after a refused
        write: what reached the KV may differ from what was published)."""
        self._metas = self._load_metas()
        self._tenants = self._load_tenants()
        self._records = self._load_records()
        raw = self.kv.get(INCARNATION_KEY)
        self._incarnation = decode_u64(raw) if raw else 0
        self._cluster_id = (self.kv.get(CLUSTER_ID_KEY) or b"").decode()
        start, end = lost_range()
        self._lost = {SegmentKey(*meta_segment(key)) for key, _ in self.kv.scan(start, end)}

    def _load_metas(self) -> dict[SegmentKey, SegmentMeta]:
        metas: dict[SegmentKey, SegmentMeta] = {}
        start, end = meta_range()
        for key, value in self.kv.scan(start, end):
            stream_id, epoch = meta_segment(key)
            metas[SegmentKey(stream_id, epoch)] = SegmentMeta.decode(value)
        return metas

    def _load_tenants(self) -> dict[int, str]:
        start, end = tenant_range()
        return {tenant_stream(k): v.decode() for k, v in self.kv.scan(start, end)}

    def _load_records(self) -> dict[SegmentKey, int]:
        start, end = record_range()
        return {
            SegmentKey(*meta_segment(key)): record_version(value)
            for key, value in self.kv.scan(start, end)
        }

    def publish(self, plan: Plan) -> None:
        """Make what `plan` did what readers see (once its KV ops are written)."""
        self._tenants.update(plan.tenants)
        for segment, meta in plan.metas.items():
            if meta is None:
                self._metas.pop(segment, None)
            else:
                self._metas[segment] = meta
        self._damaged -= plan.mended
        for segment, version in plan.records.items():
            if version:
                self._records[segment] = version
            else:
                self._records.pop(segment, None)
        for segment, lost in plan.lost.items():
            if lost:
                self._lost.add(segment)
            else:
                self._lost.discard(segment)
        if plan.cluster_id:
            self._cluster_id = plan.cluster_id

    # ---- identity ----

    def incarnation(self) -> int:
        return self._incarnation

    def keep_incarnation(self, incarnation: int) -> int:
        """The store's incarnation: the one its database keeps, else `incarnation`,
        kept durably (called once, before the store serves)."""
        assert 0 < incarnation < 1 << 64
        if not self._incarnation:
            self.kv.write([Put(INCARNATION_KEY, encode_u64(incarnation))], sync=True)
            self._incarnation = incarnation
        return self._incarnation

    def cluster_id(self) -> str:
        return self._cluster_id

    def is_lost(self, segment: SegmentKey) -> bool:
        """Whether `segment` is marked lost with an earlier incarnation of the store."""
        return segment in self._lost

    # ---- segments ----

    def meta(self, segment: SegmentKey) -> SegmentMeta | None:
        return self._metas.get(segment)

    def require(self, segment: SegmentKey) -> SegmentMeta:
        """The segment's metadata; raises BadRequest, SegmentNotFound."""
        check_segment(segment)
        meta = self._metas.get(segment)
        if meta is None:
            raise SegmentNotFound(f"segment {segment.stream_id}/{segment.epoch} is not held here")
        return meta

    def state(self, segment: SegmentKey) -> SegmentStateInfo:
        meta = self.require(segment)
        return SegmentStateInfo(
            meta.fence,
            meta.acked_index,
            meta.matched_index,
            meta.last_index,
            meta.payload_bytes,
            meta.bridge_index,
        )

    def segments(self) -> list[SegmentKey]:
        return sorted(self._metas)

    def segment_count(self) -> int:
        return len(self._metas)

    def metas(self) -> dict[SegmentKey, SegmentMeta]:
        return dict(self._metas)

    # ---- tenants and records ----

    def tenant_of(self, stream_id: int) -> str:
        """The stream's tenant as a grant or copy told this store; "" if never told."""
        return self._tenants.get(stream_id, "")

    def has_record(self, segment: SegmentKey) -> bool:
        return segment in self._records

    def record_version(self, segment: SegmentKey) -> int:
        """The version of the master's record of `segment` kept here (0: none)."""
        return self._records.get(segment, 0)

    def segment_record(self, segment: SegmentKey) -> bytes:
        """The master's record of `segment` as kept (b"": none)."""
        return self.kv.get(record_key(segment.stream_id, segment.epoch)) or b""

    def granted_stream(self, stream_id: int) -> tuple[str, int]:
        """The stream's name and write quorum as a grant told this store; ("", 0) if
        none did (or what is kept does not decode)."""
        raw = self.kv.get(name_key(stream_id))
        if not raw:
            return "", 0
        try:
            return decode_granted_stream(raw)
        except MalformedPayload:
            return "", 0

    def placed_copy_set(self, segment: SegmentKey) -> tuple[str, ...]:
        """The copy set the grant that first brought `segment` here listed (empty: none
        kept, as for a copy the master made, or a value that does not decode)."""
        raw = self.kv.get(placed_key(segment.stream_id, segment.epoch))
        if not raw:
            return ()
        try:
            return decode_copy_set(raw)
        except MalformedPayload:
            return ()

    def authority_record(self) -> bytes | None:
        """What `KeepAuthorityCommand` last kept."""
        return self.kv.get(AUTHORITY_KEY)

    def cluster_view(self) -> bytes:
        """The master's cluster view as `KeepClusterViewCommand` last kept it (b"":
        none)."""
        return self.kv.get(CLUSTER_VIEW_KEY) or b""

    # ---- damage ----

    def mark_damaged(self, segment: SegmentKey) -> None:
        """A read found a stored copy of `segment` damaged (any thread may call this)."""
        self._damaged.add(segment)

    def damaged(self) -> set[SegmentKey]:
        return set(self._damaged)

    def reported_metas(self) -> dict[SegmentKey, SegmentMeta]:
        """What the store tells the master it holds: a damaged segment with acked
        index 0, since it cannot serve what it acked (see "Damage" above)."""
        metas = self.metas()
        for segment in self._damaged & metas.keys():
            metas[segment] = dataclasses.replace(metas[segment], acked_index=0)
        return metas

    def scrub_targets(self) -> dict[SegmentKey, int]:
        """Sealed replicas to keep checked, each with its final index: sealed here
        (fenced above their epoch), acked up to their bridge, not known damaged."""
        return {
            segment: meta.bridge_index
            for segment, meta in self._metas.items()
            if meta.fence > segment.epoch and meta.bridge_index > 0 and segment not in self._damaged
        }
