"""The processes of a fault run: master and stores (`streamengine.testing`),
writer and reader processes (`tests.faults.workload`), a sampler of the master's
metadata and one of every process's memory. Every process can be killed (SIGKILL),
paused (SIGSTOP) and restarted.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from streamengine.protocol.limits import CREATE_STREAMS_PER_CALL_MAX
from streamengine.testing import ChildProcess, Cluster, ServerProcess
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc
from tests.faults.channels import open_channel
from tests.faults.history import Recorder
from tests.tree import ROOT, child_env

RPC_TIMEOUT_S = 2.0
# How often the sampler lists streams' segments (C11, C12), and how many streams at
# most each time: with more, it takes the next ones in turn (every stream is seen every
# len(streams) / SAMPLED_STREAMS_MAX seconds: 1,000 streams every 20 s).
SAMPLE_INTERVAL_S = 1.0
SAMPLED_STREAMS_MAX = 50
# Calls the harness keeps in flight to the master at once when it asks about every
# stream (creating them, waiting for their leaders).
MASTER_CALLS_IN_FLIGHT = 64
# Waiting for every stream's first leader: streams asked about a round, and the pause
# between rounds (1,000 streams: at most 400 calls a second, beside the grants).
LEADER_CHECKS_PER_ROUND = 100
LEADER_CHECK_INTERVAL_S = 0.25
# How often every process's resident memory is sampled (C13).
RSS_INTERVAL_S = 1.0


@dataclass
class ClientProcess(ChildProcess):
    """One writer or reader process of the workload; each start is a new incarnation."""

    name: str
    role: str  # writer | reader
    master: str
    streams: list[str]
    history: Path
    logs: Path
    seed: int
    options: list[str] = field(default_factory=list)
    prefix: list[str] = field(default_factory=list)  # e.g. `ip netns exec NS`
    # Added to the environment (e.g. libfaketime). Never a wrapper process such as
    # `faketime CMD`: signals for the workload would stop at the wrapper.
    env: dict[str, str] = field(default_factory=dict)
    inc: int = 0
    process: subprocess.Popen[bytes] | None = None
    stopped: bool = False

    def start(self) -> ClientProcess:
        assert not self.alive(), f"{self.name} already running"
        self.inc += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / f"{self.name}.log").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *self.prefix, sys.executable, "-m", "tests.faults.workload", self.role,
                    "--master", self.master, "--streams", ",".join(self.streams),
                    "--name", self.name, "--inc", str(self.inc),
                    "--history", str(self.history), "--seed", str(self.seed),
                    *self.options,
                ],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**child_env(), **self.env},
            )
        self.stopped = False
        return self

    def ask_to_stop(self) -> None:
        """SIGTERM without waiting (stop several processes at once)."""
        if self.alive():
            assert self.process is not None
            self.cont()
            self.process.terminate()

    def terminate(self, timeout_s: float = 25.0) -> None:
        """SIGTERM (the workload drains), SIGKILL if it does not exit in time."""
        if not self.alive():
            return
        assert self.process is not None
        self.cont()
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def resume(process: ServerProcess) -> None:
    """A stopped server continues; a dead one restarts (same data dir)."""
    if process.stopped and process.alive():
        process.cont()
    if not process.alive():
        process.start(wait=False)


@dataclass
class MetaSampler:
    """Lists streams' segments once a second into the history (C11, C12): every stream
    each time, or with more than `SAMPLED_STREAMS_MAX` the next ones in turn."""

    master: str
    streams: list[str]
    recorder: Recorder
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _next: int = 0  # where the next sample's turn begins

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="meta-sampler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.recorder.close()

    def turn(self) -> list[str]:
        """The streams the next sample lists."""
        count = min(len(self.streams), SAMPLED_STREAMS_MAX)
        chosen = [self.streams[(self._next + k) % len(self.streams)] for k in range(count)]
        self._next = (self._next + count) % len(self.streams)
        return chosen

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            # A channel per sample: with several masters, to the one active now. The
            # calls go out together: a master paused or down costs one timeout a sample.
            with open_channel(self.master) as channel:
                stub = master_pb2_grpc.MasterStub(channel)
                streams = self.turn()
                calls = [stub.ListSegments.future(master_pb2.ListSegmentsRequest(stream=stream),
                                                  timeout=RPC_TIMEOUT_S)
                         for stream in streams]
                for stream, call in zip(streams, calls, strict=True):
                    with contextlib.suppress(grpc.RpcError):
                        reply = call.result()
                        self.recorder.record("meta", stream=stream, segments=[
                            [s.id.epoch, entry_pb2.SegmentState.Name(s.state)]
                            for s in reply.segments
                        ])


@dataclass
class RssSampler:
    """Records the resident memory (MiB) of every running process once a second (C13:
    memory below its bound and not growing), and the machine's 1-minute load."""

    processes: Callable[[], dict[str, int]]  # name -> pid of what runs now
    recorder: Recorder
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.recorder.close()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(RSS_INTERVAL_S):
            sizes: dict[str, float] = {}
            for name, pid in self.processes().items():
                # A process may exit between the listing and the sample.
                with contextlib.suppress(psutil.Error):
                    sizes[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
            # The machine's load beside: liveness on a box others load too is not ours.
            self.recorder.record("rss", mib=sizes, load=round(os.getloadavg()[0], 2))


def cpu_seconds() -> float:
    """CPU seconds this process and its children, running or reaped, have used so far: a
    phase's cost to the machine, whatever else loads it (on two cores of its own a
    phase takes at least half its CPU seconds)."""
    import psutil

    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            used = child.cpu_times()
            total += used.user + used.system
    return total


def running_pids(processes: list[ServerProcess | ClientProcess]) -> dict[str, int]:
    """name -> pid of each process that runs now."""
    return {process.name: process.pid for process in processes if process.alive()}


def leader_of(cluster: Cluster, stream: str) -> str:
    """The client id leading `stream` now, "" when none (or the master is down)."""
    with open_channel(cluster.master_address) as channel:
        try:
            info = master_pb2_grpc.MasterStub(channel).DescribeStream(
                master_pb2.DescribeStreamRequest(name=stream), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError:
            return ""
        return str(info.leader_id)


def under_replicated(cluster: Cluster) -> int | None:
    """Sealed segments the master lists below N complete replicas, lacking one or being
    verified (None: no answer)."""
    with open_channel(cluster.master_address) as channel:
        try:
            status = master_pb2_grpc.MasterStub(channel).GetClusterStatus(
                master_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError:
            return None
    return len(status.under_replicated) + len(status.verifying)


def open_copy_set(cluster: Cluster, stream: str) -> list[str]:
    """Store ids of the copy set of `stream`'s newest segment ([] when unknown)."""
    with open_channel(cluster.master_address) as channel:
        try:
            reply = master_pb2_grpc.MasterStub(channel).ListSegments(
                master_pb2.ListSegmentsRequest(stream=stream), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError:
            return []
    if not reply.segments:
        return []
    return [replica.store_id for replica in reply.segments[-1].copy_set]


def create_streams(address: str, streams: list[str], replicas: int, quorum: int,
                   segment_bytes: int) -> None:
    """Create every stream (and its tenant), `CREATE_STREAMS_PER_CALL_MAX` a call."""
    policy = entry_pb2.ReplicationPolicy(replicas=replicas, write_quorum=quorum)
    with open_channel(address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        for start in range(0, len(streams), CREATE_STREAMS_PER_CALL_MAX):
            stub.CreateStreams(master_pb2.CreateStreamsRequest(streams=[
                master_pb2.CreateStreamRequest(name=name, policy=policy,
                                               segment_bytes=segment_bytes, create_tenant=True)
                for name in streams[start:start + CREATE_STREAMS_PER_CALL_MAX]
            ]), timeout=10.0)


def wait_for_leaders(address: str, streams: list[str], timeout_s: float) -> None:
    """Until every stream has had a leader (each asked about until it has one, at most
    `LEADER_CHECKS_PER_ROUND` a round, the longest waiting first: the master's calls
    are the writers' grants too); raises TimeoutError naming how many never had."""
    deadline = time.monotonic() + timeout_s
    waiting = list(streams)
    while waiting:
        asked, waiting = waiting[:LEADER_CHECKS_PER_ROUND], waiting[LEADER_CHECKS_PER_ROUND:]
        with open_channel(address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            for start in range(0, len(asked), MASTER_CALLS_IN_FLIGHT):
                batch = asked[start:start + MASTER_CALLS_IN_FLIGHT]
                calls = [stub.DescribeStream.future(
                    master_pb2.DescribeStreamRequest(name=name), timeout=RPC_TIMEOUT_S)
                    for name in batch]
                for name, call in zip(batch, calls, strict=True):
                    try:
                        led = bool(call.result().leader_id)
                    except grpc.RpcError:
                        led = False
                    if not led:
                        waiting.append(name)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} of {len(streams)} streams had no leader in "
                               f"{timeout_s:g} s (first: {waiting[:3]})")
        if waiting:
            time.sleep(LEADER_CHECK_INTERVAL_S)
