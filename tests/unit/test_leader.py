"""The writer's election loop: heartbeats every lease/3, the lease counted from the send
time, leading on while no master answers, stepping down (deposed, fenced, released) with
failed versus in-doubt appends, appends answered in doubt after their timeout, and the
gate that holds acks until earlier segments are sealed."""

from __future__ import annotations

from typing import Any

import pytest

from streamengine.client.core.replicator import (
    Acked,
    Append,
    SegmentRef,
    SendWrite,
    StoreConnected,
    Tick,
    WriteReplied,
)
from streamengine.client.core.writer import (
    FOLLOWER_HEARTBEAT_MS_MAX,
    RECOVERY_RETRY_MS,
    SESSION_BOUND_HEARTBEAT_MS,
    STREAM_DELETED,
    AppendsTimedOut,
    AskRoll,
    BecameLeader,
    FencedByStore,
    HeartbeatAnswered,
    HeartbeatFailed,
    Leader,
    LeaderAction,
    LeaderEvent,
    RecoverSegment,
    RecoveryFailed,
    Release,
    ReleaseLease,
    Replica,
    Role,
    SegmentGrant,
    SegmentSealed,
    SendHeartbeat,
    SessionAttention,
    SessionLease,
    SessionUnbound,
    StepDownReason,
    SteppedDown,
)
from streamengine.protocol.policy import ReplicationPolicy

LEASE_MS = 900
POLICY = ReplicationPolicy(3, 2)
STORES = ("s1", "s2", "s3")


def grant(epoch: int) -> SegmentGrant:
    return SegmentGrant(
        SegmentRef(stream_id=1, epoch=epoch, stream="acme/orders"),
        tuple(Replica(s, f"127.0.0.1:{7000 + i}") for i, s in enumerate(STORES)),
    )


def signed(epoch: int) -> bytes:
    """Stands for the master's signed grant of `epoch`: opaque to the writer."""
    return b"grant of epoch %d" % epoch


def leader_answer(sent_at_ms: int, epoch: int = 5, **kwargs) -> HeartbeatAnswered:
    fields = {"segment": grant(epoch), "policy": POLICY, "leader_id": "me", "grant": signed(epoch)}
    fields.update(kwargs)
    return HeartbeatAnswered(sent_at_ms, True, epoch, LEASE_MS, **fields)  # type: ignore[arg-type]


def follower_answer(sent_at_ms: int, epoch: int = 5) -> HeartbeatAnswered:
    return HeartbeatAnswered(sent_at_ms, False, epoch, LEASE_MS, leader_id="other")


def step(leader: Leader, now_ms: int, event: LeaderEvent) -> list[LeaderAction]:
    """One step and the actions it queued."""
    leader.step(now_ms, event)
    return leader.take_actions()


def of_type(actions: list[LeaderAction], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def leading(now_ms: int = 0, **kwargs) -> Leader:
    leader = Leader(now_ms, **kwargs)
    assert of_type(step(leader, now_ms, Tick()), SendHeartbeat)
    actions = step(leader, now_ms + 5, leader_answer(now_ms))
    assert of_type(actions, BecameLeader)
    for store in STORES:
        step(leader, now_ms + 5, StoreConnected(store))
    return leader


def answer_all(
    leader: Leader, now_ms: int, actions: list[LeaderAction], stores=STORES
) -> list[Any]:
    out: list[LeaderAction] = []
    for send in of_type(actions, SendWrite):
        if send.store in stores:
            reply = WriteReplied(
                send.store, send.request_id, False, send.last_index, 0, send.first_index,
                send.last_index,
            )  # fmt: skip
            out += step(leader, now_ms, reply)
    return out


def test_a_follower_heartbeats_often_whatever_the_lease_even_if_one_hangs() -> None:
    """A waiting writer asks every FOLLOWER_HEARTBEAT_MS_MAX (a third of the lease if
    shorter): a dead leader's lease ends at once, and the next question takes over."""
    interval = min(LEASE_MS // 3, FOLLOWER_HEARTBEAT_MS_MAX)
    assert interval < LEASE_MS // 3, "the test's lease is long enough to tell them apart"
    leader = Leader(0)
    [beat] = of_type(step(leader, 0, Tick()), SendHeartbeat)
    assert beat.epoch == 0
    assert step(leader, interval - 1, Tick()) == []
    step(leader, 10, follower_answer(0))
    assert leader.role is Role.FOLLOWING
    assert leader.deadline_ms(10) == interval
    # Nobody answers: the heartbeats go on schedule, up to a lease worth in flight.
    for n in (1, 2, 3):
        [beat] = of_type(step(leader, n * interval, Tick()), SendHeartbeat)
        assert beat.timeout_ms == LEASE_MS
    assert of_type(step(leader, 4 * interval, Tick()), SendHeartbeat) == []
    assert leader.deadline_ms(4 * interval) is None
    # One gives up: the overdue heartbeat goes at once.
    assert of_type(step(leader, 4 * interval + 1, HeartbeatFailed(interval, "x")), SendHeartbeat)


def test_each_heartbeat_names_the_latest_epoch_the_master_answered_with() -> None:
    """The master never grants a heartbeat naming the holder's client id without its
    secret that saw an epoch below the holder's (sent before the grant's answer came):
    the next epoch would depose the writer it was granted to."""
    leader = Leader(0)
    [first] = of_type(step(leader, 0, Tick()), SendHeartbeat)
    assert first.seen_epoch == 0
    step(leader, 10, follower_answer(0, epoch=4))
    [after_follow] = of_type(step(leader, 100, Tick()), SendHeartbeat)
    assert after_follow.seen_epoch == 4
    step(leader, 110, leader_answer(100, epoch=5))
    [leading] = of_type(step(leader, 110 + LEASE_MS, Tick()), SendHeartbeat)
    assert (leading.epoch, leading.seen_epoch) == (5, 5)


def test_a_leader_heartbeats_every_third_of_the_lease() -> None:
    leader = Leader(0)
    step(leader, 0, Tick())
    step(leader, 10, leader_answer(0))
    assert leader.role is Role.LEADING
    assert leader.heartbeat_interval_ms == LEASE_MS // 3


def test_an_answer_sent_before_the_grant_does_not_depose() -> None:
    leader = Leader(0)
    step(leader, 0, Tick())
    step(leader, LEASE_MS // 3, Tick())
    # The second heartbeat's grant overtakes the first one's FOLLOWER answer.
    assert of_type(step(leader, 400, leader_answer(LEASE_MS // 3)), BecameLeader)
    assert not of_type(step(leader, 401, follower_answer(0)), SteppedDown)
    assert leader.role is Role.LEADING


def test_the_lease_counts_from_the_send_time_and_renews_by_heartbeat() -> None:
    leader = Leader(0)
    step(leader, 0, Tick())
    # The answer takes 400 ms to come back: the lease still started at 0.
    actions = step(leader, 400, leader_answer(0))
    [became] = of_type(actions, BecameLeader)
    assert became.epoch == 5 and became.segment == grant(5)
    assert leader.statistics().lease_until_ms == LEASE_MS
    # The next heartbeat was due at 300, a third of the lease after the first send.
    [beat] = of_type(actions, SendHeartbeat)
    assert beat.epoch == 5
    step(leader, 800, leader_answer(400))
    assert leader.statistics().lease_until_ms == 400 + LEASE_MS
    assert leader.role is Role.LEADING
    # An old answer never shortens the lease.
    step(leader, 801, leader_answer(100))
    assert leader.statistics().lease_until_ms == 400 + LEASE_MS


def test_deposed_with_appends_in_flight_fails_them_honestly() -> None:
    leader = leading()
    first = step(leader, 10, Append((b"a", b"b")))  # sent, acked below
    acked = of_type(answer_all(leader, 11, first), Acked)
    assert [a.acked_index for a in acked] == [2]
    sent = step(leader, 12, Append((b"c",)))  # sent, not answered yet
    # A third append is only assigned: every store has a request in flight, so it
    # lingers, and the master deposes the writer before anything carries it.
    assert of_type(step(leader, 12, Append((b"d",))), SendWrite) == []
    actions = step(leader, 13, follower_answer(12, epoch=6))
    [down] = of_type(actions, SteppedDown)
    assert down.reason is StepDownReason.DEPOSED
    assert (down.acked_index, down.sent_through) == (2, 3)  # 3 in doubt, 4 failed
    assert leader.role is Role.FINISHED
    # Nothing more is acked, even when the quorum answers arrive after.
    assert answer_all(leader, 14, sent) == []


@pytest.mark.parametrize("deposed_by", ["follower", "another epoch of its own"])
def test_a_writer_deposed_right_after_an_ack_tells_its_stores_the_acked_index(
    deposed_by: str,
) -> None:
    """The acked index would have gone alone within `idle_ack_ms`; stepping down first,
    the writer sends it at once, before its step-down, so that followers read its last
    acked events though nobody leads the stream next (runtime seed 130)."""
    leader = leading()
    sent = step(leader, 10, Append((b"a",)))
    assert [a.acked_index for a in of_type(answer_all(leader, 11, sent), Acked)] == [1]
    answer = follower_answer(11, epoch=6) if deposed_by == "follower" else leader_answer(11, 6)
    actions = step(leader, 12, answer)
    down = [i for i, a in enumerate(actions) if isinstance(a, SteppedDown)]
    told = [(i, a) for i, a in enumerate(actions) if isinstance(a, SendWrite)]
    assert sorted(a.store for _, a in told) == sorted(STORES)
    assert all(a.acked_index == 1 and not a.payloads for _, a in told)
    assert down and all(i < down[0] for i, _ in told)


def test_a_writer_stepping_down_sends_no_acked_index_its_stores_know() -> None:
    leader = leading()
    sent = step(leader, 10, Append((b"a",)))
    answer_all(leader, 11, sent)
    carried = step(leader, 12, Append((b"b",)))  # carries acked index 1 to every store
    assert {a.acked_index for a in of_type(carried, SendWrite)} == {1}
    actions = step(leader, 13, follower_answer(12, epoch=6))
    assert of_type(actions, SendWrite) == [] and of_type(actions, SteppedDown)


def test_a_lease_run_out_unrenewed_keeps_the_writer_leading_and_acking() -> None:
    # No master answers: safety rests on fencing, so the open segment goes on.
    leader = leading()
    sent = step(leader, 10, Append((b"a",)))
    assert not of_type(step(leader, 400 + LEASE_MS, Tick()), SteppedDown)
    assert leader.role is Role.LEADING and leader.accepting_appends
    actions = answer_all(leader, 400 + LEASE_MS + 1, sent)
    assert [a.acked_index for a in of_type(actions, Acked)] == [1]
    # A master answering again renews the same epoch; the writer goes on as before.
    step(leader, 5002, leader_answer(5000))
    assert leader.statistics().lease_until_ms == 5000 + LEASE_MS
    assert leader.statistics().master_answered_ms == 5002
    assert leader.role is Role.LEADING


def test_a_store_fence_still_ends_a_writer_no_master_answers() -> None:
    leader = leading()
    step(leader, 3000, Tick())
    [down] = of_type(step(leader, 3001, FencedByStore("s1", 6)), SteppedDown)
    assert down.reason is StepDownReason.FENCED


def test_an_append_not_acked_in_time_is_answered_in_doubt_and_the_writer_goes_on() -> None:
    leader = leading(append_timeout_ms=1000)
    first = step(leader, 10, Append((b"a",)))
    step(leader, 20, Append((b"b", b"c")))
    # One store answers: no quorum. The first append's time runs out, then the second's.
    answer_all(leader, 30, first, stores=("s1",))
    assert of_type(step(leader, 1009, Tick()), AppendsTimedOut) == []
    assert leader.deadline_ms(1009) == 1010
    [late] = of_type(step(leader, 1010, Tick()), AppendsTimedOut)
    assert late == AppendsTimedOut(segment_epoch=5, last_index=1)
    [later] = of_type(step(leader, 1020, Tick()), AppendsTimedOut)
    assert later.last_index == 3 and leader.role is Role.LEADING
    # While they stay unacked, the answer is repeated (for appends held back for room).
    assert of_type(step(leader, 2019, Tick()), AppendsTimedOut) == []
    assert of_type(step(leader, 2020, Tick()), AppendsTimedOut) == [later]
    # A quorum after all: acked (in doubt meant exactly this), and nothing more repeats.
    acked = of_type(answer_all(leader, 2100, first, stores=("s2",)), Acked)
    assert [a.acked_index for a in acked] == [1]
    assert of_type(step(leader, 3100, Tick()), AppendsTimedOut) == [later]


def test_a_producer_batch_due_before_an_append_taken_ahead_of_it_ends_when_due() -> None:
    """The runtime world's seed 109: a plain append taken at 10 (due at 1010), then a
    producer's batch whose timeout counts from its call (due at 700). Appends time out
    as a prefix, so both end at 700: the batch within its own timeout."""
    leader = leading(append_timeout_ms=1000)
    step(leader, 10, Append((b"a",)))
    step(leader, 20, Append((b"b", b"c"), due_ms=700))
    assert of_type(step(leader, 699, Tick()), AppendsTimedOut) == []
    [late] = of_type(step(leader, 700, Tick()), AppendsTimedOut)
    assert late == AppendsTimedOut(segment_epoch=5, last_index=3)


def test_no_roll_starts_while_no_master_answers() -> None:
    leader = leading(rolling_supported=True)
    step(leader, 10, Append((b"a",)))  # never answered: the drain cannot finish
    # The master asks for a roll, then goes silent: the lease runs out at 401 + LEASE_MS.
    step(leader, 420, leader_answer(401, roll_requested=True, roll_reason="drain"))
    assert not leader.accepting_appends  # draining for the roll
    # No new epoch can come: the drain is given up at once and appends go on.
    quiet = step(leader, 401 + LEASE_MS, Tick())
    assert not of_type(quiet, AskRoll) and leader.accepting_appends
    assert not of_type(step(leader, 401 + 3 * LEASE_MS, Tick()), AskRoll)
    # Once a master answers again, the roll it asked for goes ahead.
    step(leader, 4000, leader_answer(3990, roll_requested=True, roll_reason="drain"))
    assert not leader.accepting_appends


@pytest.mark.parametrize(
    "answer",
    [follower_answer(300, epoch=6), leader_answer(300, epoch=6)],
    ids=["follower", "another-epoch"],
)
def test_the_master_deposing_the_leader_steps_it_down(answer) -> None:
    leader = leading()
    step(leader, 300, Tick())
    actions = step(leader, 310, answer)
    [down] = of_type(actions, SteppedDown)
    assert down.reason is StepDownReason.DEPOSED and down.epoch == 5
    # A new epoch granted to this very writer is given back, not left to run out.
    assert of_type(actions, ReleaseLease) == ([ReleaseLease(6, signed(6))] if answer.leader else [])


def test_a_fence_above_the_epoch_steps_down_and_one_at_it_does_not() -> None:
    leader = leading()
    assert step(leader, 20, FencedByStore("s2", 5)) == []
    [down] = of_type(step(leader, 20, FencedByStore("s2", 6)), SteppedDown)
    assert down.reason is StepDownReason.FENCED


def test_release_gives_the_lease_back_and_a_late_grant_too() -> None:
    leader = leading()
    actions = step(leader, 50, Release())
    assert of_type(actions, SteppedDown)[0].reason is StepDownReason.RELEASED
    assert of_type(actions, ReleaseLease) == [ReleaseLease(5, signed(5))]
    assert step(leader, 60, leader_answer(40)) == [ReleaseLease(5, signed(5))]

    follower = Leader(0)
    step(follower, 0, Tick())
    assert step(follower, 1, Release()) == []
    assert step(follower, 2, leader_answer(0, epoch=8)) == [ReleaseLease(8, signed(8))]


def test_unsealed_earlier_segments_without_recovery_fail_clearly() -> None:
    leader = Leader(0)
    step(leader, 0, Tick())
    actions = step(leader, 5, leader_answer(0, unsealed=(grant(4),)))
    [down] = of_type(actions, SteppedDown)
    assert down.reason is StepDownReason.UNSUPPORTED and "4" in down.message
    assert of_type(actions, ReleaseLease) == [ReleaseLease(5, signed(5))]
    assert not of_type(actions, BecameLeader)


def test_a_grant_without_a_segment_needs_recovery_support() -> None:
    leader = Leader(0)
    step(leader, 0, Tick())
    actions = step(leader, 5, leader_answer(0, segment=None, unsealed=(grant(3), grant(4))))
    assert of_type(actions, SteppedDown)[0].reason is StepDownReason.UNSUPPORTED


def test_the_gate_holds_acks_until_every_earlier_segment_is_sealed() -> None:
    leader = Leader(0, recovery_supported=True)
    step(leader, 0, Tick())
    actions = step(leader, 5, leader_answer(0, unsealed=(grant(3), grant(4))))
    assert of_type(actions, RecoverSegment) == [
        RecoverSegment(grant(3), 5, POLICY, signed(5)),
        RecoverSegment(grant(4), 5, POLICY, signed(5)),
    ]
    for store in STORES:
        step(leader, 5, StoreConnected(store))
    sent = step(leader, 6, Append((b"a",)))
    assert of_type(answer_all(leader, 7, sent), Acked) == []
    assert step(leader, 8, SegmentSealed(3)) == []
    [acked] = of_type(step(leader, 9, SegmentSealed(4)), Acked)
    assert acked.acked_index == 1


@pytest.mark.parametrize(
    ("code", "ends_following"),
    [
        ("NOT_FOUND", True),
        ("INVALID_ARGUMENT", True),
        ("UNAVAILABLE", False),
        ("DEADLINE_EXCEEDED", False),
        ("", False),  # no status at all: a timeout in the shell
        ("SOMETHING_NEW", False),  # not in the table: retried
    ],
)
def test_the_core_decides_which_heartbeat_failures_end_the_writer(
    code: str, ends_following: bool
) -> None:
    follower = Leader(0)
    step(follower, 0, Tick())
    actions = step(follower, 5, HeartbeatFailed(0, code, "from the master"))
    downs = of_type(actions, SteppedDown)
    if ends_following:
        assert [d.reason for d in downs] == [StepDownReason.REFUSED]
        assert code in downs[0].message and follower.role is Role.FINISHED
        assert follower.deadline_ms(6) is None
    else:
        assert downs == [] and follower.role is Role.FOLLOWING
        assert follower.deadline_ms(6) is not None
    # A leader keeps its open segment whatever the failure: its lease decides.
    leader = leading()
    step(leader, LEASE_MS // 3, Tick())
    assert of_type(step(leader, LEASE_MS // 3 + 1, HeartbeatFailed(300, code)), SteppedDown) == []
    assert leader.role is Role.LEADING


def test_a_deleted_stream_ends_a_follower_and_steps_a_leader_down_at_once() -> None:
    follower = Leader(0)
    step(follower, 0, Tick())
    downs = of_type(step(follower, 5, HeartbeatFailed(0, STREAM_DELETED, "deleted")), SteppedDown)
    assert [d.reason for d in downs] == [StepDownReason.REFUSED]
    assert follower.role is Role.FINISHED
    leader = leading()
    step(leader, LEASE_MS // 3, Tick())
    downs = of_type(
        step(leader, LEASE_MS // 3 + 1, HeartbeatFailed(300, STREAM_DELETED)), SteppedDown
    )
    assert [d.reason for d in downs] == [StepDownReason.REFUSED]
    assert leader.role is not Role.LEADING


def test_whatever_acts_under_an_epoch_carries_its_grant() -> None:
    leader = Leader(0, recovery_supported=True, rolling_supported=True)
    step(leader, 0, Tick())
    actions = step(leader, 5, leader_answer(0, unsealed=(grant(4),), roll_requested=True))
    became = of_type(actions, BecameLeader)
    assert [b.grant for b in became] == [signed(5)]
    assert [r.grant for r in of_type(actions, RecoverSegment)] == [signed(5)]
    assert leader.replicator is not None and leader.replicator.grant == signed(5)
    actions = step(leader, 6, Release())
    assert of_type(actions, ReleaseLease) == [ReleaseLease(5, signed(5))]


def test_a_renewed_grant_is_shown_to_every_store_and_an_older_one_never_comes_back() -> None:
    leader = leading()
    actions = step(leader, 10, Append((b"a",)))
    assert {w.grant for w in of_type(actions, SendWrite)} == {signed(5)}  # first requests
    answer_all(leader, 11, actions)
    renewed = b"grant of epoch 5, renewed"
    actions = step(leader, 20, leader_answer(15, grant=renewed))
    actions += step(leader, 21, leader_answer(12))  # sent before: its grant is older
    assert leader.replicator is not None and leader.replicator.grant == renewed
    actions += step(leader, 22, Append((b"b",)))
    sends = of_type(actions, SendWrite)  # the acked index broadcast, then the append
    assert {w.grant for w in sends if w.grant} == {renewed}
    assert sorted(w.store for w in sends if w.grant) == sorted(STORES)
    # No store answered the broadcast of acked index 1: the release hands it over.
    released = of_type(step(leader, 24, Release()), ReleaseLease)
    assert released == [ReleaseLease(5, renewed, acked_index=1)]


def test_a_recovery_shows_the_latest_grant_that_lists_its_segment() -> None:
    """The runtime world's seed 2082: a rival of a lower epoch sealed segment 1048580
    first, and a master restarted since renewed the leader's grant listing only what was
    unsealed then. Shown that grant, the store refused the leader's seal of 1048580
    ("does not list segment"), every retry, for good."""
    leader = Leader(0, recovery_supported=True)
    step(leader, 0, Tick())
    actions = step(leader, 5, leader_answer(0, unsealed=(grant(3), grant(4))))
    assert [r.grant for r in of_type(actions, RecoverSegment)] == [signed(5)] * 2
    renewed = b"grant of epoch 5, renewed"
    step(leader, 20, leader_answer(15, grant=renewed, unsealed=(grant(3), grant(4))))
    restarted = b"grant of epoch 5, from a master restarted after segment 4 was sealed"
    step(leader, 30, leader_answer(25, grant=restarted, unsealed=(grant(3),)))
    assert leader.replicator is not None and leader.replicator.grant == restarted
    for epoch in (3, 4):
        step(leader, 31, RecoveryFailed(epoch, "a store refused"))
    actions = step(leader, 31 + RECOVERY_RETRY_MS, Tick())
    assert {r.segment.epoch: r.grant for r in of_type(actions, RecoverSegment)} == {
        3: renewed,
        4: renewed,
    }
    # Once nothing it lists is left to recover, the next renewal is the one shown.
    step(leader, 40 + RECOVERY_RETRY_MS, SegmentSealed(4))
    latest = b"grant of epoch 5, renewed again"
    step(
        leader,
        50 + RECOVERY_RETRY_MS,
        leader_answer(45 + RECOVERY_RETRY_MS, grant=latest, unsealed=(grant(3),)),
    )
    step(leader, 51 + RECOVERY_RETRY_MS, RecoveryFailed(3, "a store refused"))
    actions = step(leader, 51 + 2 * RECOVERY_RETRY_MS, Tick())
    assert [r.grant for r in of_type(actions, RecoverSegment)] == [latest]


def test_a_leader_answer_without_a_signed_grant_cannot_be_led() -> None:
    leader = Leader(0, recovery_supported=True)
    step(leader, 0, Tick())
    actions = step(leader, 5, leader_answer(0, grant=b""))
    down = of_type(actions, SteppedDown)
    assert [d.reason for d in down] == [StepDownReason.UNSUPPORTED]
    assert "signed grant" in down[0].message
    assert of_type(actions, BecameLeader) == []


def test_a_lease_bound_to_the_session_renews_with_it_and_heartbeats_rarely() -> None:
    """Bound by the answer that says so: its lease follows the session's renewals sent
    after that answer came, under the same incarnation, and it heartbeats on its own
    every SESSION_BOUND_HEARTBEAT_MS; told unbound, or another incarnation renewing,
    its own heartbeats alone count again, every third of the lease, the first at once."""
    session = SessionLease()
    leader = Leader(0, session=session)
    step(leader, 0, Tick())
    step(leader, 10, leader_answer(0, session_incarnation=b"one"))
    assert leader.session_incarnation == b"one"
    assert leader.heartbeat_interval_ms == SESSION_BOUND_HEARTBEAT_MS
    session.incarnation, session.renewal_sent_at_ms, session.renewed_until_ms = b"one", 5, 5000
    assert leader.lease_until_ms == LEASE_MS, "sent before the answer that bound it"
    session.renewal_sent_at_ms, session.renewed_until_ms = 300, 300 + LEASE_MS
    assert leader.lease_until_ms == 300 + LEASE_MS
    assert leader.statistics().master_answered_ms == 10, "its own answer, till one comes"
    session.renewal_answered_at_ms = 304
    assert leader.statistics().master_answered_ms == 304, "the session's renewal answered"
    assert of_type(step(leader, LEASE_MS // 3, Tick()), SendHeartbeat), "due as it was bound"
    assert leader.deadline_ms(LEASE_MS // 3) == LEASE_MS // 3 + SESSION_BOUND_HEARTBEAT_MS
    assert step(leader, 5 * LEASE_MS, Tick()) == [], "no heartbeat of its own meanwhile"
    session.incarnation = b"two"  # a session held again, under a master that restarted
    assert leader.lease_until_ms == LEASE_MS
    session.incarnation = b"one"
    assert of_type(step(leader, 5 * LEASE_MS + 1, SessionAttention()), SendHeartbeat)
    step(leader, 5 * LEASE_MS + 2, SessionUnbound())
    assert leader.session_incarnation == b"" and leader.lease_until_ms == LEASE_MS
    assert leader.heartbeat_interval_ms == LEASE_MS // 3
    assert leader.role is Role.LEADING


def test_an_answer_binding_under_an_incarnation_the_session_left_binds_to_nothing() -> None:
    """The session's call was opened again (incarnation "two", renewals answered under
    it) before an answer decided under "one" arrived: that answer binds the writer to a
    session no renewal renews. It heartbeats on its own, every third of the lease, until
    an answer binds it under "two"; before, it waited two minutes with its lease run out,
    deaf to the rolls asked of it."""
    session = SessionLease(b"two", 0, LEASE_MS)
    leader = Leader(0, session=session)
    step(leader, 0, Tick())
    step(leader, 10, leader_answer(0, session_incarnation=b"one"))
    assert leader.heartbeat_interval_ms == LEASE_MS // 3
    sent = of_type(step(leader, LEASE_MS // 3, Tick()), SendHeartbeat)
    assert sent, "its next heartbeat, not two minutes off"
    step(leader, LEASE_MS // 3 + 5, leader_answer(LEASE_MS // 3, session_incarnation=b"two"))
    assert leader.heartbeat_interval_ms == SESSION_BOUND_HEARTBEAT_MS


def test_a_bound_writers_heartbeat_that_failed_goes_again_a_third_of_a_lease_later() -> None:
    """Its session asked for it (a roll to hear of) and it failed: the next goes a
    third of a lease later, not two minutes (the master names the stream no more once
    it decided that heartbeat, whose answer was lost)."""
    session = SessionLease(b"one", 0, LEASE_MS)
    leader = Leader(0, session=session)
    step(leader, 0, Tick())
    step(leader, 10, leader_answer(0, session_incarnation=b"one"))
    assert leader.heartbeat_interval_ms == SESSION_BOUND_HEARTBEAT_MS
    assert of_type(step(leader, 100, SessionAttention()), SendHeartbeat)
    assert step(leader, 100 + LEASE_MS, HeartbeatFailed(100, "DEADLINE_EXCEEDED")) == []
    assert leader.deadline_ms(100 + LEASE_MS) == 100 + LEASE_MS + LEASE_MS // 3
    assert of_type(step(leader, 100 + LEASE_MS + LEASE_MS // 3, Tick()), SendHeartbeat)
    assert leader.role is Role.LEADING


def test_a_writer_without_a_session_is_never_bound() -> None:
    leader = Leader(0)
    step(leader, 0, Tick())
    step(leader, 10, leader_answer(0, session_incarnation=b"one"))
    assert leader.session_incarnation == b""
    assert leader.heartbeat_interval_ms == LEASE_MS // 3
