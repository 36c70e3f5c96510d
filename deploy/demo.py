"""`make demo`: a local cluster doing real work, end to end.

Starts a master and three stores on 127.0.0.1 (ports 7070-7073, data under
./demo-data, wiped first), creates `demo/orders`, appends 100,000 JSON events with a
progress bar while a follower tails them, SIGKILLs one store halfway and restarts it,
seals the stream, runs the Spark analytics job over the sealed segments, verifies every
replica by digest, prints a summary, and stops the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.workload import WorkloadResult, run_workload
from streamengine import StreamClient
from streamengine.protocol.transport import Transport
from streamengine.tools.local_cluster import LocalCluster
from streamengine.tools.verify import VerifyReport, verify_stream

STREAM = "demo/orders"
KILLED_STORE = "store1"


def progress_bar(done: int, total: int) -> None:
    width = 40
    filled = width * done // total
    bar = "#" * filled + "." * (width - filled)
    print(f"\r  appending [{bar}] {done:>7,}/{total:,}", end="", file=sys.stderr, flush=True)
    if done >= total:
        print(file=sys.stderr)


@dataclass(frozen=True)
class DemoResult:
    workload: WorkloadResult
    sealed_segments: int
    spark_events: int
    spark_per_epoch: list[tuple[int, int]]
    spark_per_kind: list[tuple[str, int, float]]
    verify: VerifyReport


async def produce(cluster: LocalCluster, events: int) -> tuple[WorkloadResult, int]:
    async def crash_and_restart_a_store() -> None:
        print(f"\n  halfway: SIGKILL {KILLED_STORE}, appends go on", file=sys.stderr)
        cluster.kill(KILLED_STORE)
        await asyncio.sleep(1.0)  # a while without it: the writer keeps W=2 with the others
        cluster.restart(KILLED_STORE, wait=False)  # from this long-lived thread, see restart()
        await asyncio.to_thread(cluster.wait_serving, KILLED_STORE)
        print(f"  {KILLED_STORE} restarted and catching up", file=sys.stderr)

    async with StreamClient(cluster.master_address, certs_dir=cluster.admin_certs_dir) as client:
        await client.create_stream(STREAM, replicas=3, write_quorum=2, segment_bytes=2 << 20)
        result = await run_workload(client, STREAM, events, crash_and_restart_a_store, progress_bar)
        print("  sealing the stream", file=sys.stderr)
        await client.seal(STREAM)
        sealed = sum(1 for s in await client.list_segments(STREAM) if s.sealed)
    return result, sealed


def analyse(
    master_address: str, certs_dir: Path | None
) -> tuple[int, list[tuple[int, int]], list[tuple[str, int, float]]]:
    from deploy.examples.analytics import Access, session
    from deploy.examples.analytics import analyse as spark_analyse

    print("  running the Spark job over the sealed segments", file=sys.stderr)
    spark = session()
    try:
        access = Access(str(certs_dir or ""))
        report = spark_analyse(spark, master_address, STREAM, "kind", access)
    finally:
        spark.stop()
    return report.events, report.per_epoch, report.per_field_value


def summary(result: DemoResult) -> str:
    w = result.workload
    lines = [
        "",
        "Stream Engine demo: summary",
        f"  appended        {w.appended:,} events in {w.seconds:.1f}s "
        f"({w.events_per_s:,.0f} events/s, 3 stores, W=2, fsync always)",
        f"  follower saw    {w.followed:,} events, "
        + ("identical to what was acknowledged, in order" if w.follower_matches else "A MISMATCH"),
        f"  store crash     {KILLED_STORE} SIGKILLed halfway and restarted; no append lost",
        f"  sealed          {result.sealed_segments} segments",
        f"  Spark counted   {result.spark_events:,} events",
    ]
    for epoch, count in result.spark_per_epoch:
        lines.append(f"      segment {epoch:>3}: {count:>7,} events")
    for kind, count, mean_bytes in result.spark_per_kind:
        lines.append(f"      kind {kind:<8} {count:>7,} events, mean payload {mean_bytes:.0f} B")
    verdict = "every replica identical" if result.verify.ok else "; ".join(result.verify.problems)
    lines.append(
        f"  verify          {result.verify.sealed_segments} sealed segments digested: {verdict}"
    )
    return "\n".join(lines)


def run(data_dir: Path, events: int, port: int) -> int:
    shutil.rmtree(data_dir, ignore_errors=True)
    cluster = LocalCluster(data_dir, stores=3, port=port)
    print(f"starting a local cluster: master 127.0.0.1:{port}, data {data_dir}", file=sys.stderr)
    cluster.start()
    try:
        started = time.perf_counter()
        workload, sealed = asyncio.run(produce(cluster, events))
        spark_events, per_epoch, per_kind = analyse(cluster.master_address, cluster.admin_certs_dir)
        verify = verify_stream(
            cluster.master_address, STREAM, Transport.for_client(cluster.admin_certs_dir)
        )
        result = DemoResult(workload, sealed, spark_events, per_epoch, per_kind, verify)
        print(summary(result))
        print(f"\n(demo took {time.perf_counter() - started:.0f}s; stopping the cluster)")
    finally:
        cluster.stop()
    healthy = (
        workload.follower_matches
        and workload.followed == workload.appended == events
        and spark_events == events
        and verify.ok
    )
    return 0 if healthy else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("demo-data"))
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--port", type=int, default=7070)
    args = parser.parse_args(argv)
    return run(args.data, args.events, args.port)


if __name__ == "__main__":
    sys.exit(main())
