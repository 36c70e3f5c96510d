"""Repair planning: which replicas are bad, which copies run, by rule (DESIGN.md,
"Repair and placement")."""

from __future__ import annotations

import pytest

from streamengine.master import repair
from streamengine.master.model import Held, SegmentRecord, SegmentState, StoreView

GRACE = 1000
NOW = 10_000


def seg(
    epoch: int, copy_set=("a", "b", "c"), state=SegmentState.SEALED, final=5, settled=0
) -> SegmentRecord:
    return SegmentRecord(1, "t/s", epoch, tuple(copy_set), state, final, 0, settled, settled)


def view(sid: str, alive=True, draining=False, zone="", used=0, reported=NOW) -> StoreView:
    return StoreView(sid, zone, used, alive, draining, 0, reported)


def stores(*views: StoreView) -> dict[str, StoreView]:
    return {v.store_id: v for v in views}


def held(acked: int) -> Held:
    return Held(fence=2, acked_index=acked, last_index=acked, bytes=100)


ALL = stores(view("a"), view("b"), view("c"), view("d"))
AT_BRIDGE = {"a": held(5), "b": held(5), "c": held(5)}


@pytest.mark.parametrize(
    ("rule", "segment", "cluster", "copies", "good", "bad"),
    [
        ("every member at the bridge is good", seg(1), ALL, AT_BRIDGE, ("a", "b", "c"), ()),
        (
            "a dead store's replica is bad",
            seg(1),
            stores(view("a"), view("b", alive=False), view("c")),
            AT_BRIDGE,
            ("a", "c"),
            (("b", repair.STORE_DEAD),),
        ),
        (
            "an unregistered store's replica is bad",
            seg(1, ("a", "b", "x")),
            ALL,
            AT_BRIDGE,
            ("a", "b"),
            (("x", repair.STORE_DEAD),),
        ),
        (
            "a draining store's replica is bad",
            seg(1),
            stores(view("a", draining=True), view("b"), view("c")),
            AT_BRIDGE,
            ("b", "c"),
            (("a", repair.DRAIN),),
        ),
        (
            "a replica whose acked index missed the bridge is bad once judged",
            seg(1),
            ALL,
            {**AT_BRIDGE, "c": held(4)},
            ("a", "b"),
            (("c", repair.MISSED_BRIDGE),),
        ),
        (
            "a live store reporting no copy at all missed the bridge",
            seg(1),
            ALL,
            {"a": held(5), "b": held(5)},
            ("a", "b"),
            (("c", repair.MISSED_BRIDGE),),
        ),
        (
            "within the grace after the seal, a lagging replica is not judged",
            seg(1, settled=NOW - GRACE + 1),
            ALL,
            {**AT_BRIDGE, "c": held(4)},
            ("a", "b"),
            (),
        ),
        (
            "a report sent before the grace ended says nothing",
            seg(1, settled=NOW - 2 * GRACE),
            stores(view("a"), view("b"), view("c", reported=NOW - GRACE - 1)),
            {**AT_BRIDGE, "c": held(4)},
            ("a", "b"),
            (),
        ),
    ],
)
def test_judge(rule, segment, cluster, copies, good, bad) -> None:
    verdict = repair.judge(segment, cluster, copies, NOW, GRACE)
    assert (verdict.good, verdict.bad) == (good, bad), rule


def test_a_draining_replica_at_the_bridge_is_still_a_source() -> None:
    cluster = stores(view("a", draining=True), view("b", alive=False), view("c", alive=False))
    verdict = repair.judge(seg(1), cluster, AT_BRIDGE, NOW, GRACE)
    assert verdict.good == () and verdict.sources == ("a",)


@pytest.mark.parametrize(
    ("rule", "segment", "copies", "replicas", "expected"),
    [
        ("N good replicas", seg(1), AT_BRIDGE, 3, False),
        ("a replica below the bridge", seg(1), {**AT_BRIDGE, "c": held(4)}, 3, True),
        ("a missing report counts as missing", seg(1), {"a": held(5), "b": held(5)}, 3, True),
    ],
)
def test_under_replicated(rule, segment, copies, replicas, expected) -> None:
    assert repair.under_replicated(segment, ALL, copies, replicas) == expected, rule


def test_a_dead_store_gives_one_task_per_segment_to_a_new_target() -> None:
    cluster = stores(view("a"), view("b", alive=False), view("c"), view("d"))
    segments = [seg(e) for e in (1, 2)]
    tasks = repair.plan_tasks(
        segments, cluster, {s.key: AT_BRIDGE for s in segments}, NOW, GRACE, (), 5
    )
    assert [(t.segment, t.target, t.replaced, t.reason) for t in tasks] == [
        ((1, 1), "d", "b", repair.STORE_DEAD),
        ((1, 2), "d", "b", repair.STORE_DEAD),
    ]
    assert all(t.source in ("a", "c") for t in tasks)
    assert tasks[0].source != tasks[1].source, "sources spread over the good replicas"


def test_concurrency_is_bounded_and_busy_segments_wait() -> None:
    cluster = stores(view("a"), view("b", alive=False), view("c"), view("d"))
    segments = [seg(e) for e in range(1, 10)]
    copies = {s.key: AT_BRIDGE for s in segments}
    tasks = repair.plan_tasks(segments, cluster, copies, NOW, GRACE, busy=[(1, 1), (1, 3)], slots=3)
    assert [t.segment for t in tasks] == [(1, 2), (1, 4), (1, 5)]
    assert repair.plan_tasks(segments, cluster, copies, NOW, GRACE, busy=(), slots=0) == []


@pytest.mark.parametrize(
    ("rule", "segment"),
    [
        ("open segments are never copied", seg(1, state=SegmentState.OPEN, final=0)),
        ("sealing segments are never copied", seg(1, state=SegmentState.SEALING, final=0)),
    ],
)
def test_unsealed_segments_are_not_repaired(rule, segment) -> None:
    cluster = stores(view("a"), view("b", alive=False), view("c"), view("d"))
    assert (
        repair.plan_tasks([segment], cluster, {segment.key: AT_BRIDGE}, NOW, GRACE, (), 3) == []
    ), rule


def test_no_source_no_task() -> None:
    cluster = stores(
        view("a", alive=False), view("b", alive=False), view("c", alive=False), view("d")
    )
    assert repair.plan_tasks([seg(1)], cluster, {(1, 1): AT_BRIDGE}, NOW, GRACE, (), 3) == []


def test_missed_bridge_with_no_spare_store_refills_in_place() -> None:
    cluster = stores(view("a"), view("b"), view("c"))
    copies = {(1, 1): {**AT_BRIDGE, "c": held(3)}}
    [task] = repair.plan_tasks([seg(1)], cluster, copies, NOW, GRACE, (), 3)
    assert (task.target, task.replaced, task.reason) == ("c", "c", repair.MISSED_BRIDGE)


def test_dead_store_with_no_spare_store_waits() -> None:
    cluster = stores(view("a"), view("b"), view("c", alive=False))
    assert repair.plan_tasks([seg(1)], cluster, {(1, 1): AT_BRIDGE}, NOW, GRACE, (), 3) == []


def test_targets_told_to_delete_the_segment_are_avoided() -> None:
    cluster = stores(view("a"), view("b", alive=False), view("c"), view("d"), view("e", used=5))
    [task] = repair.plan_tasks(
        [seg(1)], cluster, {(1, 1): AT_BRIDGE}, NOW, GRACE, (), 3, avoid={(1, 1): ["d"]}
    )
    assert task.target == "e"


@pytest.mark.parametrize(
    ("rule", "cluster", "reason"),
    [
        ("healthy copy set: no roll", ALL, ""),
        (
            "a dead member: roll",
            stores(view("a"), view("b", alive=False), view("c")),
            "store-dead: b",
        ),
        (
            "a draining member: roll",
            stores(view("a"), view("b"), view("c", draining=True)),
            "drain: c",
        ),
    ],
)
def test_roll_reason(rule, cluster, reason) -> None:
    assert repair.roll_reason(("a", "b", "c"), cluster) == reason, rule
