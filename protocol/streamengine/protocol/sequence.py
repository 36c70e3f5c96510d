"""Sequences: a reader's position `epoch << 32 | index`, the resume token.

Strictly increasing along a stream (segments are ordered by epoch, entries by index)
but not contiguous across segments.
"""

from __future__ import annotations

from streamengine.protocol.limits import EPOCH_MAX, INDEX_MAX

INDEX_BITS = 32
# The last position there can be: wire fields that carry a sequence are uint64, wider.
SEQUENCE_MAX = (EPOCH_MAX << INDEX_BITS) | INDEX_MAX


def pack_sequence(epoch: int, index: int) -> int:
    if not 0 <= epoch <= EPOCH_MAX:
        raise ValueError(f"epoch {epoch} outside 0..{EPOCH_MAX}")
    if not 0 <= index <= INDEX_MAX:
        raise ValueError(f"index {index} outside 0..{INDEX_MAX}")
    return (epoch << INDEX_BITS) | index


def unpack_sequence(sequence: int) -> tuple[int, int]:
    """Return (epoch, index)."""
    if not 0 <= sequence <= SEQUENCE_MAX:
        raise ValueError(f"sequence {sequence} is not a valid position")
    return sequence >> INDEX_BITS, sequence & INDEX_MAX
