"""Repair planning: which replicas are bad, which copies run, by rule (docs/design.md,
"Repair and placement")."""

from __future__ import annotations

import dataclasses

import pytest

from streamengine.master.core import repair
from streamengine.master.core.model import Held, SegmentRecord, SegmentState, StoreView
from streamengine.protocol.certificate import Certificate, certificate_of
from streamengine.protocol.entry import EntryKind

GRACE = 1000
NOW = 10_000


def seg(
    epoch: int,
    copy_set=("a", "b", "c"),
    state=SegmentState.SEALED,
    final=5,
    settled=0,
    verified=None,
) -> SegmentRecord:
    """A segment whose members all matched the certificate unless `verified` names them."""
    record = SegmentRecord(1, "t/s", epoch, tuple(copy_set), state, final, 0, settled, settled)
    return dataclasses.replace(
        record, verified=tuple(copy_set if verified is None else verified)
    )


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


def test_a_replica_not_read_back_yet_is_a_source_but_not_good() -> None:
    segment = seg(1, verified=("b",))
    verdict = repair.judge(segment, ALL, AT_BRIDGE, NOW, GRACE)
    assert verdict.good == ("b",) and verdict.bad == ()
    assert verdict.unverified == ("a", "c")
    assert verdict.sources == ("b", "a", "c"), "the verified replica is the first source"


def test_a_copy_is_made_from_an_unverified_replica_when_no_other_can_serve() -> None:
    cluster = stores(view("a"), view("b", alive=False), view("c", alive=False), view("d"))
    segment = seg(1, verified=())
    [task] = repair.plan_tasks([segment], cluster, {(1, 1): AT_BRIDGE}, NOW, GRACE, (), 3)
    assert (task.source, task.replaced, task.target) == ("a", "b", "d")


def test_a_verified_replica_is_the_source_before_a_less_busy_unverified_one() -> None:
    cluster = stores(view("a"), view("b"), view("c", alive=False), view("d"), view("e"))
    segments = [seg(1, verified=("b",)), seg(2, verified=("b",))]
    copies = {(1, 1): AT_BRIDGE, (1, 2): AT_BRIDGE}
    tasks = repair.plan_tasks(segments, cluster, copies, NOW, GRACE, (), 3)
    assert [t.source for t in tasks] == ["b", "b"]


def test_a_draining_replica_at_the_bridge_is_still_a_source() -> None:
    cluster = stores(view("a", draining=True), view("b", alive=False), view("c", alive=False))
    verdict = repair.judge(seg(1), cluster, AT_BRIDGE, NOW, GRACE)
    assert verdict.good == () and verdict.sources == ("a",)


@pytest.mark.parametrize(
    ("rule", "segment", "copies", "replicas", "expected"),
    [
        ("N good replicas", seg(1), AT_BRIDGE, 3, False),
        ("a replica not read back yet", seg(1, verified=("a", "b")), AT_BRIDGE, 3, True),
        ("a replica below the bridge", seg(1), {**AT_BRIDGE, "c": held(4)}, 3, True),
        ("a missing report counts as missing", seg(1), {"a": held(5), "b": held(5)}, 3, True),
    ],
)
def test_under_replicated(rule, segment, copies, replicas, expected) -> None:
    verdict = repair.judge(segment, ALL, copies, NOW, GRACE)
    assert (len(verdict.good) < replicas) == expected, rule


@pytest.mark.parametrize(
    ("rule", "cluster", "segment", "copies", "verifying"),
    [
        ("sealed a moment ago: none read back yet", ALL, seg(1, verified=()), AT_BRIDGE, True),
        ("one replica not read back yet", ALL, seg(1, verified=("a", "b")), AT_BRIDGE, True),
        (
            "a member not reported at the bridge within the grace is not judged yet",
            stores(view("a"), view("b"), view("c", reported=NOW - GRACE - 1)),
            seg(1, settled=NOW - 2 * GRACE, verified=()),
            {"a": held(5), "b": held(5)},
            True,
        ),
        ("N good replicas: not below N at all", ALL, seg(1), AT_BRIDGE, False),
        (
            "a store gone lacks a replica",
            stores(view("a"), view("b"), view("c", alive=False)),
            seg(1, verified=()),
            AT_BRIDGE,
            False,
        ),
        (
            "a draining store lacks a replica",
            stores(view("a"), view("b"), view("c", draining=True)),
            seg(1),
            AT_BRIDGE,
            False,
        ),
        (
            "a bad copy lacks a replica",
            ALL,
            dataclasses.replace(seg(1, verified=()), bad=("c",)),
            AT_BRIDGE,
            False,
        ),
        ("a missed bridge lacks a replica", ALL, seg(1), {**AT_BRIDGE, "c": held(4)}, False),
    ],
)
def test_a_segment_lacking_no_replica_is_being_verified(
    rule, cluster, segment, copies, verifying
) -> None:
    verdict = repair.judge(segment, cluster, copies, NOW, GRACE)
    assert repair.being_verified(segment, verdict, 3) == verifying, rule


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


EXACTLY_N = stores(view("a"), view("b"), view("c"))
# The store found its replica damaged: it reports acked index 0, and what it holds.
C_DAMAGED = {**AT_BRIDGE, "c": Held(fence=2, acked_index=0, last_index=5, bytes=100)}
C_BAD = dataclasses.replace(seg(1, verified=("a", "b")), bad=("c",))


@pytest.mark.parametrize(
    ("rule", "cluster", "segment", "copies", "write_quorum", "expected"),
    [
        (
            "missed the bridge, no spare store: refilled in place",
            EXACTLY_N, seg(1), {**AT_BRIDGE, "c": held(3)}, 2, ("a", "c", repair.MISSED_BRIDGE),
        ),
        (
            "found damaged by its store, no spare store: refilled in place",
            EXACTLY_N, seg(1), C_DAMAGED, 2, ("a", "c", repair.MISSED_BRIDGE),
        ),
        (
            "differs from the certificate, no spare store: refilled in place",
            EXACTLY_N, C_BAD, AT_BRIDGE, 2, ("a", "c", repair.BAD_COPY),
        ),
        (
            "damaged, a spare store can take it: moved there, never in place",
            ALL, seg(1), C_DAMAGED, 2, ("a", "d", repair.MISSED_BRIDGE),
        ),
        (
            "differs, a spare store can take it: moved there",
            ALL, C_BAD, AT_BRIDGE, 2, ("a", "d", repair.BAD_COPY),
        ),
        (
            "the others hold fewer than W good replicas: waits",
            EXACTLY_N, seg(1), C_DAMAGED, 3, None,
        ),
        (
            "the other good one is not read back yet: waits",
            EXACTLY_N, seg(1, verified=("a",)), C_DAMAGED, 2, None,
        ),
        ("W unknown: waits", EXACTLY_N, seg(1), C_DAMAGED, 0, None),
        (
            "fewer than W good, the member holds no copy at all: refilled in place",
            EXACTLY_N, seg(1), {"a": held(5), "b": held(5)}, 3, ("a", "c", repair.MISSED_BRIDGE),
        ),
        (
            "fewer than W good, the member holds only a fence: refilled in place",
            EXACTLY_N, seg(1), {**AT_BRIDGE, "c": Held(2, 0, 0, 0)}, 3,
            ("a", "c", repair.MISSED_BRIDGE),
        ),
        (
            "fewer than W good, the member holds an unfinished copy: refilled in place",
            EXACTLY_N, seg(1), {**AT_BRIDGE, "c": Held(2, 0, 3, 60)}, 3,
            ("a", "c", repair.MISSED_BRIDGE),
        ),
        (
            "fewer than W good, the member acked part of it: waits",
            EXACTLY_N, seg(1), {**AT_BRIDGE, "c": held(3)}, 3, None,
        ),
        (
            "fewer than W good, the member differs from the certificate: waits",
            EXACTLY_N, C_BAD, AT_BRIDGE, 3, None,
        ),
        (
            "a dead member is never refilled in place",
            stores(view("a"), view("b"), view("c", alive=False)), seg(1), AT_BRIDGE, 2, None,
        ),
        (
            "a draining member is never refilled in place",
            stores(view("a"), view("b"), view("c", draining=True)), seg(1), AT_BRIDGE, 2, None,
        ),
    ],
)
def test_in_place_refill(rule, cluster, segment, copies, write_quorum, expected) -> None:
    quorums = {segment.stream_id: write_quorum} if write_quorum else {}
    tasks = repair.plan_tasks(
        [segment], cluster, {segment.key: copies}, NOW, GRACE, (), 3, write_quorums=quorums
    )
    if expected is None:
        assert tasks == [], rule
        return
    [task] = tasks
    assert (task.source, task.target, task.reason) == expected, rule
    assert task.replaced == "c" and task.in_place == (task.target == "c"), rule


def test_below_w_good_the_empty_members_are_refilled_first_then_the_damaged_one() -> None:
    """Runtime seed 209 (N=5, W=3, five stores): two wiped stores lost their replicas
    and a third rotted, leaving two good ones. Refilling the damaged member waits for W
    good replicas; the empty ones, which erase nothing, go first, one task a segment
    per round; once they are back, the damaged one is refilled."""
    cluster = stores(*(view(m) for m in "abcde"))
    segment = seg(1, copy_set="abcde", verified=("b", "d"))
    damaged = C_DAMAGED["c"]
    copies = {"a": damaged, "b": held(5), "d": held(5)}
    quorums = {segment.stream_id: 3}

    def plan(copies: dict[str, Held], verified: str) -> list[tuple[str, str]]:
        record = dataclasses.replace(segment, verified=tuple(verified))
        tasks = repair.plan_tasks(
            [record], cluster, {segment.key: copies}, NOW, GRACE, (), 3, write_quorums=quorums
        )
        assert all(t.in_place for t in tasks)
        return [(t.source, t.target) for t in tasks]

    assert plan(copies, "bd") == [("b", "c")], "the first empty member, never the damaged one"
    assert plan({**copies, "c": held(5)}, "bcd") == [("b", "a")], "W good: the damaged one"
    assert plan({"a": damaged, "b": held(5)}, "b") == [("b", "c")]


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


# ---- carrying a task out (RepairOp) and choosing the next ones (RepairQueue) ----


def _move(replaced: str = "c", target: str = "d") -> repair.Task:
    return repair.Task((1, 1), "a", target, replaced, repair.STORE_DEAD, 100)


def _through_digests(op: repair.RepairOp, target_digest: bytes = b"D") -> object:
    assert op.start(seg(1)) == repair.AskSourceState("a")
    copy = op.step(repair.SourceState(fence=2, acked_index=5, bytes=100))
    assert copy == repair.CopyToTarget(op.task.target, "a", 5, 2)
    assert op.step(repair.Copied(b"D")) == repair.AskDigests("a", op.task.target, 5)
    return op.step(repair.Digests(b"D", target_digest, 5))


def test_a_replaced_copy_is_deleted_only_after_the_verified_copy_is_swapped_in() -> None:
    op = repair.RepairOp(_move())
    swap = _through_digests(op)
    assert swap == repair.SwapReplica("c", "d", Held(2, 5, 5, 100))
    assert op.step(repair.Swapped()) == repair.DeleteReplaced("c")
    assert not op.error


def test_a_member_refilled_in_place_drops_its_copies_and_is_never_deleted() -> None:
    op = repair.RepairOp(_move(replaced="c", target="c"))
    assert op.start(seg(1)) == repair.AskSourceState("a")
    copy = op.step(repair.SourceState(fence=2, acked_index=5, bytes=100))
    assert copy == repair.CopyToTarget("c", "a", 5, 2, replace_held=True)
    assert op.step(repair.Copied(b"D")) == repair.AskDigests("a", "c", 5)
    assert isinstance(op.step(repair.Digests(b"D", b"D", 5)), repair.SwapReplica)
    assert op.step(repair.Swapped()) is None and not op.error


@pytest.mark.parametrize(
    ("rule", "events", "error"),
    [
        ("the source must hold the bridge", [repair.SourceState(2, 4, 100)], "below the bridge"),
        (
            "the digests must match",
            [repair.SourceState(2, 5, 100), repair.Copied(b""), repair.Digests(b"S", b"T", 5)],
            "differs",
        ),
        (
            "the copy must hold every index",
            [repair.SourceState(2, 5, 100), repair.Copied(b""), repair.Digests(b"S", b"S", 4)],
            "holds 4 of 5",
        ),
        ("a failed call ends the task", [repair.StepFailed("UNAVAILABLE: down")], "UNAVAILABLE"),
    ],
)
def test_a_task_that_fails_a_check_swaps_and_deletes_nothing(
    rule: str, events: list[repair.RepairEvent], error: str
) -> None:
    op = repair.RepairOp(_move())
    action = op.start(seg(1))
    for event in events:
        assert action is not None, rule
        action = op.step(event)
    assert action is None and error in op.error, rule


def test_a_task_no_longer_valid_does_nothing() -> None:
    assert repair.RepairOp(_move(replaced="x")).start(seg(1)) is None
    assert repair.RepairOp(_move(target="b")).start(seg(1)) is None
    assert repair.RepairOp(_move()).start(seg(1, state=SegmentState.OPEN)) is None


def test_the_queue_runs_operator_moves_first_and_backs_off_a_failed_segment() -> None:
    queue = repair.RepairQueue(concurrency=2, retry_ms=100)
    planned = [repair.Task((1, 9), "a", "d", "c", repair.STORE_DEAD, 1)]
    move = repair.Task((1, 1), "a", "d", "a", repair.REBALANCE, 1)
    queue.plan_moves([move])
    assert queue.next_tasks(0, lambda busy, slots: planned[:slots]) == [move, planned[0]]
    assert queue.next_tasks(0, lambda busy, slots: pytest.fail("no slot left")) == []
    queue.finished(move, failed=True, now_ms=0)
    assert (
        queue.next_tasks(50, lambda busy, slots: [t for t in [move] if t.segment not in busy]) == []
    )
    assert queue.next_tasks(
        100, lambda busy, slots: [t for t in [move] if t.segment not in busy]
    ) == [move]


# ---- certificates: a good source, a copy verified against the certificate ----


def _certificate(final: int = 5) -> Certificate:
    rows = [(i, int(EntryKind.EVENT), bytes([i])) for i in range(1, final)]
    return certificate_of([*rows, (final, int(EntryKind.BRIDGE), b"")])


@pytest.mark.parametrize(
    ("rule", "sources", "verified", "failed", "load", "chosen"),
    [
        ("the first good source by default", ("a", "b", "c"), set(), set(), {}, "a"),
        ("a verified replica first", ("a", "b", "c"), {"c"}, set(), {}, "c"),
        ("the least busy among verified ones", ("a", "b", "c"), {"b", "c"}, set(), {"b": 1}, "c"),
        ("never one whose copy failed while another can serve", ("a", "b"), {"a"}, {"a"}, {}, "b"),
        ("every one failed: the rotation starts over", ("a", "b"), set(), {"a", "b"}, {}, "a"),
    ],
)
def test_choosing_a_copy_source(rule, sources, verified, failed, load, chosen) -> None:
    assert repair.choose_source(sources, verified, failed, load) == chosen, rule


def test_a_failed_copy_rotates_the_next_attempt_to_another_source() -> None:
    queue = repair.RepairQueue(concurrency=1, retry_ms=100)
    segment = seg(1)
    cluster = stores(view("a"), view("b"), view("c", alive=False), view("d"))
    copies = {(1, 1): {"a": held(5), "b": held(5)}}

    def plan(busy, slots):
        return repair.plan_tasks(
            [segment], cluster, copies, NOW, GRACE, busy, slots, failed_sources=queue.failed_sources
        )

    [first] = queue.next_tasks(0, plan)
    queue.finished(first, failed=True, now_ms=0)
    [second] = queue.next_tasks(100, plan)
    assert {first.source, second.source} == {"a", "b"}
    queue.finished(second, failed=False, now_ms=100)
    assert queue.failed_sources == {}


def test_a_certified_copy_is_verified_by_the_target_against_the_certificate() -> None:
    certificate = _certificate()
    segment = dataclasses.replace(seg(1), certificate=certificate, certified_by="writer")
    op = repair.RepairOp(_move())
    assert op.start(segment) == repair.AskSourceState("a")
    copy = op.step(repair.SourceState(fence=2, acked_index=5, bytes=100))
    assert copy == repair.CopyToTarget("d", "a", 5, 2, certificate)
    # The target reports the root it verified: no digest of the source is asked.
    assert op.step(repair.Copied(certificate.root())) == repair.SwapReplica(
        "c", "d", Held(2, 5, 5, 100)
    )
    other = repair.RepairOp(_move())
    other.start(segment)
    other.step(repair.SourceState(fence=2, acked_index=5, bytes=100))
    assert other.step(repair.Copied(b"another root")) is None
    assert "root" in other.error
