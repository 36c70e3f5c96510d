"""The simulator in CI: many seeds must keep every invariant and converge, a seed must
replay exactly, and deliberately broken shells must be caught (so the checks can fail).

A failing seed is named with the command that replays it with its trace:
`python -m tests.sim SEED --steps N`.
"""

from __future__ import annotations

import pytest

from tests.sim.world import RunResult, run_seed

SEEDS = 500
CHUNK = 50
# Safety-phase steps per seed in CI: a few lease periods of virtual time, enough for
# several elections, recoveries and crashes, small enough for 500 seeds in well under
# two minutes.
STEPS = 800


def _failures(results: list[RunResult]) -> list[str]:
    return [
        f"{r.summary()}\n  replay: python -m tests.sim {r.config.seed} --steps {STEPS}"
        + (f"\n{r.error}" if r.error else "")
        for r in results
        if not r.ok and not r.known_gap
    ]


@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK), ids=lambda s: f"seeds{s}-{s + CHUNK - 1}")
def test_seeds_keep_invariants_and_converge(first: int) -> None:
    results = [run_seed(seed, STEPS) for seed in range(first, first + CHUNK)]
    failures = _failures(results)
    assert not failures, "\n".join(failures)
    # Every chunk must exercise what the simulator is for.
    assert sum(r.acked for r in results) > 0
    assert sum(r.leaders > 1 for r in results) > CHUNK // 5, "too few leader changes"


def test_a_seed_replays_exactly() -> None:
    def trace_of(seed: int) -> list[str]:
        lines: list[str] = []
        run_seed(seed, 400, trace=lines.append)
        return lines

    first = trace_of(7)
    assert len(first) > 400
    assert first == trace_of(7)


# (flaw, invariant it breaks): the checks must catch each within a few seeds.
FLAWED = [
    ("serve_matched", 2),  # a store serves readers up to its matched index
    ("ack_before_seal", 1),  # the shell lets the new segment ack before recovery ends
    ("ignore_fence", 3),  # a store lets a write below its fence through
]


@pytest.mark.parametrize(("flaw", "invariant"), FLAWED, ids=[f for f, _ in FLAWED])
def test_a_broken_variant_is_caught(flaw: str, invariant: int) -> None:
    caught = []
    for seed in range(60):
        result = run_seed(seed, STEPS, frozenset({flaw}))
        assert not result.error, result.error
        if result.violation is not None and not result.known_gap:
            caught.append((seed, result.violation))
        if len(caught) >= 2:
            break
    assert caught, f"no seed caught the flaw {flaw}"
    invariants = {v.invariant for _, v in caught}
    assert invariant in invariants or invariants <= {1, 2}, caught
