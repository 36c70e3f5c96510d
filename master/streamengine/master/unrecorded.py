"""The streams no store keeps a record of yet, which the cluster view carries as cards
(`master.records.ClusterViews`), so that a rebuild knows a stream whose records reached
no store (docs/design.md, "master --rebuild")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from streamengine.master.core.model import StreamRecord
from streamengine.protocol.segment_records import CLUSTER_VIEW_STREAMS_MAX

if TYPE_CHECKING:
    from streamengine.master.stores import StoreLive


class UnrecordedStreams:
    """Streams (ids) a store reported keeping a record of since a state loaded, and
    those not deleted that none did yet, with a count of the latter's changes."""

    def __init__(self) -> None:
        self.recorded: set[int] = set()
        self.ids: dict[int, None] = {}
        self.changes = 0

    def indexed(self, old: StreamRecord | None, record: StreamRecord) -> None:
        """`record` replaced `old` (None: it is new)."""
        stream_id = record.stream_id
        if record.deleted_until_ms or stream_id in self.recorded:
            self.left(stream_id)
        elif old is None or old.deleted_until_ms or old.has_producers != record.has_producers:
            # New to the view, or its card changed (the rest of a card never does).
            self.ids[stream_id] = None
            self.changes += 1

    def left(self, stream_id: int) -> None:
        """The stream is gone, deleted or recorded: no card of it any more."""
        if stream_id in self.ids:
            del self.ids[stream_id]
            self.changes += 1

    def note_recorded(self, stream_ids: Iterable[int]) -> None:
        """A store reported keeping records of segments of these streams."""
        for stream_id in stream_ids:
            if stream_id not in self.recorded:
                self.recorded.add(stream_id)
                self.left(stream_id)

    def newest(self, stream_of: Callable[[int], StreamRecord]) -> tuple[StreamRecord, ...]:
        """The streams no store keeps a record of, newest first, at most
        `CLUSTER_VIEW_STREAMS_MAX`."""
        newest = sorted(self.ids, reverse=True)[:CLUSTER_VIEW_STREAMS_MAX]
        return tuple(stream_of(stream_id) for stream_id in newest)


def every_store_reported(live: Iterable[StoreLive], store_timeout_ms: int, now_ms: int) -> bool:
    """Whether every store alive has given a whole report since the state loaded:
    before that every stream looks unrecorded, and no view carries cards."""
    return all(store.whole or now_ms - store.last_seen_ms > store_timeout_ms for store in live)
