"""Lease state machine: each row is one rule of the master's leadership (docs/design.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streamengine.master.core import leadership
from streamengine.master.core.errors import CallerGaveUp, InvalidArgument, NotLeader
from streamengine.master.core.leadership import Claim, Lease, Outcome, secret_digest
from streamengine.protocol.limits import (
    LEASE_SECRET_BYTES,
    LEASE_SECRET_BYTES_MAX,
    LEASE_SECRET_BYTES_MIN,
)

LEASE = 1000
# The secret each client was handed with its grant, the one the next grant hands.
SECRETS = {"a": b"a" * LEASE_SECRET_BYTES, "b": b"b" * LEASE_SECRET_BYTES}
FRESH = bytes(range(LEASE_SECRET_BYTES))
PRINCIPAL = "tenant:token-1"


def claim(client: str, secret: bytes | None = None, principal: str = PRINCIPAL) -> Claim:
    """`client` as its holder calls: its own secret unless told otherwise."""
    return Claim(client, SECRETS.get(client, b"") if secret is None else secret, principal)


def held(
    epoch: int,
    holder: str,
    expires_ms: int,
    secret: bytes | None = None,
    granted_at: int | None = None,
) -> Lease:
    """A lease `holder` was granted at `granted_at` (`epoch` unless told otherwise; a
    roll keeps it), with its own secret unless told otherwise."""
    if not holder:
        return Lease(epoch, "", expires_ms)
    shown = SECRETS[holder] if secret is None else secret
    granted_epoch = epoch if granted_at is None else granted_at
    return Lease(epoch, holder, expires_ms, secret_digest(shown), PRINCIPAL, granted_epoch)


def granted(epoch: int, holder: str, expires_ms: int) -> Lease:
    return held(epoch, holder, expires_ms, FRESH)


@pytest.mark.parametrize(
    ("rule", "lease", "caller", "epoch", "now", "outcome", "after"),
    [
        (
            "no leader yet: the first heartbeat is granted epoch 1, with a fresh secret",
            Lease(0, "", 0),
            claim("a", b""),
            0,
            5,
            Outcome.GRANTED,
            granted(1, "a", 5 + LEASE),
        ),
        (
            "the holder's heartbeat renews its lease, same epoch",
            held(3, "a", 900),
            claim("a"),
            3,
            500,
            Outcome.RENEWED,
            held(3, "a", 500 + LEASE),
        ),
        (
            "another client learns who leads and changes nothing",
            held(3, "a", 900),
            claim("b"),
            0,
            899,
            Outcome.FOLLOW,
            held(3, "a", 900),
        ),
        (
            "the holder's client id without its secret is a follower's heartbeat",
            held(3, "a", 900),
            claim("a", b""),
            3,
            500,
            Outcome.FOLLOW,
            held(3, "a", 900),
        ),
        (
            "the holder's client id with another secret is a follower's heartbeat",
            held(3, "a", 900),
            claim("a", SECRETS["b"]),
            3,
            500,
            Outcome.FOLLOW,
            held(3, "a", 900),
        ),
        (
            "the holder's id and secret from another principal is a follower's heartbeat",
            held(3, "a", 900),
            claim("a", principal="tenant:token-2"),
            3,
            500,
            Outcome.FOLLOW,
            held(3, "a", 900),
        ),
        (
            "the holder's id without its secret renews nothing once the lease ran out",
            held(3, "a", 900),
            claim("a", b""),
            3,
            5000,
            Outcome.GRANTED,
            granted(4, "a", 5000 + LEASE),
        ),
        (
            "an expired lease goes to the next caller with a higher epoch and the secret it drew",
            held(3, "a", 900),
            claim("b"),
            0,
            900,
            Outcome.GRANTED,
            held(4, "b", 900 + LEASE),
        ),
        (
            "an expired holder naming its epoch renews it while nobody else was granted",
            held(3, "a", 900),
            claim("a"),
            3,
            5000,
            Outcome.RENEWED,
            held(3, "a", 5000 + LEASE),
        ),
        (
            "the holder renews before expiry even when it does not name its epoch",
            held(3, "a", 900),
            claim("a"),
            0,
            500,
            Outcome.RENEWED,
            held(3, "a", 500 + LEASE),
        ),
        (
            "an expired holder that names no epoch (sent before its grant's answer came) "
            "renews its lease: a new epoch would depose it",
            held(3, "a", 900),
            claim("a"),
            0,
            901,
            Outcome.RENEWED,
            held(3, "a", 901 + LEASE),
        ),
        (
            "an expired holder naming the epoch before a roll it has not heard of renews "
            "the rolled epoch, opens none",
            held(4, "a", 900),
            claim("a"),
            3,
            5000,
            Outcome.RENEWED,
            held(4, "a", 5000 + LEASE),
        ),
    ],
)
def test_heartbeat(rule, lease, caller, epoch, now, outcome, after) -> None:
    decision = leadership.heartbeat(lease, caller, epoch, now, LEASE, FRESH)
    assert (decision.outcome, decision.lease) == (outcome, after), rule


@pytest.mark.parametrize(
    ("rule", "lease", "caller", "seen", "now", "outcome", "after"),
    [
        (
            "the holder's own heartbeat, sent as a follower before its grant's answer came "
            "(it saw an earlier epoch) and decided once the lease ran out, follows: the "
            "next epoch would depose the holder (issue #38)",
            held(3, "a", 900),
            claim("a", b""),
            2,
            5000,
            Outcome.FOLLOW,
            held(3, "a", 900),
        ),
        (
            "so does one sent before the writer saw any answer",
            held(1, "a", 900),
            claim("a", b""),
            0,
            5000,
            Outcome.FOLLOW,
            held(1, "a", 900),
        ),
        (
            "the holder's client id that saw the holder's epoch (its grant's answer was "
            "lost, or another process) is granted once the lease ran out",
            held(3, "a", 900),
            claim("a", b""),
            3,
            5000,
            Outcome.GRANTED,
            granted(4, "a", 5000 + LEASE),
        ),
        (
            "another client that saw an earlier epoch is granted once the lease ran out",
            held(3, "a", 900),
            claim("b", b""),
            2,
            5000,
            Outcome.GRANTED,
            granted(4, "b", 5000 + LEASE),
        ),
        (
            "a caller that says nothing of what it saw is granted as before",
            held(3, "a", 900),
            claim("a", b""),
            None,
            5000,
            Outcome.GRANTED,
            granted(4, "a", 5000 + LEASE),
        ),
        (
            "a released lease is granted to the client that released it",
            Lease(3, "", 900),
            claim("a", b""),
            2,
            5000,
            Outcome.GRANTED,
            granted(4, "a", 5000 + LEASE),
        ),
        (
            "the holder with its secret renews, whatever it saw",
            held(3, "a", 900),
            claim("a"),
            0,
            5000,
            Outcome.RENEWED,
            held(3, "a", 5000 + LEASE),
        ),
    ],
)
def test_heartbeat_by_the_epoch_its_caller_saw(
    rule, lease, caller, seen, now, outcome, after
) -> None:
    decision = leadership.heartbeat(lease, caller, 0, now, LEASE, FRESH, seen_epoch=seen)
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
        leadership.heartbeat(held(3, "a", 900), claim(client), epoch, 0, LEASE, FRESH)


@pytest.mark.parametrize(
    ("rule", "lease", "caller", "epoch"),
    [
        (
            "the holder's own heartbeat, sent as a follower before its grant came and "
            "decided after its lease ran out, opens no epoch that would depose it",
            held(3, "a", 900),
            claim("a", b""),
            0,
        ),
        ("nor does another writer's", held(3, "a", 900), claim("b", b""), 0),
        ("nor does a renewal decide anything", held(3, "a", 900), claim("a"), 3),
    ],
)
def test_a_heartbeat_decided_past_its_callers_deadline_decides_nothing(
    rule, lease, caller, epoch
) -> None:
    for answer_by in (1000, 999):  # at the deadline, and after it
        with pytest.raises(CallerGaveUp):
            leadership.heartbeat(lease, caller, epoch, 1000, LEASE, FRESH, answer_by)
    # Before its deadline the same heartbeat is decided: here each one leads.
    assert leadership.heartbeat(lease, caller, epoch, 1000, LEASE, FRESH, 1001).leads, rule


@pytest.mark.parametrize("size", [1, LEASE_SECRET_BYTES_MIN - 1, LEASE_SECRET_BYTES_MAX + 1])
def test_a_lease_secret_too_short_to_be_unguessed_or_too_long_is_malformed(size) -> None:
    with pytest.raises(InvalidArgument):
        Claim("a", b"x" * size, PRINCIPAL)
    for fine in (LEASE_SECRET_BYTES_MIN, LEASE_SECRET_BYTES_MAX):
        assert Claim("a", b"x" * fine, PRINCIPAL).secret


@pytest.mark.parametrize(
    ("rule", "lease", "caller", "epoch", "now", "handed"),
    [
        ("a grant hands the secret its winner drew", Lease(0, "", 0), claim("a"), 0, 5, "a"),
        (
            "a grant to a caller that drew none (an older client) hands the master's",
            Lease(0, "", 0),
            claim("a", b""),
            0,
            5,
            FRESH,
        ),
        (
            "the holder naming no epoch is answered as its grant was, secret and all",
            held(3, "a", 900),
            claim("a"),
            0,
            500,
            "a",
        ),
        (
            "the holder naming its epoch is renewed, no secret",
            held(3, "a", 900),
            claim("a"),
            3,
            500,
            b"",
        ),
        ("a follower is handed nothing", held(3, "a", 900), claim("b"), 0, 500, b""),
    ],
)
def test_the_secret_an_answer_hands(rule, lease, caller, epoch, now, handed) -> None:
    decision = leadership.heartbeat(lease, caller, epoch, now, LEASE, FRESH)
    assert decision.secret == SECRETS.get(handed, handed), rule


def test_a_grant_whose_answer_was_lost_is_answered_again_not_granted_again() -> None:
    """The winner drew the secret, so its next heartbeat, naming no epoch since it never
    heard of its grant, proves it holds the lease even after the lease ran out: it is
    answered with the grant, epoch 1 still (a stuttering master had granted 300 streams
    twice each, `tests/integration/test_lease_churn.py`)."""
    won = leadership.heartbeat(Lease(0, "", 0), claim("a"), 0, 0, LEASE, FRESH)
    assert won.outcome is Outcome.GRANTED and won.lease.epoch == 1
    # The answer is lost; the writer asks again, much later, having seen no epoch.
    again = leadership.heartbeat(won.lease, claim("a"), 0, 5 * LEASE, LEASE, FRESH, seen_epoch=0)
    assert (again.outcome, again.lease.epoch, again.secret) == (
        Outcome.RENEWED,
        1,
        SECRETS["a"],
    )
    # Another writer of the same principal, with its own secret, still only follows.
    other = leadership.heartbeat(again.lease, claim("b"), 0, 5 * LEASE + 1, LEASE, FRESH)
    assert other.outcome is Outcome.FOLLOW


@pytest.mark.parametrize(
    ("rule", "lease", "caller", "epoch", "now", "result"),
    [
        (
            "the holder rolls to the next epoch, which it holds with the same secret",
            held(3, "a", 900),
            claim("a"),
            3,
            10,
            held(4, "a", 10 + LEASE, granted_at=3),
        ),
        ("a follower cannot roll", held(3, "a", 900), claim("b"), 3, 10, NotLeader),
        (
            "the holder's client id without its secret cannot roll",
            held(3, "a", 900),
            claim("a", b""),
            3,
            10,
            NotLeader,
        ),
        ("a stale epoch cannot roll", held(3, "a", 900), claim("a"), 2, 10, NotLeader),
        (
            "an expired holder rolls while nobody else was granted",
            held(3, "a", 900),
            claim("a"),
            3,
            2000,
            held(4, "a", 2000 + LEASE, granted_at=3),
        ),
        ("a released lease cannot roll", Lease(3, "", 900), claim("a"), 3, 10, NotLeader),
    ],
)
def test_roll(rule, lease, caller, epoch, now, result) -> None:
    if isinstance(result, Lease):
        assert leadership.roll(lease, caller, epoch, now, LEASE) == result, rule
    else:
        with pytest.raises(result):
            leadership.roll(lease, caller, epoch, now, LEASE)


@pytest.mark.parametrize(
    ("rule", "caller", "epoch", "now", "result"),
    [
        ("the holder releases: the lease ends now", claim("a"), 3, 10, Lease(3, "", 10)),
        ("another client cannot release it", claim("b"), 3, 10, None),
        ("the holder's client id without its secret cannot", claim("a", b""), 3, 10, None),
        ("a stale epoch cannot release it", claim("a"), 2, 10, None),
        ("an expired lease nobody took is released", claim("a"), 3, 900, Lease(3, "", 900)),
    ],
)
def test_release(rule, caller, epoch, now, result) -> None:
    assert leadership.release(held(3, "a", 900), caller, epoch, now) == result, rule


@pytest.mark.parametrize(
    ("rule", "caller", "epoch", "now", "result"),
    [
        ("the holder's call ends: the lease ends now, held", claim("a"), 3, 10, held(3, "a", 10)),
        ("after it ran out: unchanged", claim("a"), 3, 950, held(3, "a", 900)),
        ("another client's call changes nothing", claim("b"), 3, 10, None),
        ("a call without the holder's secret changes nothing", claim("a", b""), 3, 10, None),
        ("a call of an earlier epoch (before a roll) changes nothing", claim("a"), 2, 10, None),
    ],
)
def test_holder_gone(rule, caller, epoch, now, result) -> None:
    assert leadership.holder_gone(held(3, "a", 900), caller, epoch, now) == result, rule


@pytest.mark.parametrize(
    ("rule", "now_lease", "ends"),
    [
        ("the grant bound to the session ends now", granted(1, "a", 900), True),
        ("rolled since (the same secret): it ends too", granted(2, "a", 900), True),
        ("granted since to another writer: unchanged", held(2, "b", 900), False),
        ("released since: unchanged", Lease(1, "", 100), False),
    ],
)
def test_session_gone(rule, now_lease, ends) -> None:
    ended = leadership.session_gone(now_lease, granted(1, "a", 600), 500)
    assert ended == (replace(now_lease, expires_ms=500) if ends else None), rule


def test_a_holder_whose_call_ended_but_lives_renews_unless_someone_took_over() -> None:
    gone = leadership.holder_gone(held(3, "a", 900), claim("a"), 3, 10)
    assert gone is not None
    renewed = leadership.heartbeat(gone, claim("a"), 3, 20, LEASE, FRESH)
    assert (renewed.outcome, renewed.lease) == (Outcome.RENEWED, held(3, "a", 20 + LEASE))
    taken = leadership.heartbeat(gone, claim("b"), 0, 20, LEASE, FRESH)
    assert (taken.outcome, taken.lease) == (Outcome.GRANTED, held(4, "b", 20 + LEASE))
    late = leadership.heartbeat(taken.lease, claim("a"), 3, 30, LEASE, FRESH)
    assert late.outcome is Outcome.FOLLOW


def test_epochs_strictly_increase_over_any_sequence_of_grants() -> None:
    lease = Lease(0, "", 0)
    epochs = []
    now = 0
    for step in range(50):
        client = "abc"[step % 3]
        now += LEASE if step % 4 == 0 else LEASE // 3
        decision = leadership.heartbeat(lease, Claim(client, FRESH), 0, now, LEASE, FRESH)
        lease = decision.lease
        if decision.outcome is Outcome.GRANTED:
            epochs.append(lease.epoch)
    assert epochs == sorted(set(epochs)) and len(epochs) > 5


def test_a_heartbeat_sent_before_a_roll_and_answered_after_it_still_renews() -> None:
    rolled = leadership.roll(held(3, "a", 900), claim("a"), 3, 10, LEASE)
    late = leadership.heartbeat(rolled, claim("a"), 3, 20, LEASE, FRESH)
    assert (late.outcome, late.lease) == (Outcome.RENEWED, held(4, "a", 20 + LEASE, granted_at=3))
    assert late.secret == b"", "a roll's answer lost at most: not the grant's again"


def test_a_holder_granted_again_after_another_hears_its_new_grant_again() -> None:
    """`a` led epoch 3, `b` was granted 4, then `a` won 5 after `b`'s lease ran out,
    and that answer was lost: `a` still names 3, before the grant it won, so its next
    heartbeat is answered as that grant (the secret says so), not as a roll of its own
    (which would have it go on with epoch 3's appends in a new segment)."""
    again = leadership.heartbeat(held(5, "a", 900), claim("a"), 3, 1000, LEASE, FRESH)
    assert (again.outcome, again.lease.epoch, again.secret) == (Outcome.RENEWED, 5, SECRETS["a"])


@pytest.mark.parametrize(
    ("rule", "recorded", "granted", "to_producer", "after"),
    [
        ("a plain writer's grant leaves a plain stream plain", False, True, False, False),
        ("a producer's grant marks the stream", False, True, True, True),
        ("a producer's renewal marks nothing (its grant did)", False, False, True, False),
        ("a plain writer's grant never clears the mark", True, True, False, True),
        ("nor does a heartbeat that grants nothing", True, False, False, True),
    ],
)
def test_has_producers(
    rule: str, recorded: bool, granted: bool, to_producer: bool, after: bool
) -> None:
    assert leadership.has_producers(recorded, granted, to_producer) is after, rule
