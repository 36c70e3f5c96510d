"""The reader's cursor: hops through bridges, skips holes, fails over with backoff, and
reports data loss only when no replica can hold the range."""

from __future__ import annotations

import pytest

from streamengine.client.core.replicas import Ask, FollowerTiming, ReplicaSet
from streamengine.client.core.subscription import (
    Cursor,
    DataLoss,
    Finished,
    ReadFrom,
    SegmentView,
    Unreachable,
    Wait,
)
from streamengine.protocol import certificate
from streamengine.protocol.certificate import certificate_of
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.sequence import pack_sequence

A, B, C = "a:1", "b:1", "c:1"
TIMING = FollowerTiming()
FIRST_RETRY_MS = TIMING.replica_backoff.first_ms


def event(index: int, payload: bytes = b"", epoch: int = 1) -> StoredEntry:
    return StoredEntry.make(index, EntryKind.EVENT, epoch, payload or f"e{index}".encode())


def hole(index: int) -> StoredEntry:
    return StoredEntry.make(index, EntryKind.HOLE, 2)


def bridge(index: int) -> StoredEntry:
    return StoredEntry.make(index, EntryKind.BRIDGE, 2)


def sealed(epoch: int, final: int, replicas: tuple[str, ...] = (A, B, C)) -> SegmentView:
    return SegmentView(epoch, replicas, True, final)


def open_segment(epoch: int, replicas: tuple[str, ...] = (A, B, C)) -> SegmentView:
    return SegmentView(epoch, replicas, False, 0)


def test_start_zero_begins_at_the_first_listed_segment() -> None:
    cursor = Cursor(0)
    assert cursor.next(0) == Wait(TIMING.idle_refresh_ms)
    cursor.on_segments([sealed(3, 2), open_segment(5)], 0)
    assert cursor.next(0) == ReadFrom(3, A, 1)


def test_events_are_yielded_holes_skipped_and_the_bridge_hops_to_the_next_segment() -> None:
    cursor = Cursor(0)
    cursor.on_segments([sealed(1, 4), open_segment(3)], 0)
    events = cursor.on_entries(1, [event(1), hole(2), event(3), bridge(4)], 0)
    assert [(e.epoch, e.index, e.payload) for e in events] == [(1, 1, b"e1"), (1, 3, b"e3")]
    assert [e.sequence for e in events] == [pack_sequence(1, 1), pack_sequence(1, 3)]
    assert cursor.next(0) == ReadFrom(3, A, 1)


def test_start_in_the_middle_of_a_sealed_segment_resumes_exactly_there() -> None:
    cursor = Cursor(pack_sequence(1, 3))
    cursor.on_segments([sealed(1, 5)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 3)
    events = cursor.on_entries(1, [event(3), event(4)], 0)
    assert [e.index for e in events] == [3, 4]


def test_a_resent_entry_below_the_position_is_never_yielded_twice() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert [e.index for e in cursor.on_entries(1, [event(1), event(2)], 0)] == [1, 2]
    assert [e.index for e in cursor.on_entries(1, [event(2), event(3)], 0)] == [3]


def test_a_gap_from_a_replica_is_a_protocol_error_not_a_silent_skip() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    with pytest.raises(ValueError, match="skipped"):
        cursor.on_entries(1, [event(2)], 0)


def test_failover_resumes_at_the_position_on_another_replica() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_entries(1, [event(1), event(2)], 0)
    cursor.on_replica_failed(1, A, 0)
    assert cursor.next(0) == ReadFrom(1, B, 3)


def test_a_replica_known_to_serve_the_position_is_preferred() -> None:
    cursor = Cursor(pack_sequence(1, 4))
    cursor.on_segments([sealed(1, 9)], 0)
    cursor.on_position(1, B, 2, 0)
    cursor.on_position(1, C, 9, 0)
    cursor.on_replica_failed(1, A, 0)
    assert cursor.next(0) == ReadFrom(1, C, 4)


def test_every_replica_of_a_sealed_segment_failing_is_retried_with_backoff_not_loss() -> None:
    """Failures say nothing of what a store holds: all replicas restarting at once is a
    wait, not data loss."""
    cursor = Cursor(pack_sequence(2, 3))
    cursor.on_segments([sealed(2, 7)], 0)
    for replica in (A, B, C):
        assert cursor.next(0) == ReadFrom(2, replica, 3)
        cursor.on_replica_failed(2, replica, 0)
    assert cursor.next(0) == Wait(FIRST_RETRY_MS)
    cursor.on_segments([sealed(2, 7)], 0)
    assert cursor.next(FIRST_RETRY_MS - 1) == Wait(FIRST_RETRY_MS)
    assert cursor.next(FIRST_RETRY_MS) == ReadFrom(2, A, 3)


def test_the_backoff_of_a_failing_replica_doubles_up_to_its_max_and_an_answer_resets_it() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1, (A,))], 0)
    now = 0
    delays = []
    for _ in range(8):
        assert cursor.next(now) == ReadFrom(1, A, 1)
        cursor.on_replica_failed(1, A, now)
        wait = cursor.next(now)
        assert isinstance(wait, Wait)
        delays.append(wait.until_ms - now)
        now = wait.until_ms
    assert delays == [100, 200, 400, 800, 1000, 1000, 1000, 1000]
    assert delays[-1] == TIMING.replica_backoff.max_ms
    assert cursor.next(now) == ReadFrom(1, A, 1)
    cursor.on_position(1, A, 0, now)
    cursor.on_replica_failed(1, A, now)
    assert cursor.next(now) == Wait(now + FIRST_RETRY_MS)


def test_every_replica_answering_it_holds_less_is_data_loss_naming_the_range() -> None:
    cursor = Cursor(pack_sequence(2, 3))
    cursor.on_segments([sealed(2, 7)], 0)
    for replica, acked in ((A, 2), (B, 0), (C, 1)):  # B: NOT_FOUND
        assert cursor.next(0) == ReadFrom(2, replica, 3)
        cursor.on_position(2, replica, acked, 0)
    # The answers may predate a repair that moved the segment: check the list first.
    assert cursor.next(5) == Wait(5)
    cursor.on_segments([sealed(2, 7)], 0)
    assert cursor.next(0) == DataLoss(2, 3, 7)


def test_a_sealed_segment_the_master_lists_without_replicas_is_data_loss() -> None:
    cursor = Cursor(0)
    cursor.on_segments([sealed(1, 5, replicas=())], 0)
    assert cursor.next(0) == DataLoss(1, 1, 5)


def test_replicas_holding_less_while_another_fails_is_a_wait_for_that_one() -> None:
    cursor = Cursor(pack_sequence(2, 3))
    cursor.on_segments([sealed(2, 7)], 0)
    cursor.on_position(2, A, 2, 0)
    cursor.on_position(2, B, 0, 0)
    assert cursor.next(0) == ReadFrom(2, C, 3)
    cursor.on_replica_failed(2, C, 0)
    cursor.on_segments([sealed(2, 7)], 0)
    assert cursor.next(0) == Wait(FIRST_RETRY_MS)
    assert cursor.next(FIRST_RETRY_MS) == ReadFrom(2, C, 3)
    cursor.on_position(2, C, 7, FIRST_RETRY_MS)
    assert cursor.next(FIRST_RETRY_MS) == ReadFrom(2, C, 3)


def test_a_repair_that_moved_the_segment_is_read_from_the_new_replica() -> None:
    cursor = Cursor(0)
    cursor.on_segments([sealed(1, 5, replicas=(A, B))], 0)
    cursor.on_position(1, A, 0, 0)
    cursor.on_position(1, B, 0, 0)
    assert cursor.next(0) == Wait(0)
    cursor.on_segments([sealed(1, 5, replicas=(A, C))], 0)
    assert cursor.next(0) == ReadFrom(1, C, 1)


def test_what_replicas_said_while_the_segment_was_open_is_forgotten_once_sealed() -> None:
    cursor = Cursor(pack_sequence(1, 4))
    cursor.on_segments([open_segment(1, (A, B))], 0)
    cursor.on_position(1, A, 2, 0)
    cursor.on_position(1, B, 3, 0)
    cursor.on_segments([sealed(1, 6, (A, B))], 0)
    cursor.on_segments([sealed(1, 6, (A, B))], 0)
    # Both may have been acked to the bridge since: ask them again.
    assert cursor.next(0) == ReadFrom(1, A, 4)


def test_every_replica_of_the_open_segment_answering_less_waits_for_it_to_grow() -> None:
    cursor = Cursor(pack_sequence(1, 4))
    cursor.on_segments([open_segment(1)], 0)
    for replica in (A, B, C):
        cursor.on_position(1, replica, 0, 0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 4)


def test_every_replica_of_the_open_segment_failing_waits_and_retries() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    for replica in (A, B, C):
        cursor.on_replica_failed(1, replica, 0)
    assert cursor.next(0) == Wait(FIRST_RETRY_MS)
    assert cursor.next(FIRST_RETRY_MS) == ReadFrom(1, A, 1)


def test_a_replica_stalled_below_the_bridge_of_a_sealed_segment_is_abandoned() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_entries(1, [event(1)], 10)
    # The segment is sealed at 3 while A never got the bridge.
    cursor.on_segments([sealed(1, 3), open_segment(4)], 0)
    stall_ms = TIMING.sealed_replica_stall_ms
    assert cursor.next(10 + stall_ms - 1) == ReadFrom(1, A, 2)
    assert cursor.next(10 + stall_ms) == ReadFrom(1, B, 2)


def test_answers_that_hold_nothing_needed_are_no_progress_on_a_sealed_segment() -> None:
    """A replica lost with a wiped store answers NOT_FOUND (0) at once and for good;
    counted as progress, it held a follower of a sealed segment on it for good
    (simulator seed 49)."""
    cursor = Cursor(0)
    cursor.on_segments([open_segment(2)], 0)
    assert cursor.next(0) == ReadFrom(2, A, 1)
    cursor.on_segments([sealed(2, 1), open_segment(4)], 10)
    stall_ms = TIMING.sealed_replica_stall_ms
    for now in range(10, 10 + stall_ms, 50):
        cursor.on_position(2, A, 0, now)  # a lower bound: the read began open
        assert cursor.next(now) == ReadFrom(2, A, 1)
    assert cursor.next(10 + stall_ms) == ReadFrom(2, B, 1, 2)


def test_a_new_call_on_a_segment_listed_sealed_takes_its_answer_as_the_end() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(2)], 0)
    assert cursor.next(0) == ReadFrom(2, A, 1)
    cursor.on_segments([sealed(2, 1), open_segment(4)], 10)
    cursor.on_call_started(2)
    cursor.on_position(2, A, 0, 20)
    assert cursor.next(20) == ReadFrom(2, B, 1, 2)


def test_a_replica_left_behind_on_an_open_segment_is_passed_over_for_the_next() -> None:
    """A store the leader detached (too far behind, its roll refused for want of
    stores) answers on with the same position while the open segment grows on the
    others; a follower tailing it once never got past it (bench.subscribe's live tail)."""
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_entries(1, [event(1)], 10)
    stall_ms = TIMING.open_replica_stall_ms
    # Positions and keepalives are answers, not entries served: A stays stalled.
    cursor.on_position(1, A, 1, stall_ms)
    cursor.on_keepalive(1, A, stall_ms)
    assert cursor.next(10 + stall_ms - 1) == ReadFrom(1, A, 2)
    now = 10 + stall_ms
    # B serves nothing either (an idle stream), alive all along: the reader rotates on,
    # to C, not back to A; then, every replica passed over once, to the one passed over
    # longest ago.
    for expected in (B, C, A, B):
        read = cursor.next(now)
        assert isinstance(read, ReadFrom) and (read.replica, read.from_index) == (expected, 2)
        for beat in range(now, now + stall_ms, TIMING.keepalive_interval_ms):
            cursor.on_keepalive(1, expected, beat)
            assert cursor.next(beat) == read
        now += stall_ms


def test_a_replica_of_a_sealed_segment_that_says_it_stops_short_is_left_at_once() -> None:
    cursor = Cursor(0)
    cursor.on_segments([sealed(1, 4)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_position(1, A, 2, 0)
    cursor.on_entries(1, [event(1), event(2)], 0)
    assert cursor.next(0) == ReadFrom(1, B, 3)


def test_a_bridge_before_the_next_segment_is_listed_waits_then_enters_it() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    cursor.on_entries(1, [event(1), bridge(2)], 0)
    assert cursor.next(0) == Wait(TIMING.idle_refresh_ms)
    cursor.on_segments([sealed(1, 2), open_segment(4)], 0)
    assert cursor.next(0) == ReadFrom(4, A, 1)


def test_a_range_read_finishes_at_its_exclusive_end() -> None:
    cursor = Cursor(pack_sequence(1, 2), end_sequence=pack_sequence(1, 4))
    cursor.on_segments([sealed(1, 9)], 0)
    events = cursor.on_entries(1, [event(2), event(3), event(4), event(5)], 0)
    assert [e.index for e in events] == [2, 3]
    assert cursor.next(0) == Finished()


def test_a_range_ending_in_a_later_segment_crosses_the_bridge() -> None:
    cursor = Cursor(0, end_sequence=pack_sequence(4, 2))
    cursor.on_segments([sealed(1, 2), open_segment(4)], 0)
    assert [e.index for e in cursor.on_entries(1, [event(1), bridge(2)], 0)] == [1]
    assert [e.index for e in cursor.on_entries(4, [event(1, epoch=4), event(2, epoch=4)], 0)] == [1]
    assert cursor.next(0) == Finished()


def test_a_silent_replica_is_left_and_retried_later() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    assert cursor.wake_at_ms() == min(TIMING.segment_refresh_ms, TIMING.silent_replica_ms)
    cursor.on_keepalive(1, A, 1000)
    assert cursor.next(1000 + TIMING.silent_replica_ms - 1) == ReadFrom(1, A, 1)
    assert cursor.next(1000 + TIMING.silent_replica_ms) == ReadFrom(1, B, 1)


def test_time_the_consumer_holds_the_events_is_not_the_replicas_silence() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    stalled_until = 10 * TIMING.silent_replica_ms
    cursor.on_delivered(stalled_until)
    assert cursor.next(stalled_until) == ReadFrom(1, A, 1)
    assert cursor.next(stalled_until + TIMING.silent_replica_ms) == ReadFrom(1, B, 1)


def test_while_tailing_the_list_is_refreshed_on_time_unless_a_refresh_is_under_way() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    assert not cursor.refresh_due(TIMING.segment_refresh_ms - 1)
    assert cursor.refresh_due(TIMING.segment_refresh_ms)
    assert cursor.wake_at_ms(listing=True) == TIMING.silent_replica_ms
    cursor.on_segments([open_segment(1)], TIMING.segment_refresh_ms)
    assert cursor.wake_at_ms() == 2 * TIMING.segment_refresh_ms


def test_a_master_that_does_not_list_is_asked_again_after_a_backoff() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    refresh_at = TIMING.segment_refresh_ms
    assert cursor.refresh_due(refresh_at)
    cursor.on_list_failed(refresh_at)
    # Tailing goes on with the list held; the next try waits for the backoff.
    assert cursor.next(refresh_at) == ReadFrom(1, A, 1)
    assert not cursor.refresh_due(refresh_at + FIRST_RETRY_MS - 1)
    assert cursor.refresh_due(refresh_at + FIRST_RETRY_MS)
    cursor.on_replica_failed(1, A, refresh_at)
    cursor.on_replica_failed(1, B, refresh_at)
    cursor.on_replica_failed(1, C, refresh_at)
    cursor.on_list_failed(refresh_at)
    assert cursor.next(refresh_at) == Wait(refresh_at + 2 * FIRST_RETRY_MS)


def test_entries_served_are_a_lower_bound_never_an_answer_about_the_end() -> None:
    # Simulator seed 153: a slow tail delivered entries 1..234 that a replica sent while
    # the segment was open, after the reader learned the segment sealed at 243. The
    # other replica answered it holds less; the served batch must not count as the
    # first replica saying so too (it held the whole segment).
    replicas = ReplicaSet(FollowerTiming())
    replicas.segment_sealed()
    replicas.served("s1", 234)
    replicas.answered("s2", 49)
    assert not replicas.below("s1", 235)
    assert replicas.choose(("s1", "s2"), sealed=True, next_index=235, now_ms=0) == Ask("s1")
    # Once the replica answers where it ends, that answer counts, and later entries
    # raise it.
    replicas.answered("s1", 200)
    replicas.served("s1", 220)
    assert replicas.below("s1", 221) and not replicas.below("s1", 220)


def test_an_answer_on_a_read_begun_while_the_segment_was_open_is_a_lower_bound() -> None:
    # Simulator seeds 10268 and 10473 (N = 1): a subscription begun on the open segment
    # was slow; the store's position (acked 9), made before the seal, arrived after the
    # reader learned the segment sealed at 14, with the bridge right behind it on the
    # same stream. Taken for an answer, it made the only replica "hold less": data loss.
    cursor = Cursor(pack_sequence(1, 10))
    cursor.on_segments([open_segment(1, (A,))], 0)
    assert cursor.next(0) == ReadFrom(1, A, 10)
    cursor.on_segments([sealed(1, 14, (A,))], 10)
    cursor.on_position(1, A, 9, 20)
    assert cursor.next(20) == ReadFrom(1, A, 10)
    cursor.on_segments([sealed(1, 14, (A,))], 30)
    assert cursor.next(30) == ReadFrom(1, A, 10)
    events = cursor.on_entries(1, [event(i) for i in range(10, 14)] + [bridge(14)], 40)
    assert [e.index for e in events] == [10, 11, 12, 13]
    assert cursor.epoch == 2


def test_an_answer_on_a_read_begun_once_sealed_says_where_the_replica_ends() -> None:
    cursor = Cursor(pack_sequence(1, 10))
    cursor.on_segments([open_segment(1, (A,))], 0)
    assert cursor.next(0) == ReadFrom(1, A, 10)
    cursor.on_segments([sealed(1, 14, (A,))], 10)
    cursor.on_replica_failed(1, A, 10)
    retry_at_ms = 10 + FIRST_RETRY_MS
    assert cursor.next(retry_at_ms) == ReadFrom(1, A, 10)
    cursor.on_position(1, A, 9, retry_at_ms)
    assert cursor.next(retry_at_ms) == Wait(retry_at_ms)  # the list again, first
    cursor.on_segments([sealed(1, 14, (A,))], retry_at_ms)
    assert cursor.next(retry_at_ms) == DataLoss(1, 10, 14)


# ---- certificates: nothing of a chunk leaves before it verified (docs/design.md) ----


def certified(
    epoch: int, entries: list[StoredEntry], replicas: tuple[str, ...] = (A, B, C), bad=()
) -> SegmentView:
    made = certificate_of([(e.index, int(e.kind), e.payload) for e in entries])
    return SegmentView(epoch, replicas, True, made.final_index, made, tuple(bad))


TEN = [event(i) for i in range(1, 10)] + [bridge(10)]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of at most 4 entries: indexes 1-4, 5-8, 9-10."""
    monkeypatch.setattr(certificate, "CHUNK_ENTRIES_MAX", 4)


@pytest.mark.usefixtures("small_chunks")
def test_a_certified_segment_is_handed_out_a_verified_chunk_at_a_time() -> None:
    cursor = Cursor(0)
    cursor.on_segments([certified(1, TEN)], 0)
    # Checked against the certificate here: the store need not check each crc32c.
    assert cursor.next(0) == ReadFrom(1, A, 1, checked=True)
    assert cursor.on_entries(1, TEN[:3], 0) == []  # chunk 1-4 incomplete: held back
    assert [e.index for e in cursor.on_entries(1, TEN[3:6], 0)] == [1, 2, 3, 4]
    assert [e.index for e in cursor.on_entries(1, TEN[6:], 0)] == [5, 6, 7, 8, 9]
    assert cursor.take_reports() == []


@pytest.mark.usefixtures("small_chunks")
def test_a_chunk_differing_from_the_certificate_is_never_handed_out() -> None:
    """A stale copy with a valid crc at index 6: the replica is damaged for this reader
    and reported; the next replica is read from that chunk's first index."""
    cursor = Cursor(0)
    cursor.on_segments([certified(1, TEN)], 0)
    served = list(TEN)
    served[5] = event(6, b"stale but crc-valid")
    assert cursor.next(0) == ReadFrom(1, A, 1, checked=True)
    assert [e.index for e in cursor.on_entries(1, served[:5], 0)] == [1, 2, 3, 4]
    assert cursor.on_entries(1, served[5:8], 0) == []
    [report] = cursor.take_reports()
    assert (report.epoch, report.replica) == (1, A) and "5..8" in report.problem
    decision = cursor.next(1)
    assert decision == ReadFrom(1, B, 5, checked=True)
    assert [e.payload for e in cursor.on_entries(1, TEN[4:8], 1)] == [b"e5", b"e6", b"e7", b"e8"]


@pytest.mark.usefixtures("small_chunks")
def test_resuming_mid_chunk_reads_from_the_chunk_start_and_yields_from_the_position() -> None:
    cursor = Cursor(pack_sequence(1, 6))
    cursor.on_segments([certified(1, TEN)], 0)
    read = cursor.next(0)
    assert read == ReadFrom(1, A, 5, checked=True)
    assert [e.index for e in cursor.on_entries(1, TEN[4:8], 0)] == [6, 7, 8]
    # The read goes on: the same attempt on the same replica.
    assert Cursor.continues(cursor.next(0), read)


@pytest.mark.usefixtures("small_chunks")
def test_a_bridge_in_a_segment_listed_open_is_read_under_the_certificate_listed_since() -> None:
    """A list older than the seal shows the segment open; a replica's bridge says it is
    sealed, its copies at rest, which only the certificate guards: nothing it sends is
    handed out until the list is read again, and then the read is certified."""
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_position(1, A, 10, 1, bridge_index=10)
    forged = [event(1), event(2, b"forged but crc-valid"), *TEN[2:]]
    assert cursor.on_entries(1, forged, 1) == []
    assert cursor.next(1) == Wait(1, relist=True)
    cursor.on_segments([certified(1, TEN)], 2)
    assert cursor.next(2) == ReadFrom(1, A, 1, 2, checked=True)
    assert cursor.on_entries(1, forged[:4], 2) == []
    [report] = cursor.take_reports()
    assert report.replica == A and "1..4" in report.problem
    assert cursor.next(2) == ReadFrom(1, B, 1, 3, checked=True)
    assert [e.payload for e in cursor.on_entries(1, TEN[:4], 2)] == [b"e1", b"e2", b"e3", b"e4"]


def test_a_segment_still_listed_open_after_a_bridge_is_read_on_under_crc() -> None:
    """The master has not recorded the seal (a recovery between its bridge and its
    seal at the master): it has no certificate to read under, so the read goes on, and
    later bridges of that segment ask for no more lists."""
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_position(1, A, 4, 1, bridge_index=4)
    assert cursor.next(1) == Wait(1, relist=True)
    cursor.on_segments([open_segment(1)], 2)
    assert cursor.next(2) == ReadFrom(1, A, 1, 2)
    cursor.on_position(1, A, 4, 2, bridge_index=4)
    assert cursor.next(2) == ReadFrom(1, A, 1, 2)
    events = cursor.on_entries(1, [event(1), event(2), event(3), bridge(4)], 2)
    assert [e.index for e in events] == [1, 2, 3]


@pytest.mark.parametrize(
    ("listed", "position", "bridge_index", "relist"),
    [
        ("open", 1, 0, False),  # no bridge: an open segment's acked entries
        ("open", 4, 4, False),  # only the bridge is left: nothing at rest to read
        ("open", 1, 4, True),
        ("sealed", 1, 4, False),  # the list knows: its certificate, if any, applies
    ],
)
def test_which_bridges_ask_for_the_list_again(
    listed: str, position: int, bridge_index: int, relist: bool
) -> None:
    cursor = Cursor(pack_sequence(1, position))
    cursor.on_segments([open_segment(1) if listed == "open" else sealed(1, 4)], 0)
    assert isinstance(cursor.next(0), ReadFrom)
    cursor.on_position(1, A, 4, 1, bridge_index=bridge_index)
    decision = cursor.next(1)
    assert (isinstance(decision, Wait) and decision.relist) == relist, decision


def test_a_bounded_read_waiting_for_a_silent_master_after_a_bridge_gives_up() -> None:
    cursor = Cursor(0, pack_sequence(1, 4), TIMING)
    cursor.on_segments([open_segment(1)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_position(1, A, 4, 1, bridge_index=4)
    cursor.on_list_failed(2)
    decision = cursor.next(TIMING.unreachable_read_ms)
    assert isinstance(decision, Unreachable) and decision.master_silent, decision
    assert "did not list its certificate" in decision.describe("t/s")


def test_every_replica_damaged_is_data_loss_not_a_wait() -> None:
    """C14 for damage: DATA_LOSS from every replica of a sealed range is an answer; once
    a list fetched after those answers names only them, the range is lost."""
    cursor = Cursor(0)
    cursor.on_segments([sealed(1, 5)], 0)
    for replica in (A, B, C):
        assert cursor.next(0) == ReadFrom(1, replica, 1)
        cursor.on_replica_damaged(1, replica, "DATA_LOSS: block checksum mismatch")
    assert len(cursor.take_reports()) == 3
    assert cursor.next(0) == Wait(0)  # re-read the master's list before calling it lost
    cursor.on_segments([sealed(1, 5)], 1)
    assert cursor.next(1) == DataLoss(1, 1, 5)


def test_a_replica_the_master_lists_as_bad_is_never_read() -> None:
    cursor = Cursor(0)
    cursor.on_segments([certified(1, TEN, bad=(A,))], 0)
    assert cursor.next(0) == ReadFrom(1, B, 1, checked=True)


def test_a_segment_whose_every_replica_the_master_lists_as_bad_is_lost() -> None:
    cursor = Cursor(0)
    cursor.on_segments([certified(1, TEN, bad=(A, B, C))], 0)
    assert cursor.next(0) == Wait(0)
    cursor.on_segments([certified(1, TEN, bad=(A, B, C))], 1)
    assert cursor.next(1) == DataLoss(1, 1, 10)


def test_a_range_sealed_accepting_loss_is_never_read_and_is_data_loss_then_resumable() -> None:
    lossy = SegmentView(1, (A, B, C), True, 5, lost_from_index=3)
    cursor = Cursor(0)
    cursor.on_segments([lossy, open_segment(3)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    events = cursor.on_entries(1, [event(1), event(2), event(3), hole(4), bridge(5)], 0)
    assert [e.index for e in events] == [1, 2], "nothing of the lost range is handed out"
    assert cursor.next(0) == DataLoss(1, 3, 5, accepted=True)
    # Starting inside the range is the same loss, and so is a position past the bridge
    # (read there from a replica since lost, whose acked events past the bridge are
    # lost too); from the loss's resume sequence, the next segment.
    for inside_at in (4, 6):
        inside = Cursor(pack_sequence(1, inside_at))
        inside.on_segments([lossy, open_segment(3)], 0)
        assert inside.next(0) == DataLoss(1, 3, 5, accepted=True)
    after = Cursor(DataLoss(1, 3, 5, accepted=True).resume_sequence)
    after.on_segments([lossy, open_segment(3)], 0)
    assert after.next(0) == ReadFrom(3, A, 1)


def test_the_upcoming_read_is_the_next_segment_from_its_first_good_replica() -> None:
    cursor = Cursor(0, end_sequence=pack_sequence(3, 1))
    cursor.on_segments([sealed(1, 5), sealed(2, 5, (B, C)), open_segment(3)], 0)
    assert cursor.next(0) == ReadFrom(1, A, 1)
    assert cursor.upcoming() == ReadFrom(2, B, 1)
    cursor.on_segments([sealed(1, 5), SegmentView(2, (B, C), True, 5, bad=(B,))], 0)
    assert cursor.upcoming() == ReadFrom(2, C, 1)
    cursor.on_entries(1, [event(1), event(2), event(3), event(4), bridge(5)], 0)
    assert cursor.epoch == 2
    assert cursor.upcoming() is None  # the next one is not listed (nor wanted)
    following = Cursor(0)
    following.on_segments([sealed(1, 5), open_segment(2)], 0)
    assert following.upcoming() == ReadFrom(2, A, 1)  # an open one: what A acked
    # A certified one is read ahead as the cursor will read it: checked by the reader.
    ahead = Cursor(0)
    ahead.on_segments([sealed(1, 5), certified(2, TEN)], 0)
    assert ahead.upcoming() == ReadFrom(2, A, 1, checked=True)
    following.on_entries(1, [event(1), event(2), event(3), event(4), bridge(5)], 0)
    assert following.upcoming() is None  # reading the open segment: nothing after it
    ends_before = Cursor(0, end_sequence=pack_sequence(2, 1))
    ends_before.on_segments([sealed(1, 5), sealed(2, 5)], 0)
    assert ends_before.upcoming() is None  # past the end of the range


def test_a_replica_passed_over_comes_after_those_that_failed_long_ago() -> None:
    """Runtime seed 58: a store wiped while its segment stayed open (N=5 on five stores,
    the roll refused) answered NOT_FOUND, an answer that cleared its failures, while the
    other replicas still counted failures from the safety phase. Passed over for serving
    nothing, it was chosen again at once (the fewest failures first), and the follower
    tailed it for good while the others served the segment on."""
    cursor = Cursor(pack_sequence(1, 19))
    cursor.on_segments([open_segment(1)], 0)
    now = 0
    for _ in range(2):  # every replica fails twice: B and C are never asked again
        for replica in (A, B, C):
            assert cursor.next(now) == ReadFrom(1, replica, 19)
            cursor.on_replica_failed(1, replica, now)
        wait = cursor.next(now)
        assert isinstance(wait, Wait)
        now = wait.until_ms
    read = cursor.next(now)
    assert read == ReadFrom(1, A, 19)
    cursor.on_position(1, A, 0, now)  # it holds nothing of the segment
    for beat in range(now, now + TIMING.open_replica_stall_ms, TIMING.keepalive_interval_ms):
        cursor.on_keepalive(1, A, beat)
        assert cursor.next(beat) == read
    now += TIMING.open_replica_stall_ms
    assert cursor.next(now) == ReadFrom(1, B, 19)
