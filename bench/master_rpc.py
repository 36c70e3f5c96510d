"""Master control-plane figures: lease renewals, grants (a synced RocksDB write each),
and the time to re-replicate a dead store's sealed segments.

    .venv/bin/python bench/master_rpc.py                 # starts its own processes
    .venv/bin/python bench/master_rpc.py --renewers 16 --seconds 5

- renewals/s: `--renewers` leaders (one stream each) heartbeating back to back over
  one aio channel;
- grant latency p50/p99: first heartbeats of fresh streams, one at a time (each grant
  persists the epoch and the new segment before it answers);
- re-replication: 5 stores, `--segments` sealed segments of `--events` x `--payload`
  bytes made over raw gRPC, one store SIGKILLed; seconds from the kill until every
  sealed segment is back at 3 replicas with matching digests (includes the store
  timeout, `--store-timeout-ms`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.segment_driver import Driver, fully_replicated, sealed_segments
from streamengine.testing import running_cluster, wait_for

POLICY = entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2)


async def renewals(address: str, renewers: int, seconds: float) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        epochs = {}
        secrets = {}
        for n in range(renewers):
            name = f"bench/renew{n}"
            await stub.CreateStream(
                master_pb2.CreateStreamRequest(name=name, policy=POLICY, create_tenant=True)
            )
            reply = await stub.WriterHeartbeat(
                master_pb2.WriterHeartbeatRequest(stream=name, client_id=f"c{n}")
            )
            epochs[name], secrets[name] = reply.epoch, reply.lease_secret
        count = 0
        deadline = time.monotonic() + seconds

        async def renew(n: int) -> None:
            nonlocal count
            name = f"bench/renew{n}"
            request = master_pb2.WriterHeartbeatRequest(
                stream=name, client_id=f"c{n}", epoch=epochs[name], lease_secret=secrets[name]
            )
            while time.monotonic() < deadline:
                reply = await stub.WriterHeartbeat(request)
                assert reply.role == master_pb2.LEADER
                count += 1

        started = time.monotonic()
        await asyncio.gather(*(renew(n) for n in range(renewers)))
        return count / (time.monotonic() - started)


def grant_latencies(address: str, grants: int) -> list[float]:
    latencies = []
    with grpc.insecure_channel(address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        for n in range(grants):
            name = f"bench/grant{n}"
            stub.CreateStream(
                master_pb2.CreateStreamRequest(name=name, policy=POLICY, create_tenant=True)
            )
            started = time.perf_counter()
            reply = stub.WriterHeartbeat(
                master_pb2.WriterHeartbeatRequest(stream=name, client_id="g")
            )
            latencies.append((time.perf_counter() - started) * 1000)
            assert reply.role == master_pb2.LEADER
    return latencies


def rereplication(root: Path, segments: int, events: int, payload: int, timeout_ms: int) -> float:
    args = ["--lease-ms", "5000", "--store-timeout-ms", str(timeout_ms)]
    with running_cluster(root, stores=5, master_args=args) as cluster:
        with grpc.insecure_channel(cluster.master_address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            wait_for(
                lambda: (
                    sum(
                        s.alive
                        for s in stub.GetClusterStatus(master_pb2.GetClusterStatusRequest()).stores
                    )
                    == 5
                ),
                20,
            )
            stub.CreateStream(
                master_pb2.CreateStreamRequest(
                    name="bench/repair", policy=POLICY, create_tenant=True
                )
            )
        driver = Driver(cluster.master_address, "bench/repair")
        for _ in range(segments):
            driver.fill_and_roll(events, payload)
        live = {s.name for s in cluster.stores}

        def replicated() -> bool:
            return all(
                fully_replicated(s, 3, live)
                for s in sealed_segments(cluster.master_address, "bench/repair")
            )

        wait_for(replicated, 60, 0.2)
        victim = cluster.stores[0]
        victim.kill()
        live.discard(victim.name)
        started = time.monotonic()
        wait_for(replicated, 300, 0.1)
        return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--renewers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--grants", type=int, default=200)
    parser.add_argument("--segments", type=int, default=20)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--payload", type=int, default=1000)
    parser.add_argument("--store-timeout-ms", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with running_cluster(
            root / "leases", stores=3, master_args=["--lease-ms", "5000"]
        ) as cluster:
            rate = asyncio.run(renewals(cluster.master_address, args.renewers, args.seconds))
            print(f"lease renewals: {rate:,.0f}/s ({args.renewers} leaders, one aio channel)")
            latencies = sorted(grant_latencies(cluster.master_address, args.grants))
            p50 = statistics.median(latencies)
            p99 = latencies[int(len(latencies) * 0.99) - 1]
            print(
                f"grant latency (synced epoch + segment): p50 {p50:.2f} ms, "
                f"p99 {p99:.2f} ms ({args.grants} grants)"
            )
        seconds = rereplication(
            root / "repair", args.segments, args.events, args.payload, args.store_timeout_ms
        )
        size_mb = args.segments * args.events * args.payload / 1e6
        print(
            f"re-replication after SIGKILL of 1 of 5 stores: {seconds:.2f} s "
            f"for {args.segments} sealed segments "
            f"({size_mb:.1f} MB per replica set, store timeout {args.store_timeout_ms} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
