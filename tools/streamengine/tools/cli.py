"""`streamengine`: run servers and operate a cluster.

Exit codes: 0 ok, 1 failure, 2 usage. Expected failures print one line, never a
traceback. Client commands find the masters from `--master HOST:PORT[,HOST:PORT...]`,
else $STREAMENGINE_MASTER, else 127.0.0.1:7070, and follow the active one; TLS from
`--certs-dir` / $STREAMENGINE_CERTS_DIR, a tenant token from `--token-file` or
$STREAMENGINE_TOKEN (`--token` too, with a warning: other local users see command
lines). Servers (`master`, `store`) also read a TOML file (`--config`) and
STREAMENGINE_<FLAG> variables; flags win over variables, which win over the file.

Why one long module: it is the table of every command and its flags, and little else
(each command runs from the module `_lazy` names, imported only when it runs): one
table reads as the CLI's manual, and adding a command adds a few lines to it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# grpc-core reads this once, at import: without it every refused TLS handshake adds an
# INFO line of its own to a command's one-line error (GRPC_VERBOSITY given wins).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from streamengine.client.errors import StreamEngineError
from streamengine.protocol.private_files import keep_private
from streamengine.tools.lifetime import (
    die_with_parent_if_asked,
    exit_at_once,
    stop_on_sigterm_as_on_sigint,
)

Runner = Callable[[argparse.Namespace], int]
if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

DEFAULT_MASTER = "127.0.0.1:7070"
ENV_PREFIX = "STREAMENGINE_"


def _lazy(module: str, function: str) -> Runner:
    """Import a command's module only when it runs (servers need no Spark, etc.)."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        result: int = getattr(importlib.import_module(module), function)(args)
        return result

    return run


def _add_master_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master",
        default=os.environ.get(f"{ENV_PREFIX}MASTER", DEFAULT_MASTER),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the masters; calls follow the active one (default: $STREAMENGINE_MASTER or "
        "%(default)s)",
    )
    _add_certs_dir_option(
        parser,
        "TLS: the certs dir with the cluster's ca.crt (and client.root.crt, used when no "
        "token is given)",
    )
    given = parser.add_mutually_exclusive_group()
    given.add_argument(
        "--token-file",
        type=Path,
        help="a file holding a tenant token, sent over TLS (default: $STREAMENGINE_TOKEN)",
    )
    given.add_argument(
        "--token",
        help="a tenant token on the command line, where other local users see it (ps): "
        "prefer $STREAMENGINE_TOKEN or --token-file",
    )


def _command_token(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The token a client command sends: `--token-file`, else `--token` (with a warning:
    a command line is public on its host), else $STREAMENGINE_TOKEN, else none."""
    if args.token_file is not None:
        try:
            token: str = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"--token-file: cannot read {args.token_file}: {error}")
        if not token:
            parser.error(f"--token-file: {args.token_file} is empty")
        return token
    if args.token is not None:
        print(
            "streamengine: warning: --token is visible to other users of this host (ps); "
            f"use ${ENV_PREFIX}TOKEN or --token-file",
            file=sys.stderr,
        )
        given: str = args.token
        return given
    return os.environ.get(f"{ENV_PREFIX}TOKEN", "")


def _add_certs_dir_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--certs-dir",
        type=Path,
        default=os.environ.get(f"{ENV_PREFIX}CERTS_DIR") or None,
        help=f"{what} (default: $STREAMENGINE_CERTS_DIR; none: plaintext)",
    )


def _add_server_commands(
    commands: Subparsers, command: str | None
) -> dict[str, argparse.ArgumentParser]:
    """The servers' commands; a server's flags only when `command` is that server (or
    None: every command's): they cost its modules' imports, half a second that every
    other command (a `status`, an `append`) would pay for nothing."""
    import importlib

    servers = {}
    for name, module_name, summary in (
        ("master", "streamengine.master.server", "run the master"),
        ("store", "streamengine.segment_store.server", "run a segment store"),
    ):
        if command is not None and command != name:
            commands.add_parser(name, help=summary)
            continue
        module = importlib.import_module(module_name)
        parser = commands.add_parser(name, help=summary, description=module.__doc__)
        module.add_arguments(parser)
        parser.add_argument(
            "--config", type=Path, help="TOML file of flag values (keys as the long flags)"
        )
        parser.set_defaults(run=module.run, until_stopped=True)
        servers[name] = parser
    return servers


def _add_cert_commands(commands: Subparsers, command: str | None) -> None:
    summary = "the cluster's CA and the certificates it signs"
    if command is not None and command != "cert":
        commands.add_parser("cert", help=summary)  # its flags cost the crypto imports
        return
    from streamengine.tools import certs

    cert = commands.add_parser("cert", help=summary)
    cert.set_defaults(run=_lazy("streamengine.tools.certs", "run"))
    for calling_masters in certs.add_arguments(cert):
        _add_master_option(calling_masters)


def _add_cluster_commands(commands: Subparsers) -> None:
    cluster = commands.add_parser("cluster", help="a whole local cluster")
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser(
        "up", help="run a master and N stores on 127.0.0.1 until Ctrl-C / SIGTERM"
    )
    up.add_argument("--stores", type=int, default=3, help="number of stores (default %(default)s)")
    up.add_argument(
        "--data", type=Path, default=Path("data"), help="data dir (default ./%(default)s)"
    )
    up.add_argument(
        "--port",
        type=int,
        default=7070,
        help="master port; stores take the next ones, the console the one after, the "
        "stores' data ports the ones after that",
    )
    up.add_argument(
        "--console-port",
        type=int,
        help="the master's web console and metrics (default: the port after the last store's)",
    )
    up.add_argument("--fsync", choices=["always", "never"], default="always")
    up.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, no certificates (default: TLS, certificates under DATA/certs)",
    )
    up.set_defaults(run=_run_cluster_up, until_stopped=True)


def _run_cluster_up(args: argparse.Namespace) -> int:
    from streamengine.tools.local_cluster import run_cluster_up

    if args.stores < 1:
        raise SystemExit("streamengine: error: --stores must be at least 1")
    console_port = args.port + args.stores + 1 if args.console_port is None else args.console_port
    return run_cluster_up(
        args.data, args.stores, args.port, args.fsync, args.insecure, console_port
    )


def _add_stream_commands(commands: Subparsers) -> None:
    stream = commands.add_parser("stream", help="create, list, describe, delete streams")
    actions = stream.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a stream (and its tenant)")
    create.add_argument("name", help="tenant/stream")
    create.add_argument("--replicas", type=int, default=3, help="N (default %(default)s)")
    create.add_argument("--write-quorum", type=int, default=2, help="W (default %(default)s)")
    create.add_argument("--segment-bytes", type=int, default=0, help="roll threshold in bytes")
    create.add_argument("--segment-age-ms", type=int, default=0, help="roll threshold in ms")
    update = actions.add_parser("update", help="change a stream's retention limits")
    update.add_argument("name", help="tenant/stream")
    for parser, default in ((create, 0), (update, None)):
        parser.add_argument(
            "--retention-age",
            type=_retention_age_ms,
            default=default,
            metavar="AGE",
            help="trim whole sealed segments sealed longer ago than this: 500ms, 90s, 30m, "
            "24h, 7d (0: no limit)",
        )
        parser.add_argument(
            "--retention-bytes",
            type=_byte_count,
            default=default,
            metavar="BYTES",
            help="trim whole sealed segments from the head while the rest still holds more "
            "than this: 1000, 64KiB, 10MiB, 1GiB (0: no limit)",
        )
    create.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_stream_create"))
    update.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_stream_update"))
    trim = actions.add_parser(
        "trim", help="trim whole sealed segments whose events all sort before a sequence"
    )
    trim.add_argument("name", help="tenant/stream")
    trim.add_argument(
        "--before", type=_sequence, required=True, metavar="SEQUENCE", help="epoch << 32 | index"
    )
    trim.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_stream_trim"))
    listing = actions.add_parser("list", help="list streams")
    listing.add_argument("--tenant", default="", help="only this tenant's streams")
    listing.add_argument(
        "--prefix", default="", help="only streams whose full name (tenant/stream) starts so"
    )
    listing.add_argument(
        "--page-size", type=int, default=0, help="streams fetched per call (0: the master's most)"
    )
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_stream_list"))
    describe = actions.add_parser("describe", help="a stream and its segments")
    describe.add_argument("name")
    describe.add_argument("--json", action="store_true")
    describe.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_stream_describe"))
    delete = actions.add_parser(
        "delete",
        help="delete a stream: refused at once, its data removed after the master's grace",
    )
    delete.add_argument("name")
    delete.add_argument(
        "--yes", action="store_true", help="delete (without it: say what would go, exit 1)"
    )
    delete.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_stream_delete"))
    undelete = actions.add_parser(
        "undelete", help="bring a deleted stream back whole, within the grace"
    )
    undelete.add_argument("name")
    undelete.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_stream_undelete"))
    explain = actions.add_parser(
        "explain",
        help="what a recovery of each unsealed segment would find and do now (writes nothing)",
    )
    explain.add_argument("name")
    explain.add_argument("--json", action="store_true")
    explain.set_defaults(run=_lazy("streamengine.tools.explain", "cmd_stream_explain"))
    for parser in (create, update, trim, listing, describe, delete, undelete, explain):
        _add_master_option(parser)


_AGE_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_BYTE_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _retention_age_ms(value: str) -> int:
    """`0`, `500ms`, `90s`, `30m`, `24h`, `7d` in milliseconds."""
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value.strip())
    if match is None or (match.group(2) is None and match.group(1) != "0"):
        raise argparse.ArgumentTypeError(
            f"{value!r}: a number then ms, s, m, h or d (e.g. 7d), or 0 for no limit"
        )
    return int(match.group(1)) * _AGE_UNIT_MS[match.group(2) or "ms"]


def _byte_count(value: str) -> int:
    """`1000`, `64KiB`, `10MiB`, `1GiB`."""
    match = re.fullmatch(r"(\d+)\s*([KMGT]iB)?", value.strip(), re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{value!r}: a number of bytes, optionally with KiB, MiB, GiB or TiB (0: no limit)"
        )
    return int(match.group(1)) * _BYTE_UNITS[(match.group(2) or "").lower()]


def _sequence(value: str) -> int:
    sequence = _sequence_or_end(value)
    if isinstance(sequence, str):
        raise argparse.ArgumentTypeError("a sequence is a number")
    return sequence


def _benchmark_names(value: str) -> list[str]:
    from streamengine.tools.ops import CLUSTER_BENCHMARKS

    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in CLUSTER_BENCHMARKS]
    if unknown or not names:
        choices = ", ".join(CLUSTER_BENCHMARKS)
        raise argparse.ArgumentTypeError(f"unknown benchmark {value!r} (choose from {choices})")
    return names


def _add_admin_commands(commands: Subparsers) -> None:
    status = commands.add_parser("status", help="stores, streams, under-replicated segments")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_status"))
    drain = commands.add_parser(
        "drain",
        help="move every replica off a store (refused when the stores left could not hold "
        "every stream's replicas)",
    )
    drain.add_argument("store", help="store id")
    what = drain.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print the plan, move nothing")
    what.add_argument("--cancel", action="store_true", help="end the store's drain")
    drain.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_drain"))
    undrain = commands.add_parser("undrain", help="end a store's drain (drain --cancel)")
    undrain.add_argument("store", help="store id")
    undrain.set_defaults(
        run=_lazy("streamengine.tools.ops", "cmd_drain"), dry_run=False, cancel=True
    )
    rebalance = commands.add_parser("rebalance", help="even out bytes per store")
    rebalance.add_argument("--dry-run", action="store_true", help="print the plan only")
    rebalance.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_rebalance"))
    verify = commands.add_parser("verify", help="digest every replica of every sealed segment")
    verify.add_argument("name", help="tenant/stream")
    verify.set_defaults(run=_lazy("streamengine.tools.verify", "cmd_verify"))
    seal = commands.add_parser("seal", help="seal a stream's open segment (for Spark)")
    seal.add_argument("name", help="tenant/stream")
    seal.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the seal (default 30)"
    )
    seal.add_argument(
        "--accept-loss",
        action="store_true",
        help="a stuck stream's way out (more than N - W replicas of an unsealed segment lost "
        "for good): seal it at what the surviving replicas hold and record the range whose "
        "acknowledged events may be lost; stop its writers first; asks for --yes",
    )
    seal.add_argument("--yes", action="store_true", help="with --accept-loss: do it")
    seal.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_seal"))
    bench = commands.add_parser("bench", help="run the benchmarks of bench/ against a cluster")
    bench.add_argument(
        "--only", type=_benchmark_names, help="comma-separated: append,subscribe,spark_scan"
    )
    bench.add_argument(
        "--compare",
        choices=("redis", "nats"),
        help="our figures beside the peer's, measured in the same run on a local cluster the "
        "bench starts (bench/compare.py; `make bench-peers` installs the peers)",
    )
    bench.add_argument(
        "--rounds", type=int, default=3, help="--compare: measurements of each side (default 3)"
    )
    bench.add_argument("--json", action="store_true", help="--compare: one JSON object")
    bench.add_argument(
        "extra", nargs="*", metavar="-- ARGS", help="arguments for each benchmark, after --"
    )
    bench.set_defaults(run=_lazy("streamengine.tools.ops", "cmd_bench"))
    for parser in (status, drain, undrain, rebalance, verify, seal, bench):
        _add_master_option(parser)


_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(value: str) -> int:
    """`90s`, `30m`, `24h`, `7d` in milliseconds (a token's lifetime)."""
    from streamengine.protocol.tokens import TOKEN_TTL_MS_MAX, TOKEN_TTL_MS_MIN

    match = re.fullmatch(r"(\d+)([smhd])", value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r}: a number then s, m, h or d (e.g. 24h)")
    ms = int(match.group(1)) * _UNIT_MS[match.group(2)]
    if not TOKEN_TTL_MS_MIN <= ms <= TOKEN_TTL_MS_MAX:
        raise argparse.ArgumentTypeError(f"{value!r}: between 1s and 366d")
    return ms


def _give_up_after_s(value: str) -> float:
    """Seconds a bounded read waits on stores that serve nothing (`read(...,
    give_up_after_s=)`), refused where the SDK would refuse them."""
    from streamengine.client.core.replicas import FollowerTiming

    try:
        seconds = float(value)
        FollowerTiming().giving_up_after(round(seconds * 1000))
    except (ValueError, OverflowError) as error:
        raise argparse.ArgumentTypeError(f"{value!r}: {error}") from None
    return seconds


def _add_token_commands(commands: Subparsers) -> None:
    token = commands.add_parser("token", help="create and revoke tenant tokens (cluster admins)")
    actions = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="a token acting in one tenant with one role, printed on stdout"
    )
    create.add_argument("--tenant", required=True, help="the tenant it acts in (created if new)")
    create.add_argument("--role", required=True, choices=["read", "write", "admin"])
    create.add_argument(
        "--ttl", type=_duration_ms, default=None, help="lifetime, e.g. 90m, 24h, 30d (default 24h)"
    )
    create.add_argument(
        "--stream", action="append", default=[], help="limit a read token to it (repeatable)"
    )
    create.set_defaults(run=_lazy("streamengine.tools.tokens", "cmd_token_create"))
    revoke = actions.add_parser("revoke", help="end a token before it expires")
    revoke.add_argument("token_id", metavar="ID", help="the id `token create` printed")
    revoke.set_defaults(run=_lazy("streamengine.tools.tokens", "cmd_token_revoke"))
    for parser in (create, revoke):
        _add_master_option(parser)


def _add_key_commands(commands: Subparsers) -> None:
    key = commands.add_parser("key", help="rotate and list the master's signing keys (admins)")
    actions = key.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("rotate", "add a key that signs from now on; old ones verify what they signed"),
        ("list", "the keys: id, created, signing, signing from or retiring at"),
    ):
        parser = actions.add_parser(action, help=text)
        parser.set_defaults(run=_lazy("streamengine.tools.tokens", f"cmd_key_{action}"))
        _add_master_option(parser)


def _sequence_or_end(value: str) -> int | str:
    if value in ("end", "earliest"):
        return value
    try:
        sequence = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a sequence nor 'end' or 'earliest'"
        ) from None
    if sequence < 0:
        raise argparse.ArgumentTypeError("a sequence is not negative")
    return sequence


def _add_data_commands(commands: Subparsers) -> None:
    append = commands.add_parser("append", help="append stdin lines (or a file) as events")
    append.add_argument("name", help="tenant/stream")
    append.add_argument("--file", help="read events from this file, one per line (- is stdin)")
    append.add_argument(
        "--batch", type=int, default=500, help="events per append (default %(default)s)"
    )
    append.set_defaults(run=_lazy("streamengine.tools.events", "cmd_append"), until_stopped=True)
    tail = commands.add_parser("tail", help="print acked events")
    tail.add_argument("name", help="tenant/stream")
    tail.add_argument(
        "--from",
        dest="start",
        type=_sequence_or_end,
        default=0,
        help="sequence to start at, 'earliest' (the first event retained) or 'end' (default 0)",
    )
    tail.add_argument("--follow", "-f", action="store_true", help="keep waiting for new events")
    tail.add_argument(
        "--give-up-after",
        type=_give_up_after_s,
        default=None,
        metavar="SECONDS",
        help="without --follow: fail once no store has served the range for this long "
        "(more than 4; default 10)",
    )
    tail.add_argument("--format", choices=["text", "json"], default="text")
    tail.set_defaults(run=_lazy("streamengine.tools.events", "cmd_tail"), until_stopped=True)
    for parser in (append, tail):
        _add_master_option(parser)


def _add_metadata_commands(commands: Subparsers) -> None:
    metadata = commands.add_parser(
        "metadata", help="back up, restore and secure the master's metadata"
    )
    actions = metadata.add_subparsers(dest="action", required=True, metavar="ACTION")
    backup = actions.add_parser(
        "backup", help="copy every record to a file (masters may keep running)"
    )
    backup.add_argument("--to", type=Path, required=True, help="the backup file to write")
    backup.set_defaults(run=_lazy("streamengine.tools.metadata_backup", "cmd_backup"))
    restore = actions.add_parser(
        "restore", help="write a backup into empty metadata (every master stopped)"
    )
    restore.add_argument("--from", dest="source", type=Path, required=True, help="the backup file")
    restore.add_argument(
        "--raise-epochs",
        type=int,
        default=0,
        metavar="N",
        help="raise every stream's latest epoch by N: for a backup older than the last "
        "grant, N above the epochs granted since (default 0)",
    )
    restore.set_defaults(run=_lazy("streamengine.tools.metadata_backup", "cmd_restore"))
    secure = actions.add_parser(
        "secure",
        help="enable etcd's auth: only the masters' certificates reach the cluster's keys",
    )
    secure.add_argument(
        "--metadata",
        required=True,
        metavar="etcd://HOST:PORT[,...][/PREFIX]",
        help="the masters' etcd and key prefix",
    )
    secure.add_argument(
        "--certs-dir",
        type=Path,
        required=True,
        help="ca.crt and the CA's key; etcd-root.crt/key are made here if missing",
    )
    secure.add_argument(
        "--ca-key", type=Path, help="the CA's key, kept apart (default: CERTS_DIR/ca.key)"
    )
    secure.add_argument(
        "--master-name",
        action="append",
        metavar="CN",
        help="the common name of a master's certificate; repeat for several "
        "(default: master, what `cert create-node --master` writes)",
    )
    secure.set_defaults(run=_lazy("streamengine.tools.metadata_secure", "cmd_secure"))
    for parser in (backup, restore):
        where = parser.add_mutually_exclusive_group(required=True)
        where.add_argument("--data", type=Path, help="a master's --data (embedded RocksDB)")
        where.add_argument(
            "--metadata", metavar="etcd://HOST:PORT[,...][/PREFIX]", help="the masters' etcd"
        )
        _add_certs_dir_option(
            parser,
            "reach etcd over TLS with ca.crt and node.crt or etcd-root.crt of this "
            "directory (`metadata secure` makes etcd-root.crt)",
        )


def build_parser(
    command: str | None = None,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser of every command, those of the servers whole only for `command` (None:
    all of them; see `_add_server_commands`)."""
    parser = argparse.ArgumentParser(prog="streamengine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    servers = _add_server_commands(commands, command)
    _add_cert_commands(commands, command)
    _add_cluster_commands(commands)
    _add_stream_commands(commands)
    _add_data_commands(commands)
    _add_admin_commands(commands)
    _add_token_commands(commands)
    _add_key_commands(commands)
    _add_metadata_commands(commands)
    return parser, servers


def _layered_defaults(server: argparse.ArgumentParser, config: Path | None) -> dict[str, Any]:
    """Values for a server's flags from its TOML file, then from the environment."""
    actions = {
        a.dest: a for a in server._actions if a.option_strings and a.dest not in ("help", "config")
    }
    values: dict[str, Any] = {}
    if config is not None:
        try:
            table = tomllib.loads(config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise SystemExit(f"streamengine: error: config {config}: {error}") from None
        for key, value in table.items():
            dest = key.replace("-", "_")
            if dest not in actions:
                raise SystemExit(f"streamengine: error: config {config}: unknown key {key!r}")
            values[dest] = value
    for dest in actions:
        raw = os.environ.get(ENV_PREFIX + dest.upper())
        if raw is not None:
            values[dest] = raw
    converted = {}
    for dest, value in values.items():
        convert = actions[dest].type
        try:
            converted[dest] = (
                convert(value) if callable(convert) and isinstance(value, str) else value
            )
        except (TypeError, ValueError):
            raise SystemExit(f"streamengine: error: bad value {value!r} for {dest}") from None
    return converted


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, servers = build_parser(argv[0] if argv else None)
    server = servers.get(argv[0]) if argv else None
    if server is None:
        args = parser.parse_args(argv)
        if hasattr(args, "token"):
            args.token = _command_token(parser, args)
        return args
    required = [a for a in server._actions if a.required]
    for action in required:
        action.required = False
    first = parser.parse_args(argv)
    server.set_defaults(**_layered_defaults(server, first.config))
    args = parser.parse_args(argv)
    missing = [a.option_strings[0] for a in required if getattr(args, a.dest) is None]
    if missing:
        server.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    if not __debug__:
        print("streamengine: refusing to run under python -O (assertions guard invariants)")
        return 2
    die_with_parent_if_asked()
    keep_private()
    args = parse(argv)
    # Commands that run until stopped (servers, `cluster up`, `tail --follow`, `append`
    # from a terminal) stop on SIGTERM as on Ctrl-C, and end within a bound once done.
    # Only as the process's entry point (no `argv`): a caller in-process keeps its own.
    until_stopped: bool = getattr(args, "until_stopped", False)
    if until_stopped:
        stop_on_sigterm_as_on_sigint()
    code = _run(args)
    if until_stopped and argv is None:
        exit_at_once(code)
    return code


def _run(args: argparse.Namespace) -> int:
    run: Runner = args.run
    try:
        return run(args)
    except StreamEngineError as error:
        print(f"streamengine: error: {error}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # Background tasks of a writer or reader fail as a group; ours are expected.
        expected, _unexpected = group.split(StreamEngineError)
        if expected is None or _unexpected is not None:
            raise
        print(f"streamengine: error: {_first_leaf(expected)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _first_leaf(group: BaseExceptionGroup[StreamEngineError]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


if __name__ == "__main__":
    sys.exit(main())
