"""Runs repair tasks against the stores, at most `concurrency` at a time, every task
inside one TaskGroup owned by `run()`.

The decisions live in pure code: what is under-replicated and which target
(`master.repair`, `master.placement`, `Replicas.plan_repairs`), which task runs
next and when a failed one is retried (`repair.RepairQueue`), and the steps of one
task, in order (`repair.RepairOp`: source state, CopySegment on the target, digests
of both, swap, delete of the replaced copy). This module only does the calls those
ask for and feeds the answers back.
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

from streamengine.master.core import authority, repair
from streamengine.master.core.errors import MasterError
from streamengine.master.core.model import SegmentKey
from streamengine.master.state import MasterState
from streamengine.protocol import codec, transport
from streamengine.protocol.logs import segment_fields
from streamengine.protocol.waiting import wait_set
from streamengine.v1 import entry_pb2, segment_store_pb2, segment_store_pb2_grpc

log = logging.getLogger("streamengine.master.core.repair")

# Finished tasks kept for status.
FINISHED_TASKS_KEPT = 200


class RepairFailed(Exception):
    pass


@dataclass(frozen=True, slots=True)
class TaskStatus:
    task: repair.Task
    state: str  # PENDING | RUNNING | DONE | FAILED
    error: str = ""


class Repairer:
    def __init__(
        self,
        state: MasterState,
        concurrency: int,
        clock_ms: Callable[[], int],
        members: transport.Transport = transport.PLAINTEXT,
    ):
        self.state = state
        # Under TLS the master's node certificate: stores take CopySegment and Delete
        # from the master's certificate only.
        self.members = members
        self.queue = repair.RepairQueue(concurrency)
        self.clock_ms = clock_ms
        self.finished: collections.deque[TaskStatus] = collections.deque(maxlen=FINISHED_TASKS_KEPT)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.done_count = 0
        self.failed_count = 0
        self._wake = asyncio.Event()

    @property
    def running(self) -> dict[SegmentKey, repair.Task]:
        return self.queue.running

    def plan_moves(self, tasks: list[repair.Task]) -> None:
        """Queue an operator's plan (rebalance) in place of any earlier one not yet
        started."""
        self.queue.plan_moves(tasks)
        self._wake.set()

    def wake(self) -> None:
        """Look for work now (a store was drained)."""
        self._wake.set()

    def statuses(self) -> list[TaskStatus]:
        pending = [TaskStatus(t, "PENDING") for t in self.queue.queued]
        running = [TaskStatus(t, "RUNNING") for t in self.queue.running.values()]
        return [*pending, *running, *self.finished]

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    for task in self._next_tasks():
                        group.create_task(self._run_one(task))
                    await wait_set(self._wake, repair.REPAIR_TICK_MS / 1000)
                    self._wake.clear()
        finally:
            for channel in self.channels.values():
                await channel.close(None)

    def _next_tasks(self) -> list[repair.Task]:
        now_ms = self.clock_ms()
        return self.queue.next_tasks(
            now_ms,
            lambda busy, slots: self.state.replicas.plan_repairs(
                now_ms, busy, slots, self.queue.failed_sources
            ),
        )

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
            await self._carry_out(task)
        except Exception as error:
            message = _describe(error)
            log.warning("repair failed: %s", message, extra=self._fields(task))
            self.queue.finished(task, True, self.clock_ms())
            # The source may be what failed (a damaged copy, or content that differs
            # from the certificate): its store checks it first, and the next attempt
            # copies from another replica.
            self.state.integrity.ask_scrub_first(task.source, task.segment)
            self.finished.append(TaskStatus(task, "FAILED", message))
            self.failed_count += 1
        else:
            log.info(
                "replica repaired in %.2fs, replacing %s",
                time.monotonic() - started,
                task.replaced or "nothing",
                extra=self._fields(task),
            )
            self.queue.finished(task, False, self.clock_ms())
            self.finished.append(TaskStatus(task, "DONE"))
            self.done_count += 1
        finally:
            self._wake.set()

    def _stub(self, address: str) -> segment_store_pb2_grpc.SegmentStoreAsyncStub:
        channel = self.channels.get(address)
        if channel is None:
            channel = self.members.aio_channel(address)
            self.channels[address] = channel
        return segment_store_pb2_grpc.SegmentStoreStub(channel)

    async def _carry_out(self, task: repair.Task) -> None:
        st = self.state
        segment = st.segments.get(task.segment)
        op = repair.RepairOp(task)
        action = op.start(segment)
        copying = False
        try:
            while action is not None:
                if isinstance(action, repair.CopyToTarget) and not copying:
                    st.replicas.begin_copy(task.target, task.segment)
                    copying = True
                assert segment is not None
                segment_id = entry_pb2.SegmentId(
                    stream_id=segment.stream_id, epoch=segment.epoch, stream=segment.stream
                )
                event = await self._perform(action, segment_id)
                action = None if event is None else op.step(event)
        finally:
            if copying:
                st.replicas.end_copy(task.target, task.segment)
        if op.error:
            raise RepairFailed(op.error)

    async def _perform(
        self, action: repair.RepairAction, segment_id: entry_pb2.SegmentId
    ) -> repair.RepairEvent | None:
        """Do one call the task asks for; its answer as an event (None: nothing to feed)."""
        control_s = repair.CONTROL_TIMEOUT_MS / 1000
        try:
            if isinstance(action, repair.AskSourceState):
                state = await self._stub(self.state.address(action.source)).GetSegmentState(
                    segment_store_pb2.GetSegmentStateRequest(segment=segment_id), timeout=control_s
                )
                return repair.SourceState(state.fence, state.acked_index, state.bytes)
            if isinstance(action, repair.CopyToTarget):
                source_record = self.state.stores.get(action.source)
                copy = segment_store_pb2.CopySegmentRequest(
                    segment=segment_id,
                    source_address=self.state.address(action.source),
                    # The copied entries are read on the source's data port.
                    source_data_address=source_record.data_address if source_record else "",
                    final_index=action.final_index,
                    fence=action.fence,
                    tenant=authority.stream_tenant(segment_id.stream),
                    replace_held=action.replace_held,
                )
                if action.certificate is not None:
                    copy.certificate.CopyFrom(codec.certificate_to_pb(action.certificate))
                copied = await self._stub(self.state.address(action.target)).CopySegment(
                    copy, timeout=repair.COPY_TIMEOUT_MS / 1000
                )
                return repair.Copied(copied.digest)
            if isinstance(action, repair.AskDigests):
                request = segment_store_pb2.DigestRequest(
                    segment=segment_id, up_to_index=action.final_index
                )
                copy_s = repair.COPY_TIMEOUT_MS / 1000
                source, target = await asyncio.gather(
                    self._stub(self.state.address(action.source)).Digest(request, timeout=copy_s),
                    self._stub(self.state.address(action.target)).Digest(request, timeout=copy_s),
                )
                return repair.Digests(source.digest, target.digest, target.entries_held)
            if isinstance(action, repair.SwapReplica):
                key = (segment_id.stream_id, segment_id.epoch)
                self.state.replicas.swap_replica(
                    key, action.replaced, action.target, action.held, self.clock_ms()
                )
                return repair.Swapped()
            await self._delete_best_effort(action.store, segment_id)
            return None
        except (grpc.aio.AioRpcError, MasterError) as error:
            return repair.StepFailed(_describe(error))

    async def _delete_best_effort(self, store_id: str, segment_id: entry_pb2.SegmentId) -> None:
        """The heartbeat reply keeps asking until the store stops reporting it; this
        only makes it quicker when the store is up."""
        views = self.state.store_views(self.clock_ms())
        if store_id not in views or not views[store_id].alive:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub(self.state.address(store_id)).Delete(
                segment_store_pb2.DeleteRequest(segment=segment_id),
                timeout=repair.CONTROL_TIMEOUT_MS / 1000,
            )


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
