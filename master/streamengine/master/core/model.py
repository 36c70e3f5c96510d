"""Types of the records (stream, segment, store, token) and store views the cores read.

What the catalog persists and the pure cores decide over: plain frozen dataclasses, no
I/O. Stores are named by their stable id everywhere; an address is looked up from the
store's latest registration when a reply is built, so a store that moves to another
port keeps its replicas.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace

from streamengine.master.core.errors import InvalidArgument
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.limits import NAME_PART_CHARS_MAX
from streamengine.protocol.producers import ProducerPosition

# A segment is named by (stream id, epoch) everywhere inside the master.
SegmentKey = tuple[int, int]

_NAME_PART = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{NAME_PART_CHARS_MAX - 1}}}")


class SegmentState(enum.IntEnum):
    """Numbers match `streamengine.v1.SegmentState`."""

    OPEN = 1
    SEALING = 2
    SEALED = 3


@dataclass(frozen=True, slots=True)
class StreamRecord:
    name: str
    stream_id: int
    replicas: int
    write_quorum: int
    segment_bytes: int
    segment_age_ms: int
    # The latest epoch granted, and to whom: persisted together before either is
    # returned, so epochs never repeat and the last holder can keep its lease across a
    # master restart.
    epoch: int
    leader_id: str
    created_at_ms: int
    # Retention limits (0: none): the master trims whole sealed segments from the head.
    retention_age_ms: int = 0
    retention_bytes: int = 0
    # Segments of this epoch and earlier are trimmed (0: none ever was); their records
    # stay until their `removal_at_ms`.
    trimmed_through_epoch: int = 0
    # Deleted, pending removal: refused until undeleted; its data goes at this time
    # (wall-clock ms; 0: not deleted).
    deleted_until_ms: int = 0
    # What proves the holder of `epoch` (`core.leadership.Lease`), persisted with it so
    # that it keeps its lease across a master restart: the hex SHA-256 of the lease
    # secret it was handed, never the secret, and the principal it acquired as.
    leader_secret_sha256: str = ""
    leader_principal: str = ""
    # Some lease was granted to a writer with a producer id: segments from then on may
    # hold PRODUCER marks (`core.leadership.has_producers`). Never cleared.
    has_producers: bool = False
    # Each producer's last event through the segment of `producers_epoch`, the newest
    # sealed one whose seal recorded them (0: none did). Kept here, not only on that
    # segment's record, because retention and trims take segment records: a producer
    # whose events were all trimmed still resends into a table that knows it. Kept for
    # the stream's life, bounded by `protocol.producers.PRODUCERS_MAX` producers.
    producers: tuple[ProducerPosition, ...] = ()
    producers_epoch: int = 0

    @property
    def tenant(self) -> str:
        return self.name.split("/", 1)[0]


def carry_producers(
    record: StreamRecord, epoch: int, producers: tuple[ProducerPosition, ...] | None
) -> StreamRecord:
    """The stream record once the segment of `epoch` is sealed with `producers` (None:
    its sealing leader kept none): they replace the stream's own only when newer."""
    if producers is None or epoch <= record.producers_epoch:
        return record
    return replace(record, producers=producers, producers_epoch=epoch)


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    stream_id: int
    stream: str
    epoch: int
    # Store ids; an open segment's copy set never changes, a sealed one's is swapped by
    # repair one member at a time.
    copy_set: tuple[str, ...]
    state: SegmentState
    final_index: int
    created_at_ms: int
    sealed_at_ms: int
    # When the copy set or the seal last changed: reports older than this say nothing
    # about whether a replica reached the bridge.
    settled_at_ms: int
    # SEALED: what the segment must contain, None while nobody knows (`integrity.py`),
    # and who made it (`integrity.WRITER` or `integrity.REPLICAS`).
    certificate: Certificate | None = None
    certified_by: str = ""
    # Members whose replica differs from the certificate: never a copy source, replaced.
    bad: tuple[str, ...] = ()
    # Members whose replica matched the certificate (`integrity.py`), sorted.
    verified: tuple[str, ...] = ()
    # Trimmed: when its record is dropped and its replicas become garbage (0: kept).
    removal_at_ms: int = 0
    # Sealed accepting loss: indexes from this one through the bridge may have held
    # acked events that are lost (0: none).
    lost_from_index: int = 0
    # SEALED: each producer's last event in the stream through this segment, as its
    # sealing leader sent them (None: it sent none); the next leader starts from them.
    producers: tuple[ProducerPosition, ...] | None = None
    # OPEN: the acked index its leader gave back with its lease while some store of the
    # copy set did not know it (0: none), owed to those stores (`core.leader_acked`).
    released_acked_index: int = 0

    @property
    def key(self) -> SegmentKey:
        return (self.stream_id, self.epoch)


@dataclass(frozen=True, slots=True)
class StoreRecord:
    store_id: str
    address: str
    zone: str
    draining: bool
    # Of the store's database, as it last registered (0: not known); a new one holds
    # none of the replicas of the one before.
    incarnation: int = 0
    # The replicas this incarnation lost with the one before: every registration of it
    # answers them, since the store may never have joined with an earlier answer.
    lost: tuple[SegmentKey, ...] = ()
    # Where it serves the data plane (Write), as it last registered ("": not told).
    data_address: str = ""

    def __post_init__(self) -> None:
        # Loaded from JSON, the keys come back as lists.
        object.__setattr__(self, "lost", tuple((int(s), int(e)) for s, e in self.lost))


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A tenant token the master issued: what it allows and until when. The token
    itself (its signature) is not kept: only its bearer has it."""

    token_id: str
    tenant: str
    role: int  # `protocol.auth.Role`
    issued_at_ms: int
    expires_at_ms: int
    revoked_at_ms: int = 0  # 0: not revoked
    # The streams it is limited to (empty: every stream of the tenant).
    stream_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Read back from JSON as a list.
        object.__setattr__(self, "stream_ids", tuple(self.stream_ids))


@dataclass(frozen=True, slots=True)
class Held:
    """One segment as a store last reported it (`record_version`: of the segment's
    record the store keeps, `master.records`)."""

    fence: int
    acked_index: int
    last_index: int
    bytes: int
    record_version: int = 0


@dataclass(frozen=True, slots=True)
class StoreView:
    """What placement and repair need to know about one store, now."""

    store_id: str
    zone: str
    used_bytes: int
    alive: bool
    draining: bool
    # Replicas assigned to the store: a tie-breaker, so copy sets handed out between two
    # heartbeats (before bytes move) still spread.
    segments: int = 0
    # When its latest heartbeat arrived (0: none since the master started).
    reported_at_ms: int = 0

    @property
    def usable(self) -> bool:
        return self.alive and not self.draining


def validate_name_part(what: str, part: str) -> str:
    if not _NAME_PART.fullmatch(part) or part.startswith("."):
        raise InvalidArgument(
            f"{what} {part!r}: 1 to {NAME_PART_CHARS_MAX} of [A-Za-z0-9._-], not starting with '.'"
        )
    return part


def validate_stream_name(name: str) -> tuple[str, str]:
    """`tenant/stream` → (tenant, stream); raises InvalidArgument."""
    parts = name.split("/")
    if len(parts) != 2:
        raise InvalidArgument(f"stream name {name!r} must be `tenant/stream`")
    return validate_name_part("tenant", parts[0]), validate_name_part("stream", parts[1])


def producers_before(
    segments: list[SegmentRecord], stream: StreamRecord, epoch: int
) -> tuple[ProducerPosition, ...]:
    """The producer positions the latest of `segments` (one stream's) sealed before
    `epoch` recorded (none: it recorded none); once retention took every such segment,
    those the stream kept from its newest seal (`carry_producers`)."""
    sealed = [s for s in segments if s.epoch < epoch and s.state == SegmentState.SEALED]
    if sealed:
        return max(sealed, key=lambda s: s.epoch).producers or ()
    return stream.producers if stream.producers_epoch < epoch else ()
