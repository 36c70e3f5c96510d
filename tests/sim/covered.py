"""`python -m tests.sim.covered` (`make sim-coverage`): the share of the product's
statements a fixed band of simulator seeds executes, per part and per module.

The simulator runs the shipped code: the master, the stores and the SDK, shells
included, on its runtime (`tests/sim/runtime`). The figure says how much of it the
seeds put under the invariants' checks; the modules at the bottom of the list are the
ones only the unit and integration tests reach.

The band is fixed (`BAND`) so that two figures compare: the world's CI seeds and those
above them, seeds of Spark jobs and seeds where the master's metadata is lost. Only
process bootstrap (the servers' and a Spark driver's JVM) and its argument parsing are
left out of the count (`EXCLUDED`, each with why); every other module of the four parts
counts, executed or not.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[2]
# The folders whose statements count: the three parts the simulator runs and the
# protocol package they share (tools/ and testing/ are neither).
PARTS = ("client", "master", "segment_store", "protocol")
# Left out of the count, relative to ROOT. Process bootstrap and argument parsing: no
# simulated node starts a process; the integration tests start these as real ones.
EXCLUDED = {
    "master/streamengine/master/server.py": "the master process: arguments, startup, "
    "metadata backend choice, signals",
    "segment_store/streamengine/segment_store/server.py": "the store process: arguments, "
    "startup, RocksDB opening, signals",
    "client/streamengine/client/spark_jvm.py": "a Spark driver's JVM process: its launch "
    "and gateway handshake (the Spark integration tests start it)",
}


@dataclass(frozen=True, slots=True)
class Band:
    name: str
    seeds: range | tuple[int, ...]


# No product module may be imported before coverage starts, or its module-level
# statements (the defs, classes and constants) would count as never executed: the world
# is imported once it runs.
BAND = (
    Band("runtime", range(0, 20)),
    # Spark jobs (`WorldConfig.analytics`), drawn in none of the seeds above but 16;
    # 227: a write task's writer closes while its stores are down (`leader_acked`).
    Band("spark jobs", (305, 50, 67, 227)),
    # The master's metadata lost and rebuilt from the stores: names from records (2008),
    # from cards (3956) and from grants (4600, 4989).
    Band("metadata lost", (2008, 3956, 4600, 4989)),
)


@dataclass(frozen=True, slots=True)
class ModuleShare:
    path: str  # relative to ROOT
    statements: int
    executed: int

    @property
    def share(self) -> float:
        return self.executed / self.statements if self.statements else 1.0


def counted_modules() -> list[Path]:
    """Every module of the four parts but the excluded ones, sorted."""
    excluded = {ROOT / path for path in EXCLUDED}
    modules = [p for part in PARTS for p in sorted((ROOT / part).rglob("*.py"))]
    return [p for p in modules if p not in excluded]


def run_band(bands: tuple[Band, ...]) -> list[str]:
    """Run every seed of the bands; the summaries of those that failed."""
    world = importlib.import_module("tests.sim.runtime.world")
    failed = []
    for band in bands:
        for seed in band.seeds:
            result = world.run_seed(seed)
            if not result.ok:
                failed.append(f"{band.name}: {result.summary()}")
    return failed


def measure(bands: tuple[Band, ...] = BAND) -> tuple[list[ModuleShare], list[str], float]:
    sources = [str(ROOT / part) for part in PARTS]
    omitted = [str(ROOT / path) for path in EXCLUDED]
    cov = coverage.Coverage(data_file=None, source=sources, omit=omitted)
    started = time.perf_counter()
    cov.start()
    try:
        failed = run_band(bands)
    finally:
        cov.stop()
    seconds = time.perf_counter() - started
    shares = []
    for module in counted_modules():
        _, statements, _, missing, _ = cov.analysis2(str(module))
        relative = str(module.relative_to(ROOT))
        shares.append(ModuleShare(relative, len(statements), len(statements) - len(missing)))
    return shares, failed, seconds


def _row(name: str, statements: int, executed: int) -> str:
    share = executed / statements if statements else 1.0
    return f"{name:<64} {statements:>6} {executed:>8} {share:>7.1%}"


def _seeds(seeds: range | tuple[int, ...]) -> str:
    if isinstance(seeds, range):
        return f"{seeds.start}..{seeds.stop - 1}"
    return ", ".join(map(str, seeds))


def report(
    shares: list[ModuleShare], failed: list[str], seconds: float, measured: tuple[Band, ...]
) -> str:
    bands = ", ".join(f"{b.name} {_seeds(b.seeds)}" for b in measured)
    seeds = sum(len(b.seeds) for b in measured)
    lines = [f"simulator coverage: {seeds} seeds ({bands}), {seconds:.0f} s under coverage"]
    header = f"{'':<64} {'stmts':>6} {'executed':>8} {'share':>7}"
    lines += ["", header]
    for part in PARTS:
        mine = [s for s in shares if s.path.startswith(f"{part}/")]
        lines.append(_row(part, sum(s.statements for s in mine), sum(s.executed for s in mine)))
    lines.append(
        _row("all four", sum(s.statements for s in shares), sum(s.executed for s in shares))
    )
    lines += ["", "per module, least executed first:", header]
    for share in sorted(shares, key=lambda s: (s.share, s.path)):
        lines.append(_row(share.path, share.statements, share.executed))
    lines += ["", "not counted:"]
    lines += [f"  {path}: {why}" for path, why in EXCLUDED.items()]
    if failed:
        lines += ["", f"{len(failed)} seeds failed:", *failed]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if not __debug__:
        print("refusing to run under python -O: the checks are asserts too", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m tests.sim.covered", description=__doc__)
    parser.parse_args(argv)
    spec = importlib.util.find_spec("streamengine")  # found, not imported (see BAND)
    found = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if found is None or ROOT not in found.parents:
        print(
            f"streamengine is found at {found}, not in this tree: put its folders first "
            "on PYTHONPATH (`make sim-coverage` does)",
            file=sys.stderr,
        )
        return 2
    shares, failed, seconds = measure()
    print(report(shares, failed, seconds, BAND))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
