"""Runs repair tasks against the stores: copy, verify by digest, swap, delete.

The decisions (what is under-replicated, which target) come from `master.repair` and
`master.placement`; this module only carries them out, at most `concurrency` copies at
a time, every copy inside one TaskGroup owned by `run()`.

One task:
1. ask the source for the segment's state: it must hold the bridge (acked index at or
   past the final index); its fence is the fence the copy gets;
2. `CopySegment` on the target (the target pulls from the source);
3. `Digest` up to the final index on source and target: they must be equal (and equal
   to what CopySegment reported);
4. swap the copy set durably (`MasterState.swap_replica`), then ask the replaced store
   to delete its copy (also listed in its heartbeat replies until it is gone).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from streamengine.master import repair
from streamengine.master.model import Held, SegmentKey, SegmentRecord, SegmentState
from streamengine.master.state import MasterState
from streamengine.protocol.limits import GRPC_MESSAGE_BYTES_MAX
from streamengine.protocol.logs import segment_fields
from streamengine.v1 import entry_pb2, segment_store_pb2, segment_store_pb2_grpc

log = logging.getLogger("streamengine.master.repair")

# How often the repairer looks for work.
REPAIR_TICK_MS = 200
# Segments judged per tick: about 50 ms of work, so heartbeats are never held up long
# (a master just started judges all its sealed segments once).
JUDGED_PER_TICK = 1000
# A failed task's segment waits this long before another attempt, so a broken store is
# not hammered and the rest of the queue moves on.
REPAIR_RETRY_MS = 2000
# Finished tasks kept for status.
FINISHED_TASKS_KEPT = 200
# A copy of a whole sealed segment may take a while; a stuck one must end.
COPY_TIMEOUT_S = 120.0
CONTROL_TIMEOUT_S = 5.0


class RepairFailed(Exception):
    pass


@dataclass(frozen=True, slots=True)
class TaskStatus:
    task: repair.Task
    state: str  # PENDING | RUNNING | DONE | FAILED
    error: str = ""


class Repairer:
    def __init__(self, state: MasterState, concurrency: int, clock_ms: Callable[[], int]):
        assert concurrency >= 1
        self.state = state
        self.concurrency = concurrency
        self.clock_ms = clock_ms
        self.queued: collections.deque[repair.Task] = collections.deque()
        self.running: dict[SegmentKey, TaskStatus] = {}
        self.finished: collections.deque[TaskStatus] = collections.deque(maxlen=FINISHED_TASKS_KEPT)
        self.retry_after: dict[SegmentKey, int] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.done_count = 0
        self.failed_count = 0
        self._wake = asyncio.Event()
        self._cursor: SegmentKey = (0, 0)

    def plan_moves(self, tasks: list[repair.Task]) -> None:
        """Queue an operator's plan (rebalance) in place of any earlier one not yet
        started: a plan is computed from the copy sets as they are, so two plans
        queued together would move the same bytes twice."""
        self.queued = collections.deque(tasks)
        self._wake.set()

    def wake(self) -> None:
        """Look for work now (a store was drained)."""
        self._wake.set()

    def statuses(self) -> list[TaskStatus]:
        pending = [TaskStatus(t, "PENDING") for t in self.queued]
        return [*pending, *self.running.values(), *self.finished]

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    for task in self._next_tasks():
                        self.running[task.segment] = TaskStatus(task, "RUNNING")
                        group.create_task(self._run_one(task))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), REPAIR_TICK_MS / 1000)
                    self._wake.clear()
        finally:
            for channel in self.channels.values():
                await channel.close(None)

    def _next_tasks(self) -> list[repair.Task]:
        now_ms = self.clock_ms()
        slots = self.concurrency - len(self.running)
        self.retry_after = {k: t for k, t in self.retry_after.items() if t > now_ms}
        busy = set(self.running) | set(self.retry_after)
        chosen: list[repair.Task] = []
        # Operator-requested moves (rebalance) first, in order.
        for task in list(self.queued):
            if len(chosen) >= slots:
                break
            if task.segment in busy:
                continue
            self.queued.remove(task)
            chosen.append(task)
            busy.add(task.segment)
        if len(chosen) < slots:
            chosen += self._plan(now_ms, busy, slots - len(chosen))
        return chosen

    def _plan(self, now_ms: int, busy: set[SegmentKey], slots: int) -> list[repair.Task]:
        """Repairs for the segments that may need one; segments seen with every member
        good are confirmed and left alone until something about them changes."""
        st = self.state
        views = st.store_views(now_ms)
        candidates = self._window(st.repair_candidates(views))
        held = st.held_for(candidates)
        for segment in candidates:
            verdict = repair.judge(segment, views, held[segment.key], now_ms, st.bridge_grace_ms)
            if len(verdict.good) == len(segment.copy_set) and segment.key not in busy:
                st.confirm(segment.key)
        return repair.plan_tasks(
            candidates, views, held, now_ms, st.bridge_grace_ms, busy, slots, st.pending_deletes()
        )

    def _window(self, candidates: list[SegmentRecord]) -> list[SegmentRecord]:
        """At most JUDGED_PER_TICK candidates, resuming after the last one judged, so a
        tick stays short (it runs on the loop that answers heartbeats) and every
        candidate gets its turn."""
        if len(candidates) <= JUDGED_PER_TICK:
            return candidates
        start = next((i for i, s in enumerate(candidates) if s.key > self._cursor), 0)
        window = (candidates[start:] + candidates[:start])[:JUDGED_PER_TICK]
        self._cursor = window[-1].key
        return window

    def _fields(self, task: repair.Task) -> dict[str, object]:
        stream_id, epoch = task.segment
        return segment_fields(
            self.state.stream_name(stream_id),
            epoch,
            source=task.source,
            target=task.target,
            reason=task.reason,
        )

    async def _run_one(self, task: repair.Task) -> None:
        started = time.monotonic()
        try:
            await self._copy_verify_swap(task)
        except Exception as error:
            message = _describe(error)
            log.warning("repair failed: %s", message, extra=self._fields(task))
            self.retry_after[task.segment] = self.clock_ms() + REPAIR_RETRY_MS
            self.finished.append(TaskStatus(task, "FAILED", message))
            self.failed_count += 1
        else:
            log.info(
                "replica repaired in %.2fs, replacing %s",
                time.monotonic() - started,
                task.replaced or "nothing",
                extra=self._fields(task),
            )
            self.retry_after.pop(task.segment, None)
            self.finished.append(TaskStatus(task, "DONE"))
            self.done_count += 1
        finally:
            self.running.pop(task.segment, None)
            self._wake.set()

    def _stub(self, address: str) -> segment_store_pb2_grpc.SegmentStoreAsyncStub:
        channel = self.channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
                    ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
                ],
            )
            self.channels[address] = channel
        return segment_store_pb2_grpc.SegmentStoreStub(channel)

    async def _copy_verify_swap(self, task: repair.Task) -> None:
        st = self.state
        segment = st.segments.get(task.segment)
        if segment is None or segment.state != SegmentState.SEALED:
            raise RepairFailed("segment is gone or not sealed")
        if task.replaced not in segment.copy_set:
            raise RepairFailed(f"{task.replaced} is no longer in the copy set")
        if task.target != task.replaced and task.target in segment.copy_set:
            raise RepairFailed(f"{task.target} is already in the copy set")
        source_address, target_address = st.address(task.source), st.address(task.target)
        segment_id = entry_pb2.SegmentId(
            stream_id=segment.stream_id, epoch=segment.epoch, stream=segment.stream
        )
        final_index = segment.final_index
        source = self._stub(source_address)
        target = self._stub(target_address)
        state = await source.GetSegmentState(
            segment_store_pb2.GetSegmentStateRequest(segment=segment_id), timeout=CONTROL_TIMEOUT_S
        )
        if state.acked_index < final_index:
            raise RepairFailed(
                f"source acked index {state.acked_index} below the bridge {final_index}"
            )
        st.begin_copy(task.target, task.segment)
        try:
            copied = await target.CopySegment(
                segment_store_pb2.CopySegmentRequest(
                    segment=segment_id,
                    source_address=source_address,
                    final_index=final_index,
                    fence=state.fence,
                ),
                timeout=COPY_TIMEOUT_S,
            )
            digest = segment_store_pb2.DigestRequest(segment=segment_id, up_to_index=final_index)
            source_digest, target_digest = await asyncio.gather(
                source.Digest(digest, timeout=COPY_TIMEOUT_S),
                target.Digest(digest, timeout=COPY_TIMEOUT_S),
            )
            if source_digest.digest != target_digest.digest:
                raise RepairFailed("digest of the copy differs from the source's")
            if copied.digest and copied.digest != source_digest.digest:
                raise RepairFailed("CopySegment reported a digest differing from the source's")
            if target_digest.entries_held < final_index:
                raise RepairFailed(
                    f"copy holds {target_digest.entries_held} of {final_index} indexes"
                )
            held = Held(state.fence, final_index, final_index, state.bytes)
            st.swap_replica(task.segment, task.replaced, task.target, held, self.clock_ms())
        finally:
            st.end_copy(task.target, task.segment)
        if task.replaced != task.target:
            await self._delete_best_effort(task.replaced, segment_id)

    async def _delete_best_effort(self, store_id: str, segment_id: entry_pb2.SegmentId) -> None:
        """The heartbeat reply keeps asking until the store stops reporting it; this
        only makes it quicker when the store is up."""
        views = self.state.store_views(self.clock_ms())
        if store_id not in views or not views[store_id].alive:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub(self.state.address(store_id)).Delete(
                segment_store_pb2.DeleteRequest(segment=segment_id), timeout=CONTROL_TIMEOUT_S
            )


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
