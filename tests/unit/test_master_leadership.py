"""Lease state machine: each row is one rule of the master's leadership (docs/design.md)."""

from __future__ import annotations

import pytest

from streamengine.master.core import leadership
from streamengine.master.core.errors import InvalidArgument, NotLeader
from streamengine.master.core.leadership import Lease, Outcome

LEASE = 1000


@pytest.mark.parametrize(
    ("rule", "lease", "client", "epoch", "now", "outcome", "after"),
    [
        (
            "no leader yet: the first heartbeat is granted epoch 1",
            Lease(0, "", 0),
            "a",
            0,
            5,
            Outcome.GRANTED,
            Lease(1, "a", 5 + LEASE),
        ),
        (
            "the holder's heartbeat renews its lease, same epoch",
            Lease(3, "a", 900),
            "a",
            3,
            500,
            Outcome.RENEWED,
            Lease(3, "a", 500 + LEASE),
        ),
        (
            "the holder renews even when it does not know its epoch yet (lost reply)",
            Lease(3, "a", 900),
            "a",
            0,
            500,
            Outcome.RENEWED,
            Lease(3, "a", 500 + LEASE),
        ),
        (
            "another client learns who leads and changes nothing",
            Lease(3, "a", 900),
            "b",
            0,
            899,
            Outcome.FOLLOW,
            Lease(3, "a", 900),
        ),
        (
            "an expired lease goes to the next caller with a higher epoch",
            Lease(3, "a", 900),
            "b",
            0,
            900,
            Outcome.GRANTED,
            Lease(4, "b", 900 + LEASE),
        ),
        (
            "an expired holder naming its epoch renews it while nobody else was granted",
            Lease(3, "a", 900),
            "a",
            3,
            5000,
            Outcome.RENEWED,
            Lease(3, "a", 5000 + LEASE),
        ),
        (
            "an expired holder that does not name its epoch gets a new one",
            Lease(3, "a", 900),
            "a",
            0,
            901,
            Outcome.GRANTED,
            Lease(4, "a", 901 + LEASE),
        ),
        (
            "a holder that gave its lease back renews nothing",
            Lease(3, "", 900),
            "a",
            3,
            901,
            Outcome.GRANTED,
            Lease(4, "a", 901 + LEASE),
        ),
        (
            "after a restart nobody is granted anything for one lease period",
            leadership.recovered_lease(7, "", 100, LEASE),
            "b",
            0,
            100 + LEASE - 1,
            Outcome.FOLLOW,
            Lease(7, "", 100 + LEASE),
        ),
        (
            "after a restart the previous holder keeps leading if it heartbeats",
            leadership.recovered_lease(7, "a", 100, LEASE),
            "a",
            7,
            600,
            Outcome.RENEWED,
            Lease(7, "a", 600 + LEASE),
        ),
        (
            "after a restart and one lease period, a new caller is granted the next epoch",
            leadership.recovered_lease(7, "a", 100, LEASE),
            "b",
            0,
            100 + LEASE,
            Outcome.GRANTED,
            Lease(8, "b", 100 + 2 * LEASE),
        ),
        (
            "a released lease is granted at once",
            Lease(5, "", 300),
            "b",
            0,
            300,
            Outcome.GRANTED,
            Lease(6, "b", 300 + LEASE),
        ),
    ],
)
def test_heartbeat(rule, lease, client, epoch, now, outcome, after) -> None:
    decision = leadership.heartbeat(lease, client, epoch, now, LEASE)
    assert (decision.outcome, decision.lease) == (outcome, after), rule


@pytest.mark.parametrize(
    ("rule", "client", "epoch"),
    [
        ("a heartbeat needs a client id", "", 0),
        ("an epoch never granted is malformed", "a", 4),
    ],
)
def test_heartbeat_refuses(rule, client, epoch) -> None:
    with pytest.raises(InvalidArgument):
        leadership.heartbeat(Lease(3, "a", 900), client, epoch, 0, LEASE)


@pytest.mark.parametrize(
    ("rule", "lease", "client", "epoch", "now", "result"),
    [
        (
            "the holder rolls to the next epoch",
            Lease(3, "a", 900),
            "a",
            3,
            10,
            Lease(4, "a", 10 + LEASE),
        ),
        ("a follower cannot roll", Lease(3, "a", 900), "b", 3, 10, NotLeader),
        ("a stale epoch cannot roll", Lease(3, "a", 900), "a", 2, 10, NotLeader),
        (
            "an expired holder rolls while nobody else was granted",
            Lease(3, "a", 900),
            "a",
            3,
            2000,
            Lease(4, "a", 2000 + LEASE),
        ),
        ("a released lease cannot roll", Lease(3, "", 900), "a", 3, 10, NotLeader),
    ],
)
def test_roll(rule, lease, client, epoch, now, result) -> None:
    if isinstance(result, Lease):
        assert leadership.roll(lease, client, epoch, now, LEASE) == result, rule
    else:
        with pytest.raises(result):
            leadership.roll(lease, client, epoch, now, LEASE)


@pytest.mark.parametrize(
    ("rule", "client", "epoch", "now", "result"),
    [
        ("the holder releases: the lease ends now", "a", 3, 10, Lease(3, "", 10)),
        ("another client cannot release it", "b", 3, 10, None),
        ("a stale epoch cannot release it", "a", 2, 10, None),
        ("an expired lease nobody took is released", "a", 3, 900, Lease(3, "", 900)),
    ],
)
def test_release(rule, client, epoch, now, result) -> None:
    assert leadership.release(Lease(3, "a", 900), client, epoch, now) == result, rule


@pytest.mark.parametrize(
    ("rule", "client", "epoch", "now", "result"),
    [
        ("the holder's call ends: the lease ends now, held", "a", 3, 10, Lease(3, "a", 10)),
        ("after it ran out: unchanged", "a", 3, 950, Lease(3, "a", 900)),
        ("another client's call changes nothing", "b", 3, 10, None),
        ("a call of an earlier epoch (before a roll) changes nothing", "a", 2, 10, None),
    ],
)
def test_holder_gone(rule, client, epoch, now, result) -> None:
    assert leadership.holder_gone(Lease(3, "a", 900), client, epoch, now) == result, rule


def test_a_holder_whose_call_ended_but_lives_renews_unless_someone_took_over() -> None:
    gone = leadership.holder_gone(Lease(3, "a", 900), "a", 3, 10)
    assert gone is not None
    renewed = leadership.heartbeat(gone, "a", 3, 20, LEASE)
    assert (renewed.outcome, renewed.lease) == (Outcome.RENEWED, Lease(3, "a", 20 + LEASE))
    taken = leadership.heartbeat(gone, "b", 0, 20, LEASE)
    assert (taken.outcome, taken.lease) == (Outcome.GRANTED, Lease(4, "b", 20 + LEASE))
    late = leadership.heartbeat(taken.lease, "a", 3, 30, LEASE)
    assert late.outcome is Outcome.FOLLOW


def test_epochs_strictly_increase_over_any_sequence_of_grants() -> None:
    lease = Lease(0, "", 0)
    epochs = []
    now = 0
    for step in range(50):
        client = "abc"[step % 3]
        now += LEASE if step % 4 == 0 else LEASE // 3
        decision = leadership.heartbeat(lease, client, 0, now, LEASE)
        lease = decision.lease
        if decision.outcome is Outcome.GRANTED:
            epochs.append(lease.epoch)
    assert epochs == sorted(set(epochs)) and len(epochs) > 5
