"""Master failover: SIGKILL of the active master to the first grant by the standby.

    .venv/bin/python -m bench.master_failover                 # etcd, 2 masters, 3 stores
    .venv/bin/python -m bench.master_failover --runs 10 --masters 3 --etcd-members 3

Starts its own etcd (on free 127.0.0.1 ports) and cluster. Per run, on a fresh stream, a
writer process (`bench.append_writer`) appends batches of 10 events one after the
other, as fast as acks come; the active master is SIGKILLed mid-stream, and a second
writer asks for a stream nobody leads. Figures per run:

- kill → standby active: until another master's health says it is the active one (the
  old election lease running out in etcd, then the standby's next poll);
- kill → first grant: until the second writer is granted an epoch by the new master,
  which waits one writer lease after it became active (the restart rule);
- appends per second before the kill (2 s), and from the kill to the first grant, and
  the longest wait between two acks of the first writer around the event (it keeps
  its epoch and keeps appending: the new master renews it).

The killed master is started again (a standby now) before the next run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import failover
from streamengine.testing import (
    Cluster,
    running_etcd,
    running_ha_cluster,
)
from streamengine.v1 import entry_pb2, master_pb2

# The rate before the kill is measured over this window, after the writer's first second.
BEFORE_WINDOW_S = 2.0
RUN_TIMEOUT_S = 60.0
# Every writer process stops after this many batches (bounded even if a run hangs).
BATCHES_MAX = 100_000


class WriterProcess(failover.WriterProcess):
    def __init__(self, master: str, stream: str, prefix: str, batches: int) -> None:
        super().__init__(master, stream, prefix, batches, timeout_s=RUN_TIMEOUT_S)

    def wait_acking_for(self, seconds: float) -> None:
        """Until the writer has been getting acks for `seconds` (at full speed by then)."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        with self.changed:
            while True:
                acks = [line["t"] for line in self.lines if "acked" in line]
                if acks and acks[-1] - acks[0] >= seconds:
                    return
                if any("error" in line for line in self.lines) or time.monotonic() > deadline:
                    raise SystemExit(f"the writer did not get going: {self.lines[-3:]}")
                self.changed.wait(max(0.0, deadline - time.monotonic()))

    def acks(self) -> list[tuple[float, int]]:
        """(wall time, events acked so far) per acked batch."""
        with self.changed:
            return [(line["t"], line["acked"] + 1) for line in self.lines if "acked" in line]



@dataclass(frozen=True)
class Run:
    active_s: float
    grant_s: float
    rate_before: float
    rate_through: float
    longest_wait_s: float
    errors: int


def acked_by(acks: list[tuple[float, int]], when: float) -> int:
    return max((count for t, count in acks if t <= when), default=0)


def create_stream(cluster: Cluster, name: str) -> None:
    from streamengine.protocol.master_calls import sync_masters

    with sync_masters(cluster.master_address) as masters:
        masters.stub.CreateStream(
            master_pb2.CreateStreamRequest(
                name=name,
                policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
                create_tenant=True,
            ),
            timeout=10,
        )


def one_run(cluster: Cluster, number: int) -> Run:
    stream, idle = f"bench/mf-{number}-{os.getpid()}", f"bench/mf-idle-{number}-{os.getpid()}"
    create_stream(cluster, stream)
    create_stream(cluster, idle)
    active = cluster.wait_active_master()
    writer = WriterProcess(cluster.master_address, stream, "a", BATCHES_MAX)
    second: WriterProcess | None = None
    try:
        writer.wait_acking_for(BEFORE_WINDOW_S + 1.0)
        killed_at = time.time()
        active.kill()
        second = WriterProcess(cluster.master_address, idle, "b", batches=1)
        new = cluster.wait_active_master(timeout_s=RUN_TIMEOUT_S)
        active_s = time.time() - killed_at
        assert new is not active
        granted = second.wait_line("leading")["t"]
        grant_s = granted - killed_at
        acks = writer.acks()
        before = acked_by(acks, killed_at) - acked_by(acks, killed_at - BEFORE_WINDOW_S)
        through = acked_by(acks, granted) - acked_by(acks, killed_at)
        times = [t for t, _ in acks if killed_at - 1 <= t <= granted]
        waits = [b - a for a, b in itertools.pairwise(times)]
        errors = sum(1 for line in writer.lines if "error" in line)
        return Run(
            active_s,
            grant_s,
            before / BEFORE_WINDOW_S,
            through / max(grant_s, 1e-9),
            max(waits, default=grant_s),
            errors,
        )
    finally:
        writer.kill()
        if second is not None:
            second.kill()
        # The killed master comes back as a standby for the next run.
        active.start(wait=False)
        active.wait_serving()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--masters", type=int, default=2)
    parser.add_argument("--etcd-members", type=int, default=1)
    parser.add_argument("--lease-ms", type=int, default=2000, help="the writers' lease")
    args = parser.parse_args(argv)
    runs: list[Run] = []
    master_args = ["--lease-ms", str(args.lease_ms)]
    with (
        tempfile.TemporaryDirectory(prefix="se-master-failover-") as root,
        running_etcd(Path(root) / "etcd", members=args.etcd_members) as etcd,
        running_ha_cluster(Path(root), etcd, args.masters, master_args=master_args) as cluster,
    ):
        for number in range(args.runs):
            run = one_run(cluster, number)
            runs.append(run)
            print(
                f"run {number + 1}: active after {run.active_s:.3f} s, first grant after "
                f"{run.grant_s:.3f} s; appends/s {run.rate_before:.0f} before, "
                f"{run.rate_through:.0f} through the failover; longest wait between "
                f"acks {run.longest_wait_s:.3f} s; failed writers {run.errors}",
                flush=True,
            )
    active = [r.active_s for r in runs]
    grants = [r.grant_s for r in runs]
    print(
        f"master failover over {len(runs)} runs ({args.masters} masters, "
        f"{args.etcd_members}-member etcd, writer lease {args.lease_ms} ms): "
        f"kill -> standby active median {statistics.median(active):.3f} s, "
        f"max {max(active):.3f} s (target <= 2 s: {'met' if max(active) <= 2 else 'MISSED'}); "
        f"kill -> first grant median {statistics.median(grants):.3f} s, "
        f"max {max(grants):.3f} s; appends/s median "
        f"{statistics.median(r.rate_before for r in runs):.0f} before, "
        f"{statistics.median(r.rate_through for r in runs):.0f} through; longest wait "
        f"between acks {max(r.longest_wait_s for r in runs):.3f} s; "
        f"failed writers {sum(r.errors for r in runs)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
