"""Run the master: metadata, leases and epochs, store liveness, placement and repair.

Serves the Master gRPC service and gRPC health (SERVING once the catalog is loaded)
on --listen, keeps its metadata in RocksDB under --data, and exits 0 on SIGTERM after
a graceful stop. For one lease period after it starts it grants no lease: writer
heartbeats are answered FOLLOWER (with the previous holder, if any, still leading).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from streamengine.master import repair
from streamengine.master.catalog import Catalog
from streamengine.master.metrics import Metrics
from streamengine.master.repairer import Repairer
from streamengine.master.rocksdb_metadata import RocksDBMetadata
from streamengine.master.service import MasterService
from streamengine.master.state import MasterState
from streamengine.protocol import logs
from streamengine.protocol.channels import SERVER_OPTIONS
from streamengine.protocol.limits import HEARTBEATS_PER_LEASE, LEASE_MS_DEFAULT
from streamengine.v1 import master_pb2_grpc

log = logging.getLogger("streamengine.master")

STORE_TIMEOUT_MS_DEFAULT = 6000
# Copies at a time: one per replica of a typical policy, so a dead store's segments
# come back quickly without starving writers of disk and network.
# A lease shorter than this leaves writers too little time between heartbeats.
LEASE_MS_MIN = HEARTBEATS_PER_LEASE * 50
GAUGES_INTERVAL_S = 1.0
SHUTDOWN_GRACE_S = 1.0
MASTER_SERVICE = "streamengine.v1.Master"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", required=True, help="host:port to serve gRPC on")
    parser.add_argument(
        "--data", required=True, type=Path, help="directory for the metadata (RocksDB)"
    )
    parser.add_argument(
        "--lease-ms", type=int, default=LEASE_MS_DEFAULT, help="writer lease length"
    )
    parser.add_argument(
        "--store-timeout-ms",
        type=int,
        default=STORE_TIMEOUT_MS_DEFAULT,
        help="a store silent this long is dead and its sealed replicas are re-created",
    )
    parser.add_argument(
        "--bridge-grace-ms",
        type=int,
        default=None,
        help="after a seal or a copy-set change, how long a replica may stay below the "
        "bridge before it is replaced (default: the store timeout)",
    )
    parser.add_argument(
        "--repair-concurrency",
        type=int,
        default=repair.REPAIR_CONCURRENCY_DEFAULT,
        help="copies at a time",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus on 127.0.0.1:PORT"
    )
    parser.add_argument("--log-level", default="INFO")


def _clock_ms() -> int:
    return time.time_ns() // 1_000_000


def run(args: argparse.Namespace) -> int:
    logs.configure(getattr(logging, str(args.log_level).upper(), logging.INFO))
    if args.lease_ms < LEASE_MS_MIN:
        print(f"streamengine master: --lease-ms must be at least {LEASE_MS_MIN}", file=sys.stderr)
        return 2
    if args.store_timeout_ms < 100 or args.repair_concurrency < 1:
        print(
            "streamengine master: --store-timeout-ms >= 100 and --repair-concurrency >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0


async def _serve(args: argparse.Namespace) -> int:
    try:
        catalog = Catalog(RocksDBMetadata(Path(args.data)))
    except Exception as error:
        print(f"streamengine master: cannot open {args.data}: {error}", file=sys.stderr)
        return 1
    try:
        return await _serve_catalog(args, catalog)
    finally:
        catalog.close()


async def _serve_catalog(args: argparse.Namespace, catalog: Catalog) -> int:
    state = MasterState(
        catalog, _clock_ms(), args.lease_ms, args.store_timeout_ms, args.bridge_grace_ms
    )
    metrics = Metrics.create()
    repairer = Repairer(state, args.repair_concurrency, _clock_ms)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    master_pb2_grpc.add_MasterServicer_to_server(
        MasterService(state, repairer, _clock_ms, metrics), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        server.add_insecure_port(args.listen)
    except RuntimeError as error:
        print(f"streamengine master: cannot listen on {args.listen}: {error}", file=sys.stderr)
        return 1
    await server.start()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    for service in ("", MASTER_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "master serving on %s (lease %d ms, store timeout %d ms)",
        args.listen,
        args.lease_ms,
        args.store_timeout_ms,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with asyncio.TaskGroup() as group:
        background = [
            group.create_task(repairer.run()),
            group.create_task(_update_gauges(state, repairer, metrics)),
        ]
        await stop.wait()
        log.info("master stopping")
        await health_servicer.enter_graceful_shutdown()
        await server.stop(SHUTDOWN_GRACE_S)
        for task in background:
            task.cancel()
    return 0


async def _update_gauges(state: MasterState, repairer: Repairer, metrics: Metrics) -> None:
    while True:
        now = _clock_ms()
        views = state.store_views(now)
        metrics.stores_registered.set(len(views))
        metrics.stores_alive.set(sum(1 for v in views.values() if v.alive))
        metrics.streams.set(len(state.streams))
        metrics.segments.set(len(state.segments))
        metrics.under_replicated.set(len(state.under_replicated(now)))
        metrics.repairs_done.set(repairer.done_count)
        metrics.repairs_failed.set(repairer.failed_count)
        metrics.repairs_running.set(len(repairer.running))
        with contextlib.suppress(TimeoutError):
            await asyncio.sleep(GAUGES_INTERVAL_S)
