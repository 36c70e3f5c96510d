"""What the checkers count toward the documented loss of a store with fsync never
(`tests.sim.checkers.Checker`): an event its followers read counts as acked, whether
its writer ever told its user or not (the runtime world's seed 1126)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from streamengine.protocol.entry import EntryKind
from streamengine.protocol.sequence import pack_sequence
from streamengine.segment_store.core.commands import SegmentKey
from tests.sim.checkers import Checker

SEGMENT = SegmentKey(7, 1)


def holding_nothing() -> Any:
    """A restarted store's core as the checker reads it: it lost every segment."""
    return SimpleNamespace(catalog=SimpleNamespace(meta=lambda key: None))


def test_an_event_read_before_the_crash_and_lost_is_the_documented_loss() -> None:
    checker = Checker(SEGMENT.stream_id, append_timeout_ms=1000)
    checker.follower_event("f1", pack_sequence(1, 1), b"e1")
    checker.store_restarted("store1", holding_nothing(), True, {SEGMENT: 3})
    assert checker.unsynced_losses == [
        "store store1 lost 1/1, acked on its answer to a write it never synced (fsync never)"
    ]


def test_an_event_read_after_the_crash_inside_what_was_lost_is_the_documented_loss() -> None:
    checker = Checker(SEGMENT.stream_id, append_timeout_ms=1000)
    checker.store_restarted("store1", holding_nothing(), True, {SEGMENT: 3})
    assert checker.unsynced_losses == [], "nothing acked or read there yet"
    checker.follower_event("f1", pack_sequence(1, 2), b"e2")
    assert len(checker.unsynced_losses) == 1 and "lost 1/2" in checker.unsynced_losses[0]


def test_a_store_that_syncs_documents_nothing() -> None:
    checker = Checker(SEGMENT.stream_id, append_timeout_ms=1000)
    checker.follower_event("f1", pack_sequence(1, 1), b"e1")
    checker.store_restarted("store2", holding_nothing(), False, {SEGMENT: 3})
    checker.follower_event("f1", pack_sequence(1, 2), b"e2")
    assert checker.unsynced_losses == []


def holding(copies: dict[int, bytes]) -> Any:
    """A store's core as the checker reads it: SEGMENT, these events at these indexes."""
    entries = [SimpleNamespace(index=i, kind=EntryKind.EVENT, payload=p) for i, p in copies.items()]
    meta = SimpleNamespace(last_index=max(copies), acked_index=0, matched_index=max(copies))

    def read(key: SegmentKey, lo: int, hi: int) -> list[Any]:
        return [e for e in entries if lo <= e.index <= hi]

    return SimpleNamespace(
        catalog=SimpleNamespace(segments=lambda: [SEGMENT], meta=lambda key: meta),
        reader=SimpleNamespace(read=read),
    )


def test_a_served_copy_lost_to_an_older_synced_one_is_the_documented_loss() -> None:
    """Simulator seed 16769: the store held, unsynced, the copy readers were served at
    an index, over an older one it had synced; it came back with the older one."""
    checker = Checker(SEGMENT.stream_id, append_timeout_ms=1000)
    checker.follower_event("f1", pack_sequence(1, 1), b"e1")
    served = checker.served_copies(holding({1: b"e1"}))
    assert served == {SEGMENT: frozenset({1})}
    checker.store_restarted("store1", holding({1: b"e0"}), True, {}, served)
    assert checker.unsynced_losses == [
        "store store1 lost its copy of 1/1 that was served, an older one it had synced "
        "under it (fsync never)"
    ]


def test_a_stale_copy_it_held_all_along_is_no_loss() -> None:
    checker = Checker(SEGMENT.stream_id, append_timeout_ms=1000)
    checker.follower_event("f1", pack_sequence(1, 1), b"e1")
    served = checker.served_copies(holding({1: b"e0"}))
    checker.store_restarted("store1", holding({1: b"e0"}), True, {}, served)
    assert served == {SEGMENT: frozenset()} and checker.unsynced_losses == []
