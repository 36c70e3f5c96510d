"""The fault suite's quick pass: scenarios once (seed 1), short fault windows, against
real processes. Fails on any safety anomaly, with the witnesses.

By default the smoke subset of FAULTS.md (S1, S2, S3, S5, S8: about two and a half
minutes on two cores); `FAULTS_QUICK=all` runs every implemented scenario (the CI pass,
also `make faults-quick`). Select with `pytest -m faults`; the full suite is
`make faults`.

S4 seed 1 also guards the harness: a writer killed through the `faketime` wrapper
once lived on and appended after the final seal (now every process on a fake clock is
started with LD_PRELOAD, so signals reach it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.faults.scenarios import SCENARIOS, run, scenario_names
from tests.faults.scenarios import unavailable as cannot_run

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

SMOKE = ["S1", "S2", "S3", "S5", "S8"]


def quick_scenarios() -> list[str]:
    if os.environ.get("FAULTS_QUICK") == "all":
        return scenario_names()
    return [name for name in scenario_names() if name in SMOKE]


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
