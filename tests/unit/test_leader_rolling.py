"""Rolling in the leader core: drain the open segment (appends wait), then ask the master
for the next epoch; the new segment opens at once and acks only once the old one is
sealed; at most one earlier segment unsealed; a refused roll resumes appends."""

from __future__ import annotations

from typing import Any

from streamengine.client.core.replicator import (
    Acked,
    Append,
    ReplicatorLimits,
    StoreConnected,
    StoreDisconnected,
    Tick,
    WriteReplied,
)
from streamengine.client.core.writer import (
    CLOSE_SEALING_MS_MAX,
    DRAIN_MS_MAX,
    ROLL_RETRY_MS,
    STORE_LOST_MS,
    AppendsLeftUnacked,
    AskRoll,
    BecameLeader,
    Closing,
    HeartbeatAnswered,
    Leader,
    LeaderAction,
    RecoverSegment,
    Release,
    ReleaseLease,
    RollAnswered,
    RollFailed,
    SegmentSealed,
    SendHeartbeat,
    SessionLease,
    StepDownReason,
    SteppedDown,
)
from streamengine.protocol.certificate import certificate_of
from streamengine.protocol.entry import EntryKind
from streamengine.protocol.limits import EVENT_BYTES_MAX
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


def rolling_leader(**answer_fields: Any) -> Leader:
    leader = Leader(0, recovery_supported=True, rolling_supported=True)
    assert of_type(step(leader, 0, Tick()), SendHeartbeat)
    answer = leader_answer(0, **answer_fields)
    assert of_type(step(leader, 5, answer), BecameLeader)
    for store in STORES:
        step(leader, 5, StoreConnected(store))
    return leader


def settle(leader: Leader, now_ms: int, actions: list[LeaderAction]) -> list[LeaderAction]:
    """Answer every write (and the ones the answers let go) until none is left."""
    out: list[LeaderAction] = list(actions)
    pending = list(actions)
    for now in range(now_ms, now_ms + 50):
        answered = answer_all(leader, now, pending) + step(leader, now, Tick())
        out += answered
        pending = answered
    return out


def roll_answer(sent_at_ms: int, epoch: int, old: int, **fields: Any) -> RollAnswered:
    return RollAnswered(leader_answer(sent_at_ms, epoch, unsealed=(grant(old),), **fields))


def test_a_segment_past_its_bytes_drains_then_asks_for_the_next_epoch() -> None:
    leader = rolling_leader(segment_bytes_max=100)
    sent = step(leader, 10, Append((b"x" * 60,)))
    assert leader.accepting_appends
    sent += step(leader, 11, Append((b"y" * 60,)))
    # Past 100 bytes: no more appends; nothing asked before both are acked.
    assert not leader.accepting_appends
    assert of_type(step(leader, 12, Tick()), AskRoll) == []
    actions = settle(leader, 13, sent)
    assert of_type(actions, Acked)[-1].acked_index == 2
    [ask] = of_type(actions, AskRoll)
    assert ask.epoch == 5 and ask.exclude_stores == () and "120 bytes" in ask.reason


def test_the_new_segment_opens_at_once_and_acks_after_the_old_is_sealed() -> None:
    leader = rolling_leader(segment_bytes_max=10)
    assert of_type(settle(leader, 11, step(leader, 10, Append((b"x" * 20,)))), AskRoll)
    actions = step(leader, 70, roll_answer(65, 6, old=5, segment_bytes_max=10))
    assert of_type(actions, BecameLeader)[0].epoch == 6
    assert of_type(actions, RecoverSegment) == [RecoverSegment(grant(5), 6, POLICY, signed(6))]
    # The recovery knows what the drained segment holds: the events as appended.
    [recover] = of_type(actions, RecoverSegment)
    assert recover.known is not None and recover.known.through_index == 1
    recover.known.add(2, EntryKind.BRIDGE, b"")
    assert recover.known.finish() == certificate_of(
        [(1, int(EntryKind.EVENT), b"x" * 20), (2, int(EntryKind.BRIDGE), b"")]
    )
    assert leader.epoch == 6 and leader.accepting_appends
    for store in STORES:
        step(leader, 71, StoreConnected(store))
    sent = step(leader, 72, Append((b"z",)))
    assert of_type(settle(leader, 73, sent), Acked) == []
    # Only one earlier segment may be unsealed: no roll while it is, even past the size.
    settle(leader, 130, step(leader, 130, Append((b"z" * 20,))))
    assert leader.accepting_appends
    [acked] = of_type(step(leader, 200, SegmentSealed(5)), Acked)
    assert acked.acked_index == 2 and acked.segment_epoch == 6
    assert not leader.accepting_appends  # now the roll may start


def test_a_heartbeat_answered_before_the_roll_does_not_depose() -> None:
    leader = rolling_leader(segment_bytes_max=10)
    settle(leader, 11, step(leader, 10, Append((b"x" * 20,))))
    step(leader, 70, roll_answer(15, 6, old=5))
    # Sent after the roll was, answered by the master before it: epoch 5, still leader.
    late = leader_answer(16, 5)
    assert of_type(step(leader, 30, late), SteppedDown) == []
    assert leader.epoch == 6
    deposed = step(leader, 31, HeartbeatAnswered(17, False, 7, LEASE_MS, leader_id="other"))
    assert of_type(deposed, SteppedDown)[0].reason is StepDownReason.DEPOSED


def test_a_renewal_answered_after_the_roll_but_heard_first_does_not_depose() -> None:
    leader = rolling_leader(segment_bytes_max=10)
    assert of_type(settle(leader, 11, step(leader, 10, Append((b"x" * 20,)))), AskRoll)
    # The master rolled to 6, then renewed the lease (now of epoch 6) for a heartbeat
    # naming 5; that answer reaches the writer before the roll's own.
    renewal = leader_answer(68, 6)
    assert of_type(step(leader, 69, renewal), SteppedDown) == []
    assert of_type(step(leader, 70, roll_answer(65, 6, old=5)), BecameLeader)[0].epoch == 6
    assert leader.epoch == 6


def test_a_roll_whose_answer_was_lost_is_taken_from_the_next_renewal() -> None:
    leader = rolling_leader(segment_bytes_max=10)
    assert of_type(settle(leader, 11, step(leader, 10, Append((b"x" * 20,)))), AskRoll)
    # The roll's call gave up; the master, too loaded to answer in time, rolled anyway.
    step(leader, 40, RollFailed("DEADLINE_EXCEEDED"))
    renewal = leader_answer(60, 6, unsealed=(grant(5),), segment_bytes_max=10)
    actions = step(leader, 70, renewal)
    assert of_type(actions, SteppedDown) == [] and of_type(actions, ReleaseLease) == []
    assert of_type(actions, BecameLeader)[0].epoch == 6
    [recover] = of_type(actions, RecoverSegment)
    assert (recover.segment, recover.new_epoch) == (grant(5), 6)
    assert recover.known is not None and recover.known.through_index == 1
    assert leader.epoch == 6


def test_a_writer_its_session_renews_heartbeats_at_once_when_a_roll_fails() -> None:
    """Its own heartbeats go every SESSION_BOUND_HEARTBEAT_MS: a roll granted whose
    answer was lost would have the master refuse every later roll ("epoch 5 is not the
    latest") for that long, and only a heartbeat's answer tells it (the runtime world's
    seed 1014: 64 rolls refused over 60 s)."""
    session = SessionLease()
    leader = Leader(0, recovery_supported=True, rolling_supported=True, session=session)
    step(leader, 0, Tick())
    step(leader, 5, leader_answer(0, segment_bytes_max=10, session_incarnation=b"one"))
    for store in STORES:
        step(leader, 5, StoreConnected(store))
    assert leader.session_incarnation == b"one"
    assert of_type(settle(leader, 11, step(leader, 10, Append((b"x" * 20,)))), AskRoll)
    assert of_type(step(leader, 40, RollFailed("DEADLINE_EXCEEDED")), SendHeartbeat)


def test_a_roll_lost_with_appends_taken_since_leaves_them_in_doubt() -> None:
    leader = rolling_leader(segment_bytes_max=10)
    assert of_type(settle(leader, 11, step(leader, 10, Append((b"x" * 20,)))), AskRoll)
    step(leader, 40, RollFailed("DEADLINE_EXCEEDED"))
    step(leader, 41, Append((b"y",)))  # appends resumed, sent, never acked
    actions = step(leader, 70, leader_answer(60, 6, unsealed=(grant(5),)))
    [left] = of_type(actions, AppendsLeftUnacked)
    assert (left.segment_epoch, left.acked_index, left.last_index) == (5, 1, 2)
    assert of_type(actions, BecameLeader)[0].epoch == 6
    [recover] = of_type(actions, RecoverSegment)
    assert recover.known is None  # recovered as after a takeover


def test_a_leader_answer_winning_a_later_epoch_anew_deposes() -> None:
    leader = rolling_leader()
    deposed = step(leader, 30, leader_answer(20, 6, lease_won=True))
    assert of_type(deposed, SteppedDown)[0].reason is StepDownReason.DEPOSED
    assert of_type(deposed, ReleaseLease) == [ReleaseLease(6, signed(6))]


def test_a_refused_roll_resumes_appends_and_retries_later() -> None:
    leader = Leader(0, recovery_supported=True, rolling_supported=True)
    step(leader, 0, Tick())
    actions = step(leader, 5, leader_answer(0, roll_requested=True, roll_reason="s3 is dead"))
    [ask] = of_type(actions, AskRoll)
    assert "s3 is dead" in ask.reason
    assert not leader.accepting_appends
    assert of_type(step(leader, 11, RollFailed("no stores")), AskRoll) == []
    assert leader.accepting_appends
    assert of_type(step(leader, 12, Tick()), AskRoll) == []
    step(leader, 13, leader_answer(ROLL_RETRY_MS, roll_requested=True))  # the lease goes on
    assert of_type(step(leader, 11 + ROLL_RETRY_MS, Tick()), AskRoll)


def test_a_store_disconnected_too_long_is_rolled_away_from() -> None:
    leader = rolling_leader()
    step(leader, 10, StoreDisconnected("s3"))
    # Keep the lease alive past the wait.
    step(leader, 20, leader_answer(10 + STORE_LOST_MS - 100))
    assert of_type(step(leader, 10 + STORE_LOST_MS - 1, Tick()), AskRoll) == []
    [ask] = of_type(step(leader, 10 + STORE_LOST_MS, Tick()), AskRoll)
    assert ask.exclude_stores == ("s3",) and "s3 lost" in ask.reason


def test_a_store_that_refuses_each_time_it_reconnects_is_lost_since_it_first_went() -> None:
    """A replica its store lost with a wipe is refused at once, UNAVAILABLE, after every
    reconnect: counted from its last refusal it was never lost, and the writer waited on
    it for good (the runtime world's seed 138)."""
    leader = rolling_leader()
    step(leader, 10, StoreDisconnected("s3"))
    step(leader, 20, leader_answer(10 + STORE_LOST_MS - 100))
    for now in range(100, STORE_LOST_MS, 1000):
        step(leader, now, StoreConnected("s3"))
        step(leader, now + 1, StoreDisconnected("s3"))  # refused again
    [ask] = of_type(step(leader, 10 + STORE_LOST_MS, Tick()), AskRoll)
    assert ask.exclude_stores == ("s3",) and "s3 lost" in ask.reason


def test_a_store_back_and_serving_is_not_lost_when_it_goes_again() -> None:
    leader = rolling_leader()
    step(leader, 10, StoreDisconnected("s3"))
    step(leader, 20, leader_answer(10 + STORE_LOST_MS - 100))
    step(leader, 100, StoreConnected("s3"))
    step(leader, 101, WriteReplied("s3", 0, False, 0, 0))  # it serves again
    step(leader, 200, StoreDisconnected("s3"))
    assert of_type(step(leader, 10 + STORE_LOST_MS, Tick()), AskRoll) == []
    assert of_type(step(leader, 200 + STORE_LOST_MS, Tick()), AskRoll)


def test_an_old_segment_rolls_by_age_only_with_something_in_it() -> None:
    leader = rolling_leader(segment_age_ms_max=200)
    assert of_type(step(leader, 300, Tick()), AskRoll) == []
    step(leader, 300, leader_answer(290, segment_age_ms_max=200))
    actions = settle(leader, 302, step(leader, 301, Append((b"a",))))
    assert of_type(actions, AskRoll)


def test_a_drain_that_does_not_finish_gives_the_roll_up() -> None:
    leader = rolling_leader(segment_bytes_max=1)
    step(leader, 10, Append((b"ab",)))  # never answered
    assert not leader.accepting_appends
    step(leader, 20, leader_answer(10 + DRAIN_MS_MAX - 500, segment_bytes_max=1))
    step(leader, 10 + DRAIN_MS_MAX, Tick())
    assert leader.accepting_appends


def test_without_rolling_support_nothing_rolls() -> None:
    leader = Leader(0, recovery_supported=True)
    step(leader, 0, Tick())
    step(leader, 5, leader_answer(0, segment_bytes_max=1, roll_requested=True))
    for store in STORES:
        step(leader, 5, StoreConnected(store))
    actions = answer_all(leader, 11, step(leader, 10, Append((b"xx",))))
    assert of_type(actions, AskRoll) == [] and leader.accepting_appends


def test_a_roll_answered_after_stepping_down_gives_the_lease_back() -> None:
    leader = Leader(0, recovery_supported=True, rolling_supported=True)
    step(leader, 0, Tick())
    assert of_type(step(leader, 5, leader_answer(0, roll_requested=True)), AskRoll)
    step(leader, 30, follower_answer(20, epoch=6))  # deposed meanwhile
    late = step(leader, 31, roll_answer(9, 6, old=5))
    assert late == [ReleaseLease(6, signed(6))]


def test_a_store_detached_for_falling_behind_is_rolled_away_from() -> None:
    bound = EVENT_BYTES_MAX + 1024
    limits = ReplicatorLimits(unacked_bytes_max=bound, retained_bytes_max=bound)
    leader = Leader(0, limits, recovery_supported=True, rolling_supported=True)
    step(leader, 0, Tick())
    step(leader, 5, leader_answer(0))
    for store in STORES:
        step(leader, 5, StoreConnected(store))
    out: list[LeaderAction] = []
    for now in range(10, 40):
        # s3 never answers: everything acked is kept for it until the buffer is full.
        if not leader.accepting_appends:
            break
        sent = step(leader, now, Append((b"x" * 100_000,)))
        out += sent + answer_all(leader, now, sent, stores=("s1", "s2"))
    asks = of_type(out, AskRoll)
    assert asks and asks[0].exclude_stores == ("s3",) and "s3 detached" in asks[0].reason


def test_closing_waits_for_the_recovery_a_roll_started_then_releases() -> None:
    leader = rolling_leader(segment_bytes_max=100)
    assert of_type(settle(leader, 11, step(leader, 10, Append((b"x" * 120,)))), AskRoll)
    step(leader, 70, roll_answer(65, 6, old=5))
    assert of_type(step(leader, 71, Append((b"y",))), Acked) == []  # held by the gate
    step(leader, 72, Closing())
    assert not leader.accepting_appends and not leader.ready_to_release(72)
    step(leader, 80, SegmentSealed(5))
    assert leader.ready_to_release(80)
    [release] = of_type(step(leader, 81, Release()), ReleaseLease)
    assert release.epoch == 6


def test_closing_gives_up_on_a_recovery_that_does_not_finish_in_time() -> None:
    leader = rolling_leader(segment_bytes_max=100)
    settle(leader, 11, step(leader, 10, Append((b"x" * 120,))))
    step(leader, 70, roll_answer(65, 6, old=5))
    step(leader, 100, Closing())
    deadline = leader.deadline_ms(100)
    assert deadline is not None and deadline <= 100 + CLOSE_SEALING_MS_MAX  # the clock wakes
    assert not leader.ready_to_release(100 + CLOSE_SEALING_MS_MAX - 1)
    assert leader.ready_to_release(100 + CLOSE_SEALING_MS_MAX)


def ticked_while_closing(leader: Leader, closed_at_ms: int) -> list[int]:
    """Tick `leader`, closing since `closed_at_ms`, at every deadline it asks for
    until well past its sealing wait; the times at which it asked for one already
    past (a shell's timer would wake it again at once, and again)."""
    past = []
    now = closed_at_ms
    while now < closed_at_ms + 2 * CLOSE_SEALING_MS_MAX:
        step(leader, now, Tick())
        deadline = leader.deadline_ms(now)
        if deadline is not None and deadline <= now:
            past.append(now)
        now = max(now + 1, deadline or now + LEASE_MS)
        # The master renews the lease: the writer leads on while it closes.
        step(leader, now, leader_answer(now, leader.epoch, segment=None, unsealed=()))
    return past


def test_a_close_past_its_sealing_wait_asks_for_no_time_already_past() -> None:
    """Runtime seed 311: once `CLOSE_SEALING_MS_MAX` had passed, the close's deadline
    stayed in the past: the writer's timer woke it at once, again and again, while the
    close flushed, and virtual time never moved on (a busy loop on a real one)."""
    leader = rolling_leader(segment_bytes_max=100)
    settle(leader, 11, step(leader, 10, Append((b"x" * 120,))))
    step(leader, 70, roll_answer(65, 6, old=5))  # segment 5's recovery never ends
    step(leader, 100, Closing())
    assert ticked_while_closing(leader, 100) == []
    assert leader.ready_to_release(100 + CLOSE_SEALING_MS_MAX)


def test_a_close_in_an_epoch_without_a_segment_asks_for_no_roll_time() -> None:
    """Closing starts no roll: the roll's retry time is no deadline either."""
    leader = Leader(0, recovery_supported=True, rolling_supported=True)
    step(leader, 0, Tick())
    step(leader, 5, leader_answer(0, segment=None))
    step(leader, 6, Closing())
    assert ticked_while_closing(leader, 6) == []


def test_closing_starts_no_roll_and_gives_up_a_drain_not_yet_asked() -> None:
    leader = rolling_leader(segment_age_ms_max=200)
    step(leader, 100, leader_answer(90, segment_age_ms_max=200))
    answer_all(leader, 101, step(leader, 100, Append((b"a",))))  # old enough at 205
    step(leader, 150, Closing())
    assert leader.ready_to_release(150)  # nothing was being recovered
    step(leader, 250, leader_answer(240, segment_age_ms_max=200))
    assert of_type(step(leader, 251, Tick()), AskRoll) == []
    assert not leader.statistics().rolling
    draining = rolling_leader(segment_bytes_max=1)
    step(draining, 10, Append((b"ab",)))  # never answered: the drain waits
    assert draining.statistics().rolling
    step(draining, 11, Closing())
    assert not draining.statistics().rolling
    assert of_type(settle(draining, 12, []), AskRoll) == []
    assert draining.ready_to_release(60)
