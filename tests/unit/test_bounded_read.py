"""A bounded read returns every acked event of its range or raises, never a short answer
(issue #36, item 0): when it gives up on its replicas, and where a read "to the acked
end" ends."""

from __future__ import annotations

import pytest

from streamengine.client.core.replicas import FollowerTiming
from streamengine.client.core.subscription import (
    Asked,
    Cursor,
    Next,
    ReadFrom,
    SegmentView,
    Unreachable,
    Wait,
    acked_end,
)
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.sequence import pack_sequence

A, B, C = "a:1", "b:1", "c:1"
TIMING = FollowerTiming()
GIVE_UP_MS = TIMING.unreachable_read_ms
END = pack_sequence(1, 101)  # a read of events 1..100 of segment 1


def segment(sealed: bool) -> SegmentView:
    return SegmentView(1, (A, B, C), sealed, 102 if sealed else 0, acked_index=100)


# What happens to the replicas, in order: (time ms, replica, "fail" | "answer N" |
# "serve N", the entries 1..N).
Step = tuple[int, str, str]
EVERY_REPLICA_FAILS_AT_0: list[Step] = [(0, A, "fail"), (0, B, "fail"), (0, C, "fail")]


def run(sealed: bool, bounded: bool, steps: list[Step], now_ms: int) -> Next:
    cursor = Cursor(0, END if bounded else None, TIMING)
    cursor.on_segments([segment(sealed)], 0)
    cursor.next(0)  # the read starts: the count of time without progress starts here
    for at_ms, replica, what in steps:
        verb, _, number = what.partition(" ")
        if verb == "fail":
            cursor.on_replica_failed(1, replica, at_ms)
        elif verb == "answer":
            cursor.on_position(1, replica, int(number), at_ms)
        else:  # the replica the read started on serves
            served = range(1, int(number) + 1)
            entries = [StoredEntry.make(i, EntryKind.EVENT, 1, b"e%d" % i) for i in served]
            cursor.on_entries(1, entries, at_ms)
    return cursor.next(now_ms)


CASES = [
    # name, sealed, bounded, steps, now, what the cursor decides
    ("every replica failing, not for long yet: retried", False, True,
     EVERY_REPLICA_FAILS_AT_0, GIVE_UP_MS - 1, ReadFrom(1, A, 1)),
    ("every replica failing for the bound: give up naming them", False, True,
     EVERY_REPLICA_FAILS_AT_0, GIVE_UP_MS, Unreachable(1, (A, B, C), GIVE_UP_MS)),
    ("the same on a sealed segment", True, True, EVERY_REPLICA_FAILS_AT_0, GIVE_UP_MS,
     Unreachable(1, (A, B, C), GIVE_UP_MS)),
    ("a subscription never gives up", False, False, EVERY_REPLICA_FAILS_AT_0,
     10 * GIVE_UP_MS, ReadFrom(1, A, 1)),
    ("one replica answered since it failed: read it, no giving up", False, True,
     [*EVERY_REPLICA_FAILS_AT_0, (5, B, "answer 100")], GIVE_UP_MS, ReadFrom(1, B, 1)),
    ("the others hold less of the sealed segment, the last one fails: give up", True, True,
     [(0, A, "answer 0"), (0, B, "answer 0"), (0, C, "fail")], GIVE_UP_MS,
     Unreachable(1, (A, B, C), GIVE_UP_MS)),
    ("served until 5 s, then every replica failing: counted from the progress", False,
     True, [(5000, A, "serve 40"), (5000, A, "fail"), (5000, B, "fail"), (5000, C, "fail")],
     5000 + GIVE_UP_MS - 1, ReadFrom(1, A, 41)),
    ("served until 5 s, then every replica failing for the bound", False, True,
     [(5000, A, "serve 40"), (5000, A, "fail"), (5000, B, "fail"), (5000, C, "fail")],
     5000 + GIVE_UP_MS, Unreachable(1, (A, B, C), GIVE_UP_MS)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sealed", "bounded", "steps", "now_ms", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_when_a_bounded_read_gives_up(
    sealed: bool, bounded: bool, steps: list[Step], now_ms: int, expected: object
) -> None:
    decision = run(sealed, bounded, steps, now_ms)
    assert decision == expected


def test_a_bounded_read_waits_no_later_than_when_it_gives_up() -> None:
    """With every replica backing off past the bound, the wait ends at the bound, so the
    error comes on time rather than a backoff late."""
    cursor = Cursor(0, END, TIMING)
    cursor.on_segments([segment(False)], 0)
    now = 0
    for _ in range(30):  # backoffs grow to their max (1 s), then one ends past the bound
        for replica in (A, B, C):
            cursor.on_replica_failed(1, replica, now)
        decision = cursor.next(now)
        assert isinstance(decision, Wait)
        now = decision.until_ms
        if now >= GIVE_UP_MS:
            break
    assert now == GIVE_UP_MS
    assert cursor.next(now) == Unreachable(1, (A, B, C), GIVE_UP_MS)


def test_with_every_replica_silent_each_is_tried_before_giving_up() -> None:
    """Stores that hang (SIGSTOP) are each left after `silent_replica_ms`; the one never
    tried comes before one tried twice, so the error names stores all tried."""
    cursor = Cursor(0, END, TIMING)
    cursor.on_segments([segment(False)], 0)
    now, tried = 0, list[str]()
    for _ in range(1000):  # bounded: a cursor that never gives up fails the test
        if cursor.refresh_due(now):
            cursor.on_segments([segment(False)], now)
        decision = cursor.next(now)
        if isinstance(decision, Unreachable):
            break
        if isinstance(decision, Wait):
            now = max(decision.until_ms, now + 1)
            continue
        assert isinstance(decision, ReadFrom)
        if not tried or tried[-1] != decision.replica:
            tried.append(decision.replica)
        now = max(cursor.wake_at_ms(), now + 1)
    assert tried[:3] == [A, B, C]
    assert decision == Unreachable(1, (A, B, C), now)
    assert GIVE_UP_MS <= now < GIVE_UP_MS + TIMING.silent_replica_ms


NO_ANSWER = [None, None, None]
REFRESH_MS = TIMING.segment_refresh_ms


@pytest.mark.parametrize(
    ("sealed", "master_acked", "answers", "asked_for_ms", "expected"),
    [
        (True, 100, [], 0, pack_sequence(2, 0)),
        (False, 100, [None, 40, None], 0, pack_sequence(1, 101)),  # the master knows more
        (False, 0, [50, 40, None], 0, pack_sequence(1, 51)),
        (False, 0, [0, 0, 0], 0, pack_sequence(1, 1)),  # nothing acked: an empty read
        # No replica answered: the master's 100 may trail the leader's acked index. Ask
        # again (the stores may be restarting), until a read gives up on its replicas.
        (False, 100, NO_ANSWER, 0, Wait(1000 + REFRESH_MS)),
        (False, 100, NO_ANSWER, GIVE_UP_MS - 1, Wait(1000 + GIVE_UP_MS - 1 + REFRESH_MS)),
        (False, 100, NO_ANSWER, GIVE_UP_MS, Unreachable(1, (A, B, C), GIVE_UP_MS)),
        (False, 0, [None, 0, None], GIVE_UP_MS, pack_sequence(1, 1)),  # one answered
    ],
)
def test_where_a_read_to_the_acked_end_ends(
    sealed: bool,
    master_acked: int,
    answers: list[int | None],
    asked_for_ms: int,
    expected: object,
) -> None:
    last = SegmentView(1, (A, B, C), sealed, 102 if sealed else 0, acked_index=master_acked)
    assert acked_end(last, Asked(answers, 1000, 1000 + asked_for_ms), TIMING) == expected


def test_the_error_names_the_stores_and_the_wait() -> None:
    text = Unreachable(4, (A, B), 10_000).describe("t/s")
    assert text == "t/s: no replica of segment 4 answered for 10 s (a:1, b:1)"


def test_a_read_given_its_own_give_up_time_raises_at_it() -> None:
    """`read(..., give_up_after_s=)`: the acked end unknown, the read raises at its own
    bound, not the default one."""
    own = TIMING.giving_up_after(5000)
    last = SegmentView(1, (A, B, C), False, 0, acked_index=100)
    assert acked_end(last, Asked(NO_ANSWER, 0, 4999), own) == Wait(4999 + REFRESH_MS)
    assert acked_end(last, Asked(NO_ANSWER, 0, 5000), own) == Unreachable(1, (A, B, C), 5000)


@pytest.mark.parametrize("ms", [TIMING.silent_replica_ms, 1000, 0, -1])
def test_a_give_up_time_within_a_replicas_silence_is_refused(ms: int) -> None:
    """A read must outlast the silence that marks a replica unreachable (and the longest
    backoff), or it would give up before it had asked each replica again."""
    with pytest.raises(ValueError, match="more than 4 s"):
        TIMING.giving_up_after(ms)
