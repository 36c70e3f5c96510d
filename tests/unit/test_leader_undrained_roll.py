"""A roll that cannot drain, in the leader core: when fewer than W stores of the copy set
can still ack the tail (detached, or lost), the writer asks for the roll at once with
the tail unacked; the answer ends that tail (`AppendsLeftUnacked`: in doubt, or failed
if no store got it) and the old segment is recovered as after a takeover. Found by the
simulator (seed 23 with `rot`: N = W = 3, a store that lost entries in a power loss was
detached, and the drain waited for it for ever)."""

from __future__ import annotations

import pytest

from streamengine.client.core.replicator import (
    Acked,
    Append,
    SendWrite,
    StoreConnected,
    StoreDetached,
    StoreDisconnected,
    Tick,
    WriteReplied,
)
from streamengine.client.core.writer import (
    APPEND_TIMEOUT_MS,
    ROLL_RETRY_MS,
    STORE_LOST_MS,
    AppendsLeftUnacked,
    AppendsTimedOut,
    AskRoll,
    BecameLeader,
    Leader,
    LeaderAction,
    RecoverSegment,
    RollAnswered,
    RollFailed,
)
from streamengine.protocol.policy import ReplicationPolicy
from tests.unit.test_leader import (
    STORES,
    answer_all,
    grant,
    leader_answer,
    of_type,
    step,
)

EVERY_STORE = ReplicationPolicy(3, 3)  # N = W: a single store unable stalls the drain
TWO_OF_THREE = ReplicationPolicy(3, 2)


def leader_of(policy: ReplicationPolicy) -> Leader:
    leader = Leader(0, recovery_supported=True, rolling_supported=True)
    step(leader, 0, Tick())
    assert of_type(step(leader, 5, leader_answer(0, policy=policy)), BecameLeader)
    for store in STORES:
        step(leader, 5, StoreConnected(store))
    return leader


def renew(leader: Leader, now_ms: int, sent_at_ms: int, policy: ReplicationPolicy) -> None:
    step(leader, now_ms, leader_answer(sent_at_ms, policy=policy))


# policy, stores lost (disconnected for STORE_LOST_MS), stores answering the append,
# then what the roll for the lost stores does: ask with the tail unacked, ask drained,
# or wait for the drain (a store of the quorum is connected and may still answer).
CASES = [
    (EVERY_STORE, ("s3",), ("s1", "s2"), "undrained"),
    (TWO_OF_THREE, ("s3",), ("s1", "s2"), "drained"),
    (TWO_OF_THREE, ("s3",), ("s1",), "waits"),
    (TWO_OF_THREE, ("s2", "s3"), ("s1",), "undrained"),
]


@pytest.mark.parametrize(("policy", "lost", "answering", "expected"), CASES)
def test_a_roll_asks_with_the_tail_unacked_only_when_too_few_stores_can_ack_it(
    policy: ReplicationPolicy, lost: tuple[str, ...], answering: tuple[str, ...], expected: str
) -> None:
    leader = leader_of(policy)
    for store in lost:
        step(leader, 10, StoreDisconnected(store))
    answer_all(leader, 12, step(leader, 11, Append((b"e",))), stores=answering)
    renew(leader, 20, 10 + STORE_LOST_MS - 100, policy)
    assert of_type(step(leader, 10 + STORE_LOST_MS - 1, Tick()), AskRoll) == []
    asks = of_type(step(leader, 10 + STORE_LOST_MS, Tick()), AskRoll)
    if expected == "waits":
        assert asks == [] and leader.statistics().rolling
        return
    [ask] = asks
    assert ask.exclude_stores == lost
    assert ("undrained: " in ask.reason) == (expected == "undrained"), ask.reason
    assert not leader.accepting_appends


def detached_leader(
    policy: ReplicationPolicy = EVERY_STORE,
) -> tuple[Leader, list[LeaderAction]]:
    """Seed 23's shape: s2 restarts without the entries it held (a power loss) below
    what the writer still keeps, so the replicator detaches it; with N = W the second
    event can never be acked."""
    leader = leader_of(policy)
    answer_all(leader, 11, step(leader, 10, Append((b"first",))))  # acked and dropped
    sent = step(leader, 20, Append((b"second",)))
    out = answer_all(leader, 21, sent, stores=("s1", "s3"))
    [write] = [send for send in of_type(sent, SendWrite) if send.store == "s2"]
    lost = WriteReplied("s2", write.request_id, False, 0, 0, write.first_index, write.last_index)
    return leader, out + step(leader, 22, lost)


def test_a_store_detached_under_n_equals_w_rolls_at_once_with_the_tail_unacked() -> None:
    leader, actions = detached_leader()
    assert [d.store for d in of_type(actions, StoreDetached)] == ["s2"]
    [ask] = of_type(actions, AskRoll)
    assert ask.exclude_stores == ("s2",)
    assert "s2 detached" in ask.reason and "undrained: 2 store(s)" in ask.reason
    assert leader.replicator is not None and leader.replicator.acked_index == 1


def test_a_refused_undrained_roll_is_asked_again_without_the_detached_store() -> None:
    """With no spare store (N stores for N replicas) the master cannot place a copy set
    without the detached one: the next attempt lets it in (it is reachable)."""
    leader, _ = detached_leader()
    step(leader, 30, RollFailed("3 replicas need 3 live stores, 2 usable"))
    assert leader.accepting_appends  # appends go on meanwhile (they wait for the ack)
    renew(leader, 40, 30 + ROLL_RETRY_MS - 100, EVERY_STORE)
    assert of_type(step(leader, 30 + ROLL_RETRY_MS - 1, Tick()), AskRoll) == []
    [ask] = of_type(step(leader, 30 + ROLL_RETRY_MS, Tick()), AskRoll)
    assert ask.exclude_stores == () and "undrained" in ask.reason


def test_a_roll_refused_twice_is_asked_excluding_no_store() -> None:
    """Seed 5204's shape: s1 refuses the segment (its replica lost to a wiped disk), so
    the writer counts it cut off, and s2 is detached. While s1 may come back, the
    writer can do without the roll and excludes both; once s1 counts lost, one store
    acks where two are needed, and with three stores for three replicas a roll
    excluding s1 is refused for good. Refused twice, the writer excludes nothing and
    the master places from the stores it knows live (s1 takes a new segment well)."""
    leader, _ = detached_leader(TWO_OF_THREE)
    step(leader, 25, StoreDisconnected("s1"))
    asks: list[tuple[str, ...]] = []
    refused_ms = 30
    for _ in range(4):
        step(leader, refused_ms, RollFailed("3 replicas need 3 live stores, 2 usable"))
        renew(leader, refused_ms + 1, refused_ms + ROLL_RETRY_MS - 100, TWO_OF_THREE)
        [ask] = of_type(step(leader, refused_ms + ROLL_RETRY_MS, Tick()), AskRoll)
        asks.append(ask.exclude_stores)
        refused_ms += ROLL_RETRY_MS
    assert 25 + STORE_LOST_MS < 30 + 3 * ROLL_RETRY_MS, "s1 counts lost by the third ask"
    assert asks == [("s1", "s2"), ("s1", "s2"), (), ()]


def test_a_refused_roll_the_writer_can_do_without_keeps_excluding_the_detached_store() -> None:
    """W = 2: s1 and s3 still ack, so the writer stays on its copy set rather than take
    back a store that fell behind (or lost entries) into the next one."""
    leader, actions = detached_leader(TWO_OF_THREE)
    [ask] = of_type(actions, AskRoll)
    assert ask.exclude_stores == ("s2",) and "undrained" not in ask.reason
    for attempt in range(1, 4):
        refused_ms = 30 + (attempt - 1) * ROLL_RETRY_MS
        step(leader, refused_ms, RollFailed("3 replicas need 3 live stores, 2 usable"))
        renew(leader, refused_ms + 1, refused_ms + ROLL_RETRY_MS - 100, TWO_OF_THREE)
        [ask] = of_type(step(leader, refused_ms + ROLL_RETRY_MS, Tick()), AskRoll)
        assert ask.exclude_stores == ("s2",), attempt


def test_the_answer_ends_the_unacked_tail_and_recovers_the_old_segment_as_a_takeover() -> None:
    leader, _ = detached_leader()
    answer = leader_answer(25, 6, unsealed=(grant(5),), policy=EVERY_STORE)
    actions = step(leader, 30, RollAnswered(answer))
    # In order: the old tail ends before the new segment takes its first append.
    kinds = [type(a) for a in actions]
    assert kinds.index(AppendsLeftUnacked) < kinds.index(BecameLeader)
    [left] = of_type(actions, AppendsLeftUnacked)
    assert left == AppendsLeftUnacked(segment_epoch=5, acked_index=1, sent_through=2, last_index=2)
    # No content known: the recovery decides from R stores, as after a takeover.
    [recover] = of_type(actions, RecoverSegment)
    assert recover.segment == grant(5) and recover.new_epoch == 6 and recover.known is None
    assert leader.epoch == 6 and leader.accepting_appends
    # Nothing of the old segment is acked or answered again afterwards.
    later = step(leader, 31, Append((b"third",)))
    later += step(leader, 30 + 3 * APPEND_TIMEOUT_MS, Tick())
    assert [a for a in of_type(later, Acked) if a.segment_epoch == 5] == []
    assert [a for a in of_type(later, AppendsTimedOut) if a.segment_epoch == 5] == []


def test_a_tail_acked_while_the_roll_was_asked_makes_it_a_drained_roll() -> None:
    """A lost store that comes back and acks before the answer: every index is then
    this writer's and acked, so its recovery gets the content (and certifies it)."""
    leader = leader_of(EVERY_STORE)
    step(leader, 10, StoreDisconnected("s3"))
    answer_all(leader, 12, step(leader, 11, Append((b"e",))), stores=("s1", "s2"))
    renew(leader, 20, 10 + STORE_LOST_MS - 100, EVERY_STORE)
    assert of_type(step(leader, 10 + STORE_LOST_MS, Tick()), AskRoll)
    back = step(leader, 10 + STORE_LOST_MS + 1, StoreConnected("s3"))
    acked = answer_all(leader, 10 + STORE_LOST_MS + 2, back, stores=("s3",))
    assert of_type(acked, Acked)[-1].acked_index == 1
    answer = leader_answer(10 + STORE_LOST_MS, 6, unsealed=(grant(5),), policy=EVERY_STORE)
    actions = step(leader, 10 + STORE_LOST_MS + 5, RollAnswered(answer))
    assert of_type(actions, AppendsLeftUnacked) == []
    [recover] = of_type(actions, RecoverSegment)
    assert recover.known is not None and recover.known.through_index == 1
