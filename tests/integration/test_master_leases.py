"""Leases and epochs with real master processes and real writer processes.

Writers are `tests.integration.lease_writer` subprocesses that heartbeat over gRPC;
stores are registrations only (leases never contact a store), with a store timeout far
beyond the test so they stay alive.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from streamengine.testing import ServerProcess, free_port, make_master, wait_for
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

LEASE_MS = 1000
STREAM = "acme/orders"
REPO = Path(__file__).resolve().parents[2]


class Writer:
    def __init__(self, master: str, client_id: str, log: Path):
        self.client_id = client_id
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.lease_writer", master, STREAM, client_id],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def events(self) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def leads(self) -> dict[str, Any] | None:
        events = [e for e in self.events() if "role" in e]
        return events[-1] if events and events[-1]["role"] == "LEADER" else None

    def first_leader_event(self, after: float = 0.0) -> dict[str, Any] | None:
        """The first reply making this writer leader that came at or after `after`. By
        the reply's time: a heartbeat sent before a leader left may still be the one
        its release lets through."""
        for event in self.events():
            if event.get("role") == "LEADER" and float(event["rt"]) >= after:
                return event
        return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def terminate(self) -> int:
        self.process.terminate()
        return self.process.wait(10)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[ServerProcess]:
    process = make_master(tmp_path, ["--lease-ms", str(LEASE_MS), "--store-timeout-ms", "600000"])
    process.start()
    try:
        with grpc.insecure_channel(process.address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            for number in range(3):
                stub.RegisterStore(
                    master_pb2.RegisterStoreRequest(
                        store_id=f"s{number}", address=f"127.0.0.1:{free_port()}", zone=f"z{number}"
                    )
                )
            stub.CreateStream(
                master_pb2.CreateStreamRequest(
                    name=STREAM,
                    policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
                    create_tenant=True,
                )
            )
        yield process
    finally:
        process.kill()


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[list[Writer]]:
    started: list[Writer] = []
    yield started
    for writer in started:
        if writer.process.poll() is None:
            writer.kill()


def describe(address: str) -> master_pb2.StreamInfo:
    with grpc.insecure_channel(address) as channel:
        return master_pb2_grpc.MasterStub(channel).DescribeStream(
            master_pb2.DescribeStreamRequest(name=STREAM), timeout=2
        )


def leaders(group: list[Writer]) -> list[Writer]:
    return [w for w in group if w.leads()]


def test_two_writers_contend_exactly_one_leads_and_the_other_takes_over(
    master: ServerProcess, writers: list[Writer], tmp_path: Path
) -> None:
    writers += [Writer(master.address, f"w{n}", tmp_path / f"w{n}.log") for n in range(2)]
    wait_for(lambda: leaders(writers), 10, message="a leader")
    # Several lease periods: never two leaders, always the same one.
    deadline = time.monotonic() + 2.5 * LEASE_MS / 1000
    first = leaders(writers)
    while time.monotonic() < deadline:
        assert leaders(writers) == first and len(first) == 1
        time.sleep(0.05)
    leader = first[0]
    other = next(w for w in writers if w is not leader)
    info = describe(master.address)
    current = leader.leads()
    assert current is not None
    old_epoch = int(current["epoch"])
    assert info.leader_id == leader.client_id and info.epoch == old_epoch
    assert other.events()[-1]["role"] == "FOLLOWER"

    killed_at = time.time()
    leader.kill()
    event = wait_for(lambda: other.first_leader_event(after=killed_at), 10, message="takeover")
    took_s = float(event["rt"]) - killed_at
    heartbeat_s = LEASE_MS / 3 / 1000
    assert took_s <= LEASE_MS / 1000 + heartbeat_s + 0.25, f"takeover took {took_s:.3f}s"
    assert int(event["epoch"]) > old_epoch
    print(f"takeover after SIGKILL of the leader: {took_s:.3f}s (lease {LEASE_MS} ms)")


def test_leaving_releases_the_lease_at_once(
    master: ServerProcess, writers: list[Writer], tmp_path: Path
) -> None:
    writers += [Writer(master.address, f"w{n}", tmp_path / f"w{n}.log") for n in range(2)]
    wait_for(lambda: leaders(writers), 10, message="a leader")
    leader = leaders(writers)[0]
    other = next(w for w in writers if w is not leader)
    left_at = time.time()
    assert leader.terminate() == 0
    event = wait_for(lambda: other.first_leader_event(after=left_at), 10, message="takeover")
    took_s = float(event["rt"]) - left_at
    assert took_s < LEASE_MS / 1000 * 0.8, f"release should not wait for the lease: {took_s:.3f}s"


def test_sigkill_master_restart_epochs_increase_and_no_early_grant(
    master: ServerProcess, writers: list[Writer], tmp_path: Path
) -> None:
    epochs: list[int] = []
    for cycle in range(3):
        writer = Writer(master.address, f"c{cycle}", tmp_path / f"c{cycle}.log")
        writers.append(writer)
        event = wait_for(writer.first_leader_event, 10, message="leader")
        epochs.append(int(event["epoch"]))
        master.kill()
        writer.kill()
        restarted_at = time.time()
        master.start()
        probe_sent = time.time()
        with grpc.insecure_channel(master.address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            probe = stub.WriterHeartbeat(
                master_pb2.WriterHeartbeatRequest(stream=STREAM, client_id=f"late{cycle}"),
                timeout=2,
            )
            status = stub.GetClusterStatus(master_pb2.GetClusterStatusRequest(), timeout=2)
        if not status.granting_leases:
            # Still inside the start-up window after the probe: it cannot have led.
            assert probe.role == master_pb2.FOLLOWER and probe.epoch == epochs[-1]
        # Started once the master serves: a channel refused while it was down would
        # back off for about a second and hide the start-up window.
        late = Writer(master.address, f"late{cycle}", tmp_path / f"late{cycle}.log")
        writers.append(late)
        event = wait_for(late.first_leader_event, 10, message="grant after restart")
        # The grant happened no earlier than the request that got it was sent.
        granted_at = probe_sent if probe.role == master_pb2.LEADER else float(event["t"])
        waited_s = granted_at - restarted_at
        assert waited_s >= LEASE_MS / 1000, f"granted {waited_s:.3f}s after restart"
        epochs.append(int(event["epoch"]))
        late.kill()
    assert epochs == sorted(set(epochs)), f"epochs not strictly increasing: {epochs}"


def test_sigterm_exits_zero_and_metrics_only_when_asked(tmp_path: Path) -> None:
    port = free_port()
    with_metrics = make_master(tmp_path / "a", ["--metrics-port", str(port)])
    plain = make_master(tmp_path / "b")
    try:
        with_metrics.start()
        plain.start()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"streamengine_master_stores_alive" in body
        assert with_metrics.terminate() == 0
        assert plain.terminate() == 0
    finally:
        with_metrics.kill()
        plain.kill()
