"""`streamengine bench --compare`: reading a peer's summary line, the ratios, the goals
and the table (no peer needs to be installed)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from bench import compare
from bench.append import Target, servers_idle
from bench.compare import PEERS, Figures, PeerError
from streamengine.tools import cli


def redis_summary(**overrides: Any) -> dict[str, Any]:
    """The shape of bench/peers/redis_streams.py's last line (figures trimmed)."""
    summary: dict[str, Any] = {
        "bench": "redis_streams_appendfsync_always",
        "server": "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64",
        "ok": True,
        "a_pipelined_100B": {"events_per_s": 60000.0, "batch": 1000},
        "b_sync_latency_100B": {"n": 2000, "p50_ms": 0.8, "p90_ms": 1.1, "p99_ms": 1.8},
        "c_consume_xread": {"mode": "XREAD", "events_per_s": 480000.0},
        "d_pipelined_1KiB": {"events_per_s": 30000.0},
    }
    summary.update(overrides)
    return summary


def test_the_summary_is_the_last_line_after_any_progress() -> None:
    stdout = "starting 3 servers\nphase a...\n" + json.dumps(redis_summary()) + "\n\n"
    figures = compare.peer_figures(compare.peer_summary(stdout), PEERS["redis"])
    assert figures == Figures(60000.0, 0.8, 1.8, 480000.0, 30000.0)


def test_nats_catch_up_is_its_ordered_push_consumer() -> None:
    summary = redis_summary(
        c_consume_pull={"events_per_s": 90000.0},
        c_consume_ordered_push={"events_per_s": 120000.0},
    )
    del summary["c_consume_xread"]
    assert compare.peer_figures(summary, PEERS["nats"]).catch_up == 120000.0
    with pytest.raises(PeerError, match="lacks a figure"):
        compare.peer_figures(summary, PEERS["redis"])


@pytest.mark.parametrize(
    ("stdout", "says"),
    [
        ("", "printed nothing"),
        ("Traceback (most recent call last):\n  boom\n", "not JSON"),
        ("[1, 2]\n", "not a JSON object"),
        (json.dumps({"ok": False, "error": "RuntimeError('replicas')"}), "replicas"),
    ],
)
def test_a_failed_or_garbled_peer_run_is_an_error_saying_why(stdout: str, says: str) -> None:
    with pytest.raises(PeerError, match=says):
        compare.peer_summary(stdout)


def test_medians_and_the_median_of_the_rounds_ratios() -> None:
    ours = [
        Figures(120_000, 0.7, 1.5, 600_000, 40_000, light_p50_ms=1.0, light_p99_ms=2.0),
        Figures(90_000, 0.9, 2.5, 450_000, 20_000, light_p50_ms=1.4, light_p99_ms=3.0),
        Figures(150_000, 0.8, 1.9, 520_000, 30_000, light_p50_ms=1.1, light_p99_ms=2.4),
    ]
    # A slow spell in round 2 falls on both sides: the ratio sees through it.
    theirs = [
        Figures(60_000, 0.8, 1.6, 500_000, 30_000),
        Figures(30_000, 1.0, 2.0, 250_000, 10_000),
        Figures(50_000, 0.9, 1.8, 480_000, 30_000),
    ]
    results = {r.figure.key: r for r in compare.compare("redis", ours, theirs)}
    batched = results["batched_100b"]
    assert batched.ours_median == 120_000 and batched.peer_median == 50_000
    assert batched.ratio == pytest.approx(3.0)  # rounds: 2.0, 3.0, 3.0
    assert batched.met is False  # under 4x Redis
    # Back to back, beside the peer's (lower is better): rounds 0.875, 0.9, 0.889.
    assert results["p50_ms"].ours_median == 0.8 and results["p50_ms"].peer_median == 0.9
    assert results["p50_ms"].ratio == pytest.approx(0.8 / 0.9)
    assert results["p50_ms"].met is None  # the goal is on the light-load figure
    # At light load the peer has no figure here: ours are shown, the ratio goal unjudged.
    light = results["light_p50_ms"]
    assert light.ours_median == 1.1 and light.peer == [] and light.peer_median is None
    assert light.ratio is None and light.met is None
    assert results["light_p99_ms"].ours_median == 2.4 and results["light_p99_ms"].met is None
    catch_up = results["catch_up"]  # rounds: 1.2, 1.8, 1.08
    assert catch_up.ours_median == 520_000 and catch_up.ratio == pytest.approx(1.2)
    assert catch_up.met is False  # under 1.5x Redis
    assert results["batched_1kib"].met is False  # 1.33x, under 3x


def test_a_peer_timed_at_light_load_gets_a_ratio_there_too() -> None:
    ours = [
        Figures(1, 1, 1, 1, 1, light_p50_ms=1.5, light_p99_ms=2.4),
        Figures(1, 1, 1, 1, 1, light_p50_ms=2.0, light_p99_ms=3.0),
    ]
    redis = [
        compare.with_light_load(Figures(1, 1, 1, 1, 1), [0.0008] * 98 + [0.0015] * 2),
        compare.with_light_load(Figures(1, 1, 1, 1, 1), [0.0010] * 100),
    ]
    assert redis[0].light_p50_ms == pytest.approx(0.8)
    assert redis[0].light_p99_ms == pytest.approx(1.5)
    light = {r.figure.key: r for r in compare.compare("redis", ours, redis)}["light_p50_ms"]
    assert light.peer == pytest.approx([0.8, 1.0])
    assert light.ratio == pytest.approx((1.5 / 0.8 + 2.0 / 1.0) / 2)
    assert light.met is False  # 1.94x, over 1.3x Redis
    ours_close = [Figures(1, 1, 1, 1, 1, light_p50_ms=1.0, light_p99_ms=1.4)] * 2
    close = {r.figure.key: r for r in compare.compare("redis", ours_close, redis)}
    assert close["light_p50_ms"].met is True  # rounds 1.25x, 1.0x: at most 1.3x
    assert close["light_p99_ms"].met is True  # rounds 0.93x, 1.4x: at most 1.5x
    # A peer without the figure in one round has none to compare.
    mixed = {
        r.figure.key: r for r in compare.compare("redis", ours, [redis[0], Figures(1, 1, 1, 1, 1)])
    }
    assert mixed["light_p50_ms"].peer == [] and mixed["light_p50_ms"].ratio is None


@pytest.mark.skipif(
    shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None,
    reason="the peer Redis is not installed (`make bench-peers`)",
)
def test_redis_at_light_load_runs_on_servers_it_starts_and_stops() -> None:
    latencies = compare.redis_light_load(1000.0, 20)
    assert len(latencies) == 20 and all(0 < v < 1 for v in latencies)


def test_goals_not_met_say_so_and_the_redis_goal_is_not_judged_against_nats() -> None:
    ours = [Figures(100_000, 1.0, 2.0, 499_000, 3.0, light_p50_ms=1.3, light_p99_ms=2.6)]
    theirs = [Figures(60_000, 0.5, 1.0, 100_000, 1.0, light_p50_ms=1.0, light_p99_ms=1.6)]
    against_redis = {r.figure.key: r.met for r in compare.compare("redis", ours, theirs)}
    assert against_redis == {
        "batched_100b": False,  # 1.67x < 4x
        "p50_ms": None,
        "p99_ms": None,
        "light_p50_ms": True,  # 1.3x
        "light_p99_ms": False,  # 1.63x > 1.5x
        "catch_up": True,  # 4.99x
        "batched_1kib": True,  # 3x
    }
    against_nats = {r.figure.key: r.met for r in compare.compare("nats", ours, theirs)}
    assert against_nats["batched_100b"] is None


def test_rounds_must_pair_up_and_ours_carry_the_light_load_figures() -> None:
    ours = Figures(1, 1, 1, 1, 1, light_p50_ms=1, light_p99_ms=1)
    with pytest.raises(ValueError):
        compare.compare("redis", [ours], [])
    with pytest.raises(ValueError):
        compare.compare("redis", [], [])
    with pytest.raises(ValueError, match="light_p50_ms"):
        compare.compare("redis", [Figures(1, 1, 1, 1, 1)], [Figures(1, 1, 1, 1, 1)])


def test_the_table_has_a_row_per_figure_with_both_sides_the_ratio_and_the_goal() -> None:
    ours = [Figures(130_000, 0.9, 1.6, 700_000, 45_000, light_p50_ms=1.1, light_p99_ms=3.1)]
    theirs = [Figures(52_000, 0.8, 1.8, 480_000, 30_000)]
    text = compare.table(PEERS["redis"], compare.compare("redis", ours, theirs))
    lines = text.splitlines()
    assert lines[0].startswith("| figure | ours | Redis | ours ÷ Redis |")
    assert len(lines) == 2 + len(compare.FIGURES) == 9
    assert "| 130,000 | 52,000 | 2.50x | ≥ 4x Redis | **no** |" in lines[2]
    assert "back to back (ms, lower is better) | 0.90 | 0.80 | 1.12x | — | — |" in lines[3]
    assert "back to back (ms, lower is better) | 1.60 | 1.80 | 0.89x | — | — |" in lines[4]
    assert "| 1.10 | — | — | ≤ 1.3x Redis (not judged here) | — |" in lines[5]
    assert "| 3.10 | — | — | ≤ 1.5x Redis (not judged here) | — |" in lines[6]
    assert "| 700,000 | 480,000 | 1.46x | ≥ 1.5x Redis | **no** |" in lines[7]
    assert lines[8].endswith("| 45,000 | 30,000 | 1.50x | ≥ 3x Redis | **no** |")
    nats = compare.table(PEERS["nats"], compare.compare("nats", ours, theirs))
    assert "≥ 4x Redis (not judged here) | — |" in nats


def test_the_json_carries_every_round_and_the_verdicts() -> None:
    ours = [Figures(130_000, 0.9, 3.1, 700_000, 45_000, light_p50_ms=1.0, light_p99_ms=2.0)] * 2
    theirs = [Figures(52_000, 0.8, 1.8, 480_000, 30_000)] * 2
    results = compare.compare("redis", ours, theirs)
    out = json.loads(json.dumps(compare.as_json(PEERS["redis"], results, {"rounds": 2})))
    assert out["peer"] == "redis" and out["rounds"] == 2
    batched = out["figures"][0]
    assert batched["ours"] == [130_000, 130_000] and batched["peer"] == [52_000, 52_000]
    assert batched["ratio_median"] == pytest.approx(2.5) and batched["met"] is False
    assert batched["goal"]["kind"] == "ratio_min"
    light = next(f for f in out["figures"] if f["key"] == "light_p99_ms")
    assert light["peer"] == [] and light["peer_median"] is None and light["ratio_median"] is None


def test_a_missing_peer_exits_2_in_one_line_naming_make_bench_peers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)

    def no_cluster(*args: object, **kwargs: object) -> None:
        raise AssertionError("started a cluster although the peer is missing")

    monkeypatch.setattr(compare, "local_cluster", no_cluster)
    assert compare.main(["--peer", "nats"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "nats-server is not installed" in err and "`make bench-peers`" in err


def test_the_cli_hands_compare_to_the_bench_script(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        ran.append(command)
        return subprocess.CompletedProcess(command, 2)

    monkeypatch.setattr(subprocess, "run", run)
    assert cli.main(["bench", "--compare", "redis", "--rounds", "5", "--json"]) == 2
    [command] = ran
    assert command[1:] == ["-m", "bench.compare", "--peer", "redis", "--rounds", "5", "--json"]


SPIN_THEN_SLEEP = """
import time
end = time.time() + 1.0
while time.time() < end:
    pass
time.sleep(30)
"""


async def test_the_light_load_waits_for_busy_servers_to_go_idle() -> None:
    """`servers_idle` watches the CPU of the processes the run started: one spinning
    for a second holds it back about that long; a quiet one not at all."""
    spinning = await asyncio.create_subprocess_exec(sys.executable, "-c", SPIN_THEN_SLEEP)
    try:
        waited = await servers_idle(Target("127.0.0.1:1", pids=(spinning.pid,)), timeout_s=10.0)
        assert waited is not None and 0.5 <= waited < 5.0
        again = await servers_idle(Target("127.0.0.1:1", pids=(spinning.pid,)), timeout_s=10.0)
        assert again is not None and again < 1.5  # one window of quiet
        assert await servers_idle(Target("127.0.0.1:1", pids=(spinning.pid,)), 0.0) is None
    finally:
        spinning.kill()
        await spinning.wait()
