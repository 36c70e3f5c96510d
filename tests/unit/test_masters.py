"""Which master a client, store or tool calls next (`streamengine.protocol.masters`)."""

from __future__ import annotations

import pytest

from streamengine.protocol.masters import (
    BadMasterList,
    attempts_per_call,
    next_master,
    parse_masters,
)

ABC = ("a:1", "b:1", "c:1")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("a:1", ("a:1",)),
        ("a:1,b:1", ("a:1", "b:1")),
        (" a:1 , b:1 ,", ("a:1", "b:1")),
        ("[::1]:7070,10.0.0.1:7070", ("[::1]:7070", "10.0.0.1:7070")),
    ],
)
def test_a_master_list_is_hosts_and_ports_separated_by_commas(spec, expected) -> None:
    assert parse_masters(spec) == expected


@pytest.mark.parametrize("spec", ["", " , ", "a", "a:", ":1", "a:x", "a:1,a:1"])
def test_a_bad_master_list_is_refused(spec) -> None:
    with pytest.raises(BadMasterList):
        parse_masters(spec)


@pytest.mark.parametrize(
    ("rule", "failed", "hint", "expected"),
    [
        ("the active master a standby names comes first", "a:1", "c:1", "c:1"),
        ("a named master outside the list is followed too", "a:1", "z:9", "z:9"),
        ("without a name, the next in the list", "a:1", "", "b:1"),
        ("the list wraps around", "c:1", "", "a:1"),
        ("a master naming itself is not believed", "b:1", "b:1", "c:1"),
        ("after a master outside the list, the first listed", "z:9", "", "a:1"),
    ],
)
def test_next_master(rule, failed, hint, expected) -> None:
    assert next_master(ABC, failed, hint) == expected, rule


def test_without_names_every_master_is_tried_within_one_call() -> None:
    for start in ABC:
        seen, current = [start], start
        for _ in range(attempts_per_call(ABC) - 1):
            current = next_master(ABC, current)
            seen.append(current)
        assert set(seen) == set(ABC)


def test_one_master_is_always_the_next() -> None:
    assert next_master(("a:1",), "a:1") == "a:1"
