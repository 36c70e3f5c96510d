"""The fault suite's quick pass: every implemented scenario once (seed 1), short fault
windows, against real processes. Fails on any safety anomaly, with the witnesses.
Select with `pytest -m faults`; the full suite is `make faults`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.faults.scenarios import SCENARIOS, run, scenario_names
from tests.faults.scenarios import unavailable as cannot_run

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def unavailable() -> str:
    if not sys.platform.startswith("linux"):
        return "the fault suite needs Linux (signals, /proc, network namespaces)"
    return ""


@pytest.mark.parametrize("name", scenario_names())
def test_quick_pass(name: str, tmp_path: Path) -> None:
    reason = unavailable() or cannot_run(SCENARIOS[name])
    if reason:
        pytest.skip(reason)
    out = Path(os.environ.get("FAULTS_QUICK_OUT", tmp_path))
    result = run(SCENARIOS[name], seed=1, out=out, quick=True)
    assert result["counts"]["appends_ok"] > 0, "the workload acked nothing"
    assert not result["nemesis_errors"], "the faults were not injected as scheduled"
    assert result["valid"], json.dumps(result["anomalies"][:5], indent=1)
