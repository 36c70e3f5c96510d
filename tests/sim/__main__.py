"""`python -m tests.sim SEED`: run one seed of the world (`tests.sim.runtime.world`, the
shipped code on the simulator's runtime) and print its trace; `--seeds A:B` runs a range
and prints one line per seed; `--soak N` runs N seeds from `--first` and counts
liveness and safety failures apart. Exits 1 if any seed fails."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from tests.sim.runtime.world import RUNTIME_FLAWS, run_seed

# Where `--soak` starts unless told: above the seeds the CI band and the named tests run.
SOAK_FIRST_SEED = 1_000


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a soak keeps of a seed's run (a `WorldResult` holds more than a process
    hands back)."""

    seed: int
    summary: str
    ok: bool
    invariant: int | None
    documented_loss: bool


def _outcome(seed: int, flaws: frozenset[str]) -> Outcome:
    result = run_seed(seed, flaws)
    invariant = result.violation.invariant if result.violation is not None else None
    return Outcome(seed, result.summary(), result.ok, invariant, result.documented_loss)


def _run_range(
    first: int, last: int, flaws: frozenset[str], quiet: bool, jobs: int
) -> list[Outcome]:
    """Seeds `first`..`last - 1`, in order, over `jobs` processes (each seed replays
    alike in any process)."""
    outcomes: Iterator[Outcome]
    seeds = range(first, last)
    if jobs > 1:
        pool = ProcessPoolExecutor(jobs)
        outcomes = pool.map(_outcome, seeds, [flaws] * len(seeds))
    else:
        pool = None
        outcomes = (_outcome(seed, flaws) for seed in seeds)
    results = []
    try:
        for outcome in outcomes:
            if not quiet or not outcome.ok:
                print(outcome.summary, flush=True)
            results.append(outcome)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return results


def _report(results: list[Outcome]) -> int:
    failed = [r for r in results if not r.ok]
    # A run that converged no more after fsync never lost acked writes is that
    # documented loss (`WorldResult.ok`), counted apart, never as a liveness failure.
    liveness = [r.seed for r in failed if r.invariant == 0]
    safety = [r.seed for r in failed if r.invariant != 0]
    documented = [r.seed for r in results if r.documented_loss]
    print(
        f"{len(results)} seeds: {len(liveness)} liveness failures {liveness}, "
        f"{len(safety)} safety failures or errors {safety}; "
        f"{len(documented)} documented losses (fsync never) {documented}"
    )
    print(f"{len(liveness) + len(safety)} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    if not __debug__:
        print("refusing to run under python -O: the checks are asserts too", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m tests.sim")
    parser.add_argument("seed", nargs="?", type=int, help="run this seed and print its trace")
    parser.add_argument("--seed", type=int, dest="named_seed", help="the same as SEED")
    parser.add_argument("--seeds", help="a range A:B of seeds, one line each")
    parser.add_argument(
        "--soak",
        type=int,
        metavar="N",
        help=f"run N seeds from --first (default {SOAK_FIRST_SEED}); count liveness and "
        "safety failures apart",
    )
    parser.add_argument("--first", type=int, default=SOAK_FIRST_SEED, help="first --soak seed")
    parser.add_argument("--quiet", action="store_true", help="no trace, only the outcome")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes running --seeds or --soak (default: one per core)",
    )
    parser.add_argument("--flaw", action="append", choices=RUNTIME_FLAWS, default=[])
    args = parser.parse_args(argv)
    flaws = frozenset(args.flaw)
    if args.soak:
        return _report(_run_range(args.first, args.first + args.soak, flaws, True, args.jobs))
    if args.seeds:
        first, _, last = args.seeds.partition(":")
        return _report(_run_range(int(first), int(last), flaws, args.quiet, args.jobs))
    seed = args.seed if args.seed is not None else args.named_seed
    if seed is None:
        parser.error("give a SEED, --seeds A:B or --soak N")
    result = run_seed(seed, flaws, None if args.quiet else print)
    print(result.config.describe())
    if result.error:
        print(result.error)
    print(result.summary())
    if not result.ok:
        switches = "".join(f" --flaw {f}" for f in sorted(flaws))
        print(f"reproduce: python -m tests.sim {seed}{switches}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
