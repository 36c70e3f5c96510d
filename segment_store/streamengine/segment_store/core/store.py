"""The segment store's rules, over a narrow KV: fencing, the overwrite rule, matched and
acked indexes, reads and digests. No gRPC, no asyncio, no clock.

Theory of operation. Every mutation is a command (`WriteCommand`, `SealCommand`,
`DeleteCommand`, `ConfirmCopyCommand`, `KeepAuthorityCommand`,
`KeepRecordsCommand`, `JoinCommand`). `plan(commands)` checks
each against the published state plus what the earlier commands of the same plan did,
and returns the KV
ops of every command that succeeded, the resulting per-segment metadata, and one outcome
per command (a result or the error that refused it, in which case the command
contributed nothing). `write_plan` applies the ops as one atomic KV batch; `publish`
makes the new metadata what readers see. The server gathers concurrent commands into one
plan, writes it, syncs once, then publishes and answers (group commit); `write`, `seal`
and `delete` do all three for one command, for tests and the simulator. Plans must be
published in the order they were made, and a plan must be made only after the previous
one was published.

Rules (docs/design.md, "The segment store"):
- a write whose writer epoch is below the segment's fence is refused, nothing written;
- a copy replaces a stored one only if its epoch is >= the stored copy's epoch; keeping
  a higher-epoch copy is still success, and the answer says what is held;
- matched index = largest m with every index 1..m held; entries above a gap are kept;
- acked index kept = max(kept, min(leader's acked index, matched index));
- once the acked index reaches a bridge, the copies past the first such bridge are
  dropped in the same batch (the bridge is the segment's final index);
- the fence only rises (seal), and a seal below it is refused;
- a segment copy's acked index rises only once the copy is verified, and only while
  it still holds its fence (`ConfirmCopyCommand`, see `copy_rules`);
- a stream's tenant, once known (from the grant a write or seal came under, or the
  master's copy request), is kept and never changes: a command naming another is
  refused;
- the master's record of a segment (`KeepRecordsCommand`) is kept only while the
  segment is held, and goes with it;
- a store takes part in writes and seals only once it joined its cluster (its first
  registration: `JoinCommand`), and never in those of a segment its earlier incarnation
  held (`check_takes_part`): an empty answer from a wiped store would count, in a
  recovery, for the replica it lost.
Whether a write or seal may happen at all (its grant, its caller) is decided before it
becomes a command (`segment_store.authority`).
Entries and the metadata that covers them are in the same KV batch, so a restart
recovers every segment's fence, matched and acked index exactly.

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
import hashlib
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from streamengine.protocol.entry import (
    VALUE_HEADER_BYTES,
    CorruptEntry,
    EntryKind,
    PackedEntries,
    StoredEntry,
    decode_value,
)
from streamengine.protocol.limits import (
    EPOCH_MAX,
    EVENT_BYTES_MAX,
    INDEX_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
)
from streamengine.protocol.segment_records import RECORD_BYTES_MAX, record_version
from streamengine.segment_store.core.keys import (
    AUTHORITY_KEY,
    BRIDGES_PER_SEGMENT_MAX,
    CLUSTER_ID_KEY,
    INCARNATION_KEY,
    SegmentMeta,
    decode_u64,
    encode_u64,
    entry_index,
    entry_key,
    entry_key_prefix,
    lost_key,
    lost_range,
    meta_key,
    meta_range,
    meta_segment,
    record_key,
    record_range,
    segment_entries_range,
    tenant_key,
    tenant_range,
    tenant_stream,
)
from streamengine.segment_store.core.kv import KV, Delete, DeleteRange, KVOp, Put, PutMany
from streamengine.segment_store.core.scrub import ReplicaScan, ScanResult

# A cluster id, as the master makes them (`cluster-` and 16 hex digits) with room to spare.
CLUSTER_ID_CHARS_MAX = 256

# Entries decoded per KV scan while reading or hashing a segment: bounds the memory of
# one scan whatever the segment's size.
SCAN_ENTRIES_MAX = 4096

_INDEX = struct.Struct(">Q")
_VALUE_HEAD = struct.Struct(">BQ")  # kind, epoch: the prefix of a stored value
_DIGEST_HELD = struct.Struct(">QBI")  # index, kind, payload length
# A run of absent indexes hashes as one record (first, last): the digest's cost follows
# what is held, not how far `up_to` reaches.
_DIGEST_ABSENT = struct.Struct(">BQQ")  # 0, first, last


@dataclass(frozen=True, slots=True, order=True)
class SegmentKey:
    stream_id: int
    epoch: int


class StoreError(Exception):
    """A command the store refused; it changed nothing."""


class BelowFence(StoreError):
    """The writer's or sealer's epoch is below the segment's fence."""

    def __init__(self, fence: int, message: str = ""):
        self.fence = fence
        super().__init__(message or f"fenced: the segment's fence is {fence}")


class BadRequest(StoreError, ValueError):
    """Malformed input: bad crc, unknown kind, non-consecutive indexes, over a limit."""


class TooLarge(BadRequest):
    """An entry or a batch over a size bound (`bytes_max`, in bytes)."""

    def __init__(self, bytes_max: int, message: str):
        self.bytes_max = bytes_max
        super().__init__(message)


class StoreUnavailable(StoreError):
    """The store could not write (a full disk, a failing device); nothing was written."""


class StoredCopyCorrupt(StoreError):
    """A copy the store holds fails its checksum; the command touching it is refused."""


class SegmentNotFound(StoreError, LookupError):
    """The store holds nothing of the segment."""


class CopyRefused(StoreError):
    """A segment copy that cannot go on: its source is not sealed or not acked up to
    the final index, or the copy lost its fence or an index before it was confirmed."""


class CopyMismatch(StoreError):
    """A segment copy whose digest differs from its source's: it stays unconfirmed."""


class NotJoined(StoreError):
    """The store has not registered with its master yet (or joined another cluster):
    it takes no writes or seals, since it may be a wiped store whose lost replicas the
    master has not told it of."""


class ReplicaLost(StoreError):
    """The segment's replica here was lost with an earlier incarnation of the store."""


@dataclass(frozen=True, slots=True)
class WriteResult:
    matched_index: int
    acked_index: int
    fence: int
    # The epoch of the copy now held at each index of the batch, in order.
    held_epochs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SealResult:
    fence: int
    acked_index: int
    matched_index: int
    last_index: int


@dataclass(frozen=True, slots=True)
class DeleteResult:
    existed: bool


@dataclass(frozen=True, slots=True)
class AuthorityKept:
    """A `KeepAuthorityCommand` is in the plan."""


@dataclass(frozen=True, slots=True)
class SegmentStateInfo:
    fence: int
    acked_index: int
    matched_index: int
    last_index: int
    bytes: int
    bridge_index: int


@dataclass(frozen=True, slots=True)
class DigestInfo:
    digest: bytes
    up_to_index: int
    entries_held: int
    acked_index: int
    fence: int


@dataclass(frozen=True, slots=True)
class WriteCommand:
    segment: SegmentKey
    writer_epoch: int
    acked_index: int
    batch: PackedEntries
    # The stream's tenant, as the write's grant says ("": not known by this command).
    tenant: str = ""

    @classmethod
    def of(
        cls,
        segment: SegmentKey,
        writer_epoch: int,
        acked_index: int,
        entries: Sequence[StoredEntry],
        tenant: str = "",
    ) -> WriteCommand:
        """A write of entries of consecutive indexes, packed as a Write carries them."""
        return cls(segment, writer_epoch, acked_index, PackedEntries.of(entries), tenant)


@dataclass(frozen=True, slots=True)
class SealCommand:
    segment: SegmentKey
    new_epoch: int
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class KeepAuthorityCommand:
    """Keep what the store trusts of its master (`authority.AuthorityRecord`, encoded)."""

    record: bytes


@dataclass(frozen=True, slots=True)
class KeepRecordsCommand:
    """Keep the master's records of segments (serialized `v1.SegmentRecord`s), each
    beside its segment; a record of a segment the store does not hold is dropped."""

    records: tuple[tuple[SegmentKey, bytes], ...]


@dataclass(frozen=True, slots=True)
class RecordsKept:
    """The segments whose records a `KeepRecordsCommand` kept."""

    kept: tuple[SegmentKey, ...]


@dataclass(frozen=True, slots=True)
class JoinCommand:
    """Keep the cluster's id (at the first registration; the same id again is a no-op)
    and mark the segments of the earlier incarnation's copy sets as lost here (those
    the store holds are not: a copy brought them since)."""

    cluster_id: str
    lost: tuple[SegmentKey, ...] = ()


@dataclass(frozen=True, slots=True)
class Joined:
    lost: tuple[SegmentKey, ...]


@dataclass(frozen=True, slots=True)
class DeleteCommand:
    segment: SegmentKey


@dataclass(frozen=True, slots=True)
class ConfirmCopyCommand:
    """The last step of a segment copy, once its digest matched the source's: raise the
    acked index to the final index. Refused unless the copy is still fenced at least at
    the fence it was made under (a delete in between dropped it) and holds every index
    up to the final one."""

    segment: SegmentKey
    fence: int
    final_index: int


Command = (
    WriteCommand
    | SealCommand
    | DeleteCommand
    | ConfirmCopyCommand
    | KeepAuthorityCommand
    | KeepRecordsCommand
    | JoinCommand
)
Outcome = (
    WriteResult | SealResult | DeleteResult | AuthorityKept | RecordsKept | Joined | StoreError
)


@dataclass(frozen=True, slots=True)
class Plan:
    ops: tuple[KVOp, ...]
    # The metadata of every segment the plan touched; None when deleted.
    metas: Mapping[SegmentKey, SegmentMeta | None]
    outcomes: tuple[Outcome, ...]
    entries_written: int
    payload_bytes: int
    # Segments a verified copy confirmed or a delete removed: no longer damaged.
    mended: frozenset[SegmentKey] = frozenset()
    # Tenants of streams the plan makes known.
    tenants: Mapping[int, str] = dataclasses.field(default_factory=dict)
    # Versions of the segment records the plan keeps; 0 when it deletes one.
    records: Mapping[SegmentKey, int] = dataclasses.field(default_factory=dict)
    # Lost-replica marks the plan sets (True) or clears (False); the cluster id it keeps.
    lost: Mapping[SegmentKey, bool] = dataclasses.field(default_factory=dict)
    cluster_id: str = ""


# What a plan knows of a held copy: (epoch, kind, payload bytes). Plain tuples: the
# hot path builds one per entry written.
_Held = tuple[int, int, int]


@dataclass
class _Work:
    """A plan being built: the published state overlaid with the plan's own effects."""

    kv: KV
    published: Mapping[SegmentKey, SegmentMeta]
    metas: dict[SegmentKey, SegmentMeta | None] = field(default_factory=dict)
    # Copies written by the plan so far, per segment then index.
    pending: dict[SegmentKey, dict[int, _Held]] = field(default_factory=dict)
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
        return self.published.get(segment)

    def held(self, segment: SegmentKey, index: int, last_index: int) -> _Held | None:
        if index > last_index:
            return None
        found = self.pending.get(segment, {}).get(index)
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
        return (epoch, kind, len(value) - VALUE_HEADER_BYTES)


def check_segment(segment: SegmentKey) -> None:
    if segment.stream_id <= 0 or segment.epoch <= 0:
        raise BadRequest(f"missing segment id (stream {segment.stream_id}, epoch {segment.epoch})")
    if segment.epoch > EPOCH_MAX:
        raise BadRequest(f"segment epoch {segment.epoch} is over {EPOCH_MAX}")


def check_epoch(epoch: int, what: str) -> None:
    """Raise BadRequest unless `epoch` is one the master can grant."""
    if not 0 < epoch <= EPOCH_MAX:
        raise BadRequest(f"{what} {epoch} is not in 1..{EPOCH_MAX}")


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
    if min(kinds) != EntryKind.EVENT or max(kinds) != EntryKind.EVENT:
        for position, kind in enumerate(kinds):
            if kind != EntryKind.EVENT and len(values[position]) > VALUE_HEADER_BYTES:
                raise BadRequest(
                    f"entry {batch.first_index + position}: a {EntryKind(kind).name} "
                    "carries no payload"
                )
    return kinds, epochs


_KIND_NAMES = {int(kind): kind.name for kind in EntryKind}


class SegmentStoreCore:
    """Segments over a KV; see the module doc for the rules and the plan/publish split."""

    def __init__(self, kv: KV, entry_bytes_max: int = EVENT_BYTES_MAX, joins_cluster: bool = False):
        """`joins_cluster`: take no writes or seals before `JoinCommand` (a store with a
        master; the core alone, in tests and the simulator, takes them at once)."""
        assert 0 < entry_bytes_max <= EVENT_BYTES_MAX, "the writer's limit bounds the store's"
        self.kv = kv
        self.joins_cluster = joins_cluster
        self.entry_bytes_max = entry_bytes_max
        self._metas = self._load_metas()
        self._damaged: set[SegmentKey] = set()
        self._tenants = self._load_tenants()
        self._records = self._load_records()
        self._load_identity()

    def _load_identity(self) -> None:
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

    def recover(self) -> None:
        """After a refused write: have the KV take writes again and reload what it holds
        (a write reported as refused may have reached its log after all; whole, since
        entries and metadata share one batch). Raises while the KV cannot recover."""
        self.kv.recover()
        self._metas = self._load_metas()
        self._tenants = self._load_tenants()
        self._records = self._load_records()
        self._load_identity()

    def keep_incarnation(self, incarnation: int) -> int:
        """The store's incarnation: the one its database keeps, else `incarnation`,
        kept durably (called once, before the store serves)."""
        assert 0 < incarnation < 1 << 64
        if not self._incarnation:
            self.kv.write([Put(INCARNATION_KEY, encode_u64(incarnation))], sync=True)
            self._incarnation = incarnation
        return self._incarnation

    # ---- mutations ----

    def plan(self, commands: Iterable[Command]) -> Plan:
        work = _Work(self.kv, self._metas)
        outcomes: list[Outcome] = []
        entries_written = 0
        payload_bytes = 0
        mended: set[SegmentKey] = set()
        for command in commands:
            # Each command checks everything before it touches the overlay, so a refused
            # command leaves the plan as it was.
            try:
                if isinstance(command, WriteCommand):
                    outcome: Outcome = self._plan_write(command, work)
                    entries_written += len(command.batch)
                    payload_bytes += command.batch.payload_bytes()
                elif isinstance(command, SealCommand):
                    outcome = self._plan_seal(command, work)
                elif isinstance(command, ConfirmCopyCommand):
                    outcome = self._plan_confirm_copy(command, work)
                elif isinstance(command, KeepAuthorityCommand):
                    work.ops.append(Put(AUTHORITY_KEY, command.record))
                    outcome = AuthorityKept()
                elif isinstance(command, KeepRecordsCommand):
                    outcome = self._plan_keep_records(command, work)
                elif isinstance(command, JoinCommand):
                    outcome = self._plan_join(command, work)
                else:
                    outcome = self._plan_delete(command, work)
            except StoreError as error:
                outcome = error
            except CorruptEntry as error:
                outcome = StoredCopyCorrupt(str(error))
                assert not isinstance(
                    command, KeepAuthorityCommand | KeepRecordsCommand | JoinCommand
                ), "it reads no entry"
                self.mark_damaged(command.segment)
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

    def write_plan(self, plan: Plan, sync: bool) -> None:
        """The KV half of a plan; safe off the thread that publishes."""
        if plan.ops:
            self.kv.write(plan.ops, sync)

    def publish(self, plan: Plan) -> None:
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

    def apply(self, plan: Plan, sync: bool = True) -> None:
        self.write_plan(plan, sync)
        self.publish(plan)

    def execute(
        self, command: Command, sync: bool = True
    ) -> WriteResult | SealResult | DeleteResult | AuthorityKept | RecordsKept | Joined:
        plan = self.plan([command])
        self.apply(plan, sync)
        outcome = plan.outcomes[0]
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome

    def write(
        self,
        segment: SegmentKey,
        writer_epoch: int,
        acked_index: int,
        entries: Sequence[StoredEntry] | PackedEntries,
        tenant: str = "",
    ) -> WriteResult:
        command = (
            WriteCommand(segment, writer_epoch, acked_index, entries, tenant)
            if isinstance(entries, PackedEntries)
            else WriteCommand.of(segment, writer_epoch, acked_index, entries, tenant)
        )
        result = self.execute(command)
        assert isinstance(result, WriteResult)
        return result

    def seal(self, segment: SegmentKey, new_epoch: int, tenant: str = "") -> SealResult:
        result = self.execute(SealCommand(segment, new_epoch, tenant))
        assert isinstance(result, SealResult)
        return result

    def confirm_copy(self, segment: SegmentKey, fence: int, final_index: int) -> WriteResult:
        result = self.execute(ConfirmCopyCommand(segment, fence, final_index))
        assert isinstance(result, WriteResult)
        return result

    def delete(self, segment: SegmentKey) -> bool:
        result = self.execute(DeleteCommand(segment))
        assert isinstance(result, DeleteResult)
        return result.existed

    def _check_tenant(self, stream_id: int, tenant: str, work: _Work) -> bool:
        """Whether `tenant` is new for the stream (to be kept); raises BadRequest when
        the stream is known to be another tenant's."""
        if not tenant:
            return False
        known = work.tenants.get(stream_id) or self._tenants.get(stream_id)
        if known is not None and known != tenant:
            raise BadRequest(f"stream {stream_id} is of tenant {known!r}, not of {tenant!r}")
        return known is None

    def _keep_tenant(self, stream_id: int, tenant: str, work: _Work) -> None:
        work.tenants[stream_id] = tenant
        work.ops.append(Put(tenant_key(stream_id), tenant.encode()))

    def _plan_write(self, command: WriteCommand, work: _Work) -> WriteResult:
        segment = command.segment
        batch = command.batch
        check_segment(segment)
        kinds, epochs = check_batch(command.writer_epoch, batch, self.entry_bytes_max)
        new_tenant = self._check_tenant(segment.stream_id, command.tenant, work)
        old = work.meta(segment) or SegmentMeta()
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
        if max(kinds, default=EntryKind.EVENT) == EntryKind.BRIDGE:
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
        pending = work.pending.setdefault(segment, {})
        pending.update((first + n, (epochs[n], kinds[n], sizes[n])) for n in written)
        if fresh_from < len(values):
            pending.update(
                zip(
                    range(first + fresh_from, last + 1),
                    zip(epochs[fresh_from:], kinds[fresh_from:], sizes[fresh_from:], strict=True),
                    strict=True,
                )
            )
        if new_tenant:
            self._keep_tenant(segment.stream_id, command.tenant, work)
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
        new = self._drop_past_final_bridge(segment, new, work)
        work.metas[segment] = new
        return WriteResult(new.matched_index, new.acked_index, new.fence, tuple(held_epochs))

    def _drop_past_final_bridge(
        self, segment: SegmentKey, meta: SegmentMeta, work: _Work
    ) -> SegmentMeta:
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
        pending = work.pending.get(segment, {})
        for index in [i for i in pending if i > final]:
            sizes[index] = pending.pop(index)[2]
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

    def _plan_seal(self, command: SealCommand, work: _Work) -> SealResult:
        check_segment(command.segment)
        check_epoch(command.new_epoch, "seal epoch")
        new_tenant = self._check_tenant(command.segment.stream_id, command.tenant, work)
        old = work.meta(command.segment) or SegmentMeta()
        if command.new_epoch < old.fence:
            raise BelowFence(
                old.fence, f"fenced: seal epoch {command.new_epoch} < fence {old.fence}"
            )
        if new_tenant:
            self._keep_tenant(command.segment.stream_id, command.tenant, work)
        new = dataclasses.replace(old, fence=max(old.fence, command.new_epoch))
        work.metas[command.segment] = new
        return SealResult(new.fence, new.acked_index, new.matched_index, new.last_index)

    def _plan_confirm_copy(self, command: ConfirmCopyCommand, work: _Work) -> WriteResult:
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
        new = self._drop_past_final_bridge(segment, new, work)
        work.metas[segment] = new
        return WriteResult(new.matched_index, new.acked_index, new.fence, ())

    def _plan_delete(self, command: DeleteCommand, work: _Work) -> DeleteResult:
        segment = command.segment
        check_segment(segment)
        existed = work.meta(segment) is not None
        work.ops.append(DeleteRange(*segment_entries_range(segment.stream_id, segment.epoch)))
        work.deleted.add(segment)
        work.pending.pop(segment, None)
        work.metas[segment] = None
        if segment in self._records or work.records.get(segment):
            work.ops.append(Delete(record_key(segment.stream_id, segment.epoch)))
            work.records[segment] = 0
        if segment in self._lost or work.lost.get(segment):
            work.ops.append(Delete(lost_key(segment.stream_id, segment.epoch)))
            work.lost[segment] = False
        return DeleteResult(existed)

    def _plan_join(self, command: JoinCommand, work: _Work) -> Joined:
        if not command.cluster_id or len(command.cluster_id) > CLUSTER_ID_CHARS_MAX:
            raise BadRequest(f"cluster id {command.cluster_id!r}")
        kept = work.cluster_id or self._cluster_id
        if kept and kept != command.cluster_id:
            raise NotJoined(f"this store belongs to cluster {kept}, not {command.cluster_id}")
        for segment in command.lost:
            check_segment(segment)
        if not kept:
            work.ops.append(Put(CLUSTER_ID_KEY, command.cluster_id.encode()))
            work.cluster_id = command.cluster_id
        marked = []
        for segment in command.lost:
            if work.meta(segment) is not None or segment in self._lost or work.lost.get(segment):
                continue
            work.ops.append(Put(lost_key(segment.stream_id, segment.epoch), b""))
            work.lost[segment] = True
            marked.append(segment)
        return Joined(tuple(marked))

    def _plan_keep_records(self, command: KeepRecordsCommand, work: _Work) -> RecordsKept:
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

    # ---- queries (published state only) ----

    def incarnation(self) -> int:
        return self._incarnation

    def cluster_id(self) -> str:
        return self._cluster_id

    def check_takes_part(self, segment: SegmentKey) -> None:
        """Refuse (NotJoined, ReplicaLost) a writer's write or seal of `segment` that
        this store must not take part in."""
        if self.joins_cluster and not self._cluster_id:
            raise NotJoined("this store has not registered with its master yet")
        if segment in self._lost and segment not in self._metas:
            raise ReplicaLost(
                f"the replica of {segment.stream_id}/{segment.epoch} here was lost with an "
                "earlier incarnation of this store"
            )

    def meta(self, segment: SegmentKey) -> SegmentMeta | None:
        return self._metas.get(segment)

    def tenant_of(self, stream_id: int) -> str:
        """The stream's tenant as a grant or copy told this store; "" if never told."""
        return self._tenants.get(stream_id, "")

    def record_version(self, segment: SegmentKey) -> int:
        """The version of the master's record of `segment` kept here (0: none)."""
        return self._records.get(segment, 0)

    def segment_record(self, segment: SegmentKey) -> bytes:
        """The master's record of `segment` as kept (b"": none)."""
        return self.kv.get(record_key(segment.stream_id, segment.epoch)) or b""

    def authority_record(self) -> bytes | None:
        """What `KeepAuthorityCommand` last kept."""
        return self.kv.get(AUTHORITY_KEY)

    def refused_busy(self, command: WriteCommand) -> WriteResult | BelowFence:
        """The answer to a write refused because the store is busy (nothing written):
        what the segment holds, so the leader resends from its matched index. Below the
        fence it is the fence instead, as for any write: the matched index of a segment
        fenced above the writer counts a later leader's recovery copies, and a writer
        taking it for its own entries would ack what a recovery replaced (a paused
        leader waking up did, simulator seed 10179)."""
        meta = self._metas.get(command.segment) or SegmentMeta()
        if command.writer_epoch < meta.fence:
            return BelowFence(meta.fence)
        return WriteResult(meta.matched_index, meta.acked_index, meta.fence, ())

    def state(self, segment: SegmentKey) -> SegmentStateInfo:
        meta = self._require(segment)
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

    @contextmanager
    def reading(self, segment: SegmentKey) -> Iterator[None]:
        """Around a read of `segment`: a damaged copy found marks it damaged."""
        try:
            yield
        except CorruptEntry:
            self.mark_damaged(segment)
            raise

    def read(
        self,
        segment: SegmentKey,
        from_index: int,
        to_index: int = 0,
        acked_only: bool = False,
        limit: int = 0,
        max_bytes: int = 0,
    ) -> list[StoredEntry]:
        """Held entries in from_index..to_index (0: up to the last held), in order,
        at most `limit` (0: all) and, past the first, at most `max_bytes` of values
        (0: no bound); with `acked_only`, none above the acked index.
        Raises SegmentNotFound, and CorruptEntry if a stored copy fails its crc."""
        rows = self.read_rows(segment, from_index, to_index, acked_only, limit, max_bytes)
        with self.reading(segment):
            return [decode_value(entry_index(key), value) for key, value in rows]

    def read_rows(
        self,
        segment: SegmentKey,
        from_index: int,
        to_index: int = 0,
        acked_only: bool = False,
        limit: int = 0,
        max_bytes: int = 0,
    ) -> list[tuple[bytes, bytes]]:
        """What `read` reads, as stored (key, value) rows, not yet decoded or verified:
        the serving path decodes whole batches at once (`streamengine.protocol.entry`)."""
        meta = self._require(segment)
        upper = meta.last_index if to_index == 0 else min(to_index, meta.last_index)
        if acked_only:
            upper = min(upper, meta.acked_index)
        first = max(from_index, 1)
        if upper < first:
            return []
        with self.reading(segment):
            return self.kv.scan(
                entry_key(segment.stream_id, segment.epoch, first),
                entry_key(segment.stream_id, segment.epoch, upper + 1),
                limit,
                max_bytes,
            )

    def read_run(
        self, segment: SegmentKey, first: int, upper: int, limit: int, max_bytes: int
    ) -> list[bytes]:
        """Stored values (not verified) of consecutive indexes from `first` up to
        `upper`: at most `limit`, cut once they reach `max_bytes`, and cut before the
        first index not held. Raises SegmentNotFound."""
        meta = self._require(segment)
        last = min(upper, meta.last_index, first + limit - 1)
        if last < first:
            return []
        start = entry_key(segment.stream_id, segment.epoch, first)
        end = entry_key(segment.stream_id, segment.epoch, last + 1)
        with self.reading(segment):
            if last <= meta.matched_index:
                # Every index up to the matched one is held, so the values alone say
                # which index each is. A run shorter than asked without reaching the
                # byte cap means the segment changed under the scan: then read it with
                # keys. The limit is what the range holds, as `scan_values` wants it.
                values = self.kv.scan_values(start, end, last - first + 1, max_bytes)
                if len(values) == last - first + 1 or sum(map(len, values)) >= max_bytes > 0:
                    return values
            values = []
            for key, value in self.kv.scan(start, end, limit, max_bytes):
                if entry_index(key) != first + len(values):
                    break
                values.append(value)
            return values

    def digest(self, segment: SegmentKey, up_to: int = 0) -> DigestInfo:
        """SHA-256 over (index, kind, payload) of indexes 1..up_to (0: the acked index);
        an index not held hashes as absent, so replicas differing anywhere differ."""
        meta = self._require(segment)
        up_to_index = meta.acked_index if up_to == 0 else up_to
        sha = hashlib.sha256()
        held = 0
        next_index = 1
        while next_index <= up_to_index:
            chunk = self.read(segment, next_index, up_to_index, limit=SCAN_ENTRIES_MAX)
            for entry in chunk:
                if entry.index > next_index:
                    sha.update(_DIGEST_ABSENT.pack(0, next_index, entry.index - 1))
                sha.update(_DIGEST_HELD.pack(entry.index, entry.kind, len(entry.payload)))
                sha.update(entry.payload)
                held += 1
                next_index = entry.index + 1
            if len(chunk) < SCAN_ENTRIES_MAX:
                if next_index <= up_to_index:
                    sha.update(_DIGEST_ABSENT.pack(0, next_index, up_to_index))
                break
        return DigestInfo(sha.digest(), up_to_index, held, meta.acked_index, meta.fence)

    def certify(self, segment: SegmentKey, final_index: int) -> ScanResult:
        """Read the replica from index 1 to `final_index` at once (no rate), checking
        every copy: the certificate of what it holds, or where it is damaged. Raises
        SegmentNotFound."""
        scan = ReplicaScan(final_index, SCAN_ENTRIES_MAX, 0)
        while (step := scan.next_read()) is not None:
            first, upper, limit, _ = step
            try:
                values = self.read_run(segment, first, upper, limit, 0)
            except CorruptEntry as error:
                scan.damaged(first, str(error))
                break
            scan.feed(values)
        assert scan.result is not None
        return scan.result

    def scrub_targets(self) -> dict[SegmentKey, int]:
        """Sealed replicas to keep checked, each with its final index: sealed here
        (fenced above their epoch), acked up to their bridge, not known damaged."""
        return {
            segment: meta.bridge_index
            for segment, meta in self._metas.items()
            if meta.fence > segment.epoch and meta.bridge_index > 0 and segment not in self._damaged
        }

    def _require(self, segment: SegmentKey) -> SegmentMeta:
        check_segment(segment)
        meta = self._metas.get(segment)
        if meta is None:
            raise SegmentNotFound(f"segment {segment.stream_id}/{segment.epoch} is not held here")
        return meta
