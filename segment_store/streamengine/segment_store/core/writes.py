"""How a segment store plans its commands: fencing, the overwrite rule, matched and
acked indexes, tenants, records and joining, over a narrow KV. No gRPC, no asyncio, no
clock.

`plan(kv, catalog, commands, ...)` checks each command against the published state
(`catalog.StoreCatalog`) plus what the earlier commands of the same plan did, and
returns a `Plan`: the KV ops of every command that succeeded, the resulting per-segment
metadata, and one outcome per command (a result or the error that refused it, in which
case the command contributed nothing).

Rules (docs/design.md, "The segment store"):
- a write whose writer epoch is below the segment's fence is refused, nothing written;
- a copy replaces a stored one only if its epoch is >= the stored copy's epoch; keeping
  a higher-epoch copy is still success, and the answer says what is held;
- a copy of the same epoch as the stored one must carry identical bytes (a
  retransmission); other bytes refuse the whole batch (`ConflictingCopy`): one epoch
  has one writer, and what it wrote at an index never changes under that epoch;
- matched index = largest m with every index 1..m held; entries above a gap are kept;
- acked index kept = max(kept, min(leader's acked index, matched index));
- once the acked index reaches a bridge, the copies past the first such bridge are
  dropped in the same batch (the bridge is the segment's final index);
- the fence only rises (seal), and a seal below it is refused;
- an acked index the master passes on from a leader that let go
  (`RaiseAckedCommand`) is kept as a leader's Write's is, only in a segment held and
  not fenced past its epoch (a copy or a recovery decides the acked index of those);
- a segment copy's acked index rises only once the copy is verified, and only while
  it still holds its fence (`ConfirmCopyCommand`, see `copy_rules`);
- a refill in place drops every copy of the segment first, never its fence
  (`DropCopiesCommand`): the segment then holds nothing, acked nothing;
- a stream's tenant, once known (from the grant a write or seal came under, or the
  master's copy request), is kept and never changes: a command naming another is
  refused;
- the master's record of a segment (`KeepRecordsCommand`) is kept only while the
  segment is held, and goes with it; so is the copy set the grant of the write or
  seal that first brought the segment here listed;
- a store takes part in writes and seals only once it joined its cluster (its first
  registration: `JoinCommand`), and never in those of a segment its earlier incarnation
  held (`SegmentStoreCore.check_takes_part`): an empty answer from a wiped store would
  count, in a recovery, for the replica it lost.
Whether a write or seal may happen at all (its grant, its caller) is decided before it
becomes a command (`core.authority`).
Entries and the metadata that covers them are in the same KV batch, so a restart
recovers every segment's fence, matched and acked index exactly.

Why one long module: every command is planned over the same overlay of the plan so
far (`_Work`: the metas, the copies written, the ranges dropped), and the rules above
meet in it (a write's acked index drops the copies past a bridge; a delete, a drop of
copies and a later write of one plan must see each other). Split, each part would
reach into the others' overlay.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from streamengine.protocol.entry import (
    PAYLOAD_KINDS,
    VALUE_HEADER_BYTES,
    CorruptEntry,
    EntryKind,
    PackedEntries,
)
from streamengine.protocol.limits import (
    EVENT_BYTES_MAX,
    INDEX_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
    WRITE_REQUEST_PARTS_MAX,
)
from streamengine.protocol.segment_records import (
    CLUSTER_VIEW_BYTES_MAX,
    RECORD_BYTES_MAX,
    record_version,
)
from streamengine.segment_store.core.catalog import StoreCatalog
from streamengine.segment_store.core.commands import (
    AckedRaised,
    AuthorityKept,
    ClusterViewKept,
    Command,
    ConfirmCopyCommand,
    DeleteCommand,
    DeleteResult,
    DropCopiesCommand,
    JoinCommand,
    Joined,
    KeepAuthorityCommand,
    KeepClusterViewCommand,
    KeepRecordsCommand,
    Outcome,
    Plan,
    RaiseAckedCommand,
    RecordsKept,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
    check_epoch,
    check_segment,
)
from streamengine.segment_store.core.errors import (
    BadRequest,
    BelowFence,
    ConflictingCopy,
    CopyRefused,
    NotJoined,
    StoredCopyCorrupt,
    StoreError,
    TooLarge,
)
from streamengine.segment_store.core.keys import (
    AUTHORITY_KEY,
    BRIDGES_PER_SEGMENT_MAX,
    CLUSTER_ID_KEY,
    CLUSTER_VIEW_KEY,
    SegmentMeta,
    encode_copy_set,
    encode_granted_stream,
    entry_index,
    entry_key,
    entry_key_prefix,
    lost_key,
    meta_key,
    name_key,
    placed_key,
    record_key,
    segment_entries_range,
    tenant_key,
)
from streamengine.segment_store.core.kv import KV, Delete, DeleteRange, KVOp, Put, PutMany
from streamengine.segment_store.core.plan_overlay import Held, Run, Written

# A cluster id, as the master makes them (`cluster-` and 16 hex digits) with room to spare.
CLUSTER_ID_CHARS_MAX = 256

_INDEX = struct.Struct(">Q")
_VALUE_HEAD = struct.Struct(">BQ")  # kind, epoch: the prefix of a stored value


# What a plan knows of a held copy: (epoch, kind, payload bytes, stored value). Plain
# tuples: the hot path builds one per entry written.
@dataclass
class _Work:
    """A plan being built: the published state overlaid with the plan's own effects."""

    kv: KV
    catalog: StoreCatalog
    entry_bytes_max: int
    metas: dict[SegmentKey, SegmentMeta | None] = field(default_factory=dict)
    # Copies written by the plan so far, per segment then index.
    pending: dict[SegmentKey, Written] = field(default_factory=dict)
    deleted: set[SegmentKey] = field(default_factory=set)
    # Segments whose copies past an index the plan dropped: the KV still holds them
    # until the plan is written.
    dropped_past: dict[SegmentKey, int] = field(default_factory=dict)
    ops: list[KVOp] = field(default_factory=list)
    tenants: dict[int, str] = field(default_factory=dict)
    records: dict[SegmentKey, int] = field(default_factory=dict)
    lost: dict[SegmentKey, bool] = field(default_factory=dict)
    cluster_id: str = ""

    def meta(self, segment: SegmentKey) -> SegmentMeta | None:
        if segment in self.metas:
            return self.metas[segment]
        return self.catalog.meta(segment)

    def held(self, segment: SegmentKey, index: int, last_index: int) -> Held | None:
        if index > last_index:
            return None
        written = self.pending.get(segment)
        found = written.held(index) if written is not None else None
        if found is not None or segment in self.deleted:
            return found
        if index > self.dropped_past.get(segment, INDEX_MAX):
            return None
        value = self.kv.get(entry_key(segment.stream_id, segment.epoch, index))
        if value is None:
            return None
        if len(value) < VALUE_HEADER_BYTES:
            raise CorruptEntry(f"index {index}: stored value of {len(value)} bytes")
        kind, epoch = _VALUE_HEAD.unpack_from(value)
        return (epoch, kind, len(value) - VALUE_HEADER_BYTES, value)


def check_write_message(parts: int, entries: int, packed_bytes: int) -> None:
    """Raise BadRequest unless a Write message of many segments' batches is within one
    batch's bounds over all its parts (`WriteRequest.parts`); pure. Checked from the
    parts' counts before any part is cut out or admitted: an oversized message costs
    nothing, and its parts are never answered one by one."""
    if parts > WRITE_REQUEST_PARTS_MAX:
        raise BadRequest(f"message of {parts} parts is over {WRITE_REQUEST_PARTS_MAX}")
    if entries > WRITE_BATCH_ENTRIES_MAX:
        raise BadRequest(f"message of {entries} entries is over {WRITE_BATCH_ENTRIES_MAX}")
    if packed_bytes > WRITE_BATCH_BYTES_MAX:
        raise BadRequest(f"message of {packed_bytes} bytes is over {WRITE_BATCH_BYTES_MAX}")


def check_batch(
    writer_epoch: int, batch: PackedEntries, entry_bytes_max: int = EVENT_BYTES_MAX
) -> tuple[list[int], list[int]]:
    """Raise BadRequest unless the batch is well formed, else its (kinds, epochs); pure.
    Every crc32c is checked in one pass over the values, no object built per entry."""
    check_epoch(writer_epoch, "writer epoch")
    count = len(batch)
    if count > WRITE_BATCH_ENTRIES_MAX:
        raise BadRequest(f"batch of {count} entries is over {WRITE_BATCH_ENTRIES_MAX}")
    if not count:
        return [], []
    if not 1 <= batch.first_index <= batch.last_index <= INDEX_MAX:
        raise BadRequest(
            f"indexes {batch.first_index}..{batch.last_index} are not in 1..{INDEX_MAX}"
        )
    values = batch.values
    longest = max(map(len, values)) - VALUE_HEADER_BYTES
    if longest > entry_bytes_max:
        position = next(n for n, v in enumerate(values) if len(v) - VALUE_HEADER_BYTES == longest)
        raise TooLarge(
            entry_bytes_max,
            f"entry {batch.first_index + position} too large: {longest} bytes, "
            f"max {entry_bytes_max}",
        )
    if batch.payload_bytes() > WRITE_BATCH_BYTES_MAX:
        raise TooLarge(
            WRITE_BATCH_BYTES_MAX, f"batch too large: over {WRITE_BATCH_BYTES_MAX} payload bytes"
        )
    try:
        kinds, epochs, bad = batch.check()
    except CorruptEntry as error:
        raise BadRequest(str(error)) from None
    if bad is not None:
        kind = kinds[bad]
        reason = "crc32c mismatch" if kind in _KIND_NAMES else f"unknown kind {kind}"
        raise BadRequest(f"index {batch.first_index + bad}: {reason}")
    if not 0 < min(epochs) <= max(epochs) <= writer_epoch:
        position = next(n for n, e in enumerate(epochs) if not 0 < e <= writer_epoch)
        raise BadRequest(
            f"entry {batch.first_index + position}: copy epoch {epochs[position]} is not in "
            f"1..{writer_epoch} (the writer's epoch)"
        )
    # Counted in C: a batch of events and producer marks is never walked in Python.
    if sum(map(kinds.count, PAYLOAD_KINDS)) != len(kinds):
        for position, kind in enumerate(kinds):
            if kind not in PAYLOAD_KINDS and len(values[position]) > VALUE_HEADER_BYTES:
                raise BadRequest(
                    f"entry {batch.first_index + position}: a {EntryKind(kind).name} "
                    "carries no payload"
                )
    return kinds, epochs


_KIND_NAMES = {int(kind): kind.name for kind in EntryKind}


def plan(kv: KV, catalog: StoreCatalog, commands: Iterable[Command], entry_bytes_max: int) -> Plan:
    """The plan of `commands`, in order, over what `catalog` publishes (module doc)."""
    work = _Work(kv, catalog, entry_bytes_max)
    outcomes: list[Outcome] = []
    entries_written = 0
    payload_bytes = 0
    mended: set[SegmentKey] = set()
    for command in commands:
        # Each command checks everything before it touches the overlay, so a refused
        # command leaves the plan as it was.
        try:
            if isinstance(command, WriteCommand):
                outcome: Outcome = _plan_write(command, work)
                entries_written += len(command.batch)
                payload_bytes += command.batch.payload_bytes()
            elif isinstance(command, SealCommand):
                outcome = _plan_seal(command, work)
            elif isinstance(command, ConfirmCopyCommand):
                outcome = _plan_confirm_copy(command, work)
            elif isinstance(command, DropCopiesCommand):
                outcome = _plan_drop_copies(command, work)
            elif isinstance(command, KeepAuthorityCommand):
                work.ops.append(Put(AUTHORITY_KEY, command.record))
                outcome = AuthorityKept()
            elif isinstance(command, KeepRecordsCommand):
                outcome = _plan_keep_records(command, work)
            elif isinstance(command, KeepClusterViewCommand):
                if not command.view or len(command.view) > CLUSTER_VIEW_BYTES_MAX:
                    raise BadRequest(f"a cluster view of {len(command.view)} bytes")
                work.ops.append(Put(CLUSTER_VIEW_KEY, command.view))
                outcome = ClusterViewKept()
            elif isinstance(command, JoinCommand):
                outcome = _plan_join(command, work)
            elif isinstance(command, RaiseAckedCommand):
                outcome = _plan_raise_acked(command, work)
            else:
                outcome = _plan_delete(command, work)
        except StoreError as error:
            outcome = error
        except CorruptEntry as error:
            outcome = StoredCopyCorrupt(str(error))
            assert not isinstance(
                command,
                KeepAuthorityCommand
                | KeepRecordsCommand
                | KeepClusterViewCommand
                | JoinCommand
                | RaiseAckedCommand,
            ), "it reads no entry"
            catalog.mark_damaged(command.segment)
        if isinstance(command, ConfirmCopyCommand | DeleteCommand) and not isinstance(
            outcome, StoreError
        ):
            mended.add(command.segment)
        outcomes.append(outcome)
    for segment, meta in sorted(work.metas.items()):
        key = meta_key(segment.stream_id, segment.epoch)
        work.ops.append(Delete(key) if meta is None else Put(key, meta.encode()))
    return Plan(
        tuple(work.ops),
        dict(work.metas),
        tuple(outcomes),
        entries_written,
        payload_bytes,
        frozenset(mended),
        work.tenants,
        work.records,
        work.lost,
        work.cluster_id,
    )


def _check_tenant(stream_id: int, tenant: str, work: _Work) -> bool:
    """Whether `tenant` is new for the stream (to be kept); raises BadRequest when
    the stream is known to be another tenant's."""
    if not tenant:
        return False
    known = work.tenants.get(stream_id) or work.catalog.tenant_of(stream_id) or None
    if known is not None and known != tenant:
        raise BadRequest(f"stream {stream_id} is of tenant {known!r}, not of {tenant!r}")
    return known is None


def _keep_tenant(stream_id: int, tenant: str, work: _Work) -> None:
    work.tenants[stream_id] = tenant
    work.ops.append(Put(tenant_key(stream_id), tenant.encode()))


def _keep_copy_set(
    segment: SegmentKey,
    copy_set: tuple[str, ...],
    stream_name: str,
    write_quorum: int,
    work: _Work,
) -> None:
    """Keep the copy set the grant of the command that first brings `segment` here
    lists, and the stream's name and write quorum it says (for a master rebuilding its
    metadata: every member of a segment whose record never reached a store, and the
    name and quorum of a stream none of whose records or cards did). An open or
    sealing segment's copy set never changes, nor does a stream id's name."""
    work.ops.append(Put(placed_key(segment.stream_id, segment.epoch), encode_copy_set(copy_set)))
    if stream_name:
        granted = encode_granted_stream(stream_name, write_quorum)
        work.ops.append(Put(name_key(segment.stream_id), granted))


def _plan_write(command: WriteCommand, work: _Work) -> WriteResult:
    segment = command.segment
    batch = command.batch
    check_segment(segment)
    kinds, epochs = check_batch(command.writer_epoch, batch, work.entry_bytes_max)
    new_tenant = _check_tenant(segment.stream_id, command.tenant, work)
    known = work.meta(segment)
    old = known or SegmentMeta()
    if command.writer_epoch < old.fence:
        raise BelowFence(
            old.fence, f"fenced: writer epoch {command.writer_epoch} < fence {old.fence}"
        )
    first, last = batch.first_index, batch.last_index
    values = batch.values
    sizes = [len(v) - VALUE_HEADER_BYTES for v in values]
    prefix = entry_key_prefix(segment.stream_id, segment.epoch)
    # Above the last index nothing is held, in the KV or in the plan: appends, the
    # common case, put every value as it came, with no lookup.
    fresh_from = min(len(values), max(0, old.last_index + 1 - first))
    payload_bytes = old.payload_bytes + sum(sizes[fresh_from:])
    entries_held = old.entries + len(values) - fresh_from
    bridges = set(old.bridges)
    held_epochs: list[int] = []
    ops: list[KVOp] = []
    written: list[int] = []  # positions in the batch written
    for position in range(fresh_from):
        index = first + position
        held = work.held(segment, index, old.last_index)
        if held is not None:
            if epochs[position] < held[0]:
                held_epochs.append(held[0])
                continue
            if epochs[position] == held[0] and held[3] != values[position]:
                raise ConflictingCopy(
                    index,
                    held[0],
                    f"index {index} is held at epoch {held[0]} with other bytes: a copy of "
                    "one epoch is never replaced (a retransmission carries the same bytes)",
                )
            payload_bytes -= held[2]
            if held[1] == EntryKind.BRIDGE:
                bridges.discard(index)
        else:
            entries_held += 1
        payload_bytes += sizes[position]
        written.append(position)
        held_epochs.append(epochs[position])
    pack = _INDEX.pack
    if written:
        ops.extend(Put(prefix + pack(first + n), values[n]) for n in written)
    if fresh_from < len(values):
        # The appended run: its keys built in one pass, its values put as they came.
        held_epochs.extend(epochs[fresh_from:])
        ops.append(
            PutMany(
                [prefix + pack(i) for i in range(first + fresh_from, last + 1)],
                values[fresh_from:] if fresh_from else values,
            )
        )
    if EntryKind.BRIDGE in kinds:  # one pass in C: a producer's batch has none
        bridges.update(
            first + n
            for n in [*written, *range(fresh_from, len(values))]
            if kinds[n] == EntryKind.BRIDGE
        )
    if len(bridges) > BRIDGES_PER_SEGMENT_MAX:
        raise BadRequest(f"segment holds more than {BRIDGES_PER_SEGMENT_MAX} bridges")
    last_index = max(old.last_index, last)
    matched = old.matched_index
    if values and first <= matched + 1 <= last:
        # Past the batch only earlier copies count, so the scan may precede the overlay
        # update, which stays last: a refused command leaves the plan untouched.
        matched = last
        while work.held(segment, matched + 1, last_index) is not None:
            matched += 1
    work.ops.extend(ops)
    written_to = work.pending.setdefault(segment, Written())
    written_to.copies.update(
        (first + n, (epochs[n], kinds[n], sizes[n], values[n])) for n in written
    )
    if fresh_from < len(values):
        # Shared, not copied, when the whole batch is the run: a run is never changed
        # in place (`Run.cut_after` slices).
        run = (epochs, kinds, sizes, values)
        if fresh_from:
            run = tuple(column[fresh_from:] for column in run)  # type: ignore[assignment]
        written_to.runs.append(Run(first + fresh_from, *run))
    if new_tenant:
        _keep_tenant(segment.stream_id, command.tenant, work)
    if known is None and command.copy_set:
        _keep_copy_set(segment, command.copy_set, command.stream_name, command.write_quorum, work)
    acked = max(old.acked_index, min(command.acked_index, matched))
    new = SegmentMeta(
        fence=old.fence,
        acked_index=acked,
        matched_index=matched,
        last_index=last_index,
        payload_bytes=payload_bytes,
        entries=entries_held,
        bridges=tuple(sorted(bridges)),
    )
    new = _drop_past_final_bridge(segment, new, work)
    work.metas[segment] = new
    return WriteResult(new.matched_index, new.acked_index, new.fence, tuple(held_epochs))


def _drop_past_final_bridge(segment: SegmentKey, meta: SegmentMeta, work: _Work) -> SegmentMeta:
    """The metadata once the copies past the segment's final bridge are gone.

    Copies at or below the acked index are final, and the first bridge among them
    ends the segment (recovery's "first chosen BRIDGE" rule): whatever lies past it
    is a stale write that no recovery rewrites, no reader is served and no repair
    copies (a paused leader's, bridged over late). It goes in the same KV batch.
    """
    final = next((b for b in meta.bridges if b <= meta.acked_index), 0)
    if final == 0 or meta.last_index == final:
        return meta
    start = entry_key(segment.stream_id, segment.epoch, final + 1)
    end = segment_entries_range(segment.stream_id, segment.epoch)[1]
    sizes: dict[int, int] = {}
    if segment not in work.deleted:
        # What an earlier command of the plan dropped is still in the KV.
        kv_end = end
        if segment in work.dropped_past:
            kv_end = entry_key(segment.stream_id, segment.epoch, work.dropped_past[segment] + 1)
        if start < kv_end:
            for key, value in work.kv.scan(start, kv_end):
                sizes[entry_index(key)] = len(value) - VALUE_HEADER_BYTES
    written = work.pending.get(segment)
    if written is not None:
        sizes.update(written.cut_after(final))
    work.ops.append(DeleteRange(start, end))
    work.dropped_past[segment] = min(final, work.dropped_past.get(segment, INDEX_MAX))
    dropped = dataclasses.replace(
        meta,
        # Nothing past the bridge is the segment's, whatever a leader called acked.
        acked_index=final,
        matched_index=final,
        last_index=final,
        payload_bytes=meta.payload_bytes - sum(sizes.values()),
        entries=meta.entries - len(sizes),
        bridges=tuple(b for b in meta.bridges if b <= final),
    )
    assert dropped.payload_bytes >= 0 and dropped.entries >= 0, (meta, sizes)
    return dropped


def _plan_raise_acked(command: RaiseAckedCommand, work: _Work) -> AckedRaised:
    for segment, _ in command.raised:
        check_segment(segment)
    raised: list[SegmentKey] = []
    for segment, acked_index in command.raised:
        old = work.meta(segment)
        if old is None or old.fence > segment.epoch:
            continue
        acked = max(old.acked_index, min(acked_index, old.matched_index))
        if acked == old.acked_index:
            continue
        new = _drop_past_final_bridge(segment, dataclasses.replace(old, acked_index=acked), work)
        work.metas[segment] = new
        raised.append(segment)
    return AckedRaised(tuple(raised))


def _plan_seal(command: SealCommand, work: _Work) -> SealResult:
    check_segment(command.segment)
    check_epoch(command.new_epoch, "seal epoch")
    new_tenant = _check_tenant(command.segment.stream_id, command.tenant, work)
    known = work.meta(command.segment)
    old = known or SegmentMeta()
    if command.new_epoch < old.fence:
        raise BelowFence(old.fence, f"fenced: seal epoch {command.new_epoch} < fence {old.fence}")
    if new_tenant:
        _keep_tenant(command.segment.stream_id, command.tenant, work)
    if known is None and command.copy_set:
        _keep_copy_set(
            command.segment, command.copy_set, command.stream_name, command.write_quorum, work
        )
    new = dataclasses.replace(old, fence=max(old.fence, command.new_epoch))
    work.metas[command.segment] = new
    return SealResult(new.fence, new.acked_index, new.matched_index, new.last_index)


def _plan_confirm_copy(command: ConfirmCopyCommand, work: _Work) -> WriteResult:
    segment = command.segment
    check_segment(segment)
    if not 0 < command.final_index <= INDEX_MAX:
        raise BadRequest(f"final index {command.final_index} is not in 1..{INDEX_MAX}")
    old = work.meta(segment)
    if old is None or old.fence < command.fence:
        raise CopyRefused(
            f"copy of {segment.stream_id}/{segment.epoch} lost its fence {command.fence} "
            f"(now {old.fence if old else 'deleted'}) before it was confirmed"
        )
    if old.matched_index < command.final_index:
        raise CopyRefused(
            f"copy of {segment.stream_id}/{segment.epoch} holds every index only up to "
            f"{old.matched_index}, short of {command.final_index}"
        )
    new = dataclasses.replace(old, acked_index=max(old.acked_index, command.final_index))
    assert new.fence >= command.fence and new.acked_index >= command.final_index
    new = _drop_past_final_bridge(segment, new, work)
    work.metas[segment] = new
    return WriteResult(new.matched_index, new.acked_index, new.fence, ())


def _plan_drop_copies(command: DropCopiesCommand, work: _Work) -> SealResult:
    segment = command.segment
    check_segment(segment)
    old = work.meta(segment)
    if old is None or old.fence < command.fence:
        raise CopyRefused(
            f"copy of {segment.stream_id}/{segment.epoch} lost its fence {command.fence} "
            f"(now {old.fence if old else 'deleted'}) before its old copies were dropped"
        )
    work.ops.append(DeleteRange(*segment_entries_range(segment.stream_id, segment.epoch)))
    work.deleted.add(segment)
    work.pending.pop(segment, None)
    work.dropped_past.pop(segment, None)
    work.metas[segment] = SegmentMeta(fence=old.fence)
    return SealResult(old.fence, 0, 0, 0)


def _plan_delete(command: DeleteCommand, work: _Work) -> DeleteResult:
    segment = command.segment
    check_segment(segment)
    existed = work.meta(segment) is not None
    work.ops.append(DeleteRange(*segment_entries_range(segment.stream_id, segment.epoch)))
    work.deleted.add(segment)
    work.pending.pop(segment, None)
    work.metas[segment] = None
    work.ops.append(Delete(placed_key(segment.stream_id, segment.epoch)))
    if work.catalog.has_record(segment) or work.records.get(segment):
        work.ops.append(Delete(record_key(segment.stream_id, segment.epoch)))
        work.records[segment] = 0
    if work.catalog.is_lost(segment) or work.lost.get(segment):
        work.ops.append(Delete(lost_key(segment.stream_id, segment.epoch)))
        work.lost[segment] = False
    return DeleteResult(existed)


def _plan_join(command: JoinCommand, work: _Work) -> Joined:
    if not command.cluster_id or len(command.cluster_id) > CLUSTER_ID_CHARS_MAX:
        raise BadRequest(f"cluster id {command.cluster_id!r}")
    kept = work.cluster_id or work.catalog.cluster_id()
    if kept and kept != command.cluster_id:
        raise NotJoined(f"this store belongs to cluster {kept}, not {command.cluster_id}")
    for segment in command.lost:
        check_segment(segment)
    if not kept:
        work.ops.append(Put(CLUSTER_ID_KEY, command.cluster_id.encode()))
        work.cluster_id = command.cluster_id
    marked = []
    for segment in command.lost:
        if (
            work.meta(segment) is not None
            or work.catalog.is_lost(segment)
            or work.lost.get(segment)
        ):
            continue
        work.ops.append(Put(lost_key(segment.stream_id, segment.epoch), b""))
        work.lost[segment] = True
        marked.append(segment)
    return Joined(tuple(marked))


def _plan_keep_records(command: KeepRecordsCommand, work: _Work) -> RecordsKept:
    kept = []
    for segment, raw in command.records:
        check_segment(segment)
        if not raw or len(raw) > RECORD_BYTES_MAX:
            raise BadRequest(f"a segment record of {len(raw)} bytes")
    for segment, raw in command.records:
        if work.meta(segment) is None:
            continue  # not held (deleted meanwhile): its record would outlive it
        work.ops.append(Put(record_key(segment.stream_id, segment.epoch), raw))
        work.records[segment] = record_version(raw)
        kept.append(segment)
    return RecordsKept(tuple(kept))
