"""What the checkers count toward the documented loss of a store with fsync never
(`tests.sim.checkers.Checker`): an event its followers read counts as acked, whether
its writer ever told its user or not (the runtime world's seed 1126)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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
