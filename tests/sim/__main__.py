"""`python -m tests.sim SEED`: run one seed and print its trace; `--seeds A:B` runs a
range and prints one line per seed. Exits 1 if any seed fails."""

from __future__ import annotations

import argparse
import sys

from tests.sim.world import FLAWS, run_seed


def main(argv: list[str] | None = None) -> int:
    if not __debug__:
        print("refusing to run under python -O: the checks are asserts too", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m tests.sim")
    parser.add_argument("seed", nargs="?", type=int, help="run this seed and print its trace")
    parser.add_argument("--seeds", help="a range A:B of seeds, one line each")
    parser.add_argument("--steps", type=int, default=3000, help="safety-phase steps")
    parser.add_argument("--quiet", action="store_true", help="no trace, only the outcome")
    parser.add_argument("--flaw", action="append", choices=FLAWS, default=[])
    parser.add_argument(
        "--no-probe",
        action="store_true",
        help="never ask a recovery's lost store again (shows recovery hanging, e.g. seed 119)",
    )
    parser.add_argument(
        "--no-close-gap",
        action="store_true",
        help="hand grants without a segment to the leader core, which refuses them",
    )
    args = parser.parse_args(argv)
    probe, close = not args.no_probe, not args.no_close_gap
    flaws = frozenset(args.flaw)
    if args.seeds:
        first, _, last = args.seeds.partition(":")
        failed = 0
        for seed in range(int(first), int(last)):
            result = run_seed(seed, args.steps, flaws, None, probe, close)
            print(result.summary(), flush=True)
            failed += not result.ok
        print(f"{failed} failed")
        return 1 if failed else 0
    if args.seed is None:
        parser.error("give a SEED or --seeds A:B")
    trace = None if args.quiet else print
    result = run_seed(args.seed, args.steps, flaws, trace, probe, close)
    print(result.config.describe())
    if result.error:
        print(result.error)
    print(result.summary())
    if not result.ok:
        switches = [f"--flaw {f}" for f in sorted(flaws)]
        switches += ["--no-probe"] * args.no_probe + ["--no-close-gap"] * args.no_close_gap
        print(f"reproduce: python -m tests.sim {args.seed} --steps {args.steps}", *switches)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
