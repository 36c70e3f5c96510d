"""Placement: copy sets, repair targets and rebalance plans, by rule."""

from __future__ import annotations

import pytest

from streamengine.master.core import placement
from streamengine.master.core.errors import NotEnoughStores
from streamengine.master.core.model import StoreView
from streamengine.master.core.placement import MovableSegment


def store(
    sid: str,
    zone: str = "",
    used: int = 0,
    alive: bool = True,
    draining: bool = False,
    segments: int = 0,
):
    return StoreView(sid, zone, used, alive, draining, segments)


@pytest.mark.parametrize(
    ("rule", "stores", "n", "exclude", "expected"),
    [
        (
            "least bytes first",
            [store("a", used=30), store("b", used=10), store("c", used=20), store("d", used=40)],
            3,
            (),
            ("b", "c", "a"),
        ),
        (
            "distinct zones when there are enough, even over less loaded stores",
            [store("a", "z1", 1), store("b", "z1", 2), store("c", "z2", 50), store("d", "z3", 60)],
            3,
            (),
            ("a", "c", "d"),
        ),
        (
            "with fewer zones than replicas, spread over every zone then fill by bytes",
            [store("a", "z1", 1), store("b", "z1", 2), store("c", "z2", 50), store("d", "z1", 0)],
            3,
            (),
            ("d", "c", "a"),
        ),
        (
            "dead and draining stores never receive a segment",
            [store("a", alive=False), store("b", draining=True), store("c"), store("d", used=5)],
            2,
            (),
            ("c", "d"),
        ),
        (
            "excluded stores are left out",
            [store("a"), store("b", used=1), store("c", used=2)],
            2,
            ("a",),
            ("b", "c"),
        ),
        (
            "equal bytes: fewer replicas first, then id",
            [store("a", segments=2), store("b", segments=1), store("c", segments=1)],
            2,
            (),
            ("b", "c"),
        ),
    ],
)
def test_choose_copy_set(rule, stores, n, exclude, expected) -> None:
    copy_set = placement.choose_copy_set(stores, n, exclude)
    assert copy_set == expected, rule
    assert len(set(copy_set)) == len(copy_set), "never two replicas on one store"


def test_not_enough_live_stores() -> None:
    with pytest.raises(NotEnoughStores):
        placement.choose_copy_set([store("a"), store("b", alive=False)], 2)


@pytest.mark.parametrize(
    ("rule", "stores", "keep", "avoid", "expected"),
    [
        (
            "a store outside the copy set, least bytes",
            [store("a"), store("b"), store("c", used=9), store("d", used=3)],
            ["a", "b"],
            [],
            "d",
        ),
        (
            "a zone the survivors do not use, over a less loaded one they do",
            [store("a", "z1"), store("b", "z2"), store("c", "z1", 0), store("d", "z3", 50)],
            ["a", "b"],
            [],
            "d",
        ),
        (
            "never a store to avoid (the replaced one)",
            [store("a"), store("b"), store("c")],
            ["a"],
            ["b"],
            "c",
        ),
        ("none left", [store("a"), store("b"), store("c", alive=False)], ["a", "b"], [], None),
    ],
)
def test_choose_target(rule, stores, keep, avoid, expected) -> None:
    assert placement.choose_target(stores, keep, avoid) == expected, rule


def apply(
    replicas: list[MovableSegment], moves: list[placement.Move]
) -> dict[tuple[int, int], tuple[str, ...]]:
    sets = {r.segment: list(r.copy_set) for r in replicas}
    for move in moves:
        members = sets[move.segment]
        assert move.source in members and move.target not in members
        members[members.index(move.source)] = move.target
    return {k: tuple(v) for k, v in sets.items()}


def test_rebalance_onto_a_new_store_ends_within_ten_percent() -> None:
    stores = [store(s) for s in "abcd"]
    replicas = [MovableSegment((1, e), ("a", "b", "c"), 100) for e in range(1, 21)]
    moves, before, after = placement.plan_rebalance(stores, replicas)
    assert before == {"a": 2000, "b": 2000, "c": 2000, "d": 0}
    assert placement.balanced(after)
    assert sum(after.values()) == sum(before.values())
    assert all(abs(b - 1500) <= 150 for b in after.values()), after
    assert len(moves) == after["d"] // 100, "a move is one replica from a full store to d"
    for members in apply(replicas, moves).values():
        assert len(set(members)) == 3, "never two replicas on one store"


def test_rebalance_keeps_zones_spread() -> None:
    stores = [store("a", "z1"), store("b", "z2"), store("c", "z3"), store("d", "z1")]
    replicas = [MovableSegment((1, e), ("a", "b", "c"), 10) for e in range(1, 13)]
    moves, _, after = placement.plan_rebalance(stores, replicas)
    assert all(m.source == "a" and m.target == "d" for m in moves), (
        "only same-zone moves keep zones"
    )
    assert after["d"] > 0


def test_balanced_cluster_plans_nothing() -> None:
    stores = [store(s) for s in "abc"]
    replicas = [MovableSegment((1, e), ("a", "b", "c"), 100) for e in range(1, 5)]
    assert placement.plan_rebalance(stores, replicas)[0] == []


def test_rebalance_stops_when_no_move_helps() -> None:
    # One huge replica cannot be split: moving it only swaps which store is full.
    stores = [store(s) for s in "abcd"]
    replicas = [MovableSegment((1, 1), ("a", "b", "c"), 1000)]
    moves, _, after = placement.plan_rebalance(stores, replicas)
    assert moves == [] and not placement.balanced(after)


def test_rebalance_ignores_dead_and_draining_stores() -> None:
    stores = [
        store("a"),
        store("b"),
        store("c"),
        store("d", alive=False),
        store("e", draining=True),
    ]
    replicas = [MovableSegment((1, e), ("a", "b", "c"), 100) for e in range(1, 4)]
    moves, before, _ = placement.plan_rebalance(stores, replicas)
    assert moves == [] and set(before) == {"a", "b", "c"}


@pytest.mark.parametrize(
    ("rule", "stores", "replicas", "refused"),
    [
        ("four stores, N=3: one may go", ["a", "b", "c", "d"], {"t/s": 3}, ""),
        ("three stores, N=3: none may go", ["a", "b", "c"], {"t/s": 3}, "2 usable stores"),
        ("the largest N decides", ["a", "b", "c", "d"], {"t/s": 2, "t/big": 4}, "t/big"),
        ("a dead store does not count", ["a", "b", "c", "d!"], {"t/s": 3}, "2 usable"),
        ("a draining one neither", ["a", "b", "c", "d~"], {"t/s": 3}, "2 usable"),
        ("no stream: anything goes", ["a"], {}, ""),
        (
            "zones: a zone's last store may not go when N needs it",
            ["c@2", "a@1", "b@1", "d@3"],
            {"t/s": 3},
            "distinct zones",
        ),
        ("zones: another store of its zone may", ["a@1", "b@1", "c@2", "d@3"], {"t/s": 3}, ""),
        (
            "zones: fewer zones than N before: no worse",
            ["a@1", "b@1", "c@1", "d@2"],
            {"t/s": 3},
            "",
        ),
    ],
)
def test_drain_refusal(
    rule: str, stores: list[str], replicas: dict[str, int], refused: str
) -> None:
    """`stores`: id[@zone], `!` dead, `~` draining; the first one is drained."""
    views = [
        store(
            s.rstrip("!~").split("@")[0],
            zone=s.rstrip("!~").split("@")[1] if "@" in s else "",
            alive=not s.endswith("!"),
            draining=s.endswith("~"),
        )
        for s in stores
    ]
    reason = placement.drain_refusal(views, views[0].store_id, replicas)
    if refused:
        assert refused in reason, (rule, reason)
    else:
        assert reason == "", (rule, reason)
