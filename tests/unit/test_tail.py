"""The store side of Subscribe (`segment_store.tail`): each rule of the live tail's
contract (docs/design.md, "Readers") as a table step."""

from __future__ import annotations

import ast
from pathlib import Path

from streamengine.segment_store.core import tail
from streamengine.segment_store.core.tail import (
    SILENT_INTERVALS_MAX,
    Drop,
    Position,
    ReadBatch,
    SendKeepalive,
    SendPosition,
    TailSettings,
    TailStream,
    WaitUntil,
)

SETTINGS = TailSettings(batch_entries=2, keepalive_ms=100, buffer_messages=3, stall_ms=500)


def test_the_position_comes_first_then_batches_up_to_the_acked_index() -> None:
    stream = TailStream(2, SETTINGS, 0)
    position = Position(acked_index=5, fence=3, bridge_index=0)
    assert stream.step(position, 0, 0) == SendPosition(position)
    read = stream.step(position, 1, 0)
    assert read == ReadBatch(2, 5, 2)
    assert isinstance(read, ReadBatch)
    stream.on_read(read, 3, 0)
    assert stream.step(position, 2, 0) == ReadBatch(4, 5, 2)


def test_a_changed_position_is_sent_once_caught_up() -> None:
    stream = TailStream(1, SETTINGS, 0)
    assert stream.step(Position(0, 3, 0), 0, 0) == SendPosition(Position(0, 3, 0))
    sealed = Position(0, 4, 0)
    assert stream.step(sealed, 0, 10) == SendPosition(sealed)
    assert stream.step(sealed, 0, 10) == WaitUntil(10 + SETTINGS.keepalive_ms)


def test_a_keepalive_goes_out_after_an_interval_with_nothing_sent() -> None:
    stream = TailStream(1, SETTINGS, 0)
    position = Position(0, 3, 0)
    stream.step(position, 0, 0)
    assert stream.step(position, 0, 99) == WaitUntil(100)
    assert stream.step(position, 0, 100) == SendKeepalive()
    stream.on_heard(100)
    assert stream.step(position, 0, 100) == WaitUntil(200)


def test_a_silent_subscriber_is_dropped_after_its_intervals() -> None:
    stream = TailStream(1, SETTINGS, 0)
    position = Position(0, 3, 0)
    stream.step(position, 0, 0)
    silent_ms = SILENT_INTERVALS_MAX * SETTINGS.keepalive_ms
    assert not isinstance(stream.step(position, 0, silent_ms), Drop)
    dropped = stream.step(position, 0, silent_ms + 1)
    assert isinstance(dropped, Drop) and dropped.reason == "silent"


def test_a_full_buffer_waits_then_drops_a_slow_subscriber() -> None:
    settings = TailSettings(batch_entries=2, keepalive_ms=1000, buffer_messages=3, stall_ms=500)
    stream = TailStream(1, settings, 0)
    position = Position(9, 3, 0)
    stream.step(position, 0, 0)
    assert stream.step(position, 3, 100) == WaitUntil(100 + settings.stall_ms)
    # Room again: the stall starts over.
    assert stream.step(position, 2, 300) == ReadBatch(1, 9, 2)
    assert stream.step(position, 3, 350) == WaitUntil(350 + settings.stall_ms)
    assert stream.step(position, 3, 849) == WaitUntil(850)
    dropped = stream.step(position, 3, 850)
    assert isinstance(dropped, Drop) and dropped.reason == "slow"
    assert "resume from the last token" in dropped.detail


def test_what_a_subscriber_asks_for_is_bounded() -> None:
    asked = TailSettings.asked(batch_entries=0, keepalive_ms=1, entries_max=1000)
    assert asked.batch_entries == tail.BATCH_ENTRIES_DEFAULT
    assert asked.keepalive_ms == tail.KEEPALIVE_MS_MIN
    assert TailSettings.asked(10**6, 10**9, 100).batch_entries == 100
    assert TailSettings.asked(10**6, 10**9, 100).keepalive_ms == tail.KEEPALIVE_MS_MAX


def test_the_tail_core_does_no_io() -> None:
    tree = ast.parse(Path(tail.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert imported <= {"__future__", "dataclasses"}, imported


def test_a_segment_tail_sends_its_position_then_reads_and_waits_for_a_change() -> None:
    segment = tail.SegmentTail(1, batch_entries=2)
    position = Position(acked_index=3, fence=3, bridge_index=0)
    assert segment.step(position) == SendPosition(position)
    read = segment.step(position)
    assert read == ReadBatch(1, 3, 2)
    assert isinstance(read, ReadBatch)
    assert segment.on_read(read, 2)
    assert segment.step(position) == ReadBatch(3, 3, 2)
    segment.on_read(ReadBatch(3, 3, 2), 3)
    assert segment.step(position) is None  # caught up: nothing until the segment changes
    sealed = Position(acked_index=3, fence=4, bridge_index=0)
    assert segment.step(sealed) == SendPosition(sealed)


def test_a_call_of_many_tails_keeps_alive_and_drops_as_one() -> None:
    liveness = tail.CallLiveness(SETTINGS, 0)
    assert liveness.check(0, 0) is None
    assert liveness.idle(50) == WaitUntil(SETTINGS.keepalive_ms)
    liveness.on_sent(50)  # a tail's batch counts as sending: no keepalive due yet
    assert liveness.idle(100) == WaitUntil(150)
    assert liveness.idle(150) == SendKeepalive()
    # A full buffer waits for room, then drops the whole call as too slow.
    liveness.on_heard(200)
    full = SETTINGS.buffer_messages
    assert liveness.check(full - 1, 200) is None
    assert isinstance(liveness.check(full, 200), WaitUntil)
    liveness.on_heard(200 + SETTINGS.stall_ms)  # heard, yet reading nothing
    dropped = liveness.check(full, 200 + SETTINGS.stall_ms)
    assert isinstance(dropped, Drop) and dropped.reason == "slow"
