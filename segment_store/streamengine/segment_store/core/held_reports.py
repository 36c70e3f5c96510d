"""What a store tells the master of the segments it holds, heartbeat after heartbeat.

A full report names every segment held, with its fence, acked and last index, bytes and
record version; a master reads it whole, and at ten thousand segments a store that was
most of an idle master's work (issue #38: a cluster's cost per pass must not grow with
idle streams). So once the master says it takes them (`deltas_taken`), a store sends a
delta instead: the segments whose report changed since the last report the master
answered, and those no longer held. A delta is taken against that answered report, so a
heartbeat whose answer was lost is simply covered by the next one. The master keeps
what the whole report and the deltas since told it, and judges every replica from that
(garbage to delete, records to send) every few seconds, so a whole report is only a
check that the two never drifted apart: every `FULL_REPORT_MS`, and at once when the
master asks (`report_full`: it holds no whole report to apply a delta to, being newly
active or having taken a registration since) or after the store registers again.

Pure: the shell (`segment_store.master_link`) hands in what the store holds and the
time, and says how the master answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from streamengine.segment_store.core.commands import SegmentKey

# A whole report at least this often: how long a report the master holds could differ
# from what the store holds, were a delta ever misapplied.
FULL_REPORT_MS = 60_000


@dataclass(frozen=True, slots=True)
class Reported:
    """What a heartbeat says of one segment held."""

    fence: int
    acked_index: int
    last_index: int
    bytes: int
    record_version: int


@dataclass(frozen=True, slots=True)
class HeldReport:
    """One heartbeat's report: whole (`changed` is everything held) or a delta."""

    full: bool
    changed: Mapping[SegmentKey, Reported]
    removed: tuple[SegmentKey, ...] = ()


class HeldReports:
    """See the module doc."""

    def __init__(self) -> None:
        # What the master holds of this store's segments, as of the last report it
        # answered (None: nothing it can apply a delta to).
        self._answered: dict[SegmentKey, Reported] | None = None
        self._full_at_ms = 0
        self._deltas_taken = False

    def report(self, held: Mapping[SegmentKey, Reported], now_ms: int) -> HeldReport:
        """The report of `held` to send now."""
        answered = self._answered
        if (
            answered is None
            or not self._deltas_taken
            or now_ms - self._full_at_ms >= FULL_REPORT_MS
        ):
            return HeldReport(True, dict(held))
        changed = {key: now for key, now in held.items() if answered.get(key) != now}
        removed = tuple(sorted(key for key in answered if key not in held))
        return HeldReport(False, changed, removed)

    def answered(
        self, report: HeldReport, now_ms: int, deltas_taken: bool, report_full: bool
    ) -> None:
        """The master answered the heartbeat that carried `report`."""
        self._deltas_taken = deltas_taken
        if report_full:
            self._answered = None
            return
        if report.full:
            self._answered = dict(report.changed)
            self._full_at_ms = now_ms
            return
        assert self._answered is not None, "a delta goes only against an answered report"
        for key in report.removed:
            self._answered.pop(key, None)
        self._answered.update(report.changed)

    def forget(self) -> None:
        """The store registers again: the next report is whole."""
        self._answered = None
