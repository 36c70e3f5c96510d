"""Acked indexes writers gave back with their leases, owed to the stores of their
segments that may not know them.

Followers read an open segment only up to an acked index a store knows (`acked_only`
reads). A writer closing while no store of its segment could be told its last acked
index (its flush gives up on stores that are down) left those events unread until a
writer led the stream again and sealed the segment: durable, but nobody read them
(the runtime world's seed 227). So a release names the acked index
(`ReleaseLeaseRequest.acked_index`), and the master passes it on in heartbeat replies
(`StoreHeartbeatReply.leader_acked`) to each store of the copy set that reports less,
until it reports it, holds nothing of the segment, holds no more of it than it
already acked, or is fenced past its epoch (a recovery seals it: its business then).
A store raises its acked index to min(that, its matched index), as the leader's next
Write would have.

The index is kept in the open segment's record (`released_acked_index`), and what
is owed is rebuilt from the records when a master's state loads, so a master serving
after a restart or a failover still owes it. In memory at most `OWED_SEGMENTS_MAX`
segments are owed, the oldest release dropped first (until the next load; a store it
stays untold then waits for the next leader's recovery, as before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from streamengine.master.core.model import Held, SegmentKey

OWED_SEGMENTS_MAX = 4096


@dataclass(slots=True)
class _Owed:
    acked_index: int
    stores: set[str]


class LeaderAckedOwed:
    """What each released segment's stores are still owed (module doc)."""

    def __init__(self, segments_max: int = OWED_SEGMENTS_MAX) -> None:
        assert segments_max > 0
        self._segments_max = segments_max
        self._owed: dict[SegmentKey, _Owed] = {}  # oldest release first

    def __len__(self) -> int:
        return len(self._owed)

    def released(self, segment: SegmentKey, copy_set: Iterable[str], acked_index: int) -> None:
        """The leader of `segment` let go with `acked_index`: owed to every member."""
        stores = set(copy_set)
        if acked_index <= 0 or not stores:
            return
        earlier = self._owed.pop(segment, None)
        if earlier is not None:
            acked_index = max(acked_index, earlier.acked_index)
        self._owed[segment] = _Owed(acked_index, stores)
        while len(self._owed) > self._segments_max:
            del self._owed[next(iter(self._owed))]

    def to_tell(
        self, store_id: str, held: Mapping[SegmentKey, Held]
    ) -> list[tuple[SegmentKey, int]]:
        """The (segment, acked index) pairs to tell `store_id`, which reports holding
        `held` (its whole report): what it is owed and does not hold acked yet. Those
        it needs no more are settled for it."""
        told: list[tuple[SegmentKey, int]] = []
        settled: list[SegmentKey] = []
        for segment, owed in self._owed.items():
            if store_id not in owed.stores:
                continue
            copy = held.get(segment)
            if (
                copy is None
                or copy.fence > segment[1]
                or copy.acked_index >= min(owed.acked_index, copy.last_index)
            ):
                owed.stores.discard(store_id)
                if not owed.stores:
                    settled.append(segment)
            else:
                told.append((segment, owed.acked_index))
        for segment in settled:
            del self._owed[segment]
        return told
