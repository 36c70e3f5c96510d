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
from streamengine.master.console import ConsoleSnapshot, serve_console
from streamengine.master.metrics import Metrics
from streamengine.master.repairer import Repairer
from streamengine.master.service import MasterService
from streamengine.master.state import MasterState
from streamengine.protocol import identity, logs, transport
from streamengine.protocol.channels import SERVER_OPTIONS
from streamengine.protocol.limits import (
    HEARTBEATS_PER_LEASE,
    LEASE_MS_DEFAULT,
    TENANT_APPEND_BYTES_PER_S_DEFAULT,
    TENANT_STREAMS_MAX_DEFAULT,
)
from streamengine.protocol.parsing import RequestParsing
from streamengine.v1 import master_pb2_grpc

log = logging.getLogger("streamengine.master")

STORE_TIMEOUT_MS_DEFAULT = 6000
# Copies at a time: one per replica of a typical policy, so a dead store's segments
# come back quickly without starving writers of disk and network.
# A lease shorter than this leaves writers too little time between heartbeats.
LEASE_MS_MIN = HEARTBEATS_PER_LEASE * 50
GAUGES_INTERVAL_S = 1.0
# Calls in progress at once; more are refused as RESOURCE_EXHAUSTED at once instead of
# queueing without bound. Stores heartbeat once a second and writers once per lease/3:
# a cluster of hundreds of stores and a few thousand writers stays well below it.
CONCURRENT_RPCS_MAX = 4096
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
    transport.add_server_arguments(parser)
    add_quota_arguments(parser)


def add_quota_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tenant-streams-max",
        type=int,
        default=TENANT_STREAMS_MAX_DEFAULT,
        help="streams a tenant may hold; more are refused (0: no limit; default %(default)s)",
    )
    parser.add_argument(
        "--tenant-append-bytes-per-s",
        type=int,
        default=TENANT_APPEND_BYTES_PER_S_DEFAULT,
        help="payload bytes per second a tenant may append through each store; stores "
        "hold back more (0: no limit; default %(default)s)",
    )



def _clock_ms() -> int:
    return time.time_ns() // 1_000_000


def run(args: argparse.Namespace) -> int:
    logs.configure(getattr(logging, str(args.log_level).upper(), logging.INFO))
    if args.lease_ms < LEASE_MS_MIN:
        print(f"streamengine master: --lease-ms must be at least {LEASE_MS_MIN}", file=sys.stderr)
        return 2
    if args.tenant_streams_max < 0 or args.tenant_append_bytes_per_s < 0:
        print("streamengine master: quotas are not negative (0: no limit)", file=sys.stderr)
        return 2
    if args.store_timeout_ms < 100 or args.repair_concurrency < 1:
        print(
            "streamengine master: --store-timeout-ms >= 100 and --repair-concurrency >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        transport.check_protected_mode(args.listen, args.certs_dir, args.insecure)
    except transport.ProtectedMode as refusal:
        print(f"streamengine master: {refusal}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0
    except transport.TransportError as error:
        print(f"streamengine master: {error}", file=sys.stderr)
        return 1


async def _serve(args: argparse.Namespace) -> int:
    try:
        catalog = Catalog(Path(args.data))
    except Exception as error:
        print(f"streamengine master: cannot open {args.data}: {error}", file=sys.stderr)
        return 1
    try:
        return await _serve_catalog(args, catalog)
    finally:
        catalog.close()


async def _serve_catalog(args: argparse.Namespace, catalog: Catalog) -> int:
    state = MasterState(
        catalog,
        _clock_ms(),
        args.lease_ms,
        args.store_timeout_ms,
        args.bridge_grace_ms,
        tenant_streams_max=args.tenant_streams_max,
    )
    metrics = Metrics.create()
    members = (
        transport.PLAINTEXT
        if args.certs_dir is None
        else transport.Transport.for_node(args.certs_dir)
    )
    repairer = Repairer(state, args.repair_concurrency, _clock_ms, members)
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=CONCURRENT_RPCS_MAX,
        interceptors=[RequestParsing()],
    )
    signer = (
        identity.CertificateProof(members.cert_pem, members.key_pem) if members.tls else None
    )
    service = MasterService(
        state,
        repairer,
        _clock_ms,
        metrics,
        signer,
        tenant_append_bytes_per_s=args.tenant_append_bytes_per_s,
    )
    master_pb2_grpc.add_MasterServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        identity.install(transport.add_server_port(server, args.listen, args.certs_dir))
    except RuntimeError as error:
        print(f"streamengine master: cannot listen on {args.listen}: {error}", file=sys.stderr)
        return 1
    await server.start()
    snapshot = None
    if args.metrics_port is not None:
        snapshot = ConsoleSnapshot()
        serve_console(args.metrics_port, snapshot, metrics.registry)
    for health_name in ("", MASTER_SERVICE):
        await health_servicer.set(health_name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "master serving %s on %s (lease %d ms, store timeout %d ms)",
        "plaintext" if args.certs_dir is None else "TLS",
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
            group.create_task(_update_gauges(service, snapshot)),
        ]
        await stop.wait()
        log.info("master stopping")
        await health_servicer.enter_graceful_shutdown()
        await server.stop(SHUTDOWN_GRACE_S)
        for task in background:
            task.cancel()
    return 0


async def _update_gauges(service: MasterService, snapshot: ConsoleSnapshot | None) -> None:
    """Refresh the gauges, and the console's snapshot when it is served, on the master's
    loop."""
    state, repairer, metrics = service.state, service.repairer, service.metrics
    while True:
        now = _clock_ms()
        if snapshot is not None:
            snapshot.publish(service.console_status())
        views = state.store_views(now)
        metrics.stores_registered.set(len(views))
        metrics.stores_alive.set(sum(1 for v in views.values() if v.alive))
        metrics.streams.set(len(state.streams))
        metrics.segments.set(len(state.segments))
        exposures = state.exposures(now)
        metrics.under_replicated.set(len(exposures))
        debt_ms = state.durability.observe(now, exposures)
        metrics.durability_debt_seconds.inc(debt_ms / 1000)
        metrics.bytes_below_n.set(state.durability.bytes_below_n)
        metrics.bytes_below_w.set(state.durability.bytes_below_w)
        metrics.repairs_done.set(repairer.done_count)
        metrics.repairs_failed.set(repairer.failed_count)
        metrics.repairs_running.set(len(repairer.running))
        with contextlib.suppress(TimeoutError):
            await asyncio.sleep(GAUGES_INTERVAL_S)
