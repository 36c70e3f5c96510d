"""`python -m tests.sim SEED`: run one seed and print its trace; `--seeds A:B` runs a
range and prints one line per seed; `--soak N` runs N long seeds and counts liveness
and safety failures apart. `--runtime` runs the world on the runtime instead (the
shipped shells, `tests.sim.runtime.world`): `--runtime --seed N`, `--runtime --soak K
--first F`. Exits 1 if any seed fails."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tests.sim.runtime import world as runtime_world
from tests.sim.world import ACCEPT_LOSS, FLAWS, WIPES, RunResult, run_seed

# Where `--soak` starts unless told: above the seeds CI runs at the short length.
SOAK_FIRST_SEED = 10_000
# Where `--runtime --soak` starts unless told: above the seeds of the runtime's CI band.
RUNTIME_SOAK_FIRST_SEED = 1_000


def _run_range(
    first: int,
    last: int,
    steps: int,
    flaws: frozenset[str],
    probe: bool,
    quiet: bool,
    overrides: dict[str, Any] | None,
) -> list[RunResult]:
    results = []
    for seed in range(first, last):
        result = run_seed(seed, steps, flaws, None, probe, overrides)
        if not quiet or not result.ok:
            print(result.summary(), flush=True)
        results.append(result)
    return results


def _report(results: list[RunResult], steps: int) -> int:
    failed = [r for r in results if not r.ok]
    # A run that converged no more after fsync never lost acked writes is that
    # documented loss (`RunResult.ok`), counted apart, never as a liveness failure.
    liveness = [r for r in failed if r.violation is not None and r.violation.invariant == 0]
    safety = [r for r in failed if r not in liveness]
    documented = [r for r in results if r.documented_loss]
    print(
        f"{len(results)} seeds at {steps} steps: "
        f"{len(liveness)} liveness failures {[r.config.seed for r in liveness]}, "
        f"{len(safety)} safety failures {[r.config.seed for r in safety]}; "
        f"{len(documented)} documented losses (fsync never) "
        f"{[r.config.seed for r in documented]}"
    )
    print(f"{len(liveness) + len(safety)} failed")
    return 1 if liveness or safety else 0


def _runtime(seed: int | None, soak: int | None, first: int, flaws: list[str], quiet: bool) -> int:
    """The world on the runtime: one seed with its trace, or `soak` seeds from `first`."""
    chosen = frozenset(flaws)
    if soak:
        failed = []
        for number in range(first, first + soak):
            result = runtime_world.run_seed(number, chosen)
            print(result.summary(), flush=True)
            if not result.ok:
                failed.append(number)
        print(f"{soak} seeds on the runtime from {first}: {len(failed)} failed {failed}")
        return 1 if failed else 0
    assert seed is not None
    result = runtime_world.run_seed(seed, chosen, None if quiet else print)
    print(result.config.describe())
    if result.error:
        print(result.error)
    print(result.summary())
    if not result.ok:
        switches = "".join(f" --flaw {f}" for f in sorted(chosen))
        print(f"reproduce: python -m tests.sim --runtime --seed {seed}{switches}")
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    if not __debug__:
        print("refusing to run under python -O: the checks are asserts too", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m tests.sim")
    parser.add_argument("seed", nargs="?", type=int, help="run this seed and print its trace")
    parser.add_argument("--seeds", help="a range A:B of seeds, one line each")
    parser.add_argument(
        "--soak",
        type=int,
        metavar="N",
        help=f"run N long seeds from --first (default {SOAK_FIRST_SEED}); count liveness "
        "and safety failures apart",
    )
    parser.add_argument("--first", type=int, default=SOAK_FIRST_SEED, help="first --soak seed")
    parser.add_argument("--steps", type=int, default=3000, help="safety-phase steps")
    parser.add_argument("--quiet", action="store_true", help="no trace, only the outcome")
    parser.add_argument(
        "--flaw", action="append", choices=FLAWS + runtime_world.RUNTIME_FLAWS, default=[]
    )
    parser.add_argument(
        "--runtime",
        action="store_true",
        help="the world on the runtime: the shipped shells (with --seed N or --soak K)",
    )
    parser.add_argument("--seed", type=int, dest="runtime_seed", help="with --runtime")
    parser.add_argument(
        "--no-probe",
        action="store_true",
        help="never ask a recovery's lost store again (shows recovery hanging, e.g. seed 272)",
    )
    parser.add_argument(
        "--wipes",
        action="store_true",
        help="wiped disks, on three stores for N=3 W=2 (the band `world.WIPES`)",
    )
    parser.add_argument(
        "--accept-loss",
        action="store_true",
        help="destroyed replicas sealed accepting loss, on three stores for N=3 W=2 (the "
        "band `world.ACCEPT_LOSS`)",
    )
    args = parser.parse_args(argv)
    if args.runtime:
        seed = args.runtime_seed if args.runtime_seed is not None else args.seed
        if seed is None and not args.soak:
            parser.error("--runtime needs --seed N or --soak K")
        first = args.first if args.first != SOAK_FIRST_SEED else RUNTIME_SOAK_FIRST_SEED
        return _runtime(seed, args.soak, first, args.flaw, args.quiet)
    probe = not args.no_probe
    flaws = frozenset(args.flaw)
    overrides = WIPES if args.wipes else ACCEPT_LOSS if args.accept_loss else None
    if args.soak:
        first, last = args.first, args.first + args.soak
        results = _run_range(first, last, args.steps, flaws, probe, True, overrides)
        return _report(results, args.steps)
    if args.seeds:
        first, _, last = args.seeds.partition(":")
        results = _run_range(
            int(first), int(last), args.steps, flaws, probe, args.quiet, overrides
        )
        return _report(results, args.steps)
    if args.seed is None:
        parser.error("give a SEED, --seeds A:B or --soak N")
    trace = None if args.quiet else print
    result = run_seed(args.seed, args.steps, flaws, trace, probe, overrides)
    print(result.config.describe())
    if result.error:
        print(result.error)
    print(result.summary())
    if not result.ok:
        switches = [f"--flaw {f}" for f in sorted(flaws)] + ["--no-probe"] * args.no_probe
        switches += ["--wipes"] * args.wipes + ["--accept-loss"] * args.accept_loss
        print(f"reproduce: python -m tests.sim {args.seed} --steps {args.steps}", *switches)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
