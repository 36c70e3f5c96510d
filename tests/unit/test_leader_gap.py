"""A grant without a segment (two earlier segments unsealed, or too few stores to place
one) and recoveries that fail:
the leader core recovers both earlier segments under the granted epoch, then asks for
the next epoch, again after every failure, until it leads a segment or loses the lease
(issue 22: a lost roll answer or a failed recovery used to leave the writer waiting for
nothing while the master renewed its lease forever)."""

from __future__ import annotations

from streamengine.client.core.replicator import Acked, Append, StoreConnected, Tick
from streamengine.client.core.writer import (
    APPEND_TIMEOUT_MS,
    RECOVERY_RETRY_MS,
    ROLL_ANSWER_GRACE_MS,
    AppendHeld,
    AskRoll,
    BecameLeader,
    HeldAppendLeft,
    HeldAppendsTimedOut,
    Leader,
    LeaderAction,
    RecoverSegment,
    RecoveryFailed,
    Role,
    RollAnswered,
    RollFailed,
    SegmentSealed,
    StepDownReason,
    SteppedDown,
)
from streamengine.protocol.backoff import ROLL_WITHOUT_SEGMENT
from tests.unit.test_leader import (
    LEASE_MS,
    POLICY,
    STORES,
    answer_all,
    follower_answer,
    grant,
    leader_answer,
    of_type,
    signed,
    step,
)


def granted_without_segment(
    unsealed: tuple[int, ...] = (3, 4),
) -> tuple[Leader, list[LeaderAction]]:
    leader = Leader(0, recovery_supported=True, rolling_supported=True)
    step(leader, 0, Tick())
    answer = leader_answer(0, segment=None, unsealed=tuple(grant(e) for e in unsealed))
    return leader, step(leader, 5, answer)


def keep_lease(leader: Leader, from_ms: int, to_ms: int) -> list[LeaderAction]:
    """The master renews the lease every third of it from `from_ms` to `to_ms`; what
    the leader did meanwhile."""
    actions: list[LeaderAction] = []
    for now in range(from_ms, to_ms, LEASE_MS // 3):
        actions += step(leader, now, leader_answer(now, segment=None))
    return actions


def test_a_grant_without_a_segment_recovers_both_then_asks_for_the_next_epoch() -> None:
    leader, actions = granted_without_segment()
    assert of_type(actions, RecoverSegment) == [
        RecoverSegment(grant(3), 5, POLICY, signed(5)),
        RecoverSegment(grant(4), 5, POLICY, signed(5)),
    ]
    assert not of_type(actions, BecameLeader) and not of_type(actions, AskRoll)
    assert leader.role is Role.LEADING and not leader.accepting_appends
    assert step(leader, 10, SegmentSealed(3)) == []
    [ask] = of_type(step(leader, 11, SegmentSealed(4)), AskRoll)
    assert ask.epoch == 5 and ask.exclude_stores == () and ask.timeout_ms == LEASE_MS
    assert not leader.accepting_appends
    actions = step(leader, 20, RollAnswered(leader_answer(11, epoch=6)))
    [became] = of_type(actions, BecameLeader)
    assert became.epoch == 6 and leader.epoch == 6 and leader.accepting_appends
    # Nothing is unsealed before epoch 6: its appends are acked at once.
    for store in STORES:
        step(leader, 21, StoreConnected(store))
    acked = of_type(answer_all(leader, 23, step(leader, 22, Append((b"a",)))), Acked)
    assert [a.acked_index for a in acked] == [1]


def test_a_refused_roll_is_asked_again_after_every_failure_soon_then_each_second() -> None:
    """No segment, no appends: the first retries come fast (a master that saw too few
    stores for a moment), then one a second."""
    leader, actions = granted_without_segment(unsealed=())
    now = 5
    waits = []
    for attempt in range(6):
        [ask] = of_type(actions, AskRoll)
        assert ask.epoch == 5, attempt
        assert of_type(step(leader, now + 1, RollFailed("NotEnoughStores")), AskRoll) == []
        wait = ROLL_WITHOUT_SEGMENT.delay_ms(attempt + 1)
        assert of_type(step(leader, now + wait, Tick()), AskRoll) == [], attempt
        waits.append(wait)
        now += wait + 1
        actions = step(leader, now, Tick())
    assert waits == [100, 200, 400, 800, 1000, 1000]
    assert leader.role is Role.LEADING
    # A segment at last: it leads it and takes appends.
    step(leader, now + 1, RollAnswered(leader_answer(now, epoch=6)))
    assert leader.epoch == 6 and leader.accepting_appends


def test_a_roll_answer_that_never_comes_is_asked_again() -> None:
    leader, actions = granted_without_segment(unsealed=())
    [ask] = of_type(actions, AskRoll)
    given_up = 5 + ask.timeout_ms + ROLL_ANSWER_GRACE_MS
    assert of_type(keep_lease(leader, 10, given_up), AskRoll) == []
    step(leader, given_up, Tick())
    retry = given_up + ROLL_WITHOUT_SEGMENT.first_ms
    assert of_type(step(leader, retry - 1, Tick()), AskRoll) == []
    assert of_type(step(leader, retry, Tick()), AskRoll)


def test_a_renewal_seen_as_a_grant_with_nothing_unsealed_asks_at_once() -> None:
    # The grant's answer was lost; the next heartbeat renews the epoch without a segment.
    leader, actions = granted_without_segment(unsealed=())
    assert leader.role is Role.LEADING
    assert of_type(actions, AskRoll) and not of_type(actions, RecoverSegment)


def test_a_failed_recovery_starts_again_after_a_pause() -> None:
    leader, _ = granted_without_segment()
    step(leader, 10, SegmentSealed(3))
    assert step(leader, 11, RecoveryFailed(4, "UNAVAILABLE")) == []
    assert of_type(keep_lease(leader, 12, 11 + RECOVERY_RETRY_MS), RecoverSegment) == []
    again = of_type(step(leader, 11 + RECOVERY_RETRY_MS, Tick()), RecoverSegment)
    assert again == [RecoverSegment(grant(4), 5, POLICY, signed(5))]
    assert of_type(step(leader, 12 + RECOVERY_RETRY_MS, SegmentSealed(4)), AskRoll)


def test_a_failed_recovery_behind_a_segment_starts_again_too() -> None:
    leader = Leader(0, recovery_supported=True)
    step(leader, 0, Tick())
    step(leader, 5, leader_answer(0, unsealed=(grant(4),)))
    step(leader, 6, RecoveryFailed(4, "DEADLINE_EXCEEDED"))
    assert of_type(keep_lease(leader, 7, 6 + RECOVERY_RETRY_MS), RecoverSegment) == []
    assert of_type(step(leader, 6 + RECOVERY_RETRY_MS, Tick()), RecoverSegment) == [
        RecoverSegment(grant(4), 5, POLICY, signed(5))
    ]
    # A failure reported for a segment already sealed changes nothing.
    step(leader, 7 + RECOVERY_RETRY_MS, SegmentSealed(4))
    step(leader, 8 + RECOVERY_RETRY_MS, RecoveryFailed(4, "late"))
    later = keep_lease(leader, 9 + RECOVERY_RETRY_MS, 9 + 3 * RECOVERY_RETRY_MS)
    assert of_type(later, RecoverSegment) == []


def test_losing_the_lease_without_a_segment_steps_down_with_nothing_sent() -> None:
    leader, _ = granted_without_segment()
    # No master answers: the writer goes on (recovering), as a leader with a segment.
    assert not of_type(step(leader, LEASE_MS, Tick()), SteppedDown)
    [down] = of_type(step(leader, LEASE_MS + 1, follower_answer(LEASE_MS, 6)), SteppedDown)
    assert down.reason is StepDownReason.DEPOSED
    assert (down.epoch, down.sent_through, down.acked_index) == (5, 0, 0)


def test_appends_held_while_the_roll_is_refused_time_out_with_the_append_timeout() -> None:
    """Issue #35, defect 3: the shell parks appends while the epoch has no segment; the
    core answers each one the append timeout after it was held, roll or no roll."""
    leader = Leader(0, recovery_supported=True, rolling_supported=True, append_timeout_ms=900)
    step(leader, 0, Tick())
    step(leader, 5, leader_answer(0, segment=None, unsealed=(grant(3),)))
    assert of_type(step(leader, 10, SegmentSealed(3)), AskRoll)
    actions = step(leader, 100, AppendHeld()) + step(leader, 300, AppendHeld())
    for now in range(310, 1100, 50):
        actions += step(leader, now, leader_answer(now, segment=None))
        actions += step(leader, now + 1, RollFailed("NotEnoughStores"))
        actions += step(leader, now + 2, Tick())
    assert of_type(actions, HeldAppendsTimedOut) == [HeldAppendsTimedOut(1)]
    assert of_type(step(leader, 1199, Tick()), HeldAppendsTimedOut) == []
    assert of_type(step(leader, 1200, Tick()), HeldAppendsTimedOut) == [HeldAppendsTimedOut(1)]
    assert leader.role is Role.LEADING and not leader.accepting_appends


def test_a_held_append_taken_or_cancelled_is_not_answered_again() -> None:
    leader, _ = granted_without_segment(unsealed=(3,))
    step(leader, 10, SegmentSealed(3))
    step(leader, 20, AppendHeld())
    step(leader, 30, AppendHeld())
    step(leader, 40, HeldAppendLeft(taken=False))  # the oldest was cancelled by its caller
    timed_out = of_type(step(leader, 20 + APPEND_TIMEOUT_MS, Tick()), HeldAppendsTimedOut)
    assert timed_out == []
    timed_out = of_type(step(leader, 30 + APPEND_TIMEOUT_MS, Tick()), HeldAppendsTimedOut)
    assert timed_out == [HeldAppendsTimedOut(1)]


def test_a_held_append_due_before_one_ahead_times_out_when_due_and_that_one_with_it() -> None:
    """A producer's batch held after waiting for its turn counts its timeout from the
    call (`AppendHeld.due_ms`); held appends are answered oldest first, so the one held
    ahead of it, due later, ends with it: each ends within its own timeout."""
    leader, _ = granted_without_segment(unsealed=(3,))
    step(leader, 10, SegmentSealed(3))
    step(leader, 100, AppendHeld(due_ms=600))
    step(leader, 200, AppendHeld(due_ms=400))
    assert of_type(step(leader, 399, Tick()), HeldAppendsTimedOut) == []
    assert of_type(step(leader, 400, Tick()), HeldAppendsTimedOut) == [HeldAppendsTimedOut(2)]
