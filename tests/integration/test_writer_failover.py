"""Leader failover, rolling and sealing against real processes (master + 3 or 4 stores).

Writers run as separate processes (`bench.append_writer`) so that a test
can SIGKILL or SIGSTOP one; what they acked is what they printed. Everything is read
back through the SDK across the segments' bridges.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from streamengine.client import SegmentState, StreamClient
from streamengine.client import writer as writer_module
from streamengine.client.errors import Unavailable
from streamengine.client.recovery import SegmentSealer
from streamengine.testing import Cluster, running_cluster, wait_until
from streamengine.tools.verify import verify_stream
from streamengine.v1 import master_pb2
from tests.integration.writer_process import WriterProcess, numbers_of, read_all

REPO = Path(__file__).resolve().parents[2]
LEASE_MS = 1000


async def test_a_killed_writer_is_taken_over_and_every_acked_append_survives_once(
    cluster: Cluster, writers: list[WriterProcess]
) -> None:
    name = "failover/kill"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        first = WriterProcess(cluster.master_address, name, "a")
        writers.append(first)
        await wait_until(lambda: first.last_acked() >= 300, 30, "300 acked appends")
        first.signal(signal.SIGKILL)
        first.kill()
        acked_before_kill = first.last_acked()
        first_epoch = first.leading_epoch()

        second = WriterProcess(cluster.master_address, name, "b", batches=5)
        writers.append(second)
        await wait_until(lambda: second.process.poll() is not None, 30, "takeover")
        assert second.first("done"), second.lines
        leading = second.first("leading")
        assert leading is not None and leading["leading"] > first_epoch

        events = await read_all(client, name)
        sequences = [sequence for sequence, _ in events]
        assert sequences == sorted(set(sequences))
        a = numbers_of(events, "a")
        # Acked ones all there, once, in order; in-doubt ones after them at most once.
        assert a == list(range(len(a))), "a-events out of order, duplicated or missing"
        assert len(a) >= acked_before_kill + 1
        assert numbers_of(events, "b") == list(range(50))
        by_epoch = {s.epoch: s for s in await client.list_segments(name)}
        assert by_epoch[first_epoch].state == SegmentState.SEALED


async def test_a_killed_leaders_lease_ends_at_once_and_a_paused_ones_runs_out(
    tmp_path: Path, writers: list[WriterProcess]
) -> None:
    """The leader holds a call open at the master; its death (the kernel resets the
    connection) ends the lease at once. A paused leader keeps its connection: the
    standby waits the lease out, as before."""
    lease_s = 8.0
    name = "failover/held"
    args = ["--lease-ms", str(int(lease_s * 1000))]
    with running_cluster(tmp_path, stores=3, master_args=args) as cluster:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(name, replicas=3, write_quorum=2)

        def started(prefix: str) -> WriterProcess:
            writer = WriterProcess(cluster.master_address, name, prefix)
            writers.append(writer)
            return writer

        async def takeover_s(leader: WriterProcess, prefix: str, number: int) -> float:
            """Seconds from sending `leader` signal `number` to a new standby leading."""
            await wait_until(lambda: leader.last_acked() >= 50, 30, f"{leader.prefix} appends")
            standby = started(prefix)
            await wait_until(lambda: standby.first("started") is not None, 30, "a standby")
            leader.signal(number)
            signalled_at = time.time()
            await wait_until(lambda: standby.first("leading") is not None, 3 * lease_s, "takeover")
            leading = standby.first("leading")
            assert leading is not None
            taken: float = leading["t"] - signalled_at
            return taken

        first = started("a")
        # Without the held call the standby waits out what is left of the lease: at
        # least two thirds of it (renewed every third).
        killed = await takeover_s(first, "b", signal.SIGKILL)
        assert killed < lease_s / 2, killed
        second = writers[-1]
        paused = await takeover_s(second, "c", signal.SIGSTOP)
        assert paused > lease_s / 2, paused
        second.signal(signal.SIGKILL)


async def test_a_paused_leader_gets_nothing_acked_after_a_takeover(
    cluster: Cluster, writers: list[WriterProcess]
) -> None:
    name = "failover/pause"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        old = WriterProcess(cluster.master_address, name, "a")
        writers.append(old)
        await wait_until(lambda: old.last_acked() >= 100, 30, "100 acked appends")
        old.signal(signal.SIGSTOP)
        try:
            async with client.writer(name, leadership_timeout_s=15) as new:
                assert new.epoch > old.leading_epoch()
                await new.append_batch([b"b-%06d" % i for i in range(20)])
                old.signal(signal.SIGCONT)
                await wait_until(lambda: old.first("error") is not None, 15, "old leader fails")
                await new.append_batch([b"b-%06d" % i for i in range(20, 40)])
        finally:
            old.signal(signal.SIGCONT)
        error = old.first("error")
        assert error is not None and error["error"] in {
            "LeadershipLost",
            "Fenced",
            "AppendInDoubt",
            "AppendFailed",
        }, error
        # Waking up, the old leader may still ack what W stores held before the
        # takeover (their replies waited in its socket): those are durable and in its
        # segment, before everything of the new leader's. Nothing it sent after waking
        # is acked: sealed stores refuse it.
        events = await read_all(client, name)
        a = numbers_of(events, "a")
        assert a == list(range(len(a))) and len(a) >= old.last_acked() + 1
        assert numbers_of(events, "b") == list(range(40))
        first_b = min(sequence for sequence, p in events if p.startswith(b"b-"))
        assert all(sequence < first_b for sequence, p in events if p.startswith(b"a-"))


async def test_rolling_by_size_gives_sealed_segments_read_back_whole(cluster: Cluster) -> None:
    name = "failover/roll"
    payloads = [b"r-%06d-" % i + b"x" * 90 for i in range(3000)]
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2, segment_bytes=64 << 10)
        async with client.writer(name) as writer:
            for start in range(0, len(payloads), 100):
                await writer.append_batch(payloads[start : start + 100])
        sealed_epoch = await client.seal(name)
        listing = await client.list_segments(name)
        sealed = [s for s in listing if s.state == SegmentState.SEALED]
        assert len(sealed) >= 4, [(s.epoch, s.state) for s in listing]
        assert sealed_epoch in {s.epoch for s in sealed}
        assert [p for _, p in await read_all(client, name)] == payloads
    report = await asyncio.to_thread(verify_stream, cluster.master_address, name)
    assert report.ok, report


async def test_a_segment_older_than_its_age_rolls(cluster: Cluster) -> None:
    name = "failover/age"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2, segment_age_ms=300)
        async with client.writer(name) as writer:
            first_epoch = writer.epoch
            number = 0
            deadline = time.monotonic() + 10
            while writer.epoch < first_epoch + 2:
                assert time.monotonic() < deadline, "no roll by age"
                await writer.append(b"age-%06d" % number)
                number += 1
                await asyncio.sleep(0.01)
            await writer.append(b"age-%06d" % number)  # acked once the last roll sealed
            number += 1
        # A clean close lets the recovery of the last roll finish: every segment but the
        # open one is sealed, and a read to the end needs no next leader.
        states = [s.state for s in await client.list_segments(name)]
        assert states[-1] == SegmentState.OPEN and len(states) >= 3
        assert set(states[:-1]) == {SegmentState.SEALED}, states
        events = await read_all(client, name)
        assert [p for _, p in events] == [b"age-%06d" % i for i in range(number)]


async def test_a_clean_close_lets_the_recovery_a_roll_started_finish(tmp_path: Path) -> None:
    """Closed while the recovery of the segment it rolled away from waits for a second
    store of its copy set (R = 2 of 3; two stopped), the writer waits for it, so the
    segment is SEALED when the close returns, not left SEALING for a next leader."""
    name = "failover/close"
    with running_cluster(tmp_path, stores=4, master_args=["--lease-ms", str(LEASE_MS)]) as c:
        async with StreamClient(c.master_address) as client:
            await client.create_stream(name, replicas=3, write_quorum=2)
            stopped = []
            try:
                async with client.writer(name) as writer:
                    await writer.append_batch([b"one", b"two"])
                    old_epoch = writer.epoch
                    [segment] = await client.list_segments(name)
                    stopped = [c.store_by_address(r.address) for r in segment.copy_set[:2]]
                    for store in stopped:
                        store.stop()
                    sealing = asyncio.create_task(client.seal(name, timeout_s=30))
                    await wait_until(lambda: writer.epoch > old_epoch, 15, "the roll")
                    assert writer.statistics().unsealed_epochs == (old_epoch,)
                    asyncio.get_running_loop().call_later(1.0, stopped[0].cont)
                states = {s.epoch: s.state for s in await client.list_segments(name)}
                assert states[old_epoch] == SegmentState.SEALED, states
                assert await sealing == old_epoch
            finally:
                for store in stopped:
                    store.cont()
            assert [p for _, p in await read_all(client, name)] == [b"one", b"two"]


async def test_seal_with_a_leader_rolls_and_without_one_leads_for_a_moment(
    cluster: Cluster,
) -> None:
    name = "failover/seal"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        assert await client.seal(name) == 0  # nothing open yet
        async with client.writer(name) as writer:
            await writer.append_batch([b"one", b"two"])
            epoch = writer.epoch
            assert await client.seal(name, timeout_s=15) == epoch
            await writer.append(b"three")  # in the next segment
            assert writer.epoch > epoch
            open_epoch = writer.epoch
        by_epoch = {s.epoch: s for s in await client.list_segments(name)}
        assert by_epoch[epoch].state == SegmentState.SEALED
        assert by_epoch[open_epoch].state == SegmentState.OPEN
        assert await client.seal(name, timeout_s=15) == open_epoch  # nobody leads
        listing = await client.list_segments(name)
        assert [s.state for s in listing if s.epoch <= open_epoch] == [SegmentState.SEALED] * 2
        assert [p for _, p in await read_all(client, name)] == [b"one", b"two", b"three"]


async def test_losing_a_copy_set_store_rolls_to_live_stores(tmp_path: Path) -> None:
    name = "failover/lost"
    with running_cluster(tmp_path, stores=4, master_args=["--lease-ms", str(LEASE_MS)]) as c:
        async with StreamClient(c.master_address) as client:
            await client.create_stream(name, replicas=3, write_quorum=2)
            async with client.writer(name) as writer:
                number = 0

                async def append_some(count: int) -> None:
                    nonlocal number
                    for _ in range(count):
                        await writer.append(b"l-%06d" % number)
                        number += 1

                await append_some(50)
                first_epoch = writer.epoch
                listing = await client.list_segments(name)
                copy_set = [r.address for r in listing[-1].copy_set]
                victim = c.store_by_address(copy_set[0])
                victim.kill()
                deadline = time.monotonic() + 30
                while writer.epoch == first_epoch:
                    assert time.monotonic() < deadline, "no roll after losing a store"
                    await append_some(10)
                await append_some(50)
                rolled_to = writer.epoch
            listing = await client.list_segments(name)
            by_epoch = {s.epoch: s for s in listing}
            assert by_epoch[first_epoch].state == SegmentState.SEALED
            live = [r.address for r in by_epoch[rolled_to].copy_set]
            assert victim.address not in live, (victim.address, listing)
            events = await read_all(client, name)
            assert [p for _, p in events] == [b"l-%06d" % i for i in range(number)]


def lead_and_die(master: str, name: str, client_id: str) -> None:
    """A heartbeat-only leader: it takes the lease (opening a segment), then dies."""
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.lease_writer", master, name, client_id],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout is not None
        while '"LEADER"' not in holder.stdout.readline():
            assert holder.poll() is None, "the lease holder exited"
    finally:
        holder.kill()
        holder.wait(10)


async def test_a_grant_without_a_segment_seals_both_earlier_ones_then_rolls(
    cluster: Cluster,
) -> None:
    """Two heartbeat-only leaders in a row leave two segments unsealed: the master then
    grants an epoch without a segment; the writer seals both, rolls, and leads."""
    name = "failover/gap"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        for number in range(2):
            await asyncio.to_thread(lead_and_die, cluster.master_address, name, f"holder-{number}")
        unsealed = [s for s in await client.list_segments(name) if not s.sealed]
        assert len(unsealed) == 2
        async with client.writer(name, leadership_timeout_s=20) as writer:
            await writer.append(b"after the gap")
            epoch = writer.epoch
        listing = await client.list_segments(name)
        assert [s.state for s in listing if s.epoch < epoch - 1] == [SegmentState.SEALED] * 2
        assert [p for _, p in await read_all(client, name)] == [b"after the gap"]


def _unavailable_once(call: Any) -> Any:
    """`call` (a stub method) whose first invocation fails with UNAVAILABLE, as a
    master that is briefly unreachable; later ones go through."""
    failed: list[bool] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(True)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "injected"
            )
        return call(*args, **kwargs)

    return wrapped


async def _two_unsealed(client: StreamClient, master: str, name: str) -> None:
    await client.create_stream(name, replicas=3, write_quorum=2)
    for number in range(2):
        await asyncio.to_thread(lead_and_die, master, name, f"holder-{number}")
    unsealed = [s for s in await client.list_segments(name) if not s.sealed]
    assert len(unsealed) == 2


async def test_a_roll_refused_after_closing_a_gap_is_asked_again(cluster: Cluster) -> None:
    """Issue 22: the roll out of an epoch granted without a segment fails once; the
    writer asks again (it used to wait forever while the master renewed its lease)."""
    name = "failover/gap-roll"
    async with StreamClient(cluster.master_address) as client:
        await _two_unsealed(client, cluster.master_address, name)
        stub = client.master
        stub.RollSegments = _unavailable_once(stub.RollSegments)
        async with client.writer(name, leadership_timeout_s=20) as writer:
            await writer.append(b"after the gap")
        assert [p for _, p in await read_all(client, name)] == [b"after the gap"]


async def test_a_recovery_failing_once_is_started_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: a sealer that ends with a transient error (not a fence) is reported to
    the core, which starts that recovery again; the writer then leads."""
    name = "failover/gap-sealer"
    failures: list[int] = []

    class FailingOnce(SegmentSealer):
        async def run(self) -> int:
            if not failures:
                failures.append(self.segment.epoch)
                await self.close()
                raise Unavailable("injected: a store answered nothing usable")
            return await super().run()

    monkeypatch.setattr(writer_module, "SegmentSealer", FailingOnce)
    async with StreamClient(cluster.master_address) as client:
        await _two_unsealed(client, cluster.master_address, name)
        async with client.writer(name, leadership_timeout_s=20) as writer:
            await writer.append(b"after the gap")
            epoch = writer.epoch
        assert failures, "the injected failure never happened"
        listing = await client.list_segments(name)
        assert [s.state for s in listing if s.epoch < epoch - 1] == [SegmentState.SEALED] * 2
        assert [p for _, p in await read_all(client, name)] == [b"after the gap"]


async def test_with_too_few_stores_for_a_new_segment_the_open_one_is_still_sealed(
    tmp_path: Path,
) -> None:
    """Two of four stores down, N = 3: no new copy set can be placed, but the open
    segment needs only R = 2 of its own stores to be sealed. `seal` gets an epoch without
    a segment and seals it, readers get every event; once a store is back, a writer
    rolls to a new segment and appends."""
    name = "failover/few"
    master_args = ["--lease-ms", str(LEASE_MS), "--store-timeout-ms", "2000"]
    with running_cluster(tmp_path, stores=4, master_args=master_args) as c:
        async with StreamClient(c.master_address) as client:
            await client.create_stream(name, replicas=3, write_quorum=2)
            async with client.writer(name) as writer:
                await writer.append_batch([b"f-%03d" % i for i in range(50)])
                epoch = writer.epoch
            [open_segment] = [s for s in await client.list_segments(name) if s.epoch == epoch]
            members = {r.store_id for r in open_segment.copy_set}
            outsider = next(s for s in c.stores if s.name not in members)
            member = next(s for s in c.stores if s.name in members)
            outsider.kill()
            member.kill()

            async def too_few_usable() -> bool:
                status = await client.master.GetClusterStatus(
                    master_pb2.GetClusterStatusRequest(), timeout=5
                )
                return sum(store.alive for store in status.stores) == 2

            await wait_until(too_few_usable, 30, "the master sees two stores down")
            assert await client.seal(name, timeout_s=20) == epoch
            by_epoch = {s.epoch: s for s in await client.list_segments(name)}
            assert by_epoch[epoch].state == SegmentState.SEALED
            assert [p for _, p in await read_all(client, name)] == [
                b"f-%03d" % i for i in range(50)
            ]

            member.start()
            async with client.writer(name, leadership_timeout_s=30) as writer:
                await writer.append(b"after")
                assert writer.epoch > epoch
            events = [p for _, p in await read_all(client, name)]
            assert events == [b"f-%03d" % i for i in range(50)] + [b"after"]
