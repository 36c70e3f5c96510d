"""The group committer over MemoryKV: one plan and one sync for everything queued while
the previous group was written, a bounded queue that refuses past its bound, answers
only after the sync."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.segment_store.core.commands import (
    Outcome,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.errors import StoreUnavailable
from streamengine.segment_store.core.kv import KVOp
from streamengine.segment_store.group_commit import (
    INLINE_GROUP_BYTES_MAX,
    INLINE_GROUP_ENTRIES_MAX,
    INLINE_SYNC_S_MAX,
    GroupCommitter,
    SegmentWatch,
)
from streamengine.segment_store.kv import MemoryKV
from tests.store_commands import CommandedCore

SEG = SegmentKey(1, 1)


class CountingKV(MemoryKV):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.syncs = 0

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        self.writes += 1
        assert not sync, "the committer writes without sync, then syncs once"
        super().write(ops, sync)

    def sync(self) -> None:
        self.syncs += 1
        super().sync()


def batch(first: int, count: int, size: int = 10) -> WriteCommand:
    entries = [
        StoredEntry.make(i, EntryKind.EVENT, 1, b"x" * size) for i in range(first, first + count)
    ]
    return WriteCommand.of(SEG, 1, first - 1, entries)


async def test_commands_queued_together_share_one_write_and_one_sync() -> None:
    kv = CountingKV()
    published: list[int] = []
    committer = GroupCommitter(CommandedCore(kv), True, lambda plan: published.append(1))
    futures = [committer.try_submit(batch(1 + 10 * n, 10)) for n in range(5)]
    futures.append(committer.submit(SealCommand(SEG, 2)))
    runner = asyncio.create_task(committer.run())
    outcomes = await asyncio.gather(*(f for f in futures if f is not None))
    committer.close()
    await runner
    committer.shutdown_executor()
    assert len(outcomes) == 6 and (kv.writes, kv.syncs, len(published)) == (1, 1, 1)
    assert [o.matched_index for o in outcomes[:5] if isinstance(o, WriteResult)] == [
        10,
        20,
        30,
        40,
        50,
    ]
    last = outcomes[5]
    assert isinstance(last, SealResult) and last.fence == 2 and last.acked_index == 40


async def test_a_full_queue_refuses_write_batches_but_not_seals() -> None:
    core = CommandedCore(MemoryKV())
    committer = GroupCommitter(core, True, lambda plan: None, queue_bytes_max=250)
    first = committer.try_submit(batch(1, 10))  # 100 bytes
    second = committer.try_submit(batch(11, 10))  # 200 bytes queued
    refused = committer.try_submit(batch(21, 10))  # would be 300: refused
    assert first is not None and second is not None and refused is None
    assert committer.queued_bytes == 200
    seal = committer.submit(SealCommand(SEG, 1))
    runner = asyncio.create_task(committer.run())
    await asyncio.gather(first, second, seal)
    assert committer.queued_bytes == 0
    assert committer.try_submit(batch(21, 10)) is not None  # room again
    committer.close()
    await runner
    committer.shutdown_executor()
    assert core.catalog.state(SEG).matched_index == 30


async def test_one_batch_larger_than_the_queue_is_still_taken_when_the_queue_is_empty() -> None:
    committer = GroupCommitter(CommandedCore(MemoryKV()), False, lambda plan: None, 50)
    assert committer.try_submit(batch(1, 10)) is not None
    assert committer.try_submit(batch(11, 1)) is None
    committer.close()
    await committer.run()
    committer.shutdown_executor()


async def test_the_watch_wakes_waiters_of_changed_segments_only() -> None:
    watch = SegmentWatch()
    mine, other = watch.event(SEG), watch.event(SegmentKey(2, 1))
    watch.changed([SEG])
    assert await SegmentWatch.wait(mine, 0.01)
    assert not await SegmentWatch.wait(other, 0.01)
    assert watch.event(SEG) is not mine  # a fresh event for the next change


class FullDiskKV(MemoryKV):
    """Refuses writes while full and, like RocksDB, keeps refusing after one failed
    until `recover` succeeds (which it cannot while full)."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False
        self.latched = False
        self.recoveries = 0

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        if self.full or self.latched:
            self.latched = True
            raise OSError("No space left on device")
        super().write(ops, sync)

    def recover(self) -> None:
        self.recoveries += 1
        if self.full:
            raise OSError("No space left on device: still full")
        self.latched = False


async def test_a_refused_kv_write_answers_unavailable_changes_nothing_then_recovers() -> None:
    kv = FullDiskKV()
    core = CommandedCore(kv)
    committer = GroupCommitter(core, True, lambda plan: None, recover_interval_s=0)
    runner = asyncio.create_task(committer.run())

    async def write(first: int) -> Outcome:
        future = committer.try_submit(batch(first, 5))
        assert future is not None
        return await future

    assert isinstance(await write(1), WriteResult)
    kv.full = True
    refused = await write(6)
    assert isinstance(refused, StoreUnavailable) and "No space" in str(refused)
    assert core.catalog.state(SEG).matched_index == 5 and committer.queued_bytes == 0
    still = await write(6)  # a recovery is tried, and fails while the disk is full
    assert isinstance(still, StoreUnavailable) and "still full" in str(still)
    assert kv.recoveries == 1
    kv.full = False
    assert isinstance(await write(6), WriteResult)
    assert kv.recoveries == 2 and core.catalog.state(SEG).matched_index == 10
    assert isinstance(await write(11), WriteResult) and kv.recoveries == 2
    committer.close()
    await runner
    committer.shutdown_executor()


async def test_after_a_refused_write_recovery_is_tried_at_most_once_per_interval() -> None:
    kv = FullDiskKV()
    core = CommandedCore(kv)
    committer = GroupCommitter(core, True, lambda plan: None, recover_interval_s=3600)
    runner = asyncio.create_task(committer.run())
    kv.full = True
    for _ in range(3):
        future = committer.try_submit(batch(1, 5))
        assert future is not None and isinstance(await future, StoreUnavailable)
        kv.full = False  # space is back, but the interval has not passed
    assert kv.recoveries == 0 and core.catalog.meta(SEG) is None
    committer.close()
    await runner
    committer.shutdown_executor()


class ThreadNotingKV(MemoryKV):
    """Notes the thread of every write; each sync advances its clock (`now_s`) by
    `sync_s`. A real clock would not do: under load a thread's sync may wait longer
    than INLINE_SYNC_S_MAX for the interpreter's lock alone."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []
        self.sync_s = 0.0
        self.clock_s = 0.0

    def now_s(self) -> float:
        return self.clock_s

    def write(self, ops: Sequence[KVOp], sync: bool) -> None:
        self.threads.append(threading.get_ident())
        super().write(ops, sync)

    def sync(self) -> None:
        self.clock_s += self.sync_s
        super().sync()


async def test_small_groups_commit_on_the_loop_while_syncs_are_quick() -> None:
    kv = ThreadNotingKV()
    committer = GroupCommitter(CommandedCore(kv), True, lambda plan: None, sync_clock_s=kv.now_s)
    runner = asyncio.create_task(committer.run())
    loop_thread = threading.get_ident()

    async def commit(command: WriteCommand) -> None:
        future = committer.try_submit(command)
        assert future is not None
        assert isinstance(await future, WriteResult)

    await commit(batch(1, 1))  # a lone append: on the loop
    await commit(batch(2, INLINE_GROUP_ENTRIES_MAX + 1))  # too many entries: the thread
    await commit(batch(67, 1, size=INLINE_GROUP_BYTES_MAX + 1))  # too many bytes: the thread
    kv.sync_s = 2 * INLINE_SYNC_S_MAX
    await commit(batch(68, 1))  # on the loop, and its sync is slow...
    kv.sync_s = 0.0
    await commit(batch(69, 1))  # ...so the next goes to the thread, whose sync is quick...
    await commit(batch(70, 1))  # ...and the one after is back on the loop.
    # A repair's copy comes through `submit` (never refused): its size counts all the same.
    copied = await committer.submit(batch(71, INLINE_GROUP_ENTRIES_MAX + 1))
    assert isinstance(copied, WriteResult)
    committer.close()
    await runner
    committer.shutdown_executor()
    on_loop = [thread == loop_thread for thread in kv.threads]
    assert on_loop == [True, False, False, True, False, True, False]
    assert committer.queued_bytes == 0
