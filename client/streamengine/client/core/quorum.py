"""Quorum arithmetic of one segment: matched indexes per store in, acked index out.

The acked index is the W-th largest matched index over the copy set (a store that never
answered counts as 0). It only ever rises: a lower figure (a store that restarted with
`fsync=never` and lost its tail) never takes back what users were told.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from streamengine.protocol.policy import ReplicationPolicy


def quorum_index(
    policy: ReplicationPolicy, matched: Mapping[str, int], copy_set: Iterable[str]
) -> int:
    """W-th largest matched index of the copy set's stores (absent stores count as 0)."""
    return policy.acked_index(matched.get(store, 0) for store in copy_set)


class QuorumTracker:
    """Matched index per store of a copy set, and the acked index they imply."""

    def __init__(self, policy: ReplicationPolicy, copy_set: Iterable[str]) -> None:
        self.policy = policy
        self.copy_set: tuple[str, ...] = tuple(copy_set)
        if len(self.copy_set) != policy.replicas:
            raise ValueError(f"copy set of {len(self.copy_set)} for {policy.replicas} replicas")
        if len(set(self.copy_set)) != len(self.copy_set):
            raise ValueError(f"copy set {self.copy_set} names a store twice")
        self._matched: dict[str, int] = dict.fromkeys(self.copy_set, 0)
        self._acked = 0

    def update(self, store: str, matched_index: int) -> int:
        """Record a store's answer; returns the (never lowered) quorum index."""
        if store not in self._matched:
            raise KeyError(f"{store} is not in the copy set {self.copy_set}")
        self._matched[store] = matched_index
        quorum = quorum_index(self.policy, self._matched, self.copy_set)
        # The quorum index is held by W stores (checked apart from the policy's ranking).
        holders = sum(matched >= quorum for matched in self._matched.values())
        assert holders >= self.policy.write_quorum, (quorum, self._matched)
        if quorum > self._acked:
            self._acked = quorum
        assert self._acked >= quorum, "the acked index never falls"
        return self._acked

    @property
    def acked_index(self) -> int:
        return self._acked
