"""The reader's cursor: hops through bridges, skips holes, fails over, reports loss."""

from __future__ import annotations

import pytest

from streamengine.client.core.cursor import (
    SEALED_REPLICA_STALL_MS,
    Cursor,
    DataLoss,
    Finished,
    ReadFrom,
    SegmentView,
    WaitForSegments,
)
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.sequence import pack_sequence

A, B, C = "a:1", "b:1", "c:1"


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
    assert cursor.next(0) == WaitForSegments()
    cursor.on_segments([sealed(3, 2), open_segment(5)])
    assert cursor.next(0) == ReadFrom(3, A, 1)


def test_events_are_yielded_holes_skipped_and_the_bridge_hops_to_the_next_segment() -> None:
    cursor = Cursor(0)
    cursor.on_segments([sealed(1, 4), open_segment(3)])
    events = cursor.on_entries(1, [event(1), hole(2), event(3), bridge(4)], 0)
    assert [(e.epoch, e.index, e.payload) for e in events] == [(1, 1, b"e1"), (1, 3, b"e3")]
    assert [e.sequence for e in events] == [pack_sequence(1, 1), pack_sequence(1, 3)]
    assert cursor.next(0) == ReadFrom(3, A, 1)


def test_start_in_the_middle_of_a_sealed_segment_resumes_exactly_there() -> None:
    cursor = Cursor(pack_sequence(1, 3))
    cursor.on_segments([sealed(1, 5)])
    assert cursor.next(0) == ReadFrom(1, A, 3)
    events = cursor.on_entries(1, [event(3), event(4)], 0)
    assert [e.index for e in events] == [3, 4]


def test_a_resent_entry_below_the_position_is_never_yielded_twice() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)])
    assert [e.index for e in cursor.on_entries(1, [event(1), event(2)], 0)] == [1, 2]
    assert [e.index for e in cursor.on_entries(1, [event(2), event(3)], 0)] == [3]


def test_a_gap_from_a_replica_is_a_protocol_error_not_a_silent_skip() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)])
    with pytest.raises(ValueError, match="skipped"):
        cursor.on_entries(1, [event(2)], 0)


def test_failover_resumes_at_the_position_on_another_replica() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)])
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_entries(1, [event(1), event(2)], 0)
    cursor.on_replica_failed(1, A)
    assert cursor.next(0) == ReadFrom(1, B, 3)


def test_a_replica_known_to_serve_the_position_is_preferred() -> None:
    cursor = Cursor(pack_sequence(1, 4))
    cursor.on_segments([sealed(1, 9)])
    cursor.on_position(1, B, 2, 0)
    cursor.on_position(1, C, 9, 0)
    cursor.on_replica_failed(1, A)
    assert cursor.next(0) == ReadFrom(1, C, 4)


def test_every_replica_of_a_sealed_segment_failing_is_data_loss_naming_the_range() -> None:
    cursor = Cursor(pack_sequence(2, 3))
    cursor.on_segments([sealed(2, 7)])
    for replica in (A, B, C):
        cursor.on_replica_failed(2, replica)
    assert cursor.next(0) == DataLoss(2, 3, 7)


def test_every_replica_of_the_open_segment_failing_waits_for_the_master() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)])
    for replica in (A, B, C):
        cursor.on_replica_failed(1, replica)
    assert cursor.next(0) == WaitForSegments()
    cursor.forget_failures()
    assert cursor.next(0) == ReadFrom(1, A, 1)


def test_a_replica_stalled_below_the_bridge_of_a_sealed_segment_is_abandoned() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)])
    assert cursor.next(0) == ReadFrom(1, A, 1)
    cursor.on_entries(1, [event(1)], 10)
    # The segment is sealed at 3 while A never got the bridge.
    cursor.on_segments([sealed(1, 3), open_segment(4)])
    assert cursor.next(10 + SEALED_REPLICA_STALL_MS - 1) == ReadFrom(1, A, 2)
    assert cursor.next(10 + SEALED_REPLICA_STALL_MS) == ReadFrom(1, B, 2)


def test_a_bridge_before_the_next_segment_is_listed_waits_then_enters_it() -> None:
    cursor = Cursor(0)
    cursor.on_segments([open_segment(1)])
    cursor.on_entries(1, [event(1), bridge(2)], 0)
    assert cursor.next(0) == WaitForSegments()
    cursor.on_segments([sealed(1, 2), open_segment(4)])
    assert cursor.next(0) == ReadFrom(4, A, 1)


def test_a_range_read_finishes_at_its_exclusive_end() -> None:
    cursor = Cursor(pack_sequence(1, 2), end_sequence=pack_sequence(1, 4))
    cursor.on_segments([sealed(1, 9)])
    events = cursor.on_entries(1, [event(2), event(3), event(4), event(5)], 0)
    assert [e.index for e in events] == [2, 3]
    assert cursor.next(0) == Finished()


def test_a_range_ending_in_a_later_segment_crosses_the_bridge() -> None:
    cursor = Cursor(0, end_sequence=pack_sequence(4, 2))
    cursor.on_segments([sealed(1, 2), open_segment(4)])
    assert [e.index for e in cursor.on_entries(1, [event(1), bridge(2)], 0)] == [1]
    assert [e.index for e in cursor.on_entries(4, [event(1, epoch=4), event(2, epoch=4)], 0)] == [1]
    assert cursor.next(0) == Finished()
