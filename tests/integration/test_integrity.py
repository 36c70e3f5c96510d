"""Integrity with real processes: damage at rest in a stopped store's files is found
(by the scrub, or by RocksDB at the store's start), the master re-replicates from a copy
that matches the certificate, readers never receive a wrong payload meanwhile, a source
that differs from the certificate is skipped, and `verify` says which replica is which.

The figures the tests print (`-s`): seconds from the damaged store's restart to the
master hearing of the damage, and to the segment being back at N verified replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from streamengine.client import StreamClient
from streamengine.testing import (
    Cluster,
    ServerProcess,
    free_port,
    metric_value,
    running_cluster,
    wait_for,
)
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc
from tests.integration import damage
from tests.integration.test_cli import run_cli

pytestmark = pytest.mark.timeout(300)

STREAM = "acme/ledger"
SCRUB_MB_PER_S = "20"
MASTER_ARGS = ["--lease-ms", "2000", "--bridge-grace-ms", "500"]
STORE_TIMEOUT_MS = 2000
# Reads of the whole stream while a repair runs: bounded in count (and by the test's
# deadlines in time).
READS_MAX = 200


def payload(index: int) -> bytes:
    return b"%06d:" % index + bytes([index % 251]) * 300


@dataclass
class Damaged:
    cluster: Cluster
    metrics_port: int

    def stub(self) -> tuple[grpc.Channel, master_pb2_grpc.MasterStub]:
        channel = grpc.insecure_channel(self.cluster.master_address)
        return channel, master_pb2_grpc.MasterStub(channel)

    def sealed(self) -> list[entry_pb2.Segment]:
        channel, stub = self.stub()
        with channel:
            reply = stub.ListSegments(
                master_pb2.ListSegmentsRequest(stream=STREAM, certificates=True), timeout=5
            )
        return [s for s in reply.segments if s.state == entry_pb2.SEALED]

    def segment(self, epoch: int) -> entry_pb2.Segment:
        return next(s for s in self.sealed() if s.id.epoch == epoch)

    def store(self, store_id: str) -> ServerProcess:
        return next(s for s in self.cluster.stores if s.name == store_id)

    def root(self, store_id: str) -> Path:
        return self.cluster.root / store_id

    def master_count(self, name: str, labels: str = "") -> float:
        return metric_value(self.metrics_port, name, labels)

    def alive(self, store_id: str) -> bool:
        channel, stub = self.stub()
        with channel:
            status = stub.GetClusterStatus(master_pb2.GetClusterStatusRequest(), timeout=5)
        return any(s.store_id == store_id and s.alive for s in status.stores)

    def describe(self) -> str:
        """The stores as the master judges them and its repair tasks, for a failure."""
        try:
            channel, stub = self.stub()
            with channel:
                status = stub.GetClusterStatus(master_pb2.GetClusterStatusRequest(), timeout=5)
        except grpc.RpcError as error:
            return f"; the master's status: {error.code().name}"
        stores = ", ".join(f"{s.store_id} {'alive' if s.alive else 'DEAD'}" for s in status.stores)
        tasks = "; ".join(
            f"{master_pb2.RepairTask.State.Name(t.state)} {t.segment.epoch}: "
            f"{t.source_store}->{t.target_store} for {t.replaced_store} ({t.reason}) {t.error}"
            for t in status.tasks[-6:]
        )
        return f"; stores: {stores}; last tasks: {tasks}"

    def tasks(self) -> list[master_pb2.RepairTask]:
        channel, stub = self.stub()
        with channel:
            status = stub.GetClusterStatus(master_pb2.GetClusterStatusRequest(), timeout=5)
        return list(status.tasks)


def fully_verified(segment: entry_pb2.Segment) -> bool:
    """N members, each seen matching the segment's certificate, none known bad."""
    members = {r.store_id for r in segment.copy_set}
    verified = {v.store_id for v in segment.verified}
    return (
        segment.HasField("certificate")
        and len(members) == 3
        and members <= verified
        and not segment.bad_stores
    )


@pytest.fixture
def damaged(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Damaged]:
    """Four stores; `indirect` parametrization gives the master's store timeout (ms)."""
    port = free_port()
    store_timeout_ms = getattr(request, "param", STORE_TIMEOUT_MS)
    with running_cluster(
        tmp_path,
        stores=4,
        master_args=[
            *MASTER_ARGS,
            f"--store-timeout-ms={store_timeout_ms}",
            "--metrics-port",
            str(port),
        ],
        store_args=["--scrub-mb-per-s", SCRUB_MB_PER_S],
    ) as cluster:
        yield Damaged(cluster, port)


@pytest.fixture
def exactly_n(tmp_path: Path) -> Iterator[Damaged]:
    """Three stores for segments of N=3: no store outside a copy set can take a
    replica, so a damaged one can only be repaired in place."""
    port = free_port()
    with running_cluster(
        tmp_path,
        stores=3,
        # The damaged store is stopped and restarted: not dead meanwhile (see below).
        master_args=[*MASTER_ARGS, "--store-timeout-ms=10000", "--metrics-port", str(port)],
        store_args=["--scrub-mb-per-s", SCRUB_MB_PER_S],
    ) as cluster:
        yield Damaged(cluster, port)


async def write_sealed(client: StreamClient, segments: int, events: int) -> list[bytes]:
    """`segments` sealed segments of `events` events each, every one sealed by its
    writer's roll (so certified by the writer)."""
    await client.create_stream(STREAM, replicas=3, write_quorum=2)
    payloads: list[bytes] = []
    async with client.writer(STREAM) as writer:
        for _ in range(segments):
            batch = [payload(len(payloads) + i) for i in range(events)]
            for start in range(0, events, 500):
                await writer.append_batch(batch[start : start + 500])
            payloads += batch
            await client.seal(STREAM)
    return payloads


async def read_all(client: StreamClient) -> list[bytes]:
    return [event.payload async for event in client.read(STREAM)]


async def read_until(client: StreamClient, payloads: list[bytes], done: asyncio.Event) -> int:
    """Read the whole stream again and again until `done`: every read must return
    exactly what was written. Returns how many reads ran."""
    reads = 0
    while not done.is_set() and reads < READS_MAX:
        assert await read_all(client) == payloads, "a reader received a wrong payload"
        reads += 1
    return reads


async def watch(
    condition: object, timeout_s: float, what: str, cluster: Damaged | None = None
) -> float:
    """Seconds until `condition()` holds (polled off the event loop); past the timeout,
    what `cluster`'s master shows of its stores and repairs goes with the error."""
    started = time.monotonic()
    assert callable(condition)

    def holds() -> bool:
        with contextlib.suppress(grpc.RpcError, OSError):
            return bool(condition())
        return False

    while not await asyncio.to_thread(holds):
        if time.monotonic() - started > timeout_s:
            shown = await asyncio.to_thread(cluster.describe) if cluster else ""
            raise TimeoutError(f"{what} not reached in {timeout_s} s{shown}")
        await asyncio.sleep(0.1)
    return round(time.monotonic() - started, 2)


# The victim is stopped, damaged and restarted: on a busy box that took 1.8 s once, and
# with a 2 s timeout the master had replaced it as dead before its scrub could report.
@pytest.mark.parametrize("damaged", [10_000], indirect=True, ids=["store-timeout-10s"])
async def test_a_flipped_sst_block_is_found_by_the_scrub_and_the_replica_replaced(
    damaged: Damaged,
) -> None:
    async with StreamClient(damaged.cluster.master_address) as client:
        payloads = await write_sealed(client, 1, 3000)
        wait_for(lambda: all(map(fully_verified, damaged.sealed())), 30, 0.2, "verified")
        [segment] = damaged.sealed()
        victim_id = segment.copy_set[0].store_id
        victim = damaged.store(victim_id)
        assert victim.terminate() == 0  # a clean stop flushes the memtable to an SST
        sst = damage.flip_in_sst(damaged.root(victim_id))
        victim.start()

        done = asyncio.Event()
        reading = asyncio.create_task(read_until(client, payloads, done))

        def heard() -> bool:
            counted = 'outcome="damaged"'
            return damaged.master_count("streamengine_master_replica_checks_total", counted) > 0

        def replaced() -> bool:
            now = damaged.segment(segment.id.epoch)
            return fully_verified(now) and victim_id not in {r.store_id for r in now.copy_set}

        try:
            detected_s = await watch(heard, 30, "the scrub's damage report")
            repaired_s = await watch(replaced, 60, "the replica replaced", damaged)
        finally:
            done.set()
        reads = await reading
        print(
            f"\nSST {sst.name}: damage reported {detected_s} s after the restart, "
            f"replica replaced {detected_s + repaired_s} s after it; {reads} full reads"
        )
        assert await read_all(client) == payloads
    verified = run_cli("verify", STREAM, "--master", damaged.cluster.master_address)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.count("matches the certificate") == 3, verified.stdout
    # What matched is kept across a master restart (the scrub checks a replica again
    # only after 10 minutes): still three matched, none to check again.
    master = damaged.cluster.master
    assert master.terminate() == 0
    master.start()
    status = run_cli("status", "--json", "--master", damaged.cluster.master_address)
    assert json.loads(status.stdout)["sealed_replicas"] == {
        "matched": 3,
        "not_matched_yet": 0,
        "bad": 0,
    }, status.stdout
    verified = run_cli("verify", STREAM, "--master", damaged.cluster.master_address)
    assert verified.stdout.count("; matched") == 3, verified.stdout


async def test_a_flipped_sst_block_with_no_spare_store_is_repaired_in_place(
    exactly_n: Damaged,
) -> None:
    """Issue #36, item 2: with exactly N stores the damaged replica has nowhere to go.
    Its store drops its copy and copies the segment back from a replica that matches
    the certificate; `verify` passes again, and readers never see a wrong payload."""
    cluster = exactly_n.cluster
    async with StreamClient(cluster.master_address) as client:
        payloads = await write_sealed(client, 1, 3000)
        wait_for(lambda: all(map(fully_verified, exactly_n.sealed())), 30, 0.2, "verified")
        [segment] = exactly_n.sealed()
        members = [r.store_id for r in segment.copy_set]
        victim_id = members[0]
        victim = exactly_n.store(victim_id)
        assert victim.terminate() == 0  # a clean stop flushes the memtable to an SST
        sst = damage.flip_in_sst(exactly_n.root(victim_id))
        victim.start()

        done = asyncio.Event()
        reading = asyncio.create_task(read_until(client, payloads, done))

        def heard() -> bool:
            counted = 'outcome="damaged"'
            return exactly_n.master_count("streamengine_master_replica_checks_total", counted) > 0

        def verify_passes() -> bool:
            verified = run_cli("verify", STREAM, "--master", cluster.master_address)
            return verified.returncode == 0

        try:
            detected_s = await watch(heard, 30, "the scrub's damage report")
            repaired_s = await watch(verify_passes, 60, "verify passing again", exactly_n)
        finally:
            done.set()
        reads = await reading
        print(
            f"\nSST {sst.name}: damage reported {detected_s} s after the restart, "
            f"verify passed {detected_s + repaired_s} s after it; {reads} full reads"
        )
        now = exactly_n.segment(segment.id.epoch)
        assert [r.store_id for r in now.copy_set] == members, "repaired in place"
        assert fully_verified(now)
        assert await read_all(client) == payloads
        in_place = [t for t in exactly_n.tasks() if t.state == master_pb2.RepairTask.DONE]
        assert [(t.source_store, t.target_store) for t in in_place if t.target_store == victim_id]
    verified = run_cli("verify", STREAM, "--master", cluster.master_address)
    assert verified.stdout.count("matches the certificate") == 3, verified.stdout


async def test_a_wal_damaged_mid_log_keeps_the_store_down_and_its_replicas_move(
    damaged: Damaged,
) -> None:
    """RocksDB would replay the log up to the damage and forget the rest (acknowledged
    writes, fences): the store refuses to start instead, the master repairs what it
    held from the others, and once the operator empties the store it serves again."""
    async with StreamClient(damaged.cluster.master_address) as client:
        payloads = await write_sealed(client, 1, 1000)
        wait_for(lambda: all(map(fully_verified, damaged.sealed())), 30, 0.2, "verified")
        [segment] = damaged.sealed()
        victim_id = segment.copy_set[0].store_id
        victim = damaged.store(victim_id)
        victim.kill()  # every write of the store still only in its write-ahead log
        damage.flip_in_wal(damaged.root(victim_id))
        victim.start(wait=False)
        assert victim.process is not None and victim.process.wait(timeout=30) == 1
        assert "Corruption" in victim.log()

        done = asyncio.Event()
        reading = asyncio.create_task(read_until(client, payloads, done))

        def moved() -> bool:
            now = damaged.segment(segment.id.epoch)
            return fully_verified(now) and victim_id not in {r.store_id for r in now.copy_set}

        try:
            repaired_s = await watch(moved, 60, "the replica moved", damaged)
        finally:
            done.set()
        reads = await reading
        print(f"\nWAL damaged: replica moved {repaired_s} s after the store failed ({reads} reads)")
        # The operator's remedy: the damaged database goes, the store starts empty.
        shutil.rmtree(damage.db_dir(damaged.root(victim_id)))
        victim.start()
        assert await read_all(client) == payloads


# The forged store is stopped, rewritten and restarted: with a 2 s timeout a busy box
# let the master declare it dead and repair it away first (2 runs in 8 at load 10-14),
# and readers then never met the forged copy. 6 s outlasts the restart; the dead member
# this test kills later is declared dead as much later.
@pytest.mark.parametrize("damaged", [6_000], indirect=True, ids=["store-timeout-6s"])
async def test_a_copy_differing_only_from_the_certificate_is_never_served_nor_copied(
    damaged: Damaged,
) -> None:
    """One replica's copy is replaced behind its store's back by another payload under
    a valid crc32c: only the certificate tells. Readers skip it and report it; a repair
    that copies from it fails its verification and the next attempt copies from another
    replica; `verify` names it; its own scrub condemns it and, a spare store being up,
    it is replaced there."""
    cluster = damaged.cluster
    async with StreamClient(cluster.master_address) as client:
        payloads = await write_sealed(client, 2, 1000)
        wait_for(lambda: all(map(fully_verified, damaged.sealed())), 30, 0.2, "verified")
        segment = damaged.sealed()[0]
        first, second, third = (r.store_id for r in segment.copy_set)
        stream_id, epoch = segment.id.stream_id, segment.id.epoch
        bad = damaged.store(first)
        assert bad.terminate() == 0
        index = 500
        original = damage.rewrite_copy(
            damaged.root(first), stream_id, epoch, index, b"forged", valid_crc=True
        )
        assert original == payloads[index - 1]
        scrubbing = bad.args.index("--scrub-mb-per-s")
        bad.args[scrubbing + 1] = "0"  # it must not find itself out yet
        bad.start()

        # Readers go to the first member first: the forged chunk never leaves.
        assert await read_all(client) == payloads
        wait_for(
            lambda: damaged.master_count("streamengine_master_reader_reports_total") >= 1,
            10,
            0.2,
            "the reader's report of the forged replica",
        )

        differs = run_cli("verify", STREAM, "--master", cluster.master_address)
        assert differs.returncode == 1
        assert f"  {first}: DIFFERS" in differs.stdout, differs.stdout

        # A repair copies from a verified member, the first in the copy set first: the
        # forged one. Its copy fails the certificate; the next attempt copies from
        # the other.
        damaged.store(third).kill()

        def copied() -> bool:
            return any(
                t.state == master_pb2.RepairTask.DONE and t.segment.epoch == epoch
                for t in damaged.tasks()
            )

        await watch(copied, 60, "the repair of the dead member", damaged)
        tasks = [t for t in damaged.tasks() if t.segment.epoch == epoch]
        failed = [t for t in tasks if t.state == master_pb2.RepairTask.FAILED]
        done = [t for t in tasks if t.state == master_pb2.RepairTask.DONE]
        assert [t.source_store for t in failed] == [first], tasks
        assert "certificate" in failed[0].error, failed[0].error
        assert [t.source_store for t in done] == [second], tasks

        # Its own scrub condemns it; a store outside the copy set is up to take its
        # place, so it is replaced there (with none, it would be refilled in place:
        # `test_a_flipped_sst_block_with_no_spare_store_is_repaired_in_place`).
        damaged.store(third).start()
        wait_for(lambda: damaged.alive(third), 30, 0.2, "the spare store back")
        bad.args[scrubbing + 1] = SCRUB_MB_PER_S
        bad.restart()

        def replaced() -> bool:
            now = damaged.segment(epoch)
            return fully_verified(now) and first not in {r.store_id for r in now.copy_set}

        wait_for(replaced, 60, 0.2, "the forged copy replaced")
        assert third in {r.store_id for r in damaged.segment(epoch).copy_set}
        assert await read_all(client) == payloads
    verified = run_cli("verify", STREAM, "--master", cluster.master_address)
    assert verified.returncode == 0, verified.stdout + verified.stderr


async def test_a_bit_flipped_under_its_crc_never_reaches_a_reader_of_a_certified_segment(
    damaged: Damaged,
) -> None:
    """A reader of a certified segment asks its stores to send copies unchecked
    (`reader_verifies`: it checks each chunk against the certificate). A copy flipped at
    rest under its old crc32c thus reaches the reader, which never hands it out, reads
    that chunk from another replica, and reports the first."""
    cluster = damaged.cluster
    async with StreamClient(cluster.master_address) as client:
        payloads = await write_sealed(client, 1, 1000)
        wait_for(lambda: all(map(fully_verified, damaged.sealed())), 30, 0.2, "verified")
        segment = damaged.sealed()[0]
        first = segment.copy_set[0].store_id
        bad = damaged.store(first)
        assert bad.terminate() == 0
        index = 700
        flipped = bytes([payloads[index - 1][0] ^ 0x01]) + payloads[index - 1][1:]
        damage.rewrite_copy(
            damaged.root(first),
            segment.id.stream_id,
            segment.id.epoch,
            index,
            flipped,
            valid_crc=False,
        )
        bad.args[bad.args.index("--scrub-mb-per-s") + 1] = "0"  # not found by its scrub
        bad.start()
        assert await read_all(client) == payloads
        batches = [batch async for batch in client.read_batches(STREAM)]
        assert [p for batch in batches for p in batch.column("payload").to_pylist()] == payloads
        # A report answered late (a loaded master) is counted once the master took it.
        wait_for(
            lambda: damaged.master_count("streamengine_master_reader_reports_total") >= 1,
            10,
            0.2,
            "the reader's report of the damaged replica",
        )


async def test_a_replica_counts_as_good_only_once_its_store_read_it_back(
    damaged: Damaged,
) -> None:
    """A store that does not scrub never has its replicas counted: their segments stay
    below N good replicas (never below W, nothing re-replicated) until it reads them
    back, shown as being verified, not as under-replicated: no replica is missing."""
    cluster = damaged.cluster
    lazy = damaged.store("store0")
    assert lazy.terminate() == 0
    scrubbing = lazy.args.index("--scrub-mb-per-s")
    lazy.args[scrubbing + 1] = "0"
    lazy.start()
    assert "never counts this store's sealed replicas as good" in lazy.log()
    channel, stub = damaged.stub()

    def status() -> master_pb2.ClusterStatus:
        reply: master_pb2.ClusterStatus = stub.GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=5
        )
        return reply

    def holding(store_id: str) -> set[int]:
        return {
            s.id.epoch for s in damaged.sealed() if store_id in {r.store_id for r in s.copy_set}
        }

    with channel:
        async with StreamClient(cluster.master_address) as client:
            await write_sealed(client, 4, 200)
        unread = holding("store0")
        assert unread, "placement spreads four segments over all four stores"

        def only_unread_listed() -> bool:
            now = status()
            # Below W only until every member reported holding the bridge; every replica
            # but store0's read back by its store (store0 may hold every segment).
            return (
                {s.id.epoch for s in now.verifying} == unread
                and not now.under_replicated
                and now.bytes_below_w == 0
                and now.replica_verification.unmatched == len(unread)
                and all(fully_verified(s) or s.id.epoch in unread for s in damaged.sealed())
            )

        wait_for(only_unread_listed, 30, 0.2, "every replica but store0's matched")
        now = status()
        assert now.bytes_below_n > 0, now
        assert not now.tasks, "a replica not read back is not replaced"
        master = ["--master", cluster.master_address]
        shown = json.loads(run_cli("status", "--json", *master).stdout)
        assert {s["epoch"] for s in shown["verifying"]} == unread
        assert shown["under_replicated"] == []
        table = run_cli("status", *master).stdout
        assert "UNDER-REPLICATED SEGMENTS: none" in table
        assert f"BEING VERIFIED: {len(unread)}" in table

        lazy.args[scrubbing + 1] = SCRUB_MB_PER_S
        lazy.restart()
        wait_for(lambda: not status().verifying, 30, 0.2, "store0's replicas matched")
        assert all(map(fully_verified, damaged.sealed()))
        assert status().replica_verification.unmatched == 0
        assert holding("store0") == unread
