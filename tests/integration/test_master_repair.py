"""Repair, drain and rebalance with a real master and real segment stores.

Sealed segments with data are made by `bench.segment_driver` (raw gRPC to master and
stores). Every check reads the stores themselves: each sealed segment must end with N
distinct live members whose digests up to the bridge are equal and whose acked index
reached it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bench.segment_driver import Driver, fully_replicated, sealed_segments, store_stub
from streamengine.testing import Cluster, running_cluster, wait_for
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2

STREAM = "acme/orders"
REPLICAS = 3
STORE_TIMEOUT_MS = 1500
# Deleted streams leave at the master's next pass (about a second).
MASTER_ARGS = [
    "--lease-ms",
    "2000",
    "--store-timeout-ms",
    str(STORE_TIMEOUT_MS),
    "--delete-grace-s",
    "0",
]
EVENTS = 20
PAYLOAD_BYTES = 500


def master_stub(cluster: Cluster) -> tuple[grpc.Channel, master_pb2_grpc.MasterStub]:
    channel = grpc.insecure_channel(cluster.master_address)
    return channel, master_pb2_grpc.MasterStub(channel)


def status(cluster: Cluster) -> master_pb2.ClusterStatus:
    channel, stub = master_stub(cluster)
    with channel:
        reply: master_pb2.ClusterStatus = stub.GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=5
        )
        return reply


def create_stream(cluster: Cluster) -> None:
    channel, stub = master_stub(cluster)
    with channel:
        stub.CreateStream(
            master_pb2.CreateStreamRequest(
                name=STREAM,
                policy=entry_pb2.ReplicationPolicy(replicas=REPLICAS, write_quorum=2),
                create_tenant=True,
            ),
            timeout=5,
        )


def alive_ids(cluster: Cluster) -> set[str]:
    return {s.name for s in cluster.stores if s.alive()}


def all_replicated(cluster: Cluster, live: set[str]) -> bool:
    segments = sealed_segments(cluster.master_address, STREAM)
    return bool(segments) and all(fully_replicated(s, REPLICAS, live) for s in segments)


def wait_replicated(cluster: Cluster, live: set[str], timeout_s: float = 40.0) -> None:
    wait_for(
        lambda: all_replicated(cluster, live),
        timeout_s,
        0.2,
        "every sealed segment at N matching replicas",
    )
    wait_for(
        lambda: not (reported := status(cluster)).under_replicated and not reported.verifying,
        10,
        0.1,
        "no segment reported under-replicated or being verified",
    )


def holds(address: str, segment: entry_pb2.Segment) -> bool:
    channel, stub = store_stub(address)
    with channel:
        try:
            stub.GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(segment=segment.id), timeout=5
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
    return True


@pytest.fixture
def cluster5(tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(tmp_path, stores=5, master_args=MASTER_ARGS) as running:
        yield running


ZONES4 = ["z1", "z2", "z3", "z1"]


@pytest.fixture
def cluster4(tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(tmp_path, stores=4, master_args=MASTER_ARGS, zones=ZONES4) as running:
        yield running


def zones_of(segment: entry_pb2.Segment) -> list[str]:
    return sorted(r.zone for r in segment.copy_set)


@pytest.fixture
def cluster3(tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(tmp_path, stores=3, master_args=MASTER_ARGS) as running:
        yield running


def make_sealed(cluster: Cluster, count: int) -> Driver:
    wait_for(
        lambda: sum(s.alive for s in status(cluster).stores) == len(cluster.stores),
        15,
        0.1,
        "stores registered",
    )
    create_stream(cluster)
    driver = Driver(cluster.master_address, STREAM)
    for _ in range(count):
        driver.fill_and_roll(EVENTS, PAYLOAD_BYTES)
    return driver


def test_dead_stores_sealed_segments_come_back_to_n_matching_replicas(cluster5: Cluster) -> None:
    cluster = cluster5
    driver = make_sealed(cluster, 4)
    live = alive_ids(cluster)
    wait_replicated(cluster, live)

    # A member of the open segment dies: its leader is asked to roll; sealed segments
    # it held are copied to the survivors.
    reply = driver.lead()
    victim = reply.segment.copy_set[0].store_id
    cluster.stores[[s.name for s in cluster.stores].index(victim)].kill()
    live.discard(victim)
    started = time.monotonic()

    def roll_requested() -> bool:
        beat = driver.lead()
        return beat.roll_requested and victim in beat.roll_reason

    wait_for(roll_requested, 10, 0.3, "roll requested from the leader")
    wait_replicated(cluster, live)
    first_s = time.monotonic() - started
    dead = next(s for s in status(cluster).stores if s.store_id == victim)
    assert not dead.alive and dead.silent_ms > STORE_TIMEOUT_MS, dead

    # A second store dies: still enough survivors for N = 3.
    held = [s for s in sealed_segments(cluster.master_address, STREAM)]
    counts = {sid: sum(sid in [r.store_id for r in s.copy_set] for s in held) for sid in live}
    second = max(sorted(counts), key=lambda sid: counts[sid])
    cluster.stores[[s.name for s in cluster.stores].index(second)].kill()
    live.discard(second)
    started = time.monotonic()
    wait_replicated(cluster, live)
    second_s = time.monotonic() - started
    tasks = status(cluster).tasks
    assert any(t.reason == "store-dead" and t.state == master_pb2.RepairTask.DONE for t in tasks)
    for segment in sealed_segments(cluster.master_address, STREAM):
        assert {r.store_id for r in segment.copy_set}.isdisjoint({victim, second})
    print(
        f"re-replicated after store death: {first_s:.2f}s and {second_s:.2f}s "
        f"(store timeout {STORE_TIMEOUT_MS} ms, 4 segments of {EVENTS}x{PAYLOAD_BYTES} B)"
    )


def test_drain_moves_every_sealed_replica_off_the_store(cluster4: Cluster) -> None:
    cluster = cluster4
    make_sealed(cluster, 3)
    live = alive_ids(cluster)
    wait_replicated(cluster, live)
    segments = sealed_segments(cluster.master_address, STREAM)
    assert all(zones_of(s) == ["z1", "z2", "z3"] for s in segments), "one replica per zone"
    # Drain a z1 store: its replicas can only go to the other z1 store to keep zones apart.
    first = next(r for r in segments[0].copy_set if r.zone == "z1")
    drained, drained_address = first.store_id, first.address
    on_drained = [s for s in segments if drained in [r.store_id for r in s.copy_set]]

    channel, stub = master_stub(cluster)
    with channel:
        plan = stub.DrainStore(master_pb2.DrainStoreRequest(store_id=drained), timeout=5)
    assert len(plan.tasks) == len(on_drained)
    assert all(t.replaced_store == drained and t.target_store != drained for t in plan.tasks)
    assert plan.bytes_after[drained] == 0 < plan.bytes_before[drained]

    wait_replicated(cluster, live - {drained})
    for segment in sealed_segments(cluster.master_address, STREAM):
        assert drained not in [r.store_id for r in segment.copy_set]
        assert zones_of(segment) == ["z1", "z2", "z3"]
    wait_for(
        lambda: not any(holds(drained_address, s) for s in on_drained),
        15,
        0.2,
        "drained copies deleted",
    )
    drained_status = next(s for s in status(cluster).stores if s.store_id == drained)
    assert drained_status.draining


def test_rebalance_plans_then_moves_until_within_ten_percent(cluster3: Cluster) -> None:
    cluster = cluster3
    make_sealed(cluster, 4)
    wait_replicated(cluster, alive_ids(cluster))
    before = sealed_segments(cluster.master_address, STREAM)
    new = cluster.add_store()
    wait_for(
        lambda: sum(s.alive for s in status(cluster).stores) == 4, 15, 0.1, "new store registered"
    )

    channel, stub = master_stub(cluster)
    with channel:
        dry = stub.Rebalance(master_pb2.RebalanceRequest(dry_run=True), timeout=5)
        assert dry.tasks and all(t.target_store == new.name for t in dry.tasks)
        assert dry.bytes_before[new.name] == 0 < dry.bytes_after[new.name]
        assert sealed_segments(cluster.master_address, STREAM) == before, "a dry run moves nothing"
        plan = stub.Rebalance(master_pb2.RebalanceRequest(), timeout=5)
    assert len(plan.tasks) == len(dry.tasks) == 3
    after = dict(plan.bytes_after)
    mean = sum(after.values()) / len(after)
    assert all(abs(b - mean) <= 0.1 * mean for b in after.values()), after

    def moves_done() -> bool:
        tasks = [t for t in status(cluster).tasks if t.reason == "rebalance"]
        assert not any(t.state == master_pb2.RepairTask.FAILED for t in tasks), tasks
        return len(tasks) == 3 and all(t.state == master_pb2.RepairTask.DONE for t in tasks)

    wait_for(moves_done, 30, 0.2, "rebalance moves done")
    wait_replicated(cluster, alive_ids(cluster))
    per_store: dict[str, int] = dict.fromkeys(alive_ids(cluster), 0)
    for segment in sealed_segments(cluster.master_address, STREAM):
        for replica in segment.copy_set:
            per_store[replica.store_id] += segment.bytes
    mean = sum(per_store.values()) / len(per_store)
    assert all(abs(b - mean) <= 0.1 * mean for b in per_store.values()), per_store

    def stores_report_balanced() -> bool:
        used = {s.store_id: s.used_bytes for s in status(cluster).stores}
        mean = sum(used.values()) / len(used)
        return all(abs(b - mean) <= 0.1 * mean for b in used.values())

    wait_for(stores_report_balanced, 15, 0.2, "stores' own byte counts balanced")


def test_a_replica_that_missed_the_bridge_is_refilled(cluster3: Cluster) -> None:
    cluster = cluster3
    driver = make_sealed(cluster, 1)
    segment = driver.fill_and_roll(EVENTS, PAYLOAD_BYTES, bridge_on=2)
    missed = segment.copy_set[2]
    assert not fully_replicated(segment, REPLICAS, alive_ids(cluster))
    # No spare store in a 3-store cluster: the copy is refilled in place.
    wait_replicated(cluster, alive_ids(cluster))
    tasks = [t for t in status(cluster).tasks if t.reason == "missed-bridge"]
    assert any(
        t.state == master_pb2.RepairTask.DONE
        and t.target_store == t.replaced_store == missed.store_id
        and t.segment.epoch == segment.id.epoch
        for t in tasks
    ), tasks


def test_deleted_stream_replicas_are_deleted_from_the_stores(cluster3: Cluster) -> None:
    cluster = cluster3
    driver = make_sealed(cluster, 2)
    wait_replicated(cluster, alive_ids(cluster))
    channel, stub = master_stub(cluster)
    with channel:
        segments = list(stub.ListSegments(master_pb2.ListSegmentsRequest(stream=STREAM)).segments)
        assert driver.segment is not None and len(segments) == 3, "two sealed and the open one"
        reply = stub.DeleteStream(master_pb2.DeleteStreamRequest(name=STREAM), timeout=5)
        assert reply.segments == 3

        def removed() -> bool:
            try:
                stub.DescribeStream(master_pb2.DescribeStreamRequest(name=STREAM), timeout=5)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.NOT_FOUND, error
                return True
            return False

        wait_for(removed, 10, 0.1, "the deleted stream removed after its grace (0 s)")

    def all_deleted() -> bool:
        return not any(holds(r.address, s) for s in segments for r in s.copy_set)

    wait_for(all_deleted, 15, 0.2, "every replica of the deleted stream deleted")


def test_after_a_master_sigkill_metadata_survives_and_repair_goes_on(cluster4: Cluster) -> None:
    cluster = cluster4
    make_sealed(cluster, 2)
    wait_replicated(cluster, alive_ids(cluster))
    before = sealed_segments(cluster.master_address, STREAM)
    cluster.master.kill()
    cluster.master.start()
    after = sealed_segments(cluster.master_address, STREAM)
    for segment in [*before, *after]:
        segment.bytes = 0  # as the stores report them, not metadata
        segment.acked_index = 0
    assert after == before
    # The stores were never forgotten: their heartbeats are taken as they come.
    wait_replicated(cluster, alive_ids(cluster))
    victim = before[0].copy_set[0].store_id
    cluster.stores[[s.name for s in cluster.stores].index(victim)].kill()
    wait_replicated(cluster, alive_ids(cluster))
    for segment in sealed_segments(cluster.master_address, STREAM):
        assert victim not in [r.store_id for r in segment.copy_set]
        assert zones_of(segment) == ["z1", "z2", "z3"]
