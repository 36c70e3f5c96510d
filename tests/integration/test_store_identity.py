"""Stores know who they are: the cluster they belong to, and their incarnation.

Real processes. A store's database keeps the id of the cluster whose master it first
registered with: started against another cluster's master it stops (exit 2, one line).
A store whose database was wiped comes back as a new incarnation under the same id:
it refuses to seal or write the segments it held before (a recovery must not count its
empty answer), the open segment rolls, and repair refills the sealed ones. A stream that
lost more than N - W replicas of its open segment that way is stuck until an operator
seals it accepting the loss.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from bench.segment_driver import Driver, fully_replicated, seal, sealed_segments, write
from streamengine.client import DataLossError, SegmentState, StreamClient, Unavailable
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.sequence import pack_sequence
from streamengine.segment_store.server import DB_DIR
from streamengine.testing import (
    STREAMENGINE,
    Cluster,
    running_cluster,
    server_env,
    wait_for,
)
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.integration.test_cli import run_cli
from tests.integration.test_master_repair import STREAM, create_stream

MASTER_ARGS = ["--lease-ms", "2000", "--store-timeout-ms", "1500"]
EVENTS = 20


def cluster_id_of(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = store_grpc.SegmentStoreStub(channel).ListSegmentRecords(
            segment_store_pb2.ListSegmentRecordsRequest(), timeout=5
        )
    return reply.cluster_id


def segment_state(address: str, stream_id: int, epoch: int) -> segment_store_pb2.SegmentStateReply:
    segment = entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch, stream=STREAM)
    with grpc.insecure_channel(address) as channel:
        return store_grpc.SegmentStoreStub(channel).GetSegmentState(
            segment_store_pb2.GetSegmentStateRequest(segment=segment), timeout=5
        )


def registered(cluster: Cluster) -> bool:
    return all(cluster_id_of(store.address) for store in cluster.stores)


def incarnations(cluster: Cluster) -> dict[str, int]:
    with grpc.insecure_channel(cluster.master_address) as channel:
        status = master_pb2_grpc.MasterStub(channel).GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=5
        )
    assert status.cluster_id == cluster_id_of(cluster.stores[0].address)
    return {s.store_id: s.incarnation for s in status.stores}


def test_a_store_on_another_clusters_data_dir_refuses_to_start(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "a", stores=1) as first:
        wait_for(lambda: registered(first), 15, 0.1, "the store joined its cluster")
        kept = cluster_id_of(first.stores[0].address)
        assert kept.startswith("cluster-")
        store_args = first.stores[0].args
        assert first.stores[0].terminate() == 0
    with running_cluster(tmp_path / "b", stores=0) as second:
        args = list(store_args)
        args[args.index("--master") + 1] = second.master_address
        done = subprocess.run(
            [STREAMENGINE, *args], capture_output=True, text=True, timeout=60, env=server_env()
        )
    assert done.returncode == 2, done
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("streamengine store: ") and kept in last, done.stderr


def test_a_wiped_store_is_a_new_incarnation_that_never_stands_for_its_lost_replicas(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path, stores=3, master_args=MASTER_ARGS) as cluster:
        wait_for(lambda: registered(cluster), 15, 0.1, "the stores joined their cluster")
        create_stream(cluster)
        driver = Driver(cluster.master_address, STREAM)
        for _ in range(2):
            driver.fill_and_roll(EVENTS, 100)
        every_store = {s.name for s in cluster.stores}

        def sealed_on_every_store() -> bool:
            return all(
                fully_replicated(s, 3, every_store)
                for s in sealed_segments(cluster.master_address, STREAM)
            )

        wait_for(sealed_on_every_store, 20, 0.2, "sealed segments at 3 replicas")
        driver.lead()
        assert driver.segment is not None
        open_segment = driver.segment
        events = [
            StoredEntry.make(i, EntryKind.EVENT, driver.epoch, b"x" * 100) for i in range(1, 6)
        ]
        for replica in open_segment.copy_set:
            write(replica.data_address, open_segment.id, driver.epoch, events, 5, driver.grant)

        wiped = cluster.stores[2]
        before = incarnations(cluster)
        wiped.kill()
        shutil.rmtree(tmp_path / wiped.name / DB_DIR)
        wiped.start()
        wait_for(lambda: registered(cluster), 15, 0.1, "the wiped store joined again")
        after = incarnations(cluster)
        assert after[wiped.name] not in (0, before[wiped.name])
        assert {k: v for k, v in after.items() if k != wiped.name} == {
            k: v for k, v in before.items() if k != wiped.name
        }

        # It holds nothing of the open segment and says so by not answering for it.
        for attempt in (
            lambda: write(
                wiped.data_address, open_segment.id, driver.epoch, events, 5, driver.grant
            ),
            lambda: seal(wiped.address, open_segment.id, driver.epoch, driver.grant),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                attempt()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "earlier incarnation" in (refused.value.details() or "")
        # The others still take it.
        seal(cluster.stores[0].address, open_segment.id, driver.epoch, driver.grant)

        def asked_to_roll() -> bool:
            beat = driver.lead()
            return beat.roll_requested and "new incarnation" in beat.roll_reason

        wait_for(asked_to_roll, 10, 0.2, "the leader asked to roll away from the lost replica")
        # Repair refills its sealed replicas from the good ones, verified.
        wait_for(sealed_on_every_store, 30, 0.2, "the wiped store's sealed replicas refilled")
        for segment in sealed_segments(cluster.master_address, STREAM):
            assert wiped.name in {r.store_id for r in segment.copy_set}


async def test_a_stream_whose_stores_were_wiped_is_stuck_until_sealed_accepting_loss(
    tmp_path: Path,
) -> None:
    """Two of three stores of the open segment come back wiped: no recovery can gather
    R = 2 answers (the wiped stores do not stand for what they lost), so the stream is
    stuck; `seal --accept-loss --yes` seals it at what the survivor holds, records the
    range whose acknowledged events may be lost (from the first index past the
    survivor's acked index to the segment's end), and the stream takes appends again.
    The survivor's acked index never rises into the range. Readers get every event
    before the range, then `DataLossError` naming it, and go on past it at the next
    segment."""
    with running_cluster(tmp_path, stores=3, master_args=MASTER_ARGS) as cluster:
        wait_for(lambda: registered(cluster), 15, 0.1, "the stores joined their cluster")
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(STREAM, replicas=3, write_quorum=2)
            before = [f"before-{n}".encode() for n in range(EVENTS)]
            async with client.writer(STREAM, leadership_timeout_s=15) as writer:
                await writer.append_batch(before)
                stuck_epoch = writer.epoch
            for wiped in cluster.stores[1:]:
                wiped.kill()
                shutil.rmtree(tmp_path / wiped.name / DB_DIR)
                wiped.start()
            wait_for(lambda: registered(cluster), 15, 0.1, "the wiped stores joined again")

            with pytest.raises(Unavailable):
                await client.seal(STREAM, timeout_s=3)
            listing = await client.list_segments(STREAM)
            assert [s.state for s in listing if s.epoch == stuck_epoch] != [SegmentState.SEALED]
            [stuck] = [s for s in listing if s.epoch == stuck_epoch]
            survivor = cluster.stores[0].address
            known_acked = segment_state(survivor, stuck.stream_id, stuck_epoch).acked_index

            asked = run_cli("seal", STREAM, "--accept-loss", "--master", cluster.master_address)
            assert asked.returncode == 1 and "add --yes" in asked.stdout, asked
            done = run_cli(
                "seal", STREAM, "--accept-loss", "--yes", "--master", cluster.master_address
            )
            assert done.returncode == 0, done
            assert f"lost (sealed accepting loss): segment {stuck_epoch} indexes" in done.stdout
            [lossy] = [s for s in await client.list_segments(STREAM) if s.epoch == stuck_epoch]
            assert lossy.sealed and lossy.lost_from_index == known_acked + 1
            held = segment_state(survivor, stuck.stream_id, stuck_epoch)
            assert held.acked_index == known_acked < lossy.final_index == held.last_index

            after = [f"after-{n}".encode() for n in range(EVENTS)]
            async with client.writer(STREAM, leadership_timeout_s=15) as writer:
                await writer.append_batch(after)

            read: list[bytes] = []
            with pytest.raises(DataLossError) as lost:
                async for event in client.read(STREAM):
                    read.append(event.payload)
            assert lost.value.accepted and lost.value.segment_epoch == stuck_epoch
            assert (lost.value.first_index, lost.value.last_index) == (
                lossy.lost_from_index,
                lossy.final_index,
            )
            assert read == before[: lossy.lost_from_index - 1]
            assert "to its end" in str(lost.value)
            assert lost.value.resume_sequence == pack_sequence(stuck_epoch + 1, 0)
            rest = [e.payload async for e in client.read(STREAM, lost.value.resume_sequence)]
            assert rest == after
