"""Which positions a trim took away: one rule for the master, the SDK and Spark.

Pure. The master trims whole sealed segments from the head of a stream, so what is
trimmed is every epoch up to `trimmed_through_epoch` (0: nothing ever was). A reader's
position is trimmed when its epoch is one of those: the events it would read next are
gone. Its index does not matter: a reader past a segment's bridge has already hopped
to a later epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamengine.protocol.sequence import pack_sequence, unpack_sequence


def position_trimmed(position: int, trimmed_through_epoch: int) -> bool:
    """Whether a reader at `position` (the next sequence it reads) lost events to a
    trim."""
    assert trimmed_through_epoch >= 0
    if trimmed_through_epoch == 0:
        return False
    epoch, _ = unpack_sequence(position)
    return epoch <= trimmed_through_epoch


def first_retained_sequence(trimmed_through_epoch: int, retained_epochs: Sequence[int]) -> int:
    """Where a reader asking for the earliest event starts: the first index of the
    oldest segment kept, else of the epoch after the trimmed ones; 0 while nothing
    was ever trimmed (the stream's very beginning)."""
    assert all(e > trimmed_through_epoch for e in retained_epochs), retained_epochs
    if trimmed_through_epoch == 0:
        return 0
    epoch = min(retained_epochs, default=trimmed_through_epoch + 1)
    first = pack_sequence(epoch, 1)
    assert not position_trimmed(first, trimmed_through_epoch)
    return first
