"""The errors a segment store's command or query is refused with; each changed nothing.

The service maps each to one gRPC status (`segment_store.refusals.STATUS`).
"""

from __future__ import annotations


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


class ConflictingCopy(StoreError):
    """A write of an index the store holds at the same copy epoch, with other bytes. One
    epoch's copy of an index is written once: a retransmission carries identical bytes,
    anything else is a second writer under the epoch's grant (or a bug), never a copy
    to keep. The whole batch is refused."""

    def __init__(self, index: int, epoch: int, message: str):
        self.index = index
        self.epoch = epoch
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
