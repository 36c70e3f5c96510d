"""`python -m tests.faults`: run scenarios against real processes and write the report.

    python -m tests.faults --standard --seeds 5 --out DIR     # `make faults`
    python -m tests.faults --standard --scenario S2 --seed 3 --out DIR   # replay one run
    python -m tests.faults --quick --out DIR                  # every scenario, short windows
    python -m tests.faults --seeds 5 --out DIR                # FAULTS.md's durations
    python -m tests.faults check RUN_DIR                      # re-check a recorded run

Exit 0 when every run is valid and within its liveness bounds (C13), 1 on any anomaly or
missed bound, 2 when it cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.faults import report
from tests.faults.checker import check
from tests.faults.history import read_file
from tests.faults.scenarios import (
    BLOCKED,
    SCENARIOS,
    STANDARD_WINDOWS,
    CannotRun,
    read_logs,
    run,
    scenario_names,
    standard_duration,
    unavailable,
)


def recheck(run_dir: Path) -> int:
    records = read_file(run_dir / "history.jsonl")
    final = json.loads((run_dir / "final.json").read_text())
    verdict = check(records, final, read_logs(run_dir / "logs"))
    print(json.dumps(verdict.as_dict(), indent=2))
    return 0 if verdict.valid else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        return recheck(Path(argv[1]))
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                        help="a scenario (repeatable); default: all implemented")
    parser.add_argument("--seed", type=int, action="append", help="a seed (repeatable)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 1..N when no --seed")
    windows = parser.add_mutually_exclusive_group()
    windows.add_argument("--quick", action="store_true",
                         help="dense schedules, short fault windows (the CI pass)")
    windows.add_argument("--standard", action="store_true",
                         help=f"dense schedules, windows {STANDARD_WINDOWS:g}x the quick ones "
                              "(`make faults`); default: FAULTS.md's schedules and durations")
    parser.add_argument("--duration", type=float, help="fault seconds, overriding the scenario")
    parser.add_argument("--out", type=Path, default=Path("faults-report"))
    args = parser.parse_args(argv)
    if os.name != "posix":
        print("the fault suite needs Linux processes and signals", file=sys.stderr)
        return 2
    names = args.scenario or scenario_names()
    seeds = args.seed or list(range(1, args.seeds + 1))
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        reason = unavailable(SCENARIOS[name])
        if reason:
            print(f"{name}: skipped: {reason}", flush=True)
            if args.scenario:
                return 2
            continue
        if name in BLOCKED and not args.scenario:
            print(f"{name}: skipped (run it alone with --scenario): {BLOCKED[name]}",
                  flush=True)
            continue
        for seed in seeds:
            try:
                scenario = SCENARIOS[name]
                duration = args.duration
                if duration is None and args.standard:
                    duration = standard_duration(scenario)
                result = run(scenario, seed, args.out, args.quick or args.standard, duration)
            except CannotRun as error:
                print(f"{name}: cannot run: {error}", file=sys.stderr)
                return 2
            results.append(result)
            state = "valid" if result["valid"] else f"INVALID {result['checks_failed']}"
            if result["documented_loss"]:
                state += f"; expected loss (documented): {result['documented_loss']}"
            if result["bounds_missed"]:
                state += f"; bounds missed (C13): {result['bounds_missed']}"
            if result["nemesis_errors"]:
                state += f" (nemesis failed: {result['nemesis_errors']})"
            state += "".join(f"; {a['problem']}" for a in result["anomalies"]
                             if a["check"] == "C0")
            print(f"{name} seed {seed}: {state}; {result['counts']}; "
                  f"{json.dumps(result['measurements'])}", flush=True)
            report.write_index(args.out, results)
    index = report.write_index(args.out, results)
    print(f"report: {index}")
    return 0 if all(_passed(r) for r in results) else 1


def _passed(result: dict[str, Any]) -> bool:
    """Valid (or its loss the documented one, S8d) within its bounds; a run that
    injected no fault (C0) never passes, whatever else it shows."""
    if "C0" in result["checks_failed"]:
        return False
    return bool(result["valid"] or result["documented_loss"]) and not result["bounds_missed"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
