"""Run a segment store: durable entries per segment in RocksDB, epoch fencing, reads
and live tails.

Serves the SegmentStore gRPC service and gRPC health (SERVING once its RocksDB is open
and every segment's state is loaded) on --listen, Write on the data plane's framed
protocol on --data-listen (docs/data-plane.md), keeps its data under --data,
registers with and heartbeats the master (retrying for as long as it takes, without
ever failing its own service), and exits 0 on SIGTERM after a graceful stop.

--fsync always (default): a write is answered only once synced; concurrent writes share
one sync (group commit). --fsync never: answered once written to RocksDB's WAL without
sync; a power loss loses every write answered since RocksDB last synced on its own (a
memtable flush), with no bound in time. Unsafe, for benchmarks and tests only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import sys
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from streamengine.protocol import identity as peer_identity
from streamengine.protocol import logs, transport
from streamengine.protocol.channels import SERVER_OPTIONS
from streamengine.protocol.framed_peer import split_address
from streamengine.protocol.limits import EVENT_BYTES_MAX
from streamengine.protocol.masters import BadMasterList, parse_masters
from streamengine.protocol.parsing import RequestParsing
from streamengine.protocol.private_files import private_dir, tightened_message
from streamengine.protocol.signing import PUBLIC_KEY_BYTES
from streamengine.segment_store import metrics
from streamengine.segment_store.core.authority import (
    CALLS_LEFT_TO_OTHERS_MIN,
    STREAMS_PER_PRINCIPAL_MAX,
    AuthorityRecord,
    StoreAuthority,
)
from streamengine.segment_store.core.commands import Plan
from streamengine.segment_store.core.keys import U64_MAX
from streamengine.segment_store.core.scrub import SCRUB_MB_PER_S_DEFAULT
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.data_plane import data_server
from streamengine.segment_store.group_commit import (
    STORE_QUEUE_BYTES_MAX,
    GroupCommitter,
    SegmentWatch,
)
from streamengine.segment_store.kv import RocksKV
from streamengine.segment_store.master_link import (
    MasterLink,
    RevokedCertsDamaged,
    StoreIdentity,
    WrongCluster,
)
from streamengine.segment_store.scrub import Scrubber
from streamengine.segment_store.service import add_to_server
from streamengine.segment_store.store_context import (
    SUBSCRIBE_BUFFER_BATCHES_DEFAULT,
    SUBSCRIBE_STALL_MS_DEFAULT,
    WRITE_STREAM_IDLE_MS_DEFAULT,
    ServiceConfig,
    StoreContext,
)

log = logging.getLogger("streamengine.store")

STORE_SERVICE = "streamengine.v1.SegmentStore"
STORE_ID_FILE = "store-id"
DB_DIR = "db"
# Concurrent RPCs (write streams, tails, reads): bounds the memory of requests being
# parsed, at most one gRPC message each.
CONCURRENT_RPCS_MAX = 512
# One principal holding all the streams it may leaves room to the others.
assert CONCURRENT_RPCS_MAX >= STREAMS_PER_PRINCIPAL_MAX + CALLS_LEFT_TO_OTHERS_MIN
# A stop lets calls in flight finish for this long, then cuts the rest: a group commit
# takes milliseconds, and tails and Write streams never end by themselves (their clients
# reconnect elsewhere), so a longer grace only delays the stop (`cluster up` ends within
# a second, `tools.local_cluster.STOP_GRACE_S`).
SHUTDOWN_GRACE_S = 0.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", required=True, help="host:port to serve gRPC on")
    parser.add_argument(
        "--data-listen",
        metavar="HOST:PORT",
        help="host:port to serve the data plane (Write) on (default: --listen's host and "
        "its port + 1; port 0 picks a free one)",
    )
    parser.add_argument("--data", required=True, type=Path, help="data directory (RocksDB)")
    parser.add_argument(
        "--master",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the masters (calls follow the active one)",
    )
    parser.add_argument(
        "--id", dest="store_id", help="stable store id (default: generated once, kept in --data)"
    )
    parser.add_argument("--zone", default="", help="failure-domain label")
    parser.add_argument(
        "--fsync",
        choices=["always", "never"],
        default="always",
        help="always: answer writes once synced (group commit); never: unsafe",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (HTTPS for cluster admins with --certs-dir)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="metrics bind address (loopback only without --certs-dir, unless --insecure)",
    )
    parser.add_argument(
        "--queue-bytes-max",
        type=int,
        default=STORE_QUEUE_BYTES_MAX,
        help="payload bytes of write batches queued before refusing (REFUSED_BUSY)",
    )
    parser.add_argument(
        "--entry-bytes-max",
        type=int,
        default=EVENT_BYTES_MAX,
        help=f"largest entry payload accepted (at most {EVENT_BYTES_MAX})",
    )
    parser.add_argument(
        "--subscribe-buffer-batches",
        type=int,
        default=SUBSCRIBE_BUFFER_BATCHES_DEFAULT,
        help="messages buffered per subscriber",
    )
    parser.add_argument(
        "--subscribe-stall-ms",
        type=int,
        default=SUBSCRIBE_STALL_MS_DEFAULT,
        help="a subscriber whose buffer stays full this long is disconnected",
    )
    parser.add_argument(
        "--write-stream-idle-ms",
        type=int,
        default=WRITE_STREAM_IDLE_MS_DEFAULT,
        help="close a Write stream with nothing in flight after this long",
    )
    parser.add_argument(
        "--trust-signing-key",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a file holding an Ed25519 public key (64 hex digits) whose grants and tokens "
        "this store accepts besides its master's (a store run without a master, in tests "
        "and tools: it takes writes before it ever registered); repeatable",
    )
    parser.add_argument(
        "--scrub-mb-per-s",
        type=float,
        default=SCRUB_MB_PER_S_DEFAULT,
        help="read sealed replicas back at this rate to find damage at rest (0: never; the "
        "master then never counts this store's replicas as good)",
    )
    transport.add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logs.configure(logging.INFO)
    if not 0 < args.entry_bytes_max <= EVENT_BYTES_MAX:
        print(f"streamengine store: --entry-bytes-max must be in 1..{EVENT_BYTES_MAX}")
        return 2
    if (
        args.queue_bytes_max <= 0
        or args.subscribe_buffer_batches <= 0
        or (args.write_stream_idle_ms <= 0)
    ):
        print("streamengine store: queue and buffer sizes and the idle timeout must be positive")
        return 2
    if args.scrub_mb_per_s < 0:
        print("streamengine store: --scrub-mb-per-s must be 0 (no scrub) or positive")
        return 2
    try:
        args.data_listen = data_listen(args.listen, args.data_listen)
    except ValueError as error:
        print(f"streamengine store: --data-listen: {error}", file=sys.stderr)
        return 2
    try:
        transport.check_protected_mode(args.listen, args.certs_dir, args.insecure)
        transport.check_protected_mode(args.data_listen, args.certs_dir, args.insecure)
        if args.metrics_port is not None:
            metrics_at = f"{args.metrics_host}:{args.metrics_port}"
            transport.check_protected_mode(metrics_at, args.certs_dir, args.insecure)
    except transport.ProtectedMode as refusal:
        print(f"streamengine store: {refusal}", file=sys.stderr)
        return 2
    try:
        parse_masters(args.master)
    except BadMasterList as error:
        print(f"streamengine store: --master: {error}", file=sys.stderr)
        return 2
    try:
        tightened = private_dir(args.data)
        if tightened:
            log.warning(tightened_message("data dir", args.data, tightened))
        identity = StoreIdentity(
            store_id(args.data, args.store_id), args.listen, args.zone, args.data
        )
        pinned = [read_public_key(path) for path in args.trust_signing_key]
        return asyncio.run(serve(args, identity, pinned))
    except (OSError, StartupError, transport.TransportError) as error:
        print(f"streamengine store: {error}", file=sys.stderr)
        return 1


def data_listen(listen: str, given: str | None) -> str:
    """Where the data plane listens: as given, or beside gRPC on the next port."""
    if given:
        split_address(given)
        return given
    port = split_address(listen)[1]
    if not port:
        return listen  # gRPC on a port picked for it: the data plane too
    if port >= 65535:
        raise ValueError(f"{listen} has no next port: give --data-listen")
    return f"{listen.rpartition(':')[0]}:{port + 1}"


class StartupError(Exception):
    """The store cannot start (its port or data dir is taken): one line, exit 1."""


def read_public_key(path: Path) -> bytes:
    """An Ed25519 public key written as 64 hex digits (surrounding blanks ignored)."""
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise StartupError(f"{path}: not a public key in hex") from None
    if len(key) != PUBLIC_KEY_BYTES:
        raise StartupError(f"{path}: a public key is {PUBLIC_KEY_BYTES} bytes, not {len(key)}")
    return key


def store_id(data_dir: Path, given: str | None) -> str:
    """The id given, else the one kept in the data dir, else a new one, kept durably."""
    path = data_dir / STORE_ID_FILE
    if given:
        return given
    if path.exists():
        kept = path.read_text().strip()
        if kept:
            return kept
    new = f"store-{uuid.uuid4().hex[:12]}"
    temporary = path.with_suffix(".tmp")
    with temporary.open("w") as file:
        file.write(new + "\n")
        file.flush()
        os.fsync(file.fileno())
    temporary.replace(path)
    directory = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return new


async def serve(args: argparse.Namespace, identity: StoreIdentity, pinned_keys: list[bytes]) -> int:
    # Read before RocksDB opens: a certs dir that cannot serve fails the start cleanly.
    members = (
        transport.PLAINTEXT
        if args.certs_dir is None
        else transport.Transport.for_node(args.certs_dir)
    )
    try:
        kv = RocksKV(identity.data_dir / DB_DIR)
    except Exception as error:  # rocksdict raises bare Exceptions (a held LOCK, corruption)
        raise StartupError(f"cannot open {identity.data_dir / DB_DIR}: {error}") from None
    # A store given keys to trust runs without a master: nobody would tell it of lost
    # replicas, so it does not wait for that.
    core = SegmentStoreCore(kv, args.entry_bytes_max, joins_cluster=not pinned_keys)
    core.catalog.keep_incarnation(secrets.randbelow(U64_MAX) + 1)
    kept = core.catalog.authority_record()
    try:
        record = AuthorityRecord.decode(kept) if kept is not None else None
    except ValueError as error:
        kv.close()
        raise StartupError(
            f"the master's authority kept in {args.data} is corrupt: {error}"
        ) from None
    authority = StoreAuthority(identity.store_id, record, pinned_keys)
    watch = SegmentWatch()

    def published(plan: Plan) -> None:
        watch.changed(list(plan.metas))
        metrics.SEGMENTS.set(core.catalog.segment_count())

    committer = GroupCommitter(core, args.fsync == "always", published, args.queue_bytes_max)
    store = StoreContext(
        core,
        committer,
        watch,
        ServiceConfig(
            args.subscribe_buffer_batches, args.subscribe_stall_ms, args.write_stream_idle_ms
        ),
        authority,
        members,
    )
    # Without SO_REUSEPORT a second store on a taken port fails instead of sharing it.
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=CONCURRENT_RPCS_MAX,
        interceptors=[RequestParsing()],
    )
    add_to_server(store, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        peer_identity.install(transport.add_server_port(server, args.listen, args.certs_dir))
    except RuntimeError:
        kv.close()
        raise StartupError(f"cannot listen on {args.listen}: in use or not available") from None
    data = data_server(store)
    try:
        data_port = await data.start(
            args.data_listen,
            None if args.certs_dir is None else transport.server_ssl_context(args.certs_dir),
        )
    except OSError as error:
        kv.close()
        raise StartupError(f"cannot listen on {args.data_listen}: {error.strerror}") from None
    identity = dataclasses.replace(
        identity, data_address=f"{args.data_listen.rpartition(':')[0]}:{data_port}"
    )
    if args.metrics_port is not None:
        metrics.serve_metrics(args.metrics_host, args.metrics_port, args.certs_dir)
    await server.start()
    for name in ("", STORE_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "store %s serving %s on %s, data on %s (zone %r, fsync %s, %d segments)",
        identity.store_id,
        "plaintext" if args.certs_dir is None else "TLS",
        args.listen,
        identity.data_address,
        identity.zone,
        args.fsync,
        len(core.catalog.segments()),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    scrubber = Scrubber(core, store.in_thread, args.scrub_mb_per_s) if args.scrub_mb_per_s else None
    if scrubber is None:
        log.warning(
            "no scrub (--scrub-mb-per-s 0): damage at rest stays unseen here, and the master "
            "never counts this store's sealed replicas as good, as none is read back"
        )
    try:
        link = MasterLink(
            args.master,
            identity,
            core,
            store.delete,
            authority,
            store.keep_authority,
            store.quota,
            members,
            peer_identity.server_identity(),
            scrubber,
            keep_records=store.keep_records,
            join=store.join,
            keep_cluster_view=store.keep_cluster_view,
            raise_acked=store.raise_acked,
        )
    except RevokedCertsDamaged as error:
        raise StartupError(str(error)) from None
    refusal: list[str] = []

    async def link_to_master() -> None:
        try:
            await link.run()
        except WrongCluster as error:
            refusal.append(str(error))
            stop.set()

    try:
        async with asyncio.TaskGroup() as tasks:
            committing = tasks.create_task(committer.run())
            linking = tasks.create_task(link_to_master())
            scrubbing = tasks.create_task(scrubber.run()) if scrubber is not None else None
            await stop.wait()
            log.info("stopping")
            await health_servicer.enter_graceful_shutdown()
            linking.cancel()
            if scrubbing is not None:
                scrubbing.cancel()
            await data.stop()
            await server.stop(SHUTDOWN_GRACE_S)
            committer.close()
            await committing
    finally:
        store.close()
        committer.shutdown_executor()
        with contextlib.suppress(Exception):
            kv.close()
    log.info("stopped")
    if refusal:
        print(f"streamengine store: {refusal[0]}", file=sys.stderr)
        return 2
    return 0
