"""Quorum acking, batching, gaps and resends, back pressure and bounded memory of the
replicator core, driven step by step with the stores' answers written out."""

from __future__ import annotations

import pytest

from streamengine.client.core.quorum import QuorumTracker, quorum_index
from streamengine.client.core.replicator import (
    ENTRY_MEMORY_BYTES,
    ENTRY_OVERHEAD_BYTES,
    Acked,
    AllowAcking,
    Append,
    Assigned,
    Flush,
    InconsistentReply,
    Replicator,
    ReplicatorAction,
    ReplicatorLimits,
    SegmentRef,
    SendWrite,
    Stop,
    StoreConnected,
    StoreDetached,
    StoreDisconnected,
    Tick,
    WriteReplied,
    WritesReplied,
)
from streamengine.protocol.certificate import certificate_of
from streamengine.protocol.entry import EntryKind
from streamengine.protocol.policy import ReplicationPolicy

SEGMENT = SegmentRef(stream_id=7, epoch=3, stream="acme/orders")
STORES = ("s1", "s2", "s3")
W2 = ReplicationPolicy(3, 2)


# ---- quorum ----


@pytest.mark.parametrize(
    ("replicas", "quorum", "matched", "acked"),
    [
        (3, 2, {}, 0),
        (3, 2, {"s1": 5}, 0),
        (3, 2, {"s1": 5, "s2": 3}, 3),
        (3, 2, {"s1": 5, "s2": 3, "s3": 4}, 4),
        (3, 3, {"s1": 5, "s2": 3, "s3": 4}, 3),
        (3, 1, {"s1": 5, "s2": 3, "s3": 4}, 5),
        (5, 3, {"s1": 9, "s2": 1, "s3": 7, "s4": 7, "s5": 2}, 7),
    ],
)
def test_acked_index_is_the_wth_largest_matched(replicas, quorum, matched, acked) -> None:
    copy_set = [f"s{i}" for i in range(1, replicas + 1)]
    assert quorum_index(ReplicationPolicy(replicas, quorum), matched, copy_set) == acked


def test_quorum_tracker_never_lowers_the_acked_index() -> None:
    tracker = QuorumTracker(W2, STORES)
    tracker.update("s1", 5)
    assert tracker.update("s2", 5) == 5
    # s2 restarted without its tail (fsync=never): users were told 5 already.
    assert tracker.update("s2", 2) == 5
    # What s2 holds now counts: s1 alone past 5 is no quorum, s3 beside it is.
    assert tracker.update("s1", 7) == 5
    assert tracker.update("s3", 6) == 6


def test_quorum_tracker_refuses_a_stranger_and_a_bad_copy_set() -> None:
    with pytest.raises(KeyError):
        QuorumTracker(W2, STORES).update("s9", 1)
    with pytest.raises(ValueError, match="twice"):
        QuorumTracker(W2, ["s1", "s1", "s2"])
    with pytest.raises(ValueError, match="copy set of 2"):
        QuorumTracker(W2, ["s1", "s2"])


# ---- helpers ----


def make(limits: ReplicatorLimits | None = None, acking: bool = True) -> Replicator:
    replicator = Replicator(SEGMENT, 3, W2, STORES, limits, acking=acking)
    for store in STORES:
        assert replicator.step(0, StoreConnected(store)) == []
    return replicator


def sends(actions: list[ReplicatorAction], store: str | None = None) -> list[SendWrite]:
    return [a for a in actions if isinstance(a, SendWrite) and store in (None, a.store)]


def acked(actions: list[ReplicatorAction]) -> list[int]:
    return [a.acked_index for a in actions if isinstance(a, Acked)]


def accept(send: SendWrite, matched: int | None = None, store_acked: int = 0) -> WriteReplied:
    """The store wrote the batch and holds everything up to `matched`."""
    return WriteReplied(
        send.store,
        send.request_id,
        busy=False,
        matched_index=send.last_index if matched is None else matched,
        acked_index=store_acked,
        first_index=send.first_index,
        last_index=send.last_index,
    )


def busy(send: SendWrite, matched: int) -> WriteReplied:
    return WriteReplied(
        send.store, send.request_id, True, matched, 0, send.first_index, send.last_index
    )


def indexes(send: SendWrite) -> list[int]:
    return [entry.index for entry in send.entries]


# ---- acking ----


def test_an_idle_store_gets_an_append_at_once_and_w_answers_ack_it() -> None:
    r = make()
    actions = r.step(10, Append((b"a", b"b", b"c")))
    assert actions[0] == Assigned(1, 3, SEGMENT.epoch)
    out = sends(actions)
    assert [(s.store, indexes(s), s.acked_index) for s in out] == [
        ("s1", [1, 2, 3], 0),
        ("s2", [1, 2, 3], 0),
        ("s3", [1, 2, 3], 0),
    ]
    assert all(e.epoch == 3 and e.payload for s in out for e in s.entries)
    assert acked(r.step(11, accept(out[1]))) == []  # one store of W=2
    assert acked(r.step(12, accept(out[2]))) == [3]
    assert acked(r.step(13, accept(out[0]))) == []  # already acked
    assert r.acked_index == 3 and r.unacked_bytes == 0


def test_the_content_digest_is_handed_out_only_once_everything_is_acked() -> None:
    r = make()
    out = sends(r.step(10, Append((b"a", b"b"))))
    assert r.content_digest() is None  # assigned, not acked: the content is not final
    r.step(11, accept(out[0]))
    r.step(12, accept(out[1]))
    digest = r.content_digest()
    assert digest is not None and digest.through_index == 2
    digest.add(3, EntryKind.BRIDGE, b"")
    assert digest.finish() == certificate_of(
        [(1, EntryKind.EVENT, b"a"), (2, EntryKind.EVENT, b"b"), (3, EntryKind.BRIDGE, b"")]
    )


def test_out_of_order_replies_across_stores_ack_only_the_common_prefix() -> None:
    limits = ReplicatorLimits(batch_entries_max=2, linger_ms=0)
    r = make(limits)
    out = sends(r.step(0, Append(tuple(b"e%d" % i for i in range(6)))))
    by_store = {s: [w for w in out if w.store == s] for s in STORES}
    assert [indexes(w) for w in by_store["s1"]] == [[1, 2], [3, 4], [5, 6]]
    # s3 answers all three batches before anyone else; s1 only its first.
    for send in by_store["s3"]:
        assert acked(r.step(1, accept(send))) == []
    assert acked(r.step(2, accept(by_store["s1"][0]))) == [2]
    # s2's answers arrive late: the W-th largest matched is now s2's.
    assert acked(r.step(3, accept(by_store["s2"][0]))) == []
    assert acked(r.step(4, accept(by_store["s2"][1]))) == [4]
    assert acked(r.step(5, accept(by_store["s1"][1]))) == []
    assert acked(r.step(6, accept(by_store["s1"][2]))) == [6]


def test_acked_index_rides_on_the_next_write_and_on_the_idle_tick() -> None:
    r = make()
    out = sends(r.step(0, Append((b"x",))))
    for send in out:
        r.step(1, accept(send))
    assert r.acked_index == 1
    # The next write carries it.
    out = sends(r.step(2, Append((b"y",))))
    assert {s.acked_index for s in out} == {1}
    r.step(3, accept(out[0]))
    r.step(3, accept(out[1]))
    r.step(3, accept(out[2]))
    assert r.acked_index == 2
    # Nothing more to write: once the acked index is the idle interval old, every store
    # hears 2 alone.
    assert sends(r.step(3 + 1, Tick())) == []
    assert r.deadline_ms(4) == 3 + r.limits.idle_ack_ms
    assert sends(r.step(2 + r.limits.idle_ack_ms, Tick())) == []
    idle = sends(r.step(3 + r.limits.idle_ack_ms, Tick()))
    assert [(s.store, s.entries, s.acked_index) for s in idle] == [
        ("s1", (), 2),
        ("s2", (), 2),
        ("s3", (), 2),
    ]
    for send in idle:
        r.step(30, accept(send, matched=2, store_acked=2))
    assert r.flushed() and r.deadline_ms(30) is None


def test_an_acked_index_waits_for_the_next_append_rather_than_going_alone() -> None:
    """A writer appending again as soon as its last append is acked sends each store
    one request per append: the acked index rides on it (long after the last send)."""
    r = make()
    out = sends(r.step(0, Append((b"x",))))
    now = 100  # a slow round trip: the stores were last written to long ago
    for send in out[:2]:
        r.step(now, accept(send))
    assert r.acked_index == 1
    assert r.deadline_ms(now) == now + r.limits.idle_ack_ms
    assert sends(r.step(now + r.limits.idle_ack_ms - 1, Tick())) == []
    # s3 answers late, past the idle interval: an answer's step sends no lone ack (the
    # shell runs the append the ack woke before the writer's next tick).
    late = now + 2 * r.limits.idle_ack_ms
    assert sends(r.step(late, accept(out[2]))) == []
    out = sends(r.step(late, Append((b"y",))))
    assert [(s.store, s.first_index, s.acked_index) for s in out] == [
        ("s1", 2, 1),
        ("s2", 2, 1),
        ("s3", 2, 1),
    ]
    assert sends(r.step(late + 2 * r.limits.idle_ack_ms, Tick())) == []


def test_a_lone_acked_index_waits_for_a_batch_held_back_to_carry_it() -> None:
    r = make(ReplicatorLimits(linger_ms=3, idle_ack_ms=1))
    first = sends(r.step(0, Append((b"x",))))
    r.step(1, accept(first[0]))
    r.step(1, accept(first[1]))
    assert r.acked_index == 1
    # s3 has a request out: the next small batch waits `linger_ms` for company, and
    # the acked index waits with it rather than going alone.
    assert sends(r.step(1, Append((b"y",))), "s3") == []
    assert r.deadline_ms(2) == 1 + 3
    assert sends(r.step(3, Tick()), "s3") == []
    held = sends(r.step(4, Tick()), "s3")
    assert [(s.first_index, s.acked_index) for s in held] == [(2, 1)]


def _pipelined(window: int = 4) -> tuple[Replicator, list[SendWrite]]:
    """Three appends in flight to every store, one request each."""
    r = make(ReplicatorLimits(window_batches=window, partial_in_flight_max=window, linger_ms=0))
    out: list[SendWrite] = []
    for now, payload in enumerate((b"a", b"b", b"c")):
        out += sends(r.step(now, Append((payload,))))
    assert [s.first_index for s in out if s.store == "s1"] == [1, 2, 3]
    return r, out


@pytest.mark.parametrize(
    ("answered", "acked_after", "matched_after"),
    [
        # s1 and s2 answer all three in one message each: acked once, at 3.
        ({"s1": 3, "s2": 3}, [3], {"s1": 3, "s2": 3, "s3": 0}),
        # s1 answers all three, s2 the first only: the 2nd largest matched is 1.
        ({"s1": 3, "s2": 1}, [1], {"s1": 3, "s2": 1, "s3": 0}),
        # One store alone acks nothing, however many answers it sends.
        ({"s3": 3}, [], {"s1": 0, "s2": 0, "s3": 3}),
    ],
)
def test_a_batch_of_answers_is_one_step_with_one_ack(
    answered: dict[str, int], acked_after: list[int], matched_after: dict[str, int]
) -> None:
    r, out = _pipelined()
    actions: list[ReplicatorAction] = []
    for store, count in answered.items():
        replies = tuple(accept(s) for s in out if s.store == store)[:count]
        actions += r.step(10, WritesReplied(replies))
    assert acked(actions) == acked_after
    assert {name: s.matched_index for name, s in r.statistics().stores.items()} == matched_after
    assert all(
        s.in_flight_requests == 3 - answered.get(name, 0)
        for name, s in r.statistics().stores.items()
    )


def test_a_batch_of_answers_ends_where_the_answers_one_by_one_end() -> None:
    """The same answers, as one batch per store or one step each: the same matched and
    acked indexes, and the same entries sent again after a gap."""
    results = []
    for batched in (False, True):
        r, out = _pipelined()
        s1 = [s for s in out if s.store == "s1"]
        # s1 lost the 2nd request: its answers to the 2nd and 3rd show the gap.
        replies = (accept(s1[0]), accept(s1[1], matched=1), accept(s1[2], matched=1))
        actions: list[ReplicatorAction] = []
        if batched:
            actions += r.step(10, WritesReplied(replies))
        else:
            for reply in replies:
                actions += r.step(10, reply)
        resent = [(s.first_index, s.last_index) for s in sends(actions, "s1")]
        results.append((resent, r.acked_index, r.statistics().stores["s1"].matched_index))
    assert results[0] == results[1]
    # Sent again once, from the gap on (the 3rd answer predates the reset).
    assert results[1][0][0][0] == 2


def test_flush_broadcasts_the_acked_index_without_waiting() -> None:
    r = make()
    out = sends(r.step(0, Append((b"x",))))
    for send in out:
        r.step(1, accept(send))
    assert not r.flushed()
    flushed = sends(r.step(2, Flush()))
    assert [(s.entries, s.acked_index) for s in flushed] == [((), 1)] * 3
    for send in flushed:
        r.step(3, accept(send, matched=1, store_acked=1))
    assert r.flushed()


def test_a_flush_waits_for_a_store_still_opening_its_first_stream_not_a_lost_one() -> None:
    """A writer closing right after its first append, while one store is still slow to
    accept its connection, waits for it (within the flush's deadline): that store would
    otherwise miss the segment until a repair. A store whose stream was lost does not
    hold a flush up."""
    r = Replicator(SEGMENT, 3, W2, STORES, None)
    r.step(0, StoreConnected("s1"))
    r.step(0, StoreConnected("s2"))
    for send in sends(r.step(1, Append((b"x",)))):
        r.step(2, accept(send, matched=1, store_acked=1))
    assert r.acked_index == 1
    assert not r.flushed()  # s3 is opening its stream
    opened = sends(r.step(3, StoreConnected("s3")))
    assert [s.store for s in opened] == ["s3"]
    for send in opened:
        r.step(4, accept(send, matched=1, store_acked=1))
    assert r.flushed()
    r.step(5, StoreDisconnected("s3"))
    for send in sends(r.step(5, Append((b"y",)))):
        r.step(6, accept(send, matched=2))
    for send in sends(r.step(7, Flush())):
        r.step(8, accept(send, matched=2, store_acked=2))
    assert r.acked_index == 2 and r.flushed()


def test_nothing_is_acked_while_the_gate_is_closed() -> None:
    r = make(acking=False)
    out = sends(r.step(0, Append((b"x", b"y"))))
    assert acked(r.step(1, accept(out[0]))) == []
    assert acked(r.step(1, accept(out[1]))) == []
    assert r.quorum_index == 2 and r.acked_index == 0
    # Nor is it broadcast to stores: readers must not see it either.
    later = sends(r.step(100, Append((b"z",))))
    assert {s.acked_index for s in later} == {0}
    assert acked(r.step(101, AllowAcking())) == [2]


# ---- batching ----


def test_a_busy_store_gets_a_batch_when_full_or_after_the_linger_or_a_reply() -> None:
    limits = ReplicatorLimits(batch_entries_max=4, linger_ms=5)
    r = make(limits)
    first = sends(r.step(0, Append((b"a",))), "s1")
    assert [indexes(s) for s in first] == [[1]]
    # s1 has a request in flight: new events wait for company...
    assert sends(r.step(1, Append((b"b", b"c"))), "s1") == []
    assert r.deadline_ms(1) == 1 + 5
    assert sends(r.step(3, Tick()), "s1") == []
    # ...until the batch is full...
    full = sends(r.step(4, Append((b"d", b"e", b"f"))), "s1")
    assert [indexes(s) for s in full] == [[2, 3, 4, 5]]
    # ...or the oldest waiting one has lingered long enough, but with two requests out
    # (`partial_in_flight_max`) a partial batch waits for a reply instead...
    assert sends(r.step(9, Tick()), "s1") == []
    assert r.deadline_ms(9) is None  # every store has two out: only replies move them
    assert [indexes(s) for s in sends(r.step(10, accept(first[0])), "s1")] == [[6]]
    # ...so batches grow with the round trip instead of filling the window.
    assert sends(r.step(11, Append((b"g",))), "s1") == []
    assert sends(r.step(20, Tick()), "s1") == []
    assert [indexes(s) for s in sends(r.step(21, accept(full[0])), "s1")] == [[7]]


def test_batches_are_cut_by_bytes_and_always_carry_at_least_one_event() -> None:
    limits = ReplicatorLimits(batch_bytes_max=1000, linger_ms=0, partial_in_flight_max=8)
    r = make(limits)
    payloads = (b"a" * 400, b"b" * 400, b"c" * 400, b"d" * 2000, b"e" * 10)
    out = sends(r.step(0, Append(payloads)), "s1")
    assert [indexes(s) for s in out] == [[1, 2], [3], [4], [5]]
    for send in out:
        assert (
            sum(len(e.payload) + ENTRY_OVERHEAD_BYTES for e in send.entries) <= 1000
            or len(send.entries) == 1
        )


def test_the_window_bounds_requests_in_flight_per_store() -> None:
    limits = ReplicatorLimits(batch_entries_max=1, window_batches=3, linger_ms=0)
    r = make(limits)
    out = sends(r.step(0, Append(tuple(b"%d" % i for i in range(5)))), "s1")
    assert [indexes(s) for s in out] == [[1], [2], [3]]
    assert r.deadline_ms(0) is None  # every window is full: only replies move them
    more = sends(r.step(1, accept(out[0])), "s1")
    assert [indexes(s) for s in more] == [[4]]


# ---- gaps, refusals, reconnects ----


def test_a_gap_resends_from_the_matched_index_once() -> None:
    limits = ReplicatorLimits(batch_entries_max=2, linger_ms=0, window_batches=8)
    r = make(limits)
    out = sends(r.step(0, Append(tuple(b"%d" % i for i in range(6)))), "s1")
    assert [indexes(s) for s in out] == [[1, 2], [3, 4], [5, 6]]
    # The store lost batch 1..2 (say, it restarted): it holds 3..4, matched stays 0.
    first = sends(r.step(1, accept(out[0], matched=0)), "s1")
    assert [indexes(s) for s in first] == [[1, 2], [3, 4], [5, 6]]
    # ...and the replies to requests sent before the reset do not reset again.
    assert sends(r.step(2, accept(out[1], matched=0)), "s1") == []
    after = sends(r.step(3, accept(out[2], matched=0)), "s1")
    assert [indexes(s) for s in after] == []
    # The resend closes the gap: matched jumps past what the store already held.
    assert sends(r.step(4, accept(first[0], matched=6)), "s1") == []
    assert r.statistics().stores["s1"].matched_index == 6


def test_refused_busy_backs_off_then_resends_from_matched() -> None:
    r = make(ReplicatorLimits(batch_entries_max=2, linger_ms=0, busy_backoff_ms=10))
    out = sends(r.step(0, Append(tuple(b"%d" % i for i in range(4)))), "s2")
    assert [indexes(s) for s in out] == [[1, 2], [3, 4]]
    r.step(1, accept(out[0]))
    assert sends(r.step(2, busy(out[1], matched=2)), "s2") == []
    assert sends(r.step(5, Tick()), "s2") == []
    assert r.deadline_ms(5) == 12
    again = sends(r.step(12, Tick()), "s2")
    assert [indexes(s) for s in again] == [[3, 4]]


def test_a_reconnected_store_is_caught_up_from_its_matched_index() -> None:
    r = make(ReplicatorLimits(batch_entries_max=2, linger_ms=0))
    out = sends(r.step(0, Append(tuple(b"%d" % i for i in range(4)))))
    s3 = [s for s in out if s.store == "s3"]
    r.step(1, accept(s3[0]))
    r.step(2, StoreDisconnected("s3"))
    # Its answer to the second batch never comes; events go on to the others.
    others = [s for s in out if s.store != "s3"]
    for send in others:
        r.step(3, accept(send))
    assert r.acked_index == 4
    assert sends(r.step(4, Append((b"x",))), "s3") == []
    caught_up = sends(r.step(5, StoreConnected("s3")), "s3")
    assert [indexes(s) for s in caught_up] == [[3, 4], [5]]
    assert caught_up[0].acked_index == 4
    # A reply on the dead stream is ignored.
    r.step(6, StoreDisconnected("s1"))
    r.step(6, accept(others[0]))
    assert r.statistics().stores["s1"].matched_index == 4


def test_each_write_stream_carries_the_grant_on_its_first_request_only() -> None:
    r = Replicator(SEGMENT, 3, W2, STORES, ReplicatorLimits(linger_ms=0), grant=b"signed")
    for store in STORES:
        r.step(0, StoreConnected(store))
    first = sends(r.step(1, Append((b"a",))))
    assert [(s.store, s.grant) for s in first] == [(store, b"signed") for store in STORES]
    for send in first:
        r.step(2, accept(send))
    later = sends(r.step(3, Append((b"b",)))) + sends(r.step(30, Tick()))
    assert later and all(s.grant == b"" for s in later)
    # A new stream knows nothing of the old one's grant: its first request carries it.
    r.step(40, StoreDisconnected("s2"))
    again = sends(r.step(41, StoreConnected("s2")), "s2")
    assert [s.grant for s in again][:1] == [b"signed"]
    assert all(s.grant == b"" for s in again[1:])


# ---- memory and back pressure ----


def test_appends_wait_once_unacked_bytes_reach_the_bound() -> None:
    limits = ReplicatorLimits(
        unacked_bytes_max=(1 << 20) + ENTRY_MEMORY_BYTES + 4096, retained_bytes_max=4 << 20
    )
    r = make(limits)
    big = b"x" * (1 << 20)
    assert r.room_for(len(big) + ENTRY_MEMORY_BYTES)
    out = sends(r.step(0, Append((big,))))
    assert r.unacked_bytes == len(big) + ENTRY_MEMORY_BYTES
    assert not r.room_for(4097)  # 1 MiB + its entry + 4097 would pass the bound
    assert r.room_for(4096)
    r.step(1, accept(out[0]))
    r.step(1, accept(out[1]))
    assert r.room_for(1 << 20)


def test_an_empty_buffer_takes_any_single_event() -> None:
    r = make(ReplicatorLimits(unacked_bytes_max=(1 << 20) + 1024, retained_bytes_max=2 << 20))
    assert r.room_for(10 << 20)


def test_a_store_left_behind_is_detached_and_memory_stays_bounded() -> None:
    limits = ReplicatorLimits(
        unacked_bytes_max=(1 << 20) + 1024,
        retained_bytes_max=(1 << 20) + 1024,
        batch_entries_max=64,
        linger_ms=0,
    )
    r = make(limits)
    r.step(0, StoreDisconnected("s3"))  # down (or SIGSTOPped) for the whole test
    payload = b"p" * 1000
    detached = []
    for round_ in range(50):
        actions = r.step(round_, Append((payload,) * 100))
        detached += [a for a in actions if isinstance(a, StoreDetached)]
        for send in sends(actions):
            actions = r.step(round_, accept(send))
            detached += [a for a in actions if isinstance(a, StoreDetached)]
        assert r.retained_bytes <= limits.retained_bytes_max + 100 * (1000 + ENTRY_MEMORY_BYTES)
    assert r.acked_index == 5000
    assert [(d.store, d.matched_index) for d in detached] == [("s3", 0)]
    assert r.statistics().stores["s3"].detached
    # A detached store gets nothing more, even if it comes back.
    assert sends(r.step(60, StoreConnected("s3")), "s3") == []


def test_a_store_behind_but_within_the_bound_keeps_its_entries() -> None:
    r = make(ReplicatorLimits(linger_ms=0))
    r.step(0, StoreDisconnected("s3"))
    out = sends(r.step(0, Append((b"a",) * 100)))
    for send in out:
        r.step(1, accept(send))
    assert r.acked_index == 100 and r.retained_bytes == 100 * (1 + ENTRY_MEMORY_BYTES)
    back = sends(r.step(2, StoreConnected("s3")), "s3")
    assert indexes(back[0])[0] == 1
    for send in back:
        r.step(3, accept(send))
    assert r.retained_bytes == 0


# ---- stopping ----


def test_after_stop_nothing_is_acked_or_sent() -> None:
    r = make()
    out = sends(r.step(0, Append((b"a", b"b"))))
    r.step(1, accept(out[0]))
    r.step(1, Stop())
    assert r.step(2, accept(out[1])) == []
    assert r.acked_index == 0 and r.sent_through == 2
    assert r.step(3, Tick()) == [] and r.deadline_ms(3) is None


def test_limits_check_their_relations() -> None:
    with pytest.raises(ValueError, match="retained"):
        ReplicatorLimits(unacked_bytes_max=64 << 20, retained_bytes_max=32 << 20)
    with pytest.raises(ValueError, match="largest event"):
        ReplicatorLimits(unacked_bytes_max=1024)
    with pytest.raises(ValueError, match="batch_entries_max"):
        ReplicatorLimits(batch_entries_max=100_000)


def test_a_batch_past_the_small_size_uses_the_whole_window() -> None:
    r = make(ReplicatorLimits(small_batch_bytes=1000, linger_ms=5))
    out = [indexes(s) for s in sends(r.step(0, Append((b"a",))), "s1")]
    out += [indexes(s) for s in sends(r.step(0, Append((b"b" * 600,) * 2)), "s1")]
    # Two requests out: a small batch waits...
    assert sends(r.step(1, Append((b"c",))), "s1") == []
    # ...until it grows past the small size, then goes into the window at once.
    out += [indexes(s) for s in sends(r.step(1, Append((b"d" * 1000,))), "s1")]
    assert out == [[1], [2, 3], [4, 5]]


def test_a_store_claiming_more_than_was_sent_is_a_broken_peer() -> None:
    r = make()
    [first, *_] = sends(r.step(10, Append((b"a",))))
    with pytest.raises(InconsistentReply, match="holds 2"):
        r.step(11, accept(first, matched=2))
    # Nothing of the claim was taken in.
    assert r.acked_index == 0 and r.statistics().stores[first.store].matched_index == 0


def test_the_memory_bound_counts_what_a_kept_entry_costs_this_process() -> None:
    """`ENTRY_MEMORY_BYTES` is measured, not guessed: what 20,000 kept 100-byte events
    cost the process beyond their payloads (the bytes objects are the writer's to keep:
    its user dropped them) is within a quarter of what the bounds count."""
    import gc
    import os
    import tracemalloc

    count, size = 20_000, 100
    r = make(ReplicatorLimits(unacked_bytes_max=1 << 30, retained_bytes_max=1 << 30))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(count // 100):
            r.step(0, Append(tuple(os.urandom(size) for _ in range(100))))
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = r.unacked_bytes
    assert counted == count * (size + ENTRY_MEMORY_BYTES)
    assert 0.75 * used <= counted <= 1.25 * used, (used / count, counted / count)
