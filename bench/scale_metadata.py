"""The master's metadata cost against the number of streams (issue #38, metadata half).

    .venv/bin/python -m bench.scale_metadata                  # N = 100 ... 100,000
    .venv/bin/python -m bench.scale_metadata --streams 1000 10000

For each N, in this process, a master's state (`MasterState`) on a fresh embedded
(RocksDB, synced) catalog, three stores registered, and N idle streams spread over
tenants of `TENANT_STREAMS` each, every one with a sealed segment and an open one (the
catalog written in bulk, `seed`). Then:

- **create**: `CREATES_TIMED` more streams through CreateStream's path, one synced
  commit each (the rate at size N, quota check included);
- **list page**: one page of ListStreams (`PAGE_STREAMS` rows) from the middle of the
  names, and one tenant's page;
- **status**: GetClusterStatus' summary of the streams (counts and the rows shown);
- **retention pass**, **repair pass**, **gauges pass**: one pass of each of the master's
  loops over the idle catalog (median of `PASSES`), after every store reported once
  and every sealed segment was confirmed; **after a start**: one gauges pass before
  any was (a start leaves them all unconfirmed), and the repair ticks that confirm
  them all;
- **stop**: seconds from SIGTERM to the master's exit;
- **restart**: a `streamengine master` process started on the catalog: seconds from
  its start until it answers a ListStreams page, and its RSS then against an empty
  master's (memory per stream).

With `--etcd`: only a master started on an etcd holding the N streams (seconds until
it serves a page), and a standby's takeover once that master is killed.

Every figure is a wall-clock time on whatever machine runs it (a shared one inflates
them). The figures, with the machine they were taken on, are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from streamengine.etcd import rpc_pb2
from streamengine.master import replies
from streamengine.master.catalog import Batch, Catalog
from streamengine.master.core import listing
from streamengine.master.core.model import (
    Held,
    SegmentRecord,
    SegmentState,
    StoreRecord,
    StreamRecord,
)
from streamengine.master.etcd import EtcdClient, parse_etcd_url
from streamengine.master.metadata import Transaction
from streamengine.master.rocksdb_metadata import RocksDBMetadata
from streamengine.master.server import uncollected
from streamengine.master.state import MasterState
from streamengine.testing.etcd import running_etcd
from streamengine.testing.processes import ServerProcess, is_active_master, make_master
from streamengine.testing.waiting import wait_for
from streamengine.v1 import master_pb2, master_pb2_grpc

STREAMS_DEFAULT = (100, 1000, 10_000, 100_000)
TENANT_STREAMS = 1000
STORES = ("store0", "store1", "store2")
# Streams per seeding transaction: a stream record and its two segments each, within
# `metadata.OPS_PER_TRANSACTION_MAX`.
SEED_STREAMS_PER_COMMIT = 30
CREATES_TIMED = 500
PAGE_STREAMS = 100
PASSES = 5
NOW_MS = 10**12
RESTART_WAIT_S = 60.0
STOP_WAIT_S = 120.0


@dataclass
class Row:
    streams: int
    seed_s: float = 0.0
    create_per_s: float = 0.0
    page_ms: float = 0.0
    tenant_page_ms: float = 0.0
    status_ms: float = 0.0
    retention_ms: float = 0.0
    repair_ms: float = 0.0
    gauges_ms: float = 0.0
    load_s: float = 0.0
    restart_s: float = 0.0
    restart_cpu_s: float = 0.0
    master_rss_mib: float = 0.0
    bytes_per_stream: float = 0.0
    stop_s: float = 0.0
    gauges_start_ms: float = 0.0
    confirm_s: float = 0.0
    confirm_ticks: int = 0


def stream_name(number: int) -> str:
    return f"meta{number // TENANT_STREAMS}/s{number:07d}"


def seed(catalog: Catalog, streams: int, segments: bool = True) -> None:
    """N idle streams, each with a sealed segment (every replica verified) and an open
    one (or none, without `segments`), on the three stores `STORES` (registered), written
    in bulk as a restored catalog would be."""
    tenants = sorted({stream_name(n).split("/")[0] for n in range(streams)})
    batch = Batch().next_stream_id(streams + 1)
    for number, store_id in enumerate(STORES):
        batch.store(StoreRecord(store_id, f"127.0.0.1:{number + 1}", "", False))
    for tenant in tenants:
        batch.tenant(tenant, NOW_MS)
    catalog.commit(batch)
    per_commit = SEED_STREAMS_PER_COMMIT if segments else SEED_STREAMS_PER_COMMIT * 3
    for start in range(0, streams, per_commit):
        batch = Batch()
        for number in range(start, min(streams, start + per_commit)):
            name, stream_id = stream_name(number), number + 1
            epoch = 2 if segments else 0
            batch.stream(StreamRecord(name, stream_id, 3, 2, 256 << 20, 3_600_000, epoch, "", 0))
            if segments:
                sealed = SegmentRecord(
                    stream_id, name, 1, STORES, SegmentState.SEALED, 10, 0, NOW_MS, 0,
                    verified=STORES,
                )
                batch.segment(sealed)
                batch.segment(
                    SegmentRecord(stream_id, name, 2, STORES, SegmentState.OPEN, 0, 0, 0, 0)
                )
        catalog.commit(batch)


def median_ms(work: Callable[[], object], passes: int = PASSES) -> float:
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def report_every_store(state: MasterState, now_ms: int) -> None:
    for store_id in STORES:
        held = {key: Held(2, 10, 10, 1000) for key in state.members.get(store_id, ())}
        state.registry.store_heartbeat(store_id, 0, 1 << 40, held, now_ms)


def list_page(state: MasterState, tenant: str, after: str, size: int, now_ms: int) -> object:
    """A page as ListStreams serves it, starting after `after` ("": the first)."""
    token = listing.encode_page_token(f"{tenant}/" if tenant else "", after) if after else ""
    records, _ = state.tenancy.list_page(tenant, "", token, size)
    return [replies.stream_info_pb(state, r, now_ms) for r in records]


def status_summary(state: MasterState, now_ms: int) -> object:
    """The streams of a status as GetClusterStatus builds them."""
    under_replicated, _ = state.replicas.below_n(now_ms)
    shown = state.tenancy.summarise(under_replicated)
    return [replies.stream_info_pb(state, state.streams[name], now_ms) for name in shown.rows]


def gauges_pass(state: MasterState, now_ms: int) -> None:
    state.durability.observe(now_ms, state.replicas.exposures(now_ms))
    state.retention.pending_removals()


def measure_passes(state: MasterState, row: Row) -> None:
    for number, store_id in enumerate(STORES):
        state.registry.register_store(store_id, f"127.0.0.1:{number + 1}", "", 1 << 40, NOW_MS)
    report_every_store(state, NOW_MS)
    # After a start every sealed segment is unconfirmed until a repair tick judges it
    # (a bounded window a tick): what that costs, then the steady state after.
    row.gauges_start_ms = median_ms(lambda: gauges_pass(state, NOW_MS), passes=1)
    started = time.perf_counter()
    while state.unconfirmed:
        state.replicas.plan_repairs(NOW_MS, set(), 3)
        row.confirm_ticks += 1
    row.confirm_s = time.perf_counter() - started
    middle = stream_name(row.streams // 2)
    row.page_ms = median_ms(lambda: list_page(state, "", middle, PAGE_STREAMS, NOW_MS))
    row.tenant_page_ms = median_ms(lambda: list_page(state, "meta0", "", PAGE_STREAMS, NOW_MS))
    row.status_ms = median_ms(lambda: status_summary(state, NOW_MS))
    row.retention_ms = median_ms(lambda: state.retention.apply_retention(NOW_MS) and None)
    row.retention_ms += median_ms(lambda: state.retention.remove_due(NOW_MS))
    row.repair_ms = median_ms(lambda: state.replicas.plan_repairs(NOW_MS, set(), 3))
    row.gauges_ms = median_ms(lambda: gauges_pass(state, NOW_MS))
    started = time.perf_counter()
    for number in range(CREATES_TIMED):
        state.tenancy.create_stream(f"fresh/s{number:05d}", 3, 2, 0, 0, True, NOW_MS)
    row.create_per_s = CREATES_TIMED / (time.perf_counter() - started)


def master_serving_page(address: str) -> bool:
    if not is_active_master(address):
        return False
    with grpc.insecure_channel(address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        try:
            stub.ListStreams(master_pb2.ListStreamsRequest(tenant="meta0"), timeout=5.0)
        except grpc.RpcError:
            return False
    return True


def start_master(root: Path, name: str) -> tuple[ServerProcess, float, float]:
    """A master process on `root/name` (seeded or empty): it, the seconds until it
    answered a ListStreams page, and the CPU seconds it used by then (which a busy
    machine inflates less than the wall-clock time)."""
    master = make_master(root, name=name, extra_args=["--tenant-streams-max", "0"])
    started = time.monotonic()
    master.start(wait=False)
    wait_for(lambda: master_serving_page(master.address), RESTART_WAIT_S, 0.05, "master serving")
    serving_s = time.monotonic() - started
    cpu = psutil.Process(master.pid).cpu_times()
    return master, serving_s, cpu.user + cpu.system


def rss_mib(process: ServerProcess) -> float:
    return psutil.Process(process.pid).memory_info().rss / (1 << 20)


def measure(root: Path, streams: int, empty_rss_mib: float) -> Row:
    row = Row(streams)
    catalog = Catalog(RocksDBMetadata(root / "master"))
    started = time.perf_counter()
    seed(catalog, streams)
    row.seed_s = time.perf_counter() - started
    started = time.perf_counter()
    with uncollected():  # as the master loads it
        state = MasterState(catalog, NOW_MS, 1000, 3000, tenant_streams_max=0)
    row.load_s = time.perf_counter() - started
    measure_passes(state, row)
    catalog.close()
    master, row.restart_s, row.restart_cpu_s = start_master(root, "master")
    try:
        row.master_rss_mib = rss_mib(master)
    finally:
        started = time.perf_counter()
        master.terminate(timeout_s=STOP_WAIT_S)
        row.stop_s = time.perf_counter() - started
    row.bytes_per_stream = max(0.0, row.master_rss_mib - empty_rss_mib) * (1 << 20) / streams
    return row


class EtcdSeeder:
    """What `seed` commits, written straight into etcd under the masters' prefix (no
    election: no master runs yet)."""

    def __init__(self, url: str) -> None:
        self.client = EtcdClient(parse_etcd_url(url))
        self.prefix = self.client.config.meta_prefix

    def read_all(self) -> list[tuple[bytes, bytes]]:
        raise NotImplementedError

    def commit(self, transaction: Transaction) -> None:
        transaction.check()
        puts = [
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=self.prefix + key, value=value))
            for key, value in transaction.puts
        ]
        self.client.kv(self.client.member).Txn(rpc_pb2.TxnRequest(success=puts), timeout=30)

    def close(self) -> None:
        pass


def measure_etcd(root: Path, streams: int) -> tuple[float, float]:
    """On one etcd holding the N streams: seconds until a first master serves a page,
    and until a standby does after the first is killed (SIGKILL: its election lease
    runs out first)."""
    with running_etcd(root / "etcd") as etcd:
        url = etcd.url()
        seed(Catalog(EtcdSeeder(url)), streams)
        metadata = ["--metadata", url, "--tenant-streams-max", "0"]
        first = make_master(root, metadata, name="master0")
        standby = make_master(root, metadata, name="master1")
        try:
            started = time.monotonic()
            first.start(wait=False)
            wait_for(lambda: master_serving_page(first.address), RESTART_WAIT_S, 0.05, "first")
            first_s = time.monotonic() - started
            standby.start()
            first.kill()
            started = time.monotonic()
            wait_for(lambda: master_serving_page(standby.address), RESTART_WAIT_S, 0.05, "standby")
            return first_s, time.monotonic() - started
        finally:
            first.kill()
            standby.kill()


def print_row(row: Row) -> None:
    print(
        f"| {row.streams:,} | {row.create_per_s:,.0f}/s | {row.page_ms:.1f} ms, tenant "
        f"{row.tenant_page_ms:.1f} ms | {row.status_ms:.1f} ms | {row.retention_ms:.2f} ms "
        f"| {row.repair_ms:.2f} ms | {row.gauges_ms:.1f} ms | {row.load_s:.2f} s "
        f"| {row.restart_s:.2f} s ({row.restart_cpu_s:.2f} s CPU) | {row.master_rss_mib:.0f} MiB, "
        f"{row.bytes_per_stream:,.0f} B/stream | {row.stop_s:.2f} s "
        f"| gauges {row.gauges_start_ms:.0f} ms, confirmed in {row.confirm_ticks} ticks, "
        f"{row.confirm_s:.2f} s |",
        flush=True,
    )


@contextlib.contextmanager
def scratch(keep: Path | None, label: str) -> Iterator[Path]:
    if keep is not None:
        root = keep / label
        root.mkdir(parents=True)
        yield root
        return
    with tempfile.TemporaryDirectory(prefix="se-scale-meta-") as directory:
        yield Path(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=list(STREAMS_DEFAULT))
    parser.add_argument("--keep", type=Path, help="keep each catalog and log here")
    parser.add_argument(
        "--etcd", action="store_true", help="only a start and a standby's takeover on etcd"
    )
    args = parser.parse_args(argv)
    if args.etcd:
        print("| N | first master serving | standby serving after a kill |\n|---|---|---|")
        for streams in args.streams:
            with scratch(args.keep, f"etcd-{streams}") as root:
                first_s, takeover_s = measure_etcd(root, streams)
            print(f"| {streams:,} | {first_s:.2f} s | {takeover_s:.2f} s |", flush=True)
        return 0
    with scratch(args.keep, "empty") as root:
        empty, _, _ = start_master(root, "master")
        empty_rss = rss_mib(empty)
        empty.terminate()
    print(
        "| N | create | list page | status | retention pass | repair pass | gauges pass "
        "| load (in process) | restart to serving | master RSS | stop | after a start |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for streams in args.streams:
        with scratch(args.keep, str(streams)) as root:
            print_row(measure(root, streams, empty_rss))
    return 0


if __name__ == "__main__":
    sys.exit(main())
