"""The rules of one segment copy (CopySegment) on its target store, with no I/O: the
store's copy client and the simulator take the same steps through the same functions.

Theory of operation. A copy creates, or refills in place, a replica of a sealed segment
from a healthy one. No reader of the target may ever see an entry that later changes,
so nothing the copy writes is served before the whole copy is verified:
1. `copy_fence`: the source must hold the segment sealed (fence above the segment's
   epoch) and acked up to the final index. The copy is made under the highest of the
   source's fence, the fence the master asked for and the target's own: never lower.
2. `fence_command`: a seal at that fence, before the first copied batch. From then on
   a delayed write of an old leader is refused. The target's copy and its fence are
   never deleted: an in-place refill overwrites stale copies by the overwrite rule.
3. `write_command`, per batch read from the source: written at the copy fence with
   acked index 0, which raises nothing (the target keeps the acked index it had: below
   it its copies were final already).
4. `verify`: the target's digest up to the final index must equal the source's, else
   `CopyMismatch`, and the copy stays unconfirmed (a copy of a higher epoch the
   overwrite rule kept, or a store gone wrong): nothing new is served from it.
5. `confirm_command`: one last write raising the acked index to the final index,
   refused if the copy lost its fence or an index meanwhile (a delete in between).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamengine.protocol.entry import StoredEntry
from streamengine.protocol.limits import INDEX_MAX
from streamengine.segment_store.store import (
    BadRequest,
    ConfirmCopyCommand,
    CopyMismatch,
    CopyRefused,
    DigestInfo,
    SealCommand,
    SegmentKey,
    WriteCommand,
)


@dataclass(frozen=True, slots=True)
class CopyTimeouts:
    """How long the target waits on the source before the copy fails (the master's
    repair retries it later, maybe from another replica)."""

    # Each unary call to the source (state, digest).
    call_ms: int = 30_000
    # The whole read of the segment: up to gigabytes over a busy network.
    read_ms: int = 600_000

    def __post_init__(self) -> None:
        assert 0 < self.call_ms <= self.read_ms, "reading a segment is the longest call"


TIMEOUTS = CopyTimeouts()
# The simulator's virtual-time runs last seconds: the same calls, scaled to them.
SIMULATED_TIMEOUTS = CopyTimeouts(call_ms=500, read_ms=2000)


def check_request(final_index: int, source_address: str) -> None:
    if not source_address:
        raise BadRequest("missing source_address")
    if not 0 < final_index <= INDEX_MAX:
        raise BadRequest(f"final_index {final_index} is not in 1..{INDEX_MAX}")


def copy_fence(
    segment: SegmentKey,
    final_index: int,
    source_fence: int,
    source_acked_index: int,
    requested_fence: int,
    local_fence: int,
) -> int:
    """The fence the copy is made under, once the source can serve it."""
    if source_fence <= segment.epoch:
        raise CopyRefused(f"segment is not sealed on the source (fence {source_fence})")
    if source_acked_index < final_index:
        raise CopyRefused(
            f"source acked index {source_acked_index} is below final index {final_index}"
        )
    fence = max(source_fence, requested_fence, local_fence)
    assert fence > segment.epoch and fence >= local_fence
    return fence


def fence_command(segment: SegmentKey, fence: int) -> SealCommand:
    return SealCommand(segment, fence)


def write_command(segment: SegmentKey, fence: int, entries: Sequence[StoredEntry]) -> WriteCommand:
    """A batch copied from the source: at the copy fence, raising no acked index."""
    assert entries, "an empty batch copies nothing"
    writer_epoch = max(fence, max(e.epoch for e in entries))
    return WriteCommand(segment, writer_epoch, 0, tuple(entries))


def verify(segment: SegmentKey, final_index: int, local: DigestInfo, source_digest: bytes) -> None:
    """Raise CopyMismatch unless the copy equals the source up to the final index."""
    assert local.up_to_index == final_index
    if local.digest != source_digest:
        raise CopyMismatch(
            f"copy of {segment.stream_id}/{segment.epoch} does not match the source up to "
            f"{final_index}: left unconfirmed (acked {local.acked_index})"
        )


def confirm_command(segment: SegmentKey, fence: int, final_index: int) -> ConfirmCopyCommand:
    return ConfirmCopyCommand(segment, fence, final_index)
