"""The replication policy: N replicas, write quorum W, read quorum R = N - W + 1.

R stores sealed and read by a new leader meet every write quorum (R + W > N), so any
index held by W stores shows up in what recovery reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from streamengine.protocol.limits import REPLICAS_MAX


class InvalidPolicy(ValueError):
    """A policy no deployment can run."""


@dataclass(frozen=True, slots=True)
class ReplicationPolicy:
    replicas: int
    write_quorum: int

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= REPLICAS_MAX:
            raise InvalidPolicy(f"replicas must be 1..{REPLICAS_MAX}, got {self.replicas}")
        if not 1 <= self.write_quorum <= self.replicas:
            raise InvalidPolicy(
                f"write quorum must be 1..replicas ({self.replicas}), got {self.write_quorum}"
            )

    @property
    def read_quorum(self) -> int:
        return self.replicas - self.write_quorum + 1

    def acked_index(self, matched_indexes: Iterable[int]) -> int:
        """The largest index every index up to which W stores hold: the W-th largest
        matched index (0 while fewer than W stores answered)."""
        ranked = sorted(matched_indexes, reverse=True)
        if len(ranked) > self.replicas:
            raise ValueError(f"{len(ranked)} matched indexes for {self.replicas} replicas")
        if len(ranked) < self.write_quorum:
            return 0
        return ranked[self.write_quorum - 1]
