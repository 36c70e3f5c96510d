"""Group commit: every mutation of the store goes through one committer, which gathers
the commands queued while the previous group was being written into one plan, one KV
batch and one sync, then publishes and answers them all.

With `fsync=always` a command is answered only after the sync that covers it. The KV
write and the sync of a group run in one worker thread; the sync (`flush_wal(True)`)
releases the GIL, so the loop keeps serving while it runs. A small group (at most
`INLINE_GROUP_ENTRIES_MAX` entries and `INLINE_GROUP_BYTES_MAX` bytes: a lone append,
an acked-index tick, a seal) is written and synced on the loop itself while syncs are
quick (the last one took at most `INLINE_SYNC_S_MAX`): the two thread hops there and
back cost a lone write more than its sync does (docs/performance.md, "Writes"), and
requests that arrive meanwhile wait in the transport and form the
next, larger group, which goes to the thread again. A slow disk thus blocks the loop
for one sync at most, then groups go to the thread until a sync is quick again.

Back pressure: queued write batches are bounded in count and payload bytes. Past the
bound `try_submit` refuses at once (the leader resends from the matched index later),
so memory stays bounded whatever the leaders send. Seals and deletes are small and
never refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from streamengine.protocol.waiting import wait_set
from streamengine.segment_store import metrics
from streamengine.segment_store.core.commands import (
    Command,
    Outcome,
    Plan,
    SegmentKey,
    WriteCommand,
)
from streamengine.segment_store.core.errors import BelowFence, StoreUnavailable
from streamengine.segment_store.core.store import SegmentStoreCore

log = logging.getLogger("streamengine.store")

# Write batches queued at once (all leaders): each holds at most a batch's bytes.
STORE_QUEUE_BATCHES_MAX = 1024
# Payload bytes queued at once: the store's memory for pending writes.
STORE_QUEUE_BYTES_MAX = 64 << 20
# Entries in one group: rocksdict holds the GIL for a whole KV write, so a group stays
# around tens of milliseconds of the loop at worst.
GROUP_ENTRIES_MAX = 32_768
# A group small enough to commit on the event loop rather than in the commit thread
# (see the module's docstring), while the last sync took at most INLINE_SYNC_S_MAX: a
# sync of a few hundred microseconds blocks the loop about as long as the hops it saves
# would take.
INLINE_GROUP_ENTRIES_MAX = 64
INLINE_GROUP_BYTES_MAX = 64 << 10
INLINE_SYNC_S_MAX = 0.002
# After a refused write, how often the KV is asked to recover (reopen) for the next one.
RECOVER_INTERVAL_S = 1.0

assert STORE_QUEUE_BATCHES_MAX >= 2, "two leaders must be able to queue at once"


class _NotWritten(Exception):
    """The KV refused a group's write batch: nothing of it was applied. `tried` is false
    when the group was refused without trying, the KV still being down."""

    def __init__(self, cause: Exception, tried: bool = True) -> None:
        self.cause = cause
        self.tried = tried
        super().__init__(str(cause))


@dataclass
class _Pending:
    command: Command
    future: asyncio.Future[Outcome]
    payload_bytes: int
    entries: int
    # Counted against the queue's bounds: a leader's write batch (`try_submit`).
    bounded: bool


class GroupCommitter:
    def __init__(
        self,
        core: SegmentStoreCore,
        fsync: bool,
        on_published: Callable[[Plan], None],
        queue_bytes_max: int = STORE_QUEUE_BYTES_MAX,
        queue_batches_max: int = STORE_QUEUE_BATCHES_MAX,
        recover_interval_s: float = RECOVER_INTERVAL_S,
        sync_clock_s: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`sync_clock_s` times each sync (seconds): a test gives one that its KV
        advances, so which group runs on the loop does not hang on the machine's load."""
        self.core = core
        self.fsync = fsync
        self._on_published = on_published
        self._queue_bytes_max = queue_bytes_max
        self._queue_batches_max = queue_batches_max
        self._queue: deque[_Pending] = deque()
        self._queued_bytes = 0
        self._queued_batches = 0
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="store-commit")
        self._closed = False
        self._recover_interval_s = recover_interval_s
        self._sync_clock_s = sync_clock_s
        # How long the last group's sync took (0 without one).
        self.last_sync_s = 0.0
        # Set while the KV refuses writes: (why, when recovery may be tried next).
        self._refusing: tuple[Exception, float] | None = None

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    @property
    def queue_bytes_max(self) -> int:
        return self._queue_bytes_max

    def try_submit(self, command: WriteCommand) -> asyncio.Future[Outcome] | None:
        """Queue a write batch, or None when the queue is full (REFUSED_BUSY)."""
        size = command.batch.payload_bytes()
        if len(command.batch) and (
            self._queued_batches >= self._queue_batches_max
            or (self._queued_bytes + size > self._queue_bytes_max and self._queued_batches > 0)
        ):
            return None
        return self._enqueue(command, size, len(command.batch), bounded=bool(command.batch))

    def submit(self, command: Command) -> asyncio.Future[Outcome]:
        """Queue a command that is never refused (seal, delete, acked-only write, a
        repair's copy: one at a time per copy)."""
        if isinstance(command, WriteCommand):
            batch = command.batch
            return self._enqueue(command, batch.payload_bytes(), len(batch), bounded=False)
        return self._enqueue(command, 0, 0, bounded=False)

    def _enqueue(
        self, command: Command, size: int, entries: int, bounded: bool
    ) -> asyncio.Future[Outcome]:
        if self._closed:
            raise RuntimeError("the store is shutting down")
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(command, future, size, entries, bounded))
        if bounded:
            self._queued_bytes += size
            self._queued_batches += 1
        metrics.QUEUE_BYTES.set(self._queued_bytes)
        metrics.QUEUE_BATCHES.set(self._queued_batches)
        self._wake.set()
        return future

    async def run(self) -> None:
        """Commit groups until closed; answers everything queued before returning."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            group = self._take_group()
            commands = [p.command for p in group]
            try:
                if self._inline(group):
                    plan, sync_s = self._commit(commands)
                else:
                    plan, sync_s = await loop.run_in_executor(
                        self._executor, self._commit, commands
                    )
            except _NotWritten as refused:
                # Nothing of the group reached the KV (a full disk, a read-only DB): refuse
                # it, publish nothing, and go on; the leaders retry later.
                if refused.tried:  # once per recovery interval at most, not per group
                    log.error("write of %d commands failed: %s", len(group), refused.cause)
                self._release(group)
                for pending in group:
                    if not pending.future.done():
                        pending.future.set_result(StoreUnavailable(f"cannot write: {refused}"))
                continue
            except BaseException as error:
                # A failed sync leaves the store's durable state unknown: fail every
                # waiter and stop; the process exits and restarts from what is durable.
                for pending in group:
                    if not pending.future.done():
                        pending.future.set_exception(RuntimeError(f"commit failed: {error}"))
                raise
            self.last_sync_s = sync_s
            self.core.publish(plan)
            self._release(group)
            self._observe(plan, group, sync_s)
            for pending, outcome in zip(group, plan.outcomes, strict=True):
                if not pending.future.done():
                    pending.future.set_result(outcome)
            self._on_published(plan)

    def close(self) -> None:
        """Refuse new commands; `run` returns once the queue is empty."""
        self._closed = True
        self._wake.set()

    def shutdown_executor(self) -> None:
        self._executor.shutdown(wait=True)

    def _take_group(self) -> list[_Pending]:
        group: list[_Pending] = []
        entries = 0
        while self._queue and (not group or entries + self._queue[0].entries <= GROUP_ENTRIES_MAX):
            pending = self._queue.popleft()
            entries += pending.entries
            group.append(pending)
        return group

    def _inline(self, group: Sequence[_Pending]) -> bool:
        """Whether to commit `group` on the loop (see the module's docstring)."""
        return (
            self._refusing is None
            and self.last_sync_s <= INLINE_SYNC_S_MAX
            and sum(pending.entries for pending in group) <= INLINE_GROUP_ENTRIES_MAX
            and sum(pending.payload_bytes for pending in group) <= INLINE_GROUP_BYTES_MAX
        )

    def _release(self, group: Sequence[_Pending]) -> None:
        for pending in group:
            if pending.bounded:
                self._queued_bytes -= pending.payload_bytes
                self._queued_batches -= 1
        metrics.QUEUE_BYTES.set(self._queued_bytes)
        metrics.QUEUE_BATCHES.set(self._queued_batches)

    def _commit(self, commands: list[Command]) -> tuple[Plan, float]:
        if self._refusing is not None:
            self._recover()
        try:
            plan = self.core.plan(commands)
            self.core.write_plan(plan, sync=False)
        except Exception as error:
            self._refusing = (error, time.monotonic() + self._recover_interval_s)
            raise _NotWritten(error) from error
        sync_s = 0.0
        if self.fsync and plan.ops:
            started = self._sync_clock_s()
            self.core.kv.sync()
            sync_s = self._sync_clock_s() - started
        return plan, sync_s

    def _recover(self) -> None:
        """Refuse at once until the KV recovers; try that at most once per interval."""
        assert self._refusing is not None
        cause, next_try = self._refusing
        if time.monotonic() < next_try:
            raise _NotWritten(cause, tried=False)
        try:
            self.core.recover()
        except Exception as error:
            self._refusing = (error, time.monotonic() + self._recover_interval_s)
            raise _NotWritten(error) from error
        self._refusing = None
        log.warning("the database takes writes again")

    def _observe(self, plan: Plan, group: Sequence[_Pending], sync_s: float) -> None:
        if self.fsync and plan.ops:
            metrics.SYNC_SECONDS.observe(sync_s)
        metrics.GROUP_COMMANDS.observe(len(group))
        for pending, outcome in zip(group, plan.outcomes, strict=True):
            if isinstance(outcome, BelowFence):
                metrics.FENCE_REJECTIONS.inc()
            elif isinstance(pending.command, WriteCommand) and not isinstance(outcome, Exception):
                metrics.WRITE_BATCHES.inc()
                metrics.WRITE_ENTRIES.inc(pending.entries)
                metrics.WRITE_BYTES.inc(pending.payload_bytes)
                metrics.BATCH_ENTRIES.observe(pending.entries)


class SegmentWatch:
    """Wakes tails when a segment's published state changes: a call of one tail waits on
    an event; a multiplexed call listens (one callback per segment it tails, so that it
    need not wait on thousands of events)."""

    def __init__(self) -> None:
        self._events: dict[SegmentKey, asyncio.Event] = {}
        self._listeners: dict[SegmentKey, list[Callable[[], None]]] = {}

    def listen(self, segment: SegmentKey, callback: Callable[[], None]) -> None:
        """Call `callback` at every change of `segment` until `unlisten`."""
        self._listeners.setdefault(segment, []).append(callback)

    def unlisten(self, segment: SegmentKey, callback: Callable[[], None]) -> None:
        listeners = self._listeners.get(segment, [])
        with contextlib.suppress(ValueError):
            listeners.remove(callback)
        if not listeners:
            self._listeners.pop(segment, None)

    def event(self, segment: SegmentKey) -> asyncio.Event:
        event = self._events.get(segment)
        if event is None:
            event = self._events[segment] = asyncio.Event()
        return event

    def changed(self, segments: Sequence[SegmentKey]) -> None:
        for segment in segments:
            event = self._events.pop(segment, None)
            if event is not None:
                event.set()
            for callback in self._listeners.get(segment, ()):
                callback()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> bool:
        """True if the event fired within the timeout. Take the event with `event()`
        before reading the state it guards, so no change slips in between."""
        return await wait_set(event, timeout_s)
