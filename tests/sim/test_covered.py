"""`make sim-coverage` (`tests/sim/covered.py`) counts what it says it counts."""

from __future__ import annotations

from tests.sim import covered


def test_sim_coverage_leaves_out_only_the_listed_modules_and_they_exist() -> None:
    """Every module of the four parts counts but `EXCLUDED`, whose entries must name
    real files (a renamed one would silently count again)."""
    counted = {str(path.relative_to(covered.ROOT)) for path in covered.counted_modules()}
    for path in covered.EXCLUDED:
        assert (covered.ROOT / path).is_file(), path
        assert path not in counted
    assert {path.split("/", 1)[0] for path in counted} == set(covered.PARTS)
