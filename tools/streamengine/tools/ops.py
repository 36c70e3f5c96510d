"""Operator commands over the master's and stores' admin RPCs (synchronous gRPC).

Each `cmd_*` takes the parsed arguments, prints its result, and returns an exit code;
gRPC failures are raised as `client.errors` types and turned into one line by the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc

from streamengine.client.errors import (
    InvalidArgument,
    StreamEngineError,
    Unavailable,
    from_rpc_error,
)
from streamengine.protocol.master_calls import sync_masters
from streamengine.protocol.masters import BadMasterList
from streamengine.protocol.status_view import segment_dict, state_name, status_dict, stream_dict
from streamengine.protocol.transport import PLAINTEXT, Transport, TransportError, tls_problem
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

if TYPE_CHECKING:
    from streamengine.client.stream_client import StreamClient

RPC_TIMEOUT_S = 10.0
PROGRESS_POLL_S = 0.25
REPAIR_WAIT_S = 600.0


def client_transport(args: argparse.Namespace) -> Transport:
    """The command's TLS credentials and token (`--certs-dir`, `--token`)."""
    try:
        return Transport.for_client(getattr(args, "certs_dir", None), getattr(args, "token", ""))
    except TransportError as error:
        raise StreamEngineError(str(error)) from None


def stream_client(args: argparse.Namespace) -> StreamClient:
    from streamengine.client.stream_client import StreamClient

    return StreamClient(args.master, certs_dir=args.certs_dir, token=args.token or None)


@contextmanager
def master_stub(
    address: str, transport: Transport = PLAINTEXT
) -> Iterator[master_pb2_grpc.MasterStub]:
    """The masters at `address` (one, or several separated by commas: calls follow the
    active one)."""
    try:
        masters = sync_masters(address, transport)
        with masters as following:
            yield following.stub
    except BadMasterList as error:
        raise InvalidArgument(f"--master: {error}") from error
    except grpc.RpcError as error:
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            problem = tls_problem(error.details() or "", transport.tls)
            raise Unavailable(
                f"master at {address}: {problem}"
                if problem
                else f"no active master answering at {address} (is the cluster up?)"
            ) from error
        raise from_rpc_error(error) from error


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    for row in [header, *rows]:
        print(
            "  ".join(
                str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)
            ).rstrip()
        )


# ---- streams ----


def cmd_stream_create(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        info = master.CreateStream(
            master_pb2.CreateStreamRequest(
                name=args.name,
                policy=entry_pb2.ReplicationPolicy(
                    replicas=args.replicas, write_quorum=args.write_quorum
                ),
                segment_bytes=args.segment_bytes,
                segment_age_ms=args.segment_age_ms,
                create_tenant=True,
                retention_age_ms=args.retention_age,
                retention_bytes=args.retention_bytes,
            ),
            timeout=RPC_TIMEOUT_S,
        )
    policy = info.policy
    print(
        f"created {info.name} (replicas {policy.replicas}, write quorum {policy.write_quorum}"
        f", retention {_retention_text(info)})"
    )
    return 0


def _retention_text(info: master_pb2.StreamInfo) -> str:
    limits = []
    if info.retention_age_ms:
        limits.append(f"age {info.retention_age_ms / 1000:g} s")
    if info.retention_bytes:
        limits.append(f"{info.retention_bytes} bytes")
    return " or ".join(limits) if limits else "unlimited"


def wall_time(ms: int) -> str:
    """Wall-clock milliseconds as UTC, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def cmd_stream_update(args: argparse.Namespace) -> int:
    if args.retention_age is None and args.retention_bytes is None:
        raise InvalidArgument("stream update: give --retention-age and/or --retention-bytes")
    request = master_pb2.UpdateStreamRequest(name=args.name)
    if args.retention_age is not None:
        request.retention_age_ms = args.retention_age
    if args.retention_bytes is not None:
        request.retention_bytes = args.retention_bytes
    with master_stub(args.master, client_transport(args)) as master:
        info = master.UpdateStream(request, timeout=RPC_TIMEOUT_S)
    print(f"updated {info.name}: retention {_retention_text(info)}")
    return 0


def cmd_stream_trim(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        reply = master.TrimStream(
            master_pb2.TrimStreamRequest(name=args.name, before_sequence=args.before),
            timeout=RPC_TIMEOUT_S,
        )
    if not reply.trimmed_epochs:
        print(
            f"nothing to trim in {args.name} before {args.before}: no whole segment lies "
            f"before it (first retained sequence {reply.first_retained_sequence})"
        )
        return 0
    print(
        f"trimmed {args.name}: segments {', '.join(map(str, reply.trimmed_epochs))} "
        f"({reply.trimmed_entries} entries, {human_bytes(reply.trimmed_bytes)}); the first "
        f"retained sequence is {reply.first_retained_sequence}; their data leaves the stores "
        f"at {wall_time(reply.removed_at_ms)}"
    )
    return 0


def list_streams(
    master: master_pb2_grpc.MasterStub, tenant: str, name_prefix: str, page_size: int
) -> Iterator[master_pb2.StreamInfo]:
    """Every stream the filters select, a page per call."""
    token = ""
    while True:
        reply = master.ListStreams(
            master_pb2.ListStreamsRequest(
                tenant=tenant, name_prefix=name_prefix, page_size=page_size, page_token=token
            ),
            timeout=RPC_TIMEOUT_S,
        )
        yield from reply.streams
        token = reply.next_page_token
        if not token:
            return


def cmd_stream_list(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        streams = list(list_streams(master, args.tenant, args.prefix, args.page_size))
    if args.json:
        print(json.dumps([stream_dict(s) for s in streams], indent=2))
        return 0
    rows = [
        [
            s.name,
            f"{s.policy.replicas}/{s.policy.write_quorum}",
            str(s.epoch),
            s.leader_id or "-",
            str(s.acked_index),
            f"deleted, removed at {wall_time(s.deleted_until_ms)}" if s.deleted_until_ms else "",
        ]
        for s in streams
    ]
    print_table(rows, ["STREAM", "N/W", "EPOCH", "LEADER", "ACKED", ""])
    return 0


def cmd_stream_describe(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        info = master.DescribeStream(
            master_pb2.DescribeStreamRequest(name=args.name), timeout=RPC_TIMEOUT_S
        )
        if info.deleted_until_ms:  # its segments are refused to readers
            segments = master_pb2.ListSegmentsReply(stream_id=info.stream_id)
        else:
            segments = master.ListSegments(
                master_pb2.ListSegmentsRequest(stream=args.name), timeout=RPC_TIMEOUT_S
            )
    described = stream_dict(info) | {"segments": [segment_dict(s) for s in segments.segments]}
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    for key, value in stream_dict(info).items():
        print(f"{key:18} {value}")
    rows = [
        [
            str(s.id.epoch),
            state_name(s.state),
            str(s.final_index or "-"),
            str(s.acked_index),
            ",".join(r.store_id for r in s.copy_set),
        ]
        for s in segments.segments
    ]
    print()
    print_table(rows, ["SEGMENT", "STATE", "FINAL", "ACKED", "COPY SET"])
    return 0


def cmd_stream_delete(args: argparse.Namespace) -> int:
    """Without --yes, say what would be deleted and exit 1; with it, delete (the data
    leaves the stores after the master's grace, unless undeleted before)."""
    with master_stub(args.master, client_transport(args)) as master:
        info = master.DescribeStream(
            master_pb2.DescribeStreamRequest(name=args.name), timeout=RPC_TIMEOUT_S
        )
        if info.deleted_until_ms:
            print(
                f"{args.name} is already deleted: its data leaves the stores at "
                f"{wall_time(info.deleted_until_ms)} unless undeleted before"
            )
            return 0 if args.yes else 1
        if not args.yes:
            segments = master.ListSegments(
                master_pb2.ListSegmentsRequest(stream=args.name), timeout=RPC_TIMEOUT_S
            ).segments
            events = sum(max(s.acked_index - (s.state == entry_pb2.SEALED), 0) for s in segments)
            size = sum(s.bytes for s in segments)
            print(
                f"would delete {args.name} (stream id {info.stream_id}): {len(segments)} "
                f"segments, about {events} events, {human_bytes(size)} per replica "
                "(as the stores last reported)"
            )
            print("nothing changed; add --yes to delete")
            return 1
        reply = master.DeleteStream(
            master_pb2.DeleteStreamRequest(name=args.name), timeout=RPC_TIMEOUT_S
        )
    print(
        f"deleted {args.name} ({reply.segments} segments): refused from now on, its data "
        f"leaves the stores at {wall_time(reply.deleted_until_ms)}; until then "
        f"`streamengine stream undelete {args.name}` brings it back"
    )
    return 0


def cmd_stream_undelete(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        info = master.UndeleteStream(
            master_pb2.UndeleteStreamRequest(name=args.name), timeout=RPC_TIMEOUT_S
        )
    print(f"undeleted {info.name} (stream id {info.stream_id}, epoch {info.epoch})")
    return 0


# ---- cluster status ----


def cmd_status(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        status = master.GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT_S
        )
    if args.json:
        print(json.dumps(status_dict(status), indent=2))
        return 0
    print(f"CLUSTER {status.cluster_id or '(rebuilding)'}\n")
    print("STORES")
    print_table(
        [
            [
                s.store_id,
                s.address,
                s.zone or "-",
                ("up" if s.alive else "DOWN") + (" draining" if s.draining else ""),
                human_bytes(s.used_bytes),
                str(s.segments),
            ]
            for s in status.stores
        ],
        ["ID", "ADDRESS", "ZONE", "STATE", "BYTES", "SEGMENTS"],
    )
    print_streams(status)
    under = status.under_replicated
    print(f"\nUNDER-REPLICATED SEGMENTS: {len(under) or 'none'}")
    print_bounded([f"  {s.id.stream} segment {s.id.epoch}" for s in under])
    if status.verifying:
        print(
            f"BEING VERIFIED: {len(status.verifying)} (every replica held, "
            "not all read back yet)"
        )
        print_bounded([f"  {s.id.stream} segment {s.id.epoch}" for s in status.verifying])
    print(
        f"\nDURABILITY DEBT: {human_bytes(status.bytes_below_n)} below N good replicas now, "
        f"{human_bytes(status.bytes_below_w)} below W"
    )
    checked = status.replica_verification
    print(
        f"SEALED REPLICAS: {checked.matched} matched their certificate, "
        f"{checked.unmatched} not yet, {checked.bad} bad"
    )
    pending = status.pending_deletes
    print(f"\nPENDING DELETES: {len(pending) or 'none'}")
    if pending:
        print_table(
            [
                [
                    p.stream,
                    str(p.segment_epoch) if p.segment_epoch else "(stream)",
                    wall_time(p.removed_at_ms),
                    human_bytes(p.bytes),
                ]
                for p in pending
            ],
            ["STREAM", "SEGMENT", "REMOVED AT", "BYTES"],
        )
    if status.durability_debt:
        print_table(
            [
                [
                    d.segment.stream,
                    str(d.segment.epoch),
                    f"{d.good_replicas}/{d.replicas}" + (" now" if d.exposed else " healed"),
                    f"{d.below_n_ms / 1000:.1f}",
                    f"{d.below_w_ms / 1000:.1f}",
                    human_bytes(d.bytes),
                ]
                for d in status.durability_debt
            ],
            ["STREAM", "SEGMENT", "GOOD", "BELOW N (S)", "BELOW W (S)", "BYTES"],
        )
    return 0


# Lines of one list in `status` (tenants, segments): a screen, the rest counted.
STATUS_LINES_MAX = 20


def print_bounded(lines: list[str]) -> None:
    for line in lines[:STATUS_LINES_MAX]:
        print(line)
    if len(lines) > STATUS_LINES_MAX:
        print(f"  ... and {len(lines) - STATUS_LINES_MAX:,} more (--json for all)")


def print_streams(status: master_pb2.ClusterStatus) -> None:
    """Counts per tenant (those with unhealthy streams first), then the rows the
    master chose: the unhealthy streams first."""
    tenants = status.tenant_streams
    total = sum(t.streams for t in tenants)

    def unhealthy(t: master_pb2.TenantStreams) -> int:
        return t.under_replicated + t.sealing + t.deleted

    print(
        f"\nSTREAMS: {total:,} in {len(tenants):,} tenant(s): "
        f"{sum(t.under_replicated for t in tenants):,} under-replicated, "
        f"{sum(t.sealing for t in tenants):,} sealing, {sum(t.deleted for t in tenants):,} deleted"
    )
    worst = sorted(tenants, key=lambda t: (-unhealthy(t), t.tenant))[:STATUS_LINES_MAX]
    print_table(
        [
            [t.tenant, f"{t.streams:,}", str(t.under_replicated), str(t.sealing), str(t.deleted)]
            for t in worst
        ],
        ["TENANT", "STREAMS", "UNDER-REPLICATED", "SEALING", "DELETED"],
    )
    if len(tenants) > len(worst):
        print(f"  ... and {len(tenants) - len(worst):,} more tenants (--json for all)")
    shown = f"{len(status.streams):,} of {total:,}, unhealthy first"
    print(f"\nSTREAMS SHOWN: {shown} (`streamengine stream list` lists all)")
    print_table(
        [
            [
                s.name,
                s.leader_id or "-",
                str(s.epoch),
                str(s.open_segment_epoch or "-"),
                str(s.acked_index),
                str(s.unsealed_segments),
                "deleted" if s.deleted_until_ms else "",
            ]
            for s in status.streams
        ],
        ["NAME", "LEADER", "EPOCH", "OPEN SEGMENT", "ACKED", "UNSEALED", ""],
    )


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


# ---- repair: drain and rebalance ----


def _progress_line(done: int, total: int, label: str) -> str:
    width = 30
    filled = width * done // total if total else width
    return f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def wait_for_tasks(
    master: master_pb2_grpc.MasterStub, plan: master_pb2.RepairPlan, label: str
) -> int:
    """Show a progress bar until every task of the plan is done or failed."""
    wanted = {(t.segment.stream_id, t.segment.epoch, t.target_store) for t in plan.tasks}
    total = len(wanted)
    deadline = time.monotonic() + REPAIR_WAIT_S
    failed: list[master_pb2.RepairTask] = []
    while True:
        status = master.GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT_S
        )
        finished = [
            t
            for t in status.tasks
            if (t.segment.stream_id, t.segment.epoch, t.target_store) in wanted
            and t.state in (master_pb2.RepairTask.DONE, master_pb2.RepairTask.FAILED)
        ]
        failed = [t for t in finished if t.state == master_pb2.RepairTask.FAILED]
        print(_progress_line(len(finished), total, label), end="", file=sys.stderr, flush=True)
        if len(finished) >= total:
            break
        if time.monotonic() > deadline:
            print(file=sys.stderr)
            raise StreamEngineError(
                f"{label}: {total - len(finished)} moves still pending after {REPAIR_WAIT_S:.0f}s"
            )
        time.sleep(PROGRESS_POLL_S)
    print(file=sys.stderr)
    for task in failed:
        segment = task.segment
        target = task.target_store
        print(f"failed: {segment.stream} segment {segment.epoch} -> {target}: {task.error}")
    return 1 if failed else 0


def print_plan(plan: master_pb2.RepairPlan) -> None:
    for task in plan.tasks:
        print(
            f"move {task.segment.stream} segment {task.segment.epoch}: "
            f"{task.replaced_store or task.source_store} -> {task.target_store} "
            f"({human_bytes(task.bytes)})"
        )
    for store_id in sorted(plan.bytes_before):
        before = human_bytes(plan.bytes_before[store_id])
        after = human_bytes(plan.bytes_after.get(store_id, 0))
        print(f"  {store_id}: {before} -> {after}")


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain a store (refused, with the reason, when the stores left could not hold
    every stream's replicas), plan one (`--dry-run`), or end a drain (`--cancel`)."""
    request = master_pb2.DrainStoreRequest(
        store_id=args.store, dry_run=args.dry_run, cancel=args.cancel
    )
    with master_stub(args.master, client_transport(args)) as master:
        plan = master.DrainStore(request, timeout=RPC_TIMEOUT_S)
        if args.cancel:
            print(f"{args.store} is not draining: it takes new replicas again")
            return 0
        verb = "plan to drain" if args.dry_run else "draining"
        print(f"{verb} {args.store}: {len(plan.tasks)} replicas to move")
        print_plan(plan)
        if args.dry_run or not plan.tasks:
            return 0
        return wait_for_tasks(master, plan, "drain")


def cmd_rebalance(args: argparse.Namespace) -> int:
    with master_stub(args.master, client_transport(args)) as master:
        plan = master.Rebalance(
            master_pb2.RebalanceRequest(dry_run=args.dry_run), timeout=RPC_TIMEOUT_S
        )
        if not plan.tasks:
            print("balanced: nothing to move")
            return 0
        print(f"{'plan' if args.dry_run else 'moving'}: {len(plan.tasks)} replicas")
        print_plan(plan)
        return 0 if args.dry_run else wait_for_tasks(master, plan, "rebalance")


def cmd_seal(args: argparse.Namespace) -> int:
    """Seal the open segment: the leader rolls, or this command leads for a moment."""
    import asyncio

    if args.accept_loss and not args.yes:
        print(
            f"would seal the unsealed segments of {args.name} at what the replicas that "
            "still answer hold, recording as lost what may have been acknowledged past "
            "them (readers of that range get DataLossError); irreversible"
        )
        print("nothing changed; stop the stream's writers and add --yes to do it")
        return 1

    async def seal() -> tuple[int, list[str]]:
        async with stream_client(args) as client:
            await client.describe_stream(args.name)  # an unknown stream fails fast
            epoch = await client.seal(
                args.name, timeout_s=args.timeout, accept_loss=args.accept_loss
            )
            lost = [
                f"segment {s.epoch} indexes {s.lost_from_index}.. to its end "
                f"(bridge at {s.final_index})"
                for s in await client.list_segments(args.name)
                if s.lost_from_index
            ]
            return epoch, lost

    epoch, lost = asyncio.run(seal())
    if epoch:
        print(f"sealed {args.name}: segment {epoch}")
    else:
        print(f"sealed {args.name}: no open segment")
    for line in lost:
        print(f"lost (sealed accepting loss): {line}")
    return 0


# ---- verify ----


# Benchmarks that run against an existing cluster (`--master`), in this order. The store
# write benchmark measures one store on its own and the failover one kills writer
# processes it starts itself: `bench/` runs those directly.
CLUSTER_BENCHMARKS = ("append", "subscribe", "spark_scan")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmarks of `bench/` against the cluster at `--master`; or, with
    `--compare PEER`, ours beside a peer's in the same run (`bench/compare.py`)."""
    import subprocess
    from pathlib import Path

    # This file is `tools/streamengine/tools/ops.py` in a checkout.
    checkout = Path(__file__).resolve().parents[3]
    if not (checkout / "bench" / "append.py").exists():
        raise StreamEngineError(
            "the benchmarks live in the source checkout (bench/); run from a clone"
        )
    if args.compare:
        # Ours on a local cluster it starts, the peer on servers its script starts: no
        # `--master`. Exit 2 when the peer is not installed.
        command = [sys.executable, "-m", "bench.compare", "--peer", args.compare]
        command += ["--rounds", str(args.rounds), *(["--json"] if args.json else [])]
        return subprocess.run([*command, *args.extra], cwd=checkout).returncode
    names: list[str] = args.only or list(CLUSTER_BENCHMARKS)
    # Fail early, in one line, without a cluster.
    with master_stub(args.master, client_transport(args)) as master:
        master.GetClusterStatus(master_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT_S)
    failed = []
    for name in names:
        print(f"== bench/{name}.py against {args.master}", flush=True)
        tls = ["--certs-dir", str(args.certs_dir)] if args.certs_dir else []
        command = [sys.executable, "-m", f"bench.{name}", "--master", args.master, *tls]
        command += args.extra
        if subprocess.run(command, cwd=checkout).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
