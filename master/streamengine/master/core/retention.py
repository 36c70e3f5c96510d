"""Retention, trims and deletes in two phases: what to trim, and when data may go.

Pure functions of a stream's segments, its limits and `now_ms`; `MasterState` persists
what they decide.

- **Only whole sealed segments, only from the head.** A trim takes the oldest segments
  of a stream, oldest first, and stops at the first one not sealed (open or sealing:
  its content is not final) or not due. So what is trimmed is always every epoch up to
  one (`trimmed_through_epoch`), which is what readers compare their position with
  (`protocol.retention`).
- **By age**: a sealed segment is due once its seal is older than the limit (its
  events are all older than that).
- **By bytes**: the head segment is due while the bytes retained without it still
  exceed the limit, so a trim never leaves less than the limit behind.
- **By hand** (`trims_before`): every segment whose events all sort before a
  sequence; one of them not sealed refuses the whole trim (`NotTrimmable`).
- **Two phases.** A trim or a stream deletion records an intent with the time its data
  goes (`removal_at_ms`: now + the grace). Readers and writers are refused at once;
  the segment records stay (and are repaired) until then, so an undeleted stream comes
  back whole. Only past that time does the master drop the records, and stores learn
  from their heartbeat replies that the replicas are garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamengine.master.core.errors import InvalidArgument, NotTrimmable
from streamengine.protocol.limits import EPOCH_MAX, INDEX_MAX
from streamengine.protocol.sequence import SEQUENCE_MAX, unpack_sequence

# Deleted streams and trimmed segments stay on the stores this long by default: time
# to notice a mistake and undelete.
DELETE_GRACE_MS_DEFAULT = 60 * 60 * 1000
# Limits a stream may be given: a century, an exabyte. Larger values are typos.
RETENTION_AGE_MS_MAX = 100 * 366 * 24 * 3600 * 1000
RETENTION_BYTES_MAX = 1 << 60
# Segments trimmed (or dropped after their grace) in one catalog transaction: one put
# each plus the stream record, within `metadata.OPS_PER_TRANSACTION_MAX` (etcd's limit;
# asserted where both are known, `streamengine.master.retention`). Longer trims take several
# transactions, each leaving a trimmed prefix behind.
TRIMS_PER_COMMIT_MAX = 100
# `next_look_ms` for a stream nothing but a change of its records can make due.
LOOK_NEVER_MS = 1 << 62


@dataclass(frozen=True, slots=True)
class SegmentFacts:
    """What a trim decision needs of one retained (not yet trimmed) segment."""

    epoch: int
    sealed: bool
    sealed_at_ms: int
    final_index: int  # the bridge's index when sealed, else 0
    bytes: int  # as its stores last reported (0: not known yet)


def validate_retention(age_ms: int, bytes_max: int) -> None:
    """Limits as given by an operator; 0 means no limit."""
    if not 0 <= age_ms <= RETENTION_AGE_MS_MAX:
        raise InvalidArgument(f"retention age {age_ms} ms outside 0..{RETENTION_AGE_MS_MAX}")
    if not 0 <= bytes_max <= RETENTION_BYTES_MAX:
        raise InvalidArgument(f"retention bytes {bytes_max} outside 0..{RETENTION_BYTES_MAX}")


def _check_order(segments: Sequence[SegmentFacts]) -> None:
    epochs = [s.epoch for s in segments]
    assert epochs == sorted(set(epochs)), f"segments not oldest first: {epochs}"


def retention_trims(
    segments: Sequence[SegmentFacts], age_ms: int, bytes_max: int, now_ms: int
) -> list[int]:
    """Epochs to trim now for a stream's limits (0: none), oldest first: a prefix of
    `segments` (the retained ones, oldest first), sealed, each due by age or bytes."""
    _check_order(segments)
    assert age_ms >= 0 and bytes_max >= 0
    retained = sum(s.bytes for s in segments)
    trims: list[int] = []
    for segment in segments:
        if not segment.sealed or len(trims) == TRIMS_PER_COMMIT_MAX:
            break
        old = age_ms > 0 and now_ms - segment.sealed_at_ms > age_ms
        over = bytes_max > 0 and retained - segment.bytes > bytes_max
        if not (old or over):
            break
        trims.append(segment.epoch)
        retained -= segment.bytes
    assert retained >= 0
    return trims


def next_look_ms(
    segments: Sequence[SegmentFacts], age_ms: int, bytes_max: int, now_ms: int
) -> int:
    """When a stream that `retention_trims` left alone now may have something due,
    unless a segment or the limits change before (the shell forgets the answer then,
    and looks at the next pass). So an idle stream costs a pass nothing until its
    head segment comes of age.

    - A byte limit: the next pass, as the bytes its stores report change without any
      record changing (an open segment grows).
    - An age limit alone: when the head segment's seal is older than the limit; never
      while the head is not sealed or there is none (its seal is a change).
    """
    _check_order(segments)
    assert age_ms > 0 or bytes_max > 0, "only a stream with a limit is looked at"
    if bytes_max:
        return now_ms
    if not segments or not segments[0].sealed:
        return LOOK_NEVER_MS
    looks = segments[0].sealed_at_ms + age_ms + 1
    assert looks > now_ms, "the head was due: retention_trims would have trimmed it"
    return looks


def entirely_before(segment: SegmentFacts, before_sequence: int) -> bool:
    """Whether every event of `segment` sorts before `before_sequence`. An unsealed
    segment may still grow: only one of an earlier epoch is."""
    epoch, index = unpack_sequence(before_sequence)
    if segment.epoch < epoch:
        return True
    return segment.epoch == epoch and segment.sealed and segment.final_index < index


def trims_before(segments: Sequence[SegmentFacts], before_sequence: int) -> list[int]:
    """Epochs of the retained segments entirely before `before_sequence`, oldest first.
    Raises NotTrimmable (nothing trimmed) when one of them is not sealed, and
    InvalidArgument for a sequence no stream can reach."""
    if not 0 <= before_sequence <= SEQUENCE_MAX:
        raise InvalidArgument(
            f"before_sequence {before_sequence} is outside 0..{SEQUENCE_MAX}, the "
            f"sequences there can be (epoch at most {EPOCH_MAX}, index at most {INDEX_MAX})"
        )
    _check_order(segments)
    trims: list[int] = []
    for segment in segments:
        if not entirely_before(segment, before_sequence):
            break
        if not segment.sealed:
            raise NotTrimmable(
                f"segment {segment.epoch} lies before sequence {before_sequence} but is not "
                "sealed: only sealed segments are trimmed (seal it first: `streamengine seal`)"
            )
        trims.append(segment.epoch)
    assert all(s.sealed for s in segments[: len(trims)])
    return trims


def removal_at_ms(now_ms: int, grace_ms: int) -> int:
    """When data deleted or trimmed now leaves the stores."""
    assert grace_ms >= 0
    return now_ms + grace_ms


def due(removal_ms: int, now_ms: int) -> bool:
    assert removal_ms > 0, "only a recorded intent is ever due"
    return now_ms >= removal_ms
