"""The fault suite's quick pass: scenarios once (seed 1), short fault windows, against
real processes. Fails on any safety anomaly, with the witnesses.

By default every implemented scenario (the pass `make test` and CI run, also
`make faults-quick`; about six minutes on two cores); `FAULTS_QUICK=smoke` runs the smoke
subset of FAULTS.md (S1, S2, S3, S5, S8: about two and a half minutes). Select with
`pytest -m faults`; the full suite is `make faults`.

S4 seed 1 also guards the harness: a writer killed through the `faketime` wrapper
once lived on and appended after the final seal (now every process on a fake clock is
started with LD_PRELOAD, so signals reach it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.faults.scenarios import SCENARIOS, run, scenario_names
from tests.faults.scenarios import unavailable as cannot_run

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

SMOKE = ["S1", "S2", "S3", "S5", "S8"]

# Anomalies the suite found in the system, kept as named regressions (scenario, seed)
# until fixed; then the xfail goes and the run stays.
S12_SILENT_TRUNCATION = (
    "S12 seed 1 (quick): after 2 bits flipped in an SST of a stopped store (store1), the "
    "store still reports acked index = bridge for a sealed segment but a full Read returns "
    "only a prefix (t2/clicks segment 1: 1..219 of 571; another run: segment 4, 1..308 of "
    "405), with no error and nothing in its log; C8 'replica ends before its bridge', C9 "
    "differs from store0. rocksdict iteration stops silently at a corrupted block (only "
    "the iterator's status() says 'Corruption: block checksum mismatch'), so the store "
    "serves a truncated segment and the master never sees the replica as damaged"
)
KNOWN_ANOMALIES = {("S12", 1): S12_SILENT_TRUNCATION}


def quick_scenarios() -> list[Any]:
    names = scenario_names()
    if os.environ.get("FAULTS_QUICK") == "smoke":
        names = [name for name in names if name in SMOKE]
    return [
        pytest.param(name, marks=pytest.mark.xfail(reason=KNOWN_ANOMALIES[(name, 1)],
                                                   strict=False))
        if (name, 1) in KNOWN_ANOMALIES else name
        for name in names
    ]


def unavailable() -> str:
    if not sys.platform.startswith("linux"):
        return "the fault suite needs Linux (signals, /proc, network namespaces)"
    return ""


@pytest.mark.parametrize("name", quick_scenarios())
def test_quick_pass(name: str, tmp_path: Path) -> None:
    reason = unavailable() or cannot_run(SCENARIOS[name])
    if reason:
        pytest.skip(reason)
    out = Path(os.environ.get("FAULTS_QUICK_OUT", tmp_path))
    result = run(SCENARIOS[name], seed=1, out=out, quick=True)
    assert result["counts"]["appends_ok"] > 0, "the workload acked nothing"
    assert not result["nemesis_errors"], "the faults were not injected as scheduled"
    assert result["valid"], json.dumps(result["anomalies"][:5], indent=1)


@pytest.mark.parametrize(
    ("name", "seed"),
    [pytest.param(name, seed, marks=pytest.mark.xfail(reason=reason, strict=False))
     for (name, seed), reason in sorted(KNOWN_ANOMALIES.items())],
)
def test_regression(name: str, seed: int, tmp_path: Path) -> None:
    """A run that once found an anomaly, replayed with its seed."""
    reason = unavailable() or cannot_run(SCENARIOS[name])
    if reason:
        pytest.skip(reason)
    result = run(SCENARIOS[name], seed=seed, out=tmp_path, quick=True)
    assert not result["nemesis_errors"], "the faults were not injected as scheduled"
    assert result["valid"], json.dumps(result["anomalies"][:5], indent=1)
