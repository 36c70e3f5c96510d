"""What the SDK answers with: small frozen structs of its own, never wire messages.

`StreamClient.create_stream` and `describe_stream` return a `StreamInfo`,
`list_segments` a list of `SegmentInfo`. Sequences, indexes, epochs, sizes and times are
ints (times in milliseconds, wall clock), a segment's state a `SegmentState`. The
protobuf messages they come from stay behind the SDK (`client.wire` converts them), so a
field added to the wire changes nothing here until it is given a name for users.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# One type for a store of a copy set, the writer's core and users alike.
from streamengine.client.core.writer import Replica

__all__ = ["Replica", "SegmentInfo", "SegmentState", "StreamInfo"]


class SegmentState(enum.StrEnum):
    """A segment's lifecycle; the value is the name the CLI prints."""

    # Taking appends from the leader of its epoch.
    OPEN = "open"
    # A later epoch exists; the segment waits for a leader to seal and recover it.
    SEALING = "sealing"
    # Recovered and bridged: immutable, `final_index` is its bridge.
    SEALED = "sealed"


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """A stream as the master records it."""

    name: str
    stream_id: int
    # N: stores in each segment's copy set; W: stores that hold an event before it is
    # acknowledged.
    replicas: int
    write_quorum: int
    # Roll thresholds: a writer opens a new segment past either.
    segment_bytes: int
    segment_age_ms: int
    # The latest epoch granted (0 before the first leader).
    epoch: int
    # The client id of the writer leading the stream, "" when none.
    leader_id: str
    # The acked index of the latest segment (the open one while there is one).
    acked_index: int
    # Epoch of the open segment, 0 when none.
    open_segment_epoch: int
    unsealed_segments: int
    created_at_ms: int
    # Retention limits, 0 for none.
    retention_age_ms: int
    retention_bytes: int
    # Segments of this epoch and earlier are trimmed (0: none ever was).
    trimmed_through_epoch: int
    # Where `start="earliest"` begins (0 while nothing is trimmed).
    first_retained_sequence: int
    # When a deleted stream's data goes (0: not deleted).
    deleted_until_ms: int

    @property
    def deleted(self) -> bool:
        return self.deleted_until_ms != 0


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment of a stream: the events one leader's epoch appended."""

    stream: str
    stream_id: int
    epoch: int
    state: SegmentState
    # The stores holding the segment; repair may swap those of a sealed segment.
    copy_set: tuple[Replica, ...]
    # The index of the bridge once sealed, else 0.
    final_index: int
    # The largest acked index the master knows of (status only while open).
    acked_index: int
    created_at_ms: int
    # 0 while not sealed.
    sealed_at_ms: int
    # Bytes of one replica, as its stores last reported (0 while unknown).
    bytes: int
    # Store ids of copy-set members whose replica differs from the certificate: never
    # read, and replaced by repair.
    bad_stores: tuple[str, ...]
    # Sealed accepting loss: indexes `lost_from_index`..`final_index` may have held
    # acknowledged events that are gone, and reading them raises `DataLossError`
    # (0: nothing lost).
    lost_from_index: int
    # Who certified the sealed content: "writer" (the sealing leader) or "replicas"
    # (W replicas agreeing); "" while it has no certificate.
    certified_by: str

    @property
    def sealed(self) -> bool:
        return self.state is SegmentState.SEALED
