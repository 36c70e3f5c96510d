"""The store's commands, their outcomes and the plan that carries them out.

Every mutation of a segment store is a command (`WriteCommand`, `SealCommand`,
`DeleteCommand`, `DropCopiesCommand`, `ConfirmCopyCommand`, `KeepAuthorityCommand`,
`KeepRecordsCommand`, `KeepClusterViewCommand`, `JoinCommand`, `RaiseAckedCommand`);
`writes.plan` turns commands into one `Plan`: the KV ops of every command that
succeeded, the metadata they leave, and one outcome per command (its result, or the
`StoreError` that refused it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from streamengine.protocol.entry import PackedEntries, StoredEntry
from streamengine.protocol.limits import EPOCH_MAX
from streamengine.segment_store.core.errors import BadRequest, StoreError
from streamengine.segment_store.core.keys import SegmentMeta
from streamengine.segment_store.core.kv import KVOp


@dataclass(frozen=True, slots=True, order=True)
class SegmentKey:
    stream_id: int
    epoch: int


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
class WriteCommand:
    segment: SegmentKey
    writer_epoch: int
    acked_index: int
    batch: PackedEntries
    # The stream's tenant, as the write's grant says ("": not known by this command).
    tenant: str = ""
    # The segment's copy set, as the write's grant lists it, kept if the write is the
    # first to bring the segment here (empty: not known by this command, or the store
    # held the segment when it was admitted).
    copy_set: tuple[str, ...] = ()
    # The stream's name and write quorum, as the write's grant says, kept with the copy
    # set ("" and 0: not known by this command).
    stream_name: str = ""
    write_quorum: int = 0

    @classmethod
    def of(
        cls,
        segment: SegmentKey,
        writer_epoch: int,
        acked_index: int,
        entries: Sequence[StoredEntry],
        tenant: str = "",
        copy_set: tuple[str, ...] = (),
    ) -> WriteCommand:
        """A write of entries of consecutive indexes, packed as a Write carries them."""
        return cls(segment, writer_epoch, acked_index, PackedEntries.of(entries), tenant, copy_set)


@dataclass(frozen=True, slots=True)
class SealCommand:
    segment: SegmentKey
    new_epoch: int
    tenant: str = ""
    # As a `WriteCommand`'s: the copy set the seal's grant lists for the segment, and
    # the stream's name and write quorum it says.
    copy_set: tuple[str, ...] = ()
    stream_name: str = ""
    write_quorum: int = 0


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
class KeepClusterViewCommand:
    """Keep the master's cluster view (a serialized `v1.ClusterView`)."""

    view: bytes


@dataclass(frozen=True, slots=True)
class ClusterViewKept:
    """A `KeepClusterViewCommand` is in the plan."""


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
class DropCopiesCommand:
    """The first step of a refill in place (a copy asked to replace what its target
    holds): drop every copy of the segment, keeping its fence, tenant and record, so
    none of the old copies (a damaged block, content that differs from the certificate,
    a copy of a higher epoch the overwrite rule would keep) outlives the copy."""

    segment: SegmentKey
    # The fence the copy is made under: the drop is refused if the segment lost it.
    fence: int


@dataclass(frozen=True, slots=True)
class ConfirmCopyCommand:
    """The last step of a segment copy, once its digest matched the source's: raise the
    acked index to the final index. Refused unless the copy is still fenced at least at
    the fence it was made under (a delete in between dropped it) and holds every index
    up to the final one."""

    segment: SegmentKey
    fence: int
    final_index: int


@dataclass(frozen=True, slots=True)
class RaiseAckedCommand:
    """Acked indexes the master passes on from leaders that let go of their segments
    (`StoreHeartbeatReply.leader_acked`): each segment held and not fenced past its
    epoch keeps max(kept, min(acked index, matched index)), as the leader's Write
    would have; the others are left as they are."""

    raised: tuple[tuple[SegmentKey, int], ...]


@dataclass(frozen=True, slots=True)
class AckedRaised:
    """The segments whose acked index a `RaiseAckedCommand` raised."""

    raised: tuple[SegmentKey, ...]


Command = (
    WriteCommand
    | SealCommand
    | DeleteCommand
    | DropCopiesCommand
    | ConfirmCopyCommand
    | KeepAuthorityCommand
    | KeepRecordsCommand
    | KeepClusterViewCommand
    | JoinCommand
    | RaiseAckedCommand
)
# What a command that succeeded answers.
Result = (
    WriteResult
    | SealResult
    | DeleteResult
    | AuthorityKept
    | RecordsKept
    | ClusterViewKept
    | Joined
    | AckedRaised
)
Outcome = Result | StoreError


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


def check_segment(segment: SegmentKey) -> None:
    if segment.stream_id <= 0 or segment.epoch <= 0:
        raise BadRequest(f"missing segment id (stream {segment.stream_id}, epoch {segment.epoch})")
    if segment.epoch > EPOCH_MAX:
        raise BadRequest(f"segment epoch {segment.epoch} is over {EPOCH_MAX}")


def check_epoch(epoch: int, what: str) -> None:
    """Raise BadRequest unless `epoch` is one the master can grant."""
    if not 0 < epoch <= EPOCH_MAX:
        raise BadRequest(f"{what} {epoch} is not in 1..{EPOCH_MAX}")
