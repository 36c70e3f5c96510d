"""The fault suite's quick pass: scenarios once (seed 1), short fault windows, against
real processes. Fails on any safety anomaly, with the witnesses, and on a liveness
bound (C13) missed other than a known finding (KNOWN_BOUND_MISSES).

By default every implemented scenario (the pass `make test` and CI run, also
`make faults-quick`; about seven and a half minutes on two cores shared with other
work; `make test` runs it after the rest of the suite, alone: its bounds are for a box
of its own); `FAULTS_QUICK=smoke` runs the smoke
subset of FAULTS.md (S1, S2, S3, S5, S8: about two and a half minutes). Select with
`pytest -m faults`; the full suite is `make faults`.

S4 seed 1 also guards the harness: a writer killed through the `faketime` wrapper
once lived on and appended after the final seal (now every process on a fake clock is
started with LD_PRELOAD, so signals reach it)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.faults.scenarios import BLOCKED, SCENARIOS, run, scenario_names
from tests.faults.scenarios import unavailable as cannot_run

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

SMOKE = ["S1", "S2", "S3", "S5", "S8"]

# Runs that found an anomaly in the system, kept as named regressions (scenario, seed):
# `test_regression` replays each. While an anomaly is not fixed its entry is also in
# KNOWN_ANOMALIES (an xfail with the finding); once fixed the xfail goes and the run
# stays. A scenario whose regression is seed 1 has that run as its quick pass.
REGRESSIONS = {
    ("S3", 1): (
        "S3 seed 1 (quick, in a clean-clone CI run on a loaded box): C8, store0 holds "
        "t1/orders segment 2 index 71 beyond its bridge at 70. A paused leader that wakes "
        "up now leads on until a fence stops it (leaders ride out a silent master); it "
        "wrote 70-71 to a store the recovery had not sealed yet, and the recovery, having "
        "decided from the other stores, bridged that store late: the bridge replaced 70, "
        "71 stayed. Never served (the acked index stops at the bridge) nor copied (repair "
        "and digests stop there), but FAULTS.md's C8 wants nothing beyond the bridge. Fixed: "
        "a store drops what lies past the first bridge its acked index reaches"
    ),
    ("S12", 1): (
        "S12 seed 1 (quick): after 2 bits flipped in an SST of a stopped store (store1), the "
        "store still reported acked index = bridge for a sealed segment but a full Read "
        "returned only a prefix (t2/clicks segment 1: 1..219 of 571), with no error: "
        "rocksdict's iteration stops silently at a block that fails its checksum. Fixed: the "
        "store checks its iterators' status (DATA_LOSS, the replica reported damaged and "
        "repaired by the master)"
    ),
}
KNOWN_ANOMALIES: dict[tuple[str, int], str] = {}

# The liveness bounds of FAULTS.md §1 are for a box the run has to itself: a quick run's
# own processes load two cores to about 3-4. Beyond this 1-minute load others are busy
# too (other test runs, benchmarks), and a missed bound is a warning, not a failure.
BUSY_LOAD = 2.0 * (os.cpu_count() or 2) + 2.0

# Liveness bounds (C13) a scenario is known to miss, with the finding; any other miss
# fails its quick pass. (S11's reader that once never caught up, on either stream, fits
# a reader process that died: a master killed just after reading a new client's first
# call closes the connection as a TLS server closes a plaintext client's, the SDK took
# it for "it serves TLS", and the workload let that error end the process. Both fixed,
# tests/unit/test_first_contact.py; the exemption it had is gone.)
KNOWN_BOUND_MISSES: dict[str, dict[str, str]] = {}


def quick_scenarios() -> list[Any]:
    names = scenario_names()
    if os.environ.get("FAULTS_QUICK") == "smoke":
        names = [name for name in names if name in SMOKE]
    # Seed 1 of a scenario with a seed-1 regression runs as that regression.
    return [name for name in names if (name, 1) not in REGRESSIONS]


def unavailable() -> str:
    if not sys.platform.startswith("linux"):
        return "the fault suite needs Linux (signals, /proc, network namespaces)"
    return ""


@pytest.mark.parametrize("name", quick_scenarios())
def test_quick_pass(name: str, tmp_path: Path, seed: int = 1) -> None:
    reason = unavailable() or cannot_run(SCENARIOS[name]) or BLOCKED.get(name, "")
    if reason:
        pytest.skip(reason)
    out = Path(os.environ.get("FAULTS_QUICK_OUT", tmp_path))
    result = run(SCENARIOS[name], seed=seed, out=out, quick=True,
                 picture_on_failure_only=True)
    assert result["counts"]["appends_ok"] > 0, "the workload acked nothing"
    assert not result["nemesis_errors"], "the faults were not injected as scheduled"
    no_faults = [a["problem"] for a in result["anomalies"] if a["check"] == "C0"]
    assert not no_faults, no_faults[0]
    if SCENARIOS[name].expect_loss:
        # fsync=never: the loss is what the run measures (the durability docs' window).
        warnings.warn(f"{name}: {json.dumps(result['documented_loss'])}", stacklevel=1)
        return
    assert result["valid"], json.dumps(result["anomalies"][:5], indent=1)
    known = KNOWN_BOUND_MISSES.get(name, {})
    missed = {key: result["bounds"][key] for key in result["bounds_missed"] if key not in known}
    load = (result["measurements"].get("load_1min") or {}).get("max", 0.0)
    if missed and load > BUSY_LOAD:
        warnings.warn(f"{name}: liveness bounds missed (C13) while the machine was busy "
                      f"(load {load} > {BUSY_LOAD}), not failed: {json.dumps(missed)}",
                      stacklevel=1)
        return
    stalled = json.dumps(result.get("stalled_readers", {}), indent=1)
    assert not missed, f"liveness bounds missed (C13): {json.dumps(missed)}; readers: {stalled}"


def regressions() -> list[Any]:
    smoke = os.environ.get("FAULTS_QUICK") == "smoke"
    return [
        pytest.param(name, seed, id=f"{name}-{seed}", marks=[
            pytest.mark.xfail(reason=KNOWN_ANOMALIES[(name, seed)], strict=False)
        ] if (name, seed) in KNOWN_ANOMALIES else [])
        for name, seed in sorted(REGRESSIONS)
        if not smoke or name in SMOKE
    ]


@pytest.mark.parametrize(("name", "seed"), regressions())
def test_regression(name: str, seed: int, tmp_path: Path) -> None:
    """A run that once found an anomaly, replayed with its seed (REGRESSIONS says
    what it found)."""
    test_quick_pass(name, tmp_path, seed)
