"""`checkers.CatalogChecker` (invariant 16) on made-up looks and answers: what a paged
walk, a description or a status may show of the streams the master held."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.sim.checkers import CatalogChecker, Shown, Violation


def _state(**ids: int) -> Any:
    streams = {name.replace("_", "/"): SimpleNamespace(stream_id=i) for name, i in ids.items()}
    return SimpleNamespace(streams=streams)


def _checker() -> CatalogChecker:
    checker = CatalogChecker()
    for name in ("a/s1", "a/s2", "b/s3", "b/s4"):
        checker.asked_to_create(name)
    return checker


def test_a_walk_shows_every_stream_held_throughout_once_in_order() -> None:
    checker = _checker()
    before = checker.look(0, _state(a_s1=1, a_s2=2, b_s3=3)).index
    after = checker.look(5, _state(a_s1=1, a_s2=2, b_s3=3, b_s4=4)).index
    ids = {"a/s1": 1, "a/s2": 2, "b/s3": 3}
    # b/s4, created during the walk, may be shown or not.
    checker.shown(Shown("walk", ["a/s1", "a/s2", "b/s3"], ids), before, after)
    checker.shown(Shown("walk", ["a/s1", "a/s2", "b/s3", "b/s4"], {}), before, after)
    with pytest.raises(Violation, match="after 'a/s2'"):
        checker.shown(Shown("walk", ["a/s1", "a/s2", "a/s2", "b/s3"], ids), before, after)
    with pytest.raises(Violation, match=r"\['a/s2'\] held throughout"):
        checker.shown(Shown("walk", ["a/s1", "b/s3"], ids), before, after)
    with pytest.raises(Violation, match="as stream 9"):
        checker.shown(Shown("walk", ["a/s1", "a/s2", "b/s3"], {**ids, "a/s1": 9}), before, after)


def test_filters_and_a_tenants_caller_keep_to_their_streams() -> None:
    checker = _checker()
    looked = checker.look(0, _state(a_s1=1, a_s2=2, b_s3=3)).index
    checker.shown(Shown("walk", ["b/s3"], {}, tenant="b"), looked, looked)
    checker.shown(Shown("walk", ["a/s2"], {}, prefix="a/s2"), looked, looked)
    checker.shown(Shown("walk", [], {}, tenant="b", caller_tenant="a"), looked, looked)
    with pytest.raises(Violation, match="not selected"):
        checker.shown(Shown("walk", ["a/s1", "a/s2", "b/s3"], {}, caller_tenant="a"), 0, 0)


def test_a_removed_stream_is_never_shown_again_nor_held_again() -> None:
    checker = _checker()
    checker.look(0, _state(a_s1=1, a_s2=2))
    removed = checker.look(5, _state(a_s1=1)).index
    with pytest.raises(Violation, match="a/s2 shown after a look at 1 missed it"):
        checker.shown(Shown("describe", ["a/s2"], {}, name="a/s2"), removed, removed)
    with pytest.raises(Violation, match="held again"):
        checker.look(9, _state(a_s1=1, a_s2=2))
    with pytest.raises(Violation, match="never created"):
        checker.shown(Shown("walk", ["a/s9"], {}, complete=False), removed, removed)


def test_an_answer_with_no_look_after_it_is_judged_at_the_next_look() -> None:
    checker = _checker()
    before = checker.look(0, _state(a_s1=1, a_s2=2)).index
    checker.shown(Shown("walk", ["a/s1"], {}), before, None)
    assert checker.judged == 0
    with pytest.raises(Violation, match=r"\['a/s2'\] held throughout"):
        checker.look(5, _state(a_s1=1, a_s2=2))
