"""The store's scrub loop: the shell of `segment_store.scrub`. It reads one sealed
replica at a time in the store's reader threads, at the rate the schedule allows, and
keeps what each read found for the next heartbeat to the master (`take_reports`),
which judges it against the segment's certificate. Damage it finds itself (a checksum,
an index missing) marks the replica damaged at once: the store then reports it with
acked index 0 and the master refills it from a good replica.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from streamengine.protocol.clock import monotonic_ms
from streamengine.protocol.entry import CorruptEntry
from streamengine.protocol.waiting import wait_set
from streamengine.segment_store import metrics
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import SegmentNotFound
from streamengine.segment_store.core.scrub import ReplicaScan, ScanResult, ScrubSchedule
from streamengine.segment_store.core.store import SegmentStoreCore

log = logging.getLogger("streamengine.store.scrub")
T = TypeVar("T")

# With nothing due, look again this often (new sealed replicas, the master's requests).
IDLE_WAKE_S = 1.0
# Reports waiting for a heartbeat the master answers; beyond this the oldest go (they
# are read again at the next pass).
REPORTS_KEPT_MAX = 1024


class InThread(Protocol):
    def __call__(self, function: Callable[[], T], /) -> Awaitable[T]: ...



class Scrubber:
    def __init__(self, core: SegmentStoreCore, in_thread: InThread, mb_per_s: float) -> None:
        assert mb_per_s > 0
        self.core = core
        self.in_thread = in_thread
        self.schedule: ScrubSchedule[SegmentKey] = ScrubSchedule(
            mb_per_s * 1_000_000, monotonic_ms()
        )
        self._reports: dict[SegmentKey, ScanResult] = {}
        self._wake = asyncio.Event()

    # ---- the master link's side ----

    def take_reports(self) -> dict[SegmentKey, ScanResult]:
        """What was read since the last heartbeat (give them back if it failed)."""
        reports, self._reports = self._reports, {}
        return reports

    def give_back(self, reports: dict[SegmentKey, ScanResult]) -> None:
        """Reports a heartbeat could not deliver: sent with the next one, unless a newer
        read of the same replica replaced them."""
        self._reports = {**reports, **self._reports}
        self._bound_reports()

    def check_first(self, segment: SegmentKey) -> None:
        """The master asks for this replica before any other (a reader or a repair
        found it suspect)."""
        if self.schedule.check_first(segment):
            log.info("checking %s/%s first, as the master asks", segment.stream_id, segment.epoch)
            self._wake.set()

    # ---- the loop ----

    async def run(self) -> None:
        while True:
            targets = self.core.catalog.scrub_targets()
            self._update_gauges(targets)
            replica = self.schedule.next_replica(monotonic_ms(), targets)
            if replica is None:
                due = self.schedule.due_ms(targets)
                wait_s = IDLE_WAKE_S if due is None else max(0, due - monotonic_ms()) / 1000
                await self._sleep(min(wait_s, IDLE_WAKE_S))
                continue
            result = await self._scan(replica, targets[replica])
            self.schedule.checked(replica, monotonic_ms())
            if result is not None:
                self._done(replica, result)

    async def _sleep(self, seconds: float) -> None:
        """Wait `seconds`, or less when the master asks for a check."""
        self._wake.clear()
        await wait_set(self._wake, seconds)

    async def _scan(self, replica: SegmentKey, final_index: int) -> ScanResult | None:
        """Read `replica` back at the schedule's rate; None when it went away midway."""
        scan = ReplicaScan(final_index)
        while (step := scan.next_read()) is not None:
            first, upper, limit, max_bytes = step
            wait_ms = self.schedule.read_at_ms() - monotonic_ms()
            if wait_ms > 0:
                await asyncio.sleep(wait_ms / 1000)  # the rate, not a wait for a condition
            read = functools.partial(
                self.core.reader.read_run, replica, first, upper, limit, max_bytes
            )
            try:
                values = await self.in_thread(read)
            except SegmentNotFound:
                return None  # deleted meanwhile
            except CorruptEntry as error:
                scan.damaged(first, str(error))
                break
            nbytes = sum(map(len, values))
            self.schedule.read_done(monotonic_ms(), nbytes)
            metrics.SCRUB_BYTES.inc(nbytes)
            scan.feed(values)
        assert scan.result is not None
        return scan.result

    def _done(self, replica: SegmentKey, result: ScanResult) -> None:
        fields = {"stream": "?", "epoch": replica.epoch, "index": result.damaged_index}
        if result.damaged:
            self.core.catalog.mark_damaged(replica)
            metrics.SCRUB_REPLICAS.labels("damaged").inc()
            log.error(
                "scrub: replica of %s/%s is damaged: %s",
                replica.stream_id,
                replica.epoch,
                result.detail,
                extra=fields,
            )
        else:
            metrics.SCRUB_REPLICAS.labels("read").inc()
        self._reports[replica] = result
        self._bound_reports()

    def _bound_reports(self) -> None:
        while len(self._reports) > REPORTS_KEPT_MAX:
            del self._reports[next(iter(self._reports))]

    def _update_gauges(self, targets: dict[SegmentKey, int]) -> None:
        now = monotonic_ms()
        metrics.SCRUB_OLDEST_CHECK_SECONDS.set(
            self.schedule.oldest_check_age_ms(now, targets) / 1000
        )
        metrics.SCRUB_UNCHECKED.set(self.schedule.unchecked(targets))
