"""Our figures beside a peer's, measured in the same run (`streamengine bench --compare`).

    .venv/bin/python -m bench.compare --peer redis              # 3 rounds, a table
    .venv/bin/python -m bench.compare --peer nats --rounds 5 --json

Absolute rates on a shared machine move 2-3x with other load, so every figure is shown
beside the same figure of a peer measured in the same run, and judged by their ratio. The
rounds alternate: ours, the peer's, ours, the peer's... (`--rounds` of each), so slow
spells of the machine fall on both.

Our side: a local cluster started for each round and stopped before the peer's turn, as
the peer's script starts its servers (3 stores, fsync always), streams with N=3, W=2,
one writer; in this order:
- single appends one at a time, back to back (as the peers measure theirs), p50 and p99,
  on the idle cluster (after the batched run its stores spend half a minute and more of
  a core between them on flushes, compactions and the first scrub of what it sealed);
- single appends at light load (as `bench/append.py`): one at a
  time, 100 per second, p50 and p99;
- batched appends of 100 B events: `append_batch` of 1000, 8 batches in flight;
- follower catch-up: one reader reads all of the stream's events from the start with
  `client.read` (event by event);
- batched appends of 1 KiB events.

The peer's side: its script in `bench/peers/` (it starts its own servers on free ports and
ends with one JSON line): pipelines of 1000 appends each waiting for a replica (Redis:
XADD + WAIT 1 with appendfsync always; NATS JetStream: R3 file stream, 1000 acks in
flight), one append at a time (back to back), a consumer reading all of the first run
(Redis: XREAD of 1000; NATS: an ordered push consumer), and the 1 KiB run. The scripts
time single appends back to back only; for Redis, appends at light load are timed here
after its script, the same way as ours (`--light-rate`, `--light-count`), on three
servers started as its script starts them (`redis_light_load`). NATS has no light-load
figure.

Printed: a Markdown table with each figure's median over the rounds, ours and the peer's,
the median of the rounds' ratios (ours ÷ peer), and the goal of issue #39 (a ratio to
Redis in the same run) with whether it is met; `--json` prints one JSON object instead.
Exit 2, in one line, when the peer's server or Python client is missing (`make
bench-peers` installs them).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.append import Target, light_load, local_cluster, peak_batched, percentile
from bench.subscribe import catch_up

PEERS_DIR = Path(__file__).resolve().parent / "peers"
# Single appends made before the timed ones (connections, the first segment's streams).
SINGLES_WARM_UP = 200


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    script: str
    server: str  # the binary its script starts
    client_module: str  # the Python client its script imports
    args: tuple[str, ...]  # the script's options for a like-for-like run
    consume: str  # which of its `c_consume_*` figures is the catch-up read
    # Times single appends at light load (rate/s, count) on servers it starts, or None.
    light_load: Callable[[float, int], list[float]] | None = None


def redis_light_load(rate: float, count: int) -> list[float]:
    """Redis's single appends at light load, as `light_load` times ours: XADD + WAIT 1
    one at a time, `rate` per second after SINGLES_WARM_UP untimed ones, on a primary and
    two replicas started by its script's own `start_node` (appendfsync always)."""
    import redis

    from bench.peers import redis_streams as script
    from bench.peers.common import free_ports, stop_process, wait_port

    payload = os.urandom(100)
    with tempfile.TemporaryDirectory(prefix="bench-redis-light-") as data:
        ports = free_ports(3)
        nodes = [script.start_node(data, "primary", ports[0], "always")]
        try:
            for number, port in enumerate(ports[1:], 1):
                nodes.append(script.start_node(data, f"replica{number}", port, "always", ports[0]))
            for port in ports:
                if not wait_port(port):
                    raise PeerError(f"redis-server on port {port} did not start")
            primary = redis.Redis(host="127.0.0.1", port=ports[0], socket_timeout=30)
            script.wait_replicas(primary, 2)

            def append() -> None:
                pipeline = primary.pipeline(transaction=False)
                pipeline.xadd("light", {"d": payload})
                pipeline.execute_command("WAIT", 1, 1000)
                pipeline.execute()

            for _ in range(SINGLES_WARM_UP):
                append()
            latencies = []
            for _ in range(count):
                started = time.perf_counter()
                append()
                latencies.append(time.perf_counter() - started)
                time.sleep(max(0.0, 1 / rate - latencies[-1]))
            primary.close()
            return latencies
        except (redis.RedisError, RuntimeError) as error:  # RuntimeError: no replicas
            raise PeerError(f"Redis at light load: {error!r}") from error
        finally:
            for process, log in nodes:
                stop_process(process)
                log.close()


PEERS = {
    "redis": Peer(
        "redis",
        "Redis",
        "redis_streams.py",
        "redis-server",
        "redis",
        ("--appendfsync", "always"),
        "c_consume_xread",
        redis_light_load,
    ),
    "nats": Peer(
        "nats",
        "NATS JetStream",
        "nats_jetstream.py",
        "nats-server",
        "nats",
        (),
        "c_consume_ordered_push",
    ),
}


@dataclass(frozen=True)
class Figures:
    """One round's figures of one side."""

    batched_100b: float  # events/s
    p50_ms: float  # one append at a time, back to back
    p99_ms: float
    catch_up: float  # events/s, read from the start
    batched_1kib: float  # events/s
    # One at a time, paced at light load (None for a peer that has no such figure).
    light_p50_ms: float | None = None
    light_p99_ms: float | None = None


@dataclass(frozen=True)
class Goal:
    """Issue #39's goal for a figure: `ratio_min` or `ratio_max` (ours ÷ the peer's, at
    least or at most `value`; only judged against `peer`), `max` or `min` (our figure
    itself)."""

    kind: str
    value: float
    text: str
    peer: str | None = None


@dataclass(frozen=True)
class Figure:
    key: str  # a field of Figures
    label: str
    unit: str
    higher_is_better: bool
    goal: Goal | None


FIGURES = (
    Figure(
        "batched_100b",
        "batched appends, 100 B",
        "events/s",
        True,
        Goal("ratio_min", 4.0, "≥ 4x Redis", peer="redis"),
    ),
    Figure("p50_ms", "single append p50, back to back", "ms", False, None),
    Figure("p99_ms", "single append p99, back to back", "ms", False, None),
    Figure(
        "light_p50_ms",
        "single append p50, light load (100/s)",
        "ms",
        False,
        Goal("ratio_max", 1.3, "≤ 1.3x Redis", peer="redis"),
    ),
    Figure(
        "light_p99_ms",
        "single append p99, light load (100/s)",
        "ms",
        False,
        Goal("ratio_max", 1.5, "≤ 1.5x Redis", peer="redis"),
    ),
    Figure(
        "catch_up",
        "follower catch-up, per event",
        "events/s",
        True,
        Goal("ratio_min", 1.5, "≥ 1.5x Redis", peer="redis"),
    ),
    Figure(
        "batched_1kib",
        "batched appends, 1 KiB",
        "events/s",
        True,
        Goal("ratio_min", 3.0, "≥ 3x Redis", peer="redis"),
    ),
)


class PeerError(Exception):
    """The peer's run gave no usable figures."""


def peer_summary(stdout: str) -> dict[str, Any]:
    """The JSON object on the last non-empty line of a peer script's output."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise PeerError("the peer printed nothing")
    try:
        summary = json.loads(lines[-1])
    except json.JSONDecodeError as error:
        raise PeerError(f"the peer's last line is not JSON: {lines[-1][:200]!r}") from error
    if not isinstance(summary, dict):
        raise PeerError("the peer's last line is not a JSON object")
    if not summary.get("ok", False):
        raise PeerError(f"the peer's run failed: {summary.get('error', 'no error given')}")
    return summary


def peer_figures(summary: dict[str, Any], peer: Peer) -> Figures:
    """A peer's figures from its summary (`peer_summary`)."""
    try:
        sync = summary["b_sync_latency_100B"]
        return Figures(
            batched_100b=float(summary["a_pipelined_100B"]["events_per_s"]),
            p50_ms=float(sync["p50_ms"]),
            p99_ms=float(sync["p99_ms"]),
            catch_up=float(summary[peer.consume]["events_per_s"]),
            batched_1kib=float(summary["d_pipelined_1KiB"]["events_per_s"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise PeerError(f"the peer's summary lacks a figure: {error!r}") from error


@dataclass(frozen=True)
class Compared:
    """One figure over the rounds: the medians of each side, the median of the rounds'
    ratios (ours ÷ the peer's), and whether the goal is met (None: not judged here)."""

    figure: Figure
    ours: list[float]
    peer: list[float]  # empty for a figure the peer lacks
    ours_median: float
    peer_median: float | None
    ratio: float | None
    met: bool | None


def goal_met(goal: Goal | None, ours: float, ratio: float | None, peer: str) -> bool | None:
    if goal is None:
        return None
    if goal.kind in ("ratio_min", "ratio_max"):
        if ratio is None or goal.peer not in (None, peer):
            return None
        return ratio >= goal.value if goal.kind == "ratio_min" else ratio <= goal.value
    if goal.kind == "max":
        return ours <= goal.value
    if goal.kind == "min":
        return ours >= goal.value
    raise ValueError(f"unknown goal kind {goal.kind!r}")


def compare(peer: str, ours: Sequence[Figures], theirs: Sequence[Figures]) -> list[Compared]:
    if not ours or len(ours) != len(theirs):
        raise ValueError("one round of ours for each of the peer's")
    results = []
    for figure in FIGURES:
        mine = [_number(f, figure.key) for f in ours]
        # A figure the peer lacks in any round (NATS at light load) is ours only.
        theirs_known = [getattr(f, figure.key) for f in theirs]
        peers = [] if None in theirs_known else [float(v) for v in theirs_known]
        ratios = [m / p if p > 0 else float("inf") for m, p in zip(mine, peers, strict=False)]
        ours_median = statistics.median(mine)
        ratio = statistics.median(ratios) if ratios else None
        results.append(
            Compared(
                figure,
                mine,
                peers,
                ours_median,
                statistics.median(peers) if peers else None,
                ratio,
                goal_met(figure.goal, ours_median, ratio, peer),
            )
        )
    return results


def _number(figures: Figures, key: str) -> float:
    value = getattr(figures, key)
    if value is None:
        raise ValueError(f"no {key} in {figures}")
    return float(value)


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if unit == "ms" else f"{value:,.0f}"


def _met(met: bool | None) -> str:
    return "—" if met is None else ("yes" if met else "**no**")


def table(peer: Peer, results: Sequence[Compared]) -> str:
    """A Markdown table: a row per figure."""
    rows = [
        f"| figure | ours | {peer.label} | ours ÷ {peer.label} | goal (issue #39) | met |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in results:
        better = "higher" if r.figure.higher_is_better else "lower"
        goal = r.figure.goal
        goal_text = goal.text if goal is not None else "—"
        if goal is not None and r.met is None:
            goal_text += " (not judged here)"
        rows.append(
            f"| {r.figure.label} ({r.figure.unit}, {better} is better)"
            f" | {_value(r.ours_median, r.figure.unit)}"
            f" | {_value(r.peer_median, r.figure.unit)}"
            f" | {'—' if r.ratio is None else f'{r.ratio:.2f}x'} | {goal_text} | {_met(r.met)} |"
        )
    return "\n".join(rows)


def heading(peer: Peer, about: dict[str, Any]) -> str:
    server = " ".join(str(about.get("peer_server") or peer.server).split()[:3])
    pressure = about.get("cpu_pressure_avg60") or {}
    return (
        f"Stream Engine (3 stores, N=3 W=2, fsync always) vs {peer.label} ({server};"
        f" {about.get('peer_durability')}), started {about.get('started')} on"
        f" {about.get('cpus')} CPUs (CPU pressure {pressure.get('start')}% at the start,"
        f" {pressure.get('end')}% at the end); rounds of each: {about.get('rounds')},"
        " alternating; medians, and the median of the rounds' ratios"
    )


def as_json(peer: Peer, results: Sequence[Compared], extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "peer": peer.name,
        **extra,
        "figures": [
            {
                "key": r.figure.key,
                "label": r.figure.label,
                "unit": r.figure.unit,
                "higher_is_better": r.figure.higher_is_better,
                "ours": r.ours,
                "peer": r.peer,
                "ours_median": r.ours_median,
                "peer_median": r.peer_median,
                "ratio_median": r.ratio,
                "goal": asdict(r.figure.goal) if r.figure.goal else None,
                "met": r.met,
            }
            for r in results
        ],
    }


# ---- running both sides ----


def missing(peer: Peer) -> str | None:
    """What of the peer is not installed here, or None."""
    if shutil.which(peer.server) is None:
        return f"{peer.server} is not installed"
    if importlib.util.find_spec(peer.client_module) is None:
        return f"the Python client {peer.client_module!r} is not installed in {sys.executable}"
    return None


def run_peer(peer: Peer, args: argparse.Namespace) -> tuple[Figures, dict[str, Any]]:
    command = [
        sys.executable,
        str(PEERS_DIR / peer.script),
        *peer.args,
        "--events",
        str(args.peer_events),
        "--sync-events",
        str(args.peer_sync_events),
        "--max-seconds",
        str(args.peer_max_seconds),
    ]
    # Five timed phases (NATS: six), each bounded by --max-seconds, and start-up.
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=7 * args.peer_max_seconds + 120
    )
    try:
        summary = peer_summary(done.stdout)
    except PeerError as error:
        tail = done.stderr.strip().splitlines()[-3:]
        raise PeerError(f"{peer.script} (exit {done.returncode}): {error}; {tail}") from error
    return peer_figures(summary, peer), summary


async def our_round(target: Target, args: argparse.Namespace) -> Figures:
    """One round on a cluster started for it (as the peer's script starts its servers):
    single appends first, while the cluster is idle, then what loads it."""
    async with target.client() as client:
        stream = f"bench/compare-{time.time_ns()}"
        await client.create_stream(
            stream, replicas=3, write_quorum=2, segment_bytes=args.segment_mb << 20
        )
        async with client.writer(stream) as writer:
            warm_singles = await light_load(writer, 100, float("inf"), SINGLES_WARM_UP)
            back_to_back = await light_load(writer, 100, float("inf"), args.sync_count)
            light = await light_load(writer, 100, args.light_rate, args.light_count)
            warm = await peak_batched(writer, 100, args.batch, args.batches_in_flight, 1.0)
            batched = await peak_batched(
                writer, 100, args.batch, args.batches_in_flight, args.seconds
            )
        written = len(warm_singles) + len(back_to_back) + len(light) + warm.events + batched.events
        read_seconds = await catch_up(client, stream, written)
        stream_1k = f"{stream}-1k"
        await client.create_stream(stream_1k, replicas=3, write_quorum=2)
        async with client.writer(stream_1k) as writer:
            await peak_batched(writer, 1024, args.batch, args.batches_in_flight, 1.0)
            batched_1k = await peak_batched(
                writer, 1024, args.batch, args.batches_in_flight, args.seconds
            )
    ms = [v * 1000 for v in back_to_back]
    light_ms = [v * 1000 for v in light]
    return Figures(
        batched_100b=batched.events_per_s,
        p50_ms=percentile(ms, 0.50),
        p99_ms=percentile(ms, 0.99),
        catch_up=written / read_seconds,
        batched_1kib=batched_1k.events_per_s,
        light_p50_ms=percentile(light_ms, 0.50),
        light_p99_ms=percentile(light_ms, 0.99),
    )


def cpu_pressure_avg60() -> float | None:
    """Linux PSI: % of the last minute in which some task waited for a CPU."""
    try:
        with open("/proc/pressure/cpu") as pressure:
            for line in pressure:
                if line.startswith("some"):
                    return float(line.split()[2].split("=")[1])
    except (OSError, IndexError, ValueError):
        pass
    return None


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def with_light_load(figures: Figures, latencies_s: Sequence[float]) -> Figures:
    """`figures` with the light-load p50 and p99 of these latencies."""
    ms = [v * 1000 for v in latencies_s]
    return replace(figures, light_p50_ms=percentile(ms, 0.50), light_p99_ms=percentile(ms, 0.99))


def _short(f: Figures) -> str:
    light = ""
    if f.light_p50_ms is not None and f.light_p99_ms is not None:
        light = f" (paced {f.light_p50_ms:.2f}/{f.light_p99_ms:.2f})"
    return (
        f"batched {f.batched_100b:,.0f}/s, p50/p99 {f.p50_ms:.2f}/{f.p99_ms:.2f} ms{light},"
        f" catch-up {f.catch_up:,.0f}/s, 1 KiB {f.batched_1kib:,.0f}/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=sorted(PEERS), default="redis")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each side")
    parser.add_argument("--json", action="store_true", help="one JSON object, no table")
    parser.add_argument("--seconds", type=float, default=5.0, help="ours: each batched run")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--batches-in-flight", type=int, default=8)
    parser.add_argument("--light-rate", type=float, default=100.0, help="single appends/s")
    parser.add_argument("--light-count", type=int, default=500)
    parser.add_argument(
        "--sync-count", type=int, default=2000, help="ours: single appends back to back"
    )
    parser.add_argument("--segment-mb", type=int, default=32, help="ours: roll threshold")
    parser.add_argument("--peer-events", type=int, default=200_000, help="peer: --events")
    parser.add_argument(
        "--peer-sync-events", type=int, default=2000, help="peer: --sync-events (back to back)"
    )
    parser.add_argument("--peer-max-seconds", type=float, default=60.0, help="peer: per phase")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    peer = PEERS[args.peer]
    absent = missing(peer)
    if absent is not None:
        print(
            f"bench --compare {peer.name}: {absent}; `make bench-peers` installs the peers'"
            " servers and clients",
            file=sys.stderr,
        )
        return 2

    ours: list[Figures] = []
    theirs: list[Figures] = []
    summary: dict[str, Any] = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    pressure_at_start = cpu_pressure_avg60()
    for number in range(1, args.rounds + 1):
        # A cluster per round, stopped before the peer runs: neither side's servers
        # work in the background (flushes, compactions, scrubs) while the other is timed.
        with local_cluster("always", tls=False) as target:
            ours.append(asyncio.run(our_round(target, args)))
        progress(f"round {number}/{args.rounds} ours:  {_short(ours[-1])}")
        try:
            figures, summary = run_peer(peer, args)
            if peer.light_load is not None:
                figures = with_light_load(
                    figures, peer.light_load(args.light_rate, args.light_count)
                )
        except (PeerError, subprocess.TimeoutExpired) as error:
            print(f"bench --compare {peer.name}: {error}", file=sys.stderr)
            return 1
        theirs.append(figures)
        progress(f"round {number}/{args.rounds} {peer.name}: {_short(theirs[-1])}")
    results = compare(peer.name, ours, theirs)
    about = {
        "started": started,
        "rounds": args.rounds,
        "ours": "local cluster, 3 stores, N=3 W=2, fsync always, one writer",
        "peer_server": summary.get("server"),
        "peer_durability": summary.get("durability"),
        "peer_args": list(peer.args),
        "cpus": os.cpu_count(),
        # Other work on the machine: % of the time some task waited for a CPU (Linux PSI).
        "cpu_pressure_avg60": {"start": pressure_at_start, "end": cpu_pressure_avg60()},
    }
    if args.json:
        print(json.dumps(as_json(peer, results, about), sort_keys=True))
        return 0
    print(heading(peer, about))
    print()
    print(table(peer, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
