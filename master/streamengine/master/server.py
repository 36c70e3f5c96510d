"""Run the master: metadata, leases and epochs, store liveness, placement and repair.

Serves the Master gRPC service and gRPC health on --listen and exits 0 on SIGTERM after
a graceful stop. Its metadata lives in the embedded RocksDB under --data (the default:
one master), or in etcd (`--metadata etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`): then
several masters run on the same etcd, one active, chosen by an etcd lease election
(`master.election`), and the others are standbys answering every call UNAVAILABLE with
the active master's address (`--advertise`) in the trailing metadata. Health: the
empty service name is SERVING once the process serves (standbys too);
`streamengine.v1.Master` is SERVING only while this master is the active one.

For one lease period after a master starts or becomes active it grants no lease:
writer heartbeats are answered FOLLOWER (with the previous holder, if any, still
leading).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from streamengine.master.catalog import Catalog
from streamengine.master.console import ConsoleSnapshot, serve_console
from streamengine.master.core import repair, retention
from streamengine.master.core.authority import LEASE_HOLDS_PER_PRINCIPAL_MAX, check_grant_ms
from streamengine.master.core.errors import InvalidArgument, RebuildUnfinished
from streamengine.master.election import ELECTION_TTL_S_DEFAULT, KEEPALIVES_PER_TTL, Election
from streamengine.master.etcd import EtcdClient, EtcdTLS, is_etcd_url, parse_etcd_url
from streamengine.master.etcd_metadata import EtcdMetadata
from streamengine.master.ha import MASTER_SERVICE, ElectedMaster
from streamengine.master.metrics import Metrics
from streamengine.master.rebuild import Rebuilder
from streamengine.master.rebuild import commit as commit_rebuilt
from streamengine.master.repair import Repairer
from streamengine.master.rocksdb_metadata import RocksDBMetadata
from streamengine.master.role import FOREVER_MS, MasterRole
from streamengine.master.service import MasterService
from streamengine.master.state import MasterState, new_cluster_id
from streamengine.protocol import identity, logs, transport
from streamengine.protocol.channels import SERVER_OPTIONS
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.grants import GRANT_MS_DEFAULT
from streamengine.protocol.limits import (
    HEARTBEATS_PER_LEASE,
    LEASE_MS_DEFAULT,
    TENANT_APPEND_BYTES_PER_S_DEFAULT,
    TENANT_STREAMS_MAX_DEFAULT,
)
from streamengine.protocol.parsing import RequestParsing
from streamengine.protocol.private_files import private_dir, tightened_message

log = logging.getLogger("streamengine.master")

STORE_TIMEOUT_MS_DEFAULT = 6000
# A lease shorter than this leaves writers too little time between heartbeats.
LEASE_MS_MIN = HEARTBEATS_PER_LEASE * 50
GAUGES_INTERVAL_S = 1.0
# Calls in progress at once; more are refused as RESOURCE_EXHAUSTED at once instead of
# queueing without bound. Stores heartbeat once a second and writers once per lease/3:
# a cluster of hundreds of stores and a few thousand writers stays well below it.
CONCURRENT_RPCS_MAX = 4096
assert CONCURRENT_RPCS_MAX >= 4 * LEASE_HOLDS_PER_PRINCIPAL_MAX
SHUTDOWN_GRACE_S = 1.0
# Stores register again within a few heartbeats of the master's start; a store missing
# past this is rebuilt without (its segments' other replicas still name it).
REBUILD_WAIT_S_DEFAULT = 30.0
# A commit to etcd blocks the master's event loop (its state is synchronous), which also
# runs the election keepalive: a commit may take at most half a TTL, so that with one
# keepalive interval before it the lease is still renewed in time.
COMMIT_SHARE_OF_TTL = 0.5
assert 1 / KEEPALIVES_PER_TTL + COMMIT_SHARE_OF_TTL < 1, "a slow commit never starves the lease"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", required=True, help="host:port to serve gRPC on")
    parser.add_argument(
        "--data",
        type=Path,
        help="directory for local files: the embedded metadata (RocksDB), unless "
        "--metadata names etcd",
    )
    parser.add_argument(
        "--metadata",
        default="",
        metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
        help="keep the metadata in etcd (several masters, one active) instead of under --data",
    )
    parser.add_argument(
        "--advertise",
        default="",
        metavar="HOST:PORT",
        help="the address clients and stores reach this master at, which standbys name "
        "(default: --listen)",
    )
    parser.add_argument(
        "--election-ttl-s",
        type=int,
        default=ELECTION_TTL_S_DEFAULT,
        help="etcd lease of the active master: a standby takes over this long (plus up "
        "to 0.5 s) after the active master dies",
    )
    parser.add_argument(
        "--lease-ms", type=int, default=LEASE_MS_DEFAULT, help="writer lease length"
    )
    parser.add_argument(
        "--grant-ms",
        type=int,
        default=GRANT_MS_DEFAULT,
        help="how long a leader's grant is good for: stores refuse it after that, and "
        "the master renews it with the lease (at least 4 leases; default %(default)s)",
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
        "--delete-grace-s",
        type=float,
        default=retention.DELETE_GRACE_MS_DEFAULT / 1000,
        help="deleted streams and trimmed segments stay on the stores this long (an "
        "undelete within it brings a stream back whole) (default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the web console and Prometheus metrics on this port (HTTPS with "
        "--certs-dir)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the console's host; beyond loopback it needs --certs-dir or --insecure",
    )
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="rebuild the metadata from the stores' segment records: refused on a --data "
        "that is not empty; with etcd, done when this master first serves empty metadata "
        "(deploy/README.md says when)",
    )
    parser.add_argument(
        "--rebuild-wait-s",
        type=float,
        default=REBUILD_WAIT_S_DEFAULT,
        help="with --rebuild: how long to wait for stores to register and answer",
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




def run(args: argparse.Namespace) -> int:
    logs.configure(getattr(logging, str(args.log_level).upper(), logging.INFO))
    if args.lease_ms < LEASE_MS_MIN:
        print(f"streamengine master: --lease-ms must be at least {LEASE_MS_MIN}", file=sys.stderr)
        return 2
    if args.delete_grace_s < 0:
        print("streamengine master: --delete-grace-s is not negative", file=sys.stderr)
        return 2
    try:
        check_grant_ms(args.grant_ms, args.lease_ms)
    except InvalidArgument as error:
        print(f"streamengine master: --grant-ms: {error}", file=sys.stderr)
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
    if args.metadata:
        try:
            parse_etcd_url(args.metadata)
        except InvalidArgument as error:
            print(f"streamengine master: --metadata: {error}", file=sys.stderr)
            return 2
        if args.election_ttl_s < 1:
            print("streamengine master: --election-ttl-s must be at least 1", file=sys.stderr)
            return 2
    elif args.data is None:
        print("streamengine master: --data is required without --metadata", file=sys.stderr)
        return 2
    if args.rebuild and args.rebuild_wait_s <= 0:
        print("streamengine master: --rebuild needs --rebuild-wait-s > 0", file=sys.stderr)
        return 2
    try:
        transport.check_protected_mode(args.listen, args.certs_dir, args.insecure)
        if args.metrics_port is not None:
            console = f"{args.metrics_host}:{args.metrics_port}"
            transport.check_protected_mode(console, args.certs_dir, args.insecure)
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
    role = MasterRole(args.advertise or args.listen)
    metrics = Metrics.create()
    members = (
        transport.PLAINTEXT
        if args.certs_dir is None
        else transport.Transport.for_node(args.certs_dir)
    )
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=CONCURRENT_RPCS_MAX,
        interceptors=[RequestParsing()],
    )
    signer = (
        identity.CertificateProof(members.cert_pem, members.key_pem) if members.tls else None
    )
    service = MasterService(
        role,
        wall_ms,
        metrics,
        signer,
        tenant_append_bytes_per_s=args.tenant_append_bytes_per_s,
    )
    service.add_to_server(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        identity.install(transport.add_server_port(server, args.listen, args.certs_dir))
    except RuntimeError as error:
        print(f"streamengine master: cannot listen on {args.listen}: {error}", file=sys.stderr)
        return 1
    if is_etcd_url(args.metadata):
        run_role = _etcd_master(args, role, health_servicer, members, service)
    else:
        try:
            _private_data_dir(Path(args.data))
            catalog = Catalog(RocksDBMetadata(Path(args.data)))
        except Exception as error:
            print(f"streamengine master: cannot open {args.data}: {error}", file=sys.stderr)
            return 1
        if args.rebuild and catalog.metadata.read_all():
            catalog.close()
            print(
                f"streamengine master: --rebuild refused: the metadata under {args.data} is "
                "not empty",
                file=sys.stderr,
            )
            return 2
        run_role = _embedded_master(args, role, catalog, health_servicer, members, service)

    await server.start()
    snapshot = None
    if args.metrics_port is not None:
        snapshot = ConsoleSnapshot()
        try:
            serve_console(
                args.metrics_port, snapshot, metrics.registry, args.metrics_host, args.certs_dir
            )
        except OSError as error:
            console = f"{args.metrics_host}:{args.metrics_port}"
            print(f"streamengine master: console on {console}: {error}", file=sys.stderr)
            return 1
    # The process serves; `MASTER_SERVICE` is SERVING only while this master is active.
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "master serving %s on %s (lease %d ms, store timeout %d ms, metadata %s)",
        "plaintext" if args.certs_dir is None else "TLS",
        args.listen,
        args.lease_ms,
        args.store_timeout_ms,
        args.metadata or f"under {args.data}",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    refusals: list[str] = []

    async def serve_role() -> None:
        try:
            await run_role
        except RebuildUnfinished as refusal:
            refusals.append(str(refusal))
            stop.set()

    async with asyncio.TaskGroup() as group:
        background = [
            group.create_task(serve_role()),
            group.create_task(_update_gauges(service, snapshot)),
        ]
        await stop.wait()
        log.info("master stopping")
        await health_servicer.enter_graceful_shutdown()
        await server.stop(SHUTDOWN_GRACE_S)
        for task in background:
            task.cancel()
    if refusals:
        print(f"streamengine master: {refusals[0]}", file=sys.stderr)
        return 2
    return 0


def _load_state(
    args: argparse.Namespace, catalog: Catalog, rebuilding: bool = False
) -> MasterState:
    """The master's state over `catalog`; while `rebuilding`, without a cluster id
    (the rebuild adopts the stores')."""
    with uncollected():
        return MasterState(
            catalog,
            wall_ms(),
            args.lease_ms,
            args.store_timeout_ms,
            args.bridge_grace_ms,
            tenant_streams_max=args.tenant_streams_max,
            delete_grace_ms=round(args.delete_grace_s * 1000),
            make_cluster_id=None if rebuilding else new_cluster_id,
            grant_ms=args.grant_ms,
        )


@contextlib.contextmanager
def uncollected() -> Iterator[None]:
    """No cyclic garbage collection while the catalog loads, and none of what it
    loaded looked at by later ones. Loading makes millions of records and indexes that
    live as long as the master or until refcounting frees them (records hold no
    cycles): every collection on the way would walk all made so far (over half of a
    start on 100,000 streams), and every full one after would walk them all again, on
    the master's loop."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.freeze()


def _new_repairer(
    args: argparse.Namespace, state: MasterState, members: transport.Transport
) -> Repairer:
    return Repairer(state, args.repair_concurrency, wall_ms, members)


def _private_data_dir(data: Path) -> None:
    tightened = private_dir(data)
    if tightened:
        log.warning(tightened_message("data dir", data, tightened))


async def _embedded_master(
    args: argparse.Namespace,
    role: MasterRole,
    catalog: Catalog,
    health_servicer: health.aio.HealthServicer,
    members: transport.Transport,
    service: MasterService,
) -> None:
    """The only master: active from the moment its catalog is loaded (with --rebuild,
    serving the stores only until the catalog is rebuilt from them)."""
    try:
        state = _load_state(args, catalog, rebuilding=bool(args.rebuild))
        state.registry.count_silence_from(wall_ms())
        repairer = _new_repairer(args, state, members)
        service.calls.rebuilding = bool(args.rebuild)
        role.activate(state, repairer, until_ms=FOREVER_MS)
        await health_servicer.set(MASTER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if args.rebuild:
            state = await _rebuild(args, catalog, state, service, members)
            repairer = _new_repairer(args, state, members)
            role.activate(state, repairer, until_ms=FOREVER_MS)
            service.calls.rebuilding = False
            log.info("metadata rebuilt: serving (no lease for one lease period)")
        await repairer.run()
    finally:
        role.step_down()
        catalog.close()


async def _rebuild(
    args: argparse.Namespace,
    catalog: Catalog,
    state: MasterState,
    service: MasterService,
    members: transport.Transport,
) -> MasterState:
    """Serve the stores only, ask them, write the catalog they make; the state loaded
    from it. The caller activates it and ends `service.calls.rebuilding`, with no await in
    between: no request sees the catalog half loaded."""
    service.calls.rebuilding = True
    rebuilt = await Rebuilder(state, members, args.rebuild_wait_s, wall_ms).run()
    commit_rebuilt(catalog, rebuilt)
    return _load_state(args, catalog)


async def _etcd_master(
    args: argparse.Namespace,
    role: MasterRole,
    health_servicer: health.aio.HealthServicer,
    members: transport.Transport,
    service: MasterService,
) -> None:
    """Stand by or serve as the election says (`master.ha`); on a clean stop give the
    election lease back so that a standby takes over at once. With `--rebuild`, the
    first time this master serves empty metadata it rebuilds it from the stores."""
    config = parse_etcd_url(args.metadata)
    # etcd follows the master's transport: TLS with its node certificate when it has one.
    client = EtcdClient(
        config, None if args.certs_dir is None else EtcdTLS.from_certs_dir(args.certs_dir)
    )
    election = Election(client, role.address, args.election_ttl_s, wall_ms)
    metadata = EtcdMetadata(client, commit_timeout_s=args.election_ttl_s * COMMIT_SHARE_OF_TTL)

    async def rebuild(
        catalog: Catalog, state: MasterState, activate: Callable[[MasterState], None]
    ) -> None:
        try:
            activate(await _rebuild(args, catalog, state, service, members))
        finally:
            service.calls.rebuilding = False
    elected = ElectedMaster(
        role,
        election,
        metadata,
        health_servicer,
        lambda catalog, rebuilding: _load_state(args, catalog, rebuilding),
        lambda state: _new_repairer(args, state, members),
        rebuild if args.rebuild else None,
    )
    try:
        await elected.run()
    finally:
        role.lease_lost()
        await election.revoke()
        await client.aclose()


def _pending_delete_gauges(metrics: Metrics, state: MasterState) -> None:
    pending = state.retention.pending_removals()
    metrics.pending_deletes.labels("stream").set(sum(1 for p in pending if not p.segment_epoch))
    metrics.pending_deletes.labels("segment").set(sum(1 for p in pending if p.segment_epoch))
    metrics.pending_delete_bytes.set(sum(p.bytes for p in pending))
    metrics.pending_delete_at.clear()
    soonest: dict[tuple[str, str], int] = {}
    for p in pending:
        key = (p.stream, "trim" if p.segment_epoch else "stream")
        soonest[key] = min(soonest.get(key, p.removal_at_ms), p.removal_at_ms)
    for (stream, kind), at_ms in sorted(soonest.items()):
        metrics.pending_delete_at.labels(stream, kind).set(at_ms / 1000)


async def _update_gauges(service: MasterService, snapshot: ConsoleSnapshot | None) -> None:
    """Refresh the gauges, and the console's snapshot when it is served, on the master's
    loop; a standby publishes only that it stands by, and which master is active."""
    role, metrics = service.calls.role, service.calls.metrics
    while True:
        now = wall_ms()
        state, repairer = role.state, role.repairer
        active = state is not None and repairer is not None and now < role.active_until_ms
        metrics.active.set(1 if active else 0)
        if state is None or repairer is None:
            if snapshot is not None:
                snapshot.publish_standby(role.active_address)
        else:
            if snapshot is not None:
                snapshot.publish(service.admin.console_view())
            views = state.store_views(now)
            metrics.stores_registered.set(len(views))
            metrics.stores_alive.set(sum(1 for v in views.values() if v.alive))
            metrics.streams.set(len(state.streams))
            metrics.segments.set(len(state.segments))
            exposures = state.replicas.exposures(now)
            metrics.under_replicated.set(sum(1 for e in exposures if not e.verifying))
            metrics.verifying.set(sum(1 for e in exposures if e.verifying))
            debt_ms = state.durability.observe(now, exposures)
            metrics.durability_debt_seconds.inc(debt_ms / 1000)
            metrics.bytes_below_n.set(state.durability.bytes_below_n)
            metrics.bytes_below_w.set(state.durability.bytes_below_w)
            metrics.repairs_done.set(repairer.done_count)
            metrics.repairs_failed.set(repairer.failed_count)
            metrics.repairs_running.set(len(repairer.running))
            if active:
                service.streams.enforce_retention()
            _pending_delete_gauges(metrics, state)
        with contextlib.suppress(TimeoutError):
            await asyncio.sleep(GAUGES_INTERVAL_S)
