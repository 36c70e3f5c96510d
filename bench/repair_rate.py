"""Repair time for a store's worth of data (FAULTS.md §1: "store declared dead -> its
sealed segments back at N replicas"), measured on real processes.

    python -m bench.repair_rate [--mb 100] [--out FILE.json]

A master and 4 stores (N=3, W=2; the master's store timeout 3 s, as in the scenarios) on
127.0.0.1; sealed segments of 4 KiB events written until the store holding the most has
`--mb` MB; that store killed (kill -9) and its directory wiped; the time until the
master lists its
segments under-replicated (detection: the store timeout plus a heartbeat) and until it
lists none (every segment back at N replicas), polled every 0.1 s. The copy rate is the
bytes the lost store held over the time after detection.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.segment_driver import Driver
from streamengine.testing import running_cluster, wait_for
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

STREAM = "repair/data"
EVENT_BYTES = 4096
EVENTS_PER_SEGMENT = 1500  # about 6 MB: under the 8 MiB write batch
STORES = 4
MB = 1_000_000
POLL_S = 0.1
REPAIR_TIMEOUT_S = 600.0


def status(master: str) -> master_pb2.ClusterStatus:
    with grpc.insecure_channel(master) as channel:
        return master_pb2_grpc.MasterStub(channel).GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=10)


def below_n(reported: master_pb2.ClusterStatus) -> int:
    """Sealed segments below N complete replicas: lacking one, or being verified."""
    return len(reported.under_replicated) + len(reported.verifying)


def measure(megabytes: float, root: Path) -> dict[str, float | int | str]:
    # A long lease: the driver writes a 6 MB segment to three stores between two
    # heartbeats (the lease plays no part in repair).
    master_args = ["--lease-ms", "30000", "--store-timeout-ms", "3000"]
    with running_cluster(root, stores=STORES, master_args=master_args) as cluster:
        with grpc.insecure_channel(cluster.master_address) as channel:
            master_pb2_grpc.MasterStub(channel).CreateStream(master_pb2.CreateStreamRequest(
                name=STREAM, policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
                segment_bytes=1 << 40, create_tenant=True), timeout=10)
        driver = Driver(cluster.master_address, STREAM)

        def held() -> dict[str, int]:
            return {s.store_id: s.used_bytes for s in status(cluster.master_address).stores}

        started = time.monotonic()
        while max(held().values(), default=0) < megabytes * MB:
            driver.fill_and_roll(EVENTS_PER_SEGMENT, EVENT_BYTES)
        fill_s = time.monotonic() - started
        wait_for(lambda: not below_n(status(cluster.master_address)), 60, 0.2,
                 "nothing under-replicated before the loss")
        # Every store has reported what it holds once two heartbeats agree.
        reports: list[dict[str, int]] = []

        def settled() -> bool:
            reports.append(held())
            return len(reports) > 1 and reports[-1] == reports[-2]

        wait_for(settled, 30, 1.1, "every store reported what it holds")
        sizes = reports[-1]
        victim_id = max(sizes, key=lambda store_id: sizes[store_id])
        victim = next(s for s in cluster.stores if s.name == victim_id)
        victim.kill()
        shutil.rmtree(cluster.root / victim.name)
        lost_at = time.monotonic()
        detected = repaired = None
        while time.monotonic() - lost_at < REPAIR_TIMEOUT_S:
            under = below_n(status(cluster.master_address))
            now = time.monotonic() - lost_at
            if under and detected is None:
                detected = now
            elif not under and detected is not None:
                repaired = now
                break
            time.sleep(POLL_S)
        if detected is None or repaired is None:
            raise RuntimeError(f"not repaired in {REPAIR_TIMEOUT_S} s (detected: {detected})")
        copy_s = repaired - detected
        return {
            "victim": victim_id,
            "bytes": sizes[victim_id],
            "fill_s": round(fill_s, 1),
            "detect_s": round(detected, 2),
            "repair_s": round(repaired, 2),
            "copy_mb_per_s": round(sizes[victim_id] / MB / copy_s, 1),
            "repair_s_per_100mb": round(detected + copy_s * 100 * MB / sizes[victim_id], 2),
        }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repair_rate",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="MB on the lost store")
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="faults-repair-"))
    try:
        figures = measure(args.mb, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
