"""The segment store's rules (docs/design.md, "The segment store"), each test named
after the rule it checks, over MemoryKV (and RocksKV where durability is the point)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from streamengine.protocol.entry import (
    CorruptEntry,
    EntryKind,
    PackedEntries,
    StoredEntry,
    encode_value,
)
from streamengine.protocol.limits import (
    EVENT_BYTES_MAX,
    INDEX_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
    WRITE_REQUEST_PARTS_MAX,
)
from streamengine.segment_store.core import copy as copy_rules
from streamengine.segment_store.core.catalog import SegmentStateInfo
from streamengine.segment_store.core.commands import (
    DeleteCommand,
    DropCopiesCommand,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.errors import (
    BadRequest,
    BelowFence,
    ConflictingCopy,
    CopyMismatch,
    CopyRefused,
    SegmentNotFound,
    StoredCopyCorrupt,
)
from streamengine.segment_store.core.keys import entry_key, segment_entries_range
from streamengine.segment_store.core.kv import KV, Delete, DeleteRange, Put
from streamengine.segment_store.kv import BLOCK_BYTES, MemoryKV, RocksKV
from tests.store_commands import CommandedCore

SEG = SegmentKey(7, 3)
EVENT, HOLE, BRIDGE = EntryKind.EVENT, EntryKind.HOLE, EntryKind.BRIDGE


def ev(index: int, epoch: int = 3, payload: bytes | None = None) -> StoredEntry:
    return StoredEntry.make(index, EVENT, epoch, payload if payload is not None else b"e%d" % index)


def events(first: int, last: int, epoch: int = 3) -> list[StoredEntry]:
    return [ev(i, epoch) for i in range(first, last + 1)]


def snapshot(kv: KV) -> list[tuple[bytes, bytes]]:
    return kv.scan(b"", b"\xff")


@pytest.fixture
def core() -> CommandedCore:
    return CommandedCore(MemoryKV())


# ---- fencing ----


def test_write_below_fence_is_refused_with_the_fence_and_writes_nothing(
    core: CommandedCore,
) -> None:
    core.write(SEG, 3, 0, events(1, 2))
    core.seal(SEG, 5)
    before = snapshot(core.kv)
    with pytest.raises(BelowFence) as refused:
        core.write(SEG, 4, 2, events(3, 4, epoch=4))
    assert refused.value.fence == 5
    assert snapshot(core.kv) == before
    assert core.catalog.state(SEG).matched_index == 2 and core.catalog.state(SEG).acked_index == 0


def test_a_busy_refusal_below_the_fence_is_the_fence_not_a_matched_index(
    core: CommandedCore,
) -> None:
    # Simulator seed 10179: a recovery at epoch 5 wrote up to 4; a waking leader of
    # epoch 3 must not read matched 4 as its own entries held.
    core.write(SEG, 3, 0, events(1, 2))
    core.seal(SEG, 5)
    core.write(SEG, 5, 0, events(3, 4, epoch=5))
    refused = core.refused_busy(WriteCommand.of(SEG, 3, 0, events(3, 3)))
    assert isinstance(refused, BelowFence) and refused.fence == 5
    # At or above the fence it says what the segment holds, and writes nothing.
    before = snapshot(core.kv)
    held = core.refused_busy(WriteCommand.of(SEG, 5, 0, events(5, 5, epoch=5)))
    assert isinstance(held, WriteResult) and (held.matched_index, held.fence) == (4, 5)
    assert snapshot(core.kv) == before


def test_write_at_the_fence_epoch_is_accepted(core: CommandedCore) -> None:
    core.seal(SEG, 5)
    assert core.write(SEG, 5, 0, events(1, 1, epoch=5)).matched_index == 1


@pytest.mark.parametrize(
    ("seals", "expected_fence"),
    [([4], 4), ([4, 4], 4), ([4, 6], 6), ([2, 9, 9], 9)],
)
def test_seal_raises_the_fence_and_equal_is_idempotent(
    core: CommandedCore, seals: list[int], expected_fence: int
) -> None:
    for epoch in seals:
        result = core.seal(SEG, epoch)
    assert result.fence == expected_fence
    assert core.catalog.state(SEG).fence == expected_fence


def test_seal_below_the_fence_is_refused_and_never_lowers_it(core: CommandedCore) -> None:
    core.seal(SEG, 6)
    with pytest.raises(BelowFence) as refused:
        core.seal(SEG, 5)
    assert refused.value.fence == 6
    assert core.catalog.state(SEG).fence == 6


def test_seal_answers_acked_matched_and_last_index(core: CommandedCore) -> None:
    core.write(SEG, 3, 0, events(1, 3))
    core.write(SEG, 3, 2, events(5, 6))
    result = core.seal(SEG, 4)
    assert (result.fence, result.acked_index, result.matched_index, result.last_index) == (
        4,
        2,
        3,
        6,
    )


def test_seal_of_an_unknown_segment_creates_it_empty_with_that_fence(
    core: CommandedCore,
) -> None:
    result = core.seal(SEG, 8)
    assert (result.fence, result.acked_index, result.matched_index, result.last_index) == (
        8,
        0,
        0,
        0,
    )
    assert core.catalog.segments() == [SEG]


def test_write_to_an_unknown_segment_creates_it_with_fence_zero(core: CommandedCore) -> None:
    result = core.write(SEG, 3, 0, events(1, 1))
    assert result.fence == 0 and core.catalog.state(SEG).fence == 0


# ---- the overwrite rule ----


@pytest.mark.parametrize(
    ("stored_epoch", "sent_epoch", "held_epoch"),
    [
        (3, 4, 4),  # a recovery copy replaces an older one
        (5, 4, 5),  # a lower-epoch copy never replaces a higher one
        (2, 9, 9),
    ],
)
def test_a_copy_replaces_a_stored_one_only_if_its_epoch_is_not_lower(
    core: CommandedCore, stored_epoch: int, sent_epoch: int, held_epoch: int
) -> None:
    core.write(SEG, stored_epoch, 0, [ev(1, stored_epoch, b"old")])
    result = core.write(SEG, 9, 0, [ev(1, sent_epoch, b"new")])
    assert result.held_epochs == (held_epoch,)
    (held,) = core.reader.read(SEG, 1, 1)
    assert held.epoch == held_epoch
    assert held.payload == (b"new" if sent_epoch >= stored_epoch else b"old")


# Held: 1..2 at epoch 3, acked through 2 ("e1", "e2").
@pytest.mark.parametrize(
    ("rule", "writer_epoch", "batch", "refused"),
    [
        ("a retransmission carries identical bytes: accepted", 3, [ev(1), ev(2)], False),
        (
            "other bytes at the writer's epoch, at an acked index: refused",
            3,
            [ev(1, 3, b"TAMPERED")],
            True,
        ),
        (
            "one conflicting entry refuses the whole batch, appends included",
            3,
            [ev(1), ev(2, 3, b"TAMPERED"), ev(3)],
            True,
        ),
        (
            "other bytes under a copy epoch below the writer's: refused as well",
            4,
            [ev(1, 3, b"TAMPERED")],
            True,
        ),
        ("a recovery copy of a higher epoch replaces it", 4, [ev(1, 4, b"recovered")], False),
    ],
)
def test_a_copy_held_at_its_epoch_is_never_replaced_by_other_bytes(
    core: CommandedCore, rule: str, writer_epoch: int, batch: list[StoredEntry], refused: bool
) -> None:
    core.write(SEG, 3, 2, events(1, 2))
    before = snapshot(core.kv)
    meta = core.catalog.meta(SEG)
    if refused:
        with pytest.raises(ConflictingCopy) as error:
            core.write(SEG, writer_epoch, 2, batch)
        assert (error.value.epoch, snapshot(core.kv), core.catalog.meta(SEG)) == (
            3,
            before,
            meta,
        ), rule
        assert [e.payload for e in core.reader.read(SEG, 1)] == [b"e1", b"e2"], rule
    else:
        core.write(SEG, writer_epoch, 2, batch)
        assert [e.payload for e in core.reader.read(SEG, 1, 1)] == [batch[0].payload], rule


def test_a_plan_refuses_other_bytes_for_a_copy_an_earlier_command_wrote(
    core: CommandedCore,
) -> None:
    plan = core.plan(
        [
            WriteCommand.of(SEG, 3, 0, events(1, 2)),
            WriteCommand.of(SEG, 3, 0, [ev(2)]),
            WriteCommand.of(SEG, 3, 0, [ev(2, 3, b"other")]),
        ]
    )
    core.apply(plan)
    assert isinstance(plan.outcomes[1], WriteResult)
    assert isinstance(plan.outcomes[2], ConflictingCopy)
    assert [e.payload for e in core.reader.read(SEG, 1)] == [b"e1", b"e2"]


def test_keeping_a_higher_epoch_copy_is_success_saying_what_is_held(
    core: CommandedCore,
) -> None:
    core.write(SEG, 5, 0, [StoredEntry.make(2, HOLE, 5)])
    result = core.write(SEG, 6, 0, [ev(1, 4), ev(2, 4), ev(3, 6)])
    assert result.held_epochs == (4, 5, 6)
    assert result.matched_index == 3
    assert [e.kind for e in core.reader.read(SEG, 1)] == [EVENT, HOLE, EVENT]


def test_a_bridge_replaced_by_a_higher_epoch_copy_is_forgotten(core: CommandedCore) -> None:
    core.write(SEG, 4, 0, [StoredEntry.make(1, BRIDGE, 4)])
    core.write(SEG, 5, 1, [ev(1, 5), StoredEntry.make(2, BRIDGE, 5)])
    assert core.catalog.meta(SEG) is not None and core.catalog.meta(SEG).bridges == (2,)  # type: ignore[union-attr]
    assert core.catalog.state(SEG).bridge_index == 0  # acked 1 does not cover the bridge
    core.write(SEG, 5, 2, [])
    assert core.catalog.state(SEG).bridge_index == 2


def test_a_stale_copy_past_the_bridge_goes_once_the_acked_index_reaches_it(
    core: CommandedCore,
) -> None:
    """S3 seed 1 of the fault suite: a paused leader (epoch 3) wrote 70-71 here alone;
    the recovery at epoch 4, decided elsewhere, bridges this store late at 70."""
    core.write(SEG, 3, 69, events(1, 71))
    core.seal(SEG, 4)
    late = core.write(SEG, 4, 69, [StoredEntry.make(70, BRIDGE, 4)])
    assert (late.matched_index, late.acked_index) == (71, 69)
    assert core.catalog.meta(SEG).last_index == 71  # type: ignore[union-attr]
    kept_bytes = sum(len(e.payload) for e in events(1, 69))
    raised = core.write(SEG, 4, 70, [])
    assert (raised.matched_index, raised.acked_index) == (70, 70)
    state = core.catalog.state(SEG)
    assert (state.last_index, state.bridge_index, state.bytes) == (70, 70, kept_bytes)
    assert [e.index for e in core.reader.read(SEG, 1)] == list(range(1, 71))
    # A copy that arrives past the final bridge later goes in the batch that wrote it.
    again = core.write(SEG, 4, 70, [ev(71, 4)])
    assert (again.matched_index, again.acked_index) == (70, 70)
    assert core.catalog.state(SEG).last_index == 70
    assert [e.index for e in core.reader.read(SEG, 60)] == list(range(60, 71))


def test_a_plan_counts_what_an_earlier_command_dropped_past_the_bridge_as_gone(
    core: CommandedCore,
) -> None:
    core.write(SEG, 3, 0, events(1, 5))
    plan = core.plan(
        [
            WriteCommand.of(SEG, 4, 2, (ev(1, 4), StoredEntry.make(2, BRIDGE, 4))),
            WriteCommand.of(SEG, 4, 2, (ev(3, 4),)),  # past the final bridge: dropped too
        ]
    )
    core.apply(plan)
    state = core.catalog.state(SEG)
    assert (state.last_index, state.matched_index, state.acked_index) == (2, 2, 2)
    assert state.bytes == len(ev(1, 4).payload)
    assert [e.index for e in core.reader.read(SEG, 1)] == [1, 2]
    assert CommandedCore(core.kv).catalog.state(SEG) == state  # what a restart finds


def test_copies_past_a_bridge_the_acked_index_has_not_reached_stay(
    core: CommandedCore,
) -> None:
    """An unacked bridge may still be replaced by a later recovery's choice."""
    core.write(SEG, 4, 1, [ev(1, 4), StoredEntry.make(2, BRIDGE, 4), ev(3, 3)])
    assert core.catalog.state(SEG).last_index == 3


# ---- matched index: gaps and retransmission ----


@pytest.mark.parametrize(
    ("batches", "matched_after_each"),
    [
        ([(1, 3), (4, 6)], [3, 6]),
        ([(4, 6), (1, 3)], [0, 6]),  # above a gap, then the gap fills
        ([(1, 2), (5, 6), (8, 9), (3, 4)], [2, 2, 2, 6]),  # fills up to the next gap
        ([(1, 2), (5, 6), (8, 9), (3, 4), (7, 7)], [2, 2, 2, 6, 9]),
        ([(1, 5), (3, 7)], [5, 7]),  # overlapping retransmission
        ([(1, 5), (1, 5), (2, 3)], [5, 5, 5]),  # pure retransmission
        ([(2, 2)], [0]),
    ],
)
def test_matched_index_is_the_largest_m_with_every_index_up_to_m_held(
    core: CommandedCore, batches: list[tuple[int, int]], matched_after_each: list[int]
) -> None:
    seen = [core.write(SEG, 3, 0, events(first, last)).matched_index for first, last in batches]
    assert seen == matched_after_each
    assert core.catalog.state(SEG).matched_index == matched_after_each[-1]


def test_retransmission_counts_bytes_and_entries_once(core: CommandedCore) -> None:
    core.write(SEG, 3, 0, events(1, 4))
    once = core.catalog.meta(SEG)
    core.write(SEG, 3, 0, events(1, 4))
    assert core.catalog.meta(SEG) == once
    assert core.catalog.state(SEG).bytes == sum(len(e.payload) for e in events(1, 4))


def test_a_hole_filled_by_recovery_after_a_stale_copy_above_matches_through(
    core: CommandedCore,
) -> None:
    # RECOVERY-CASES B2 (fixed), store C: [. e2@1] receives BR@2 at 1 -> matched 2.
    core.write(SEG, 1, 0, [ev(2, 1)])
    result = core.write(SEG, 2, 0, [StoredEntry.make(1, BRIDGE, 2)])
    assert result.matched_index == 2


# ---- acked index ----


@pytest.mark.parametrize(
    ("writes", "acked_after_each"),
    [
        ([((1, 3), 2)], [2]),
        ([((1, 3), 9)], [3]),  # clamped to matched
        ([((1, 3), 3), ((4, 4), 1)], [3, 3]),  # never lowered
        ([((2, 5), 5)], [0]),  # a gap at 1: nothing is matched
        ([((1, 2), 0), ((4, 5), 5), ((3, 3), 4)], [0, 2, 4]),
        ([((1, 2), 2), ((0, -1), 9)], [2, 2]),  # empty batch carries only the acked index
    ],
)
def test_acked_index_is_the_leaders_clamped_to_matched_and_never_lowered(
    core: CommandedCore,
    writes: list[tuple[tuple[int, int], int]],
    acked_after_each: list[int],
) -> None:
    seen = [core.write(SEG, 3, acked, events(*span)).acked_index for span, acked in writes]
    assert seen == acked_after_each


def test_an_empty_write_raises_acked_up_to_matched(core: CommandedCore) -> None:
    core.write(SEG, 3, 0, events(1, 4))
    assert core.write(SEG, 3, 3, []).acked_index == 3


# ---- bad input changes nothing ----


def _bad_crc() -> StoredEntry:
    good = ev(1)
    return StoredEntry(good.index, good.kind, good.epoch, good.payload, good.crc32c ^ 1)


def _unknown_kind() -> StoredEntry:
    return StoredEntry(1, 9, 3, b"", 0)  # type: ignore[arg-type]


BAD_WRITES: list[tuple[str, Callable[[], WriteCommand]]] = [
    (
        "a value shorter than its header",
        lambda: WriteCommand(SEG, 3, 0, PackedEntries(1, [b"\x01"])),
    ),
    (
        "a value with a header only and a bad crc",
        lambda: WriteCommand(SEG, 3, 0, PackedEntries(1, [encode_value(EVENT, 3, 0, b"")])),
    ),
    ("index zero", lambda: WriteCommand.of(SEG, 3, 0, [StoredEntry.make(0, EVENT, 3, b"x")])),
    (
        "an index past the last",
        lambda: WriteCommand.of(SEG, 3, 0, [StoredEntry.make(INDEX_MAX + 1, EVENT, 3, b"x")]),
    ),
    ("bad crc", lambda: WriteCommand.of(SEG, 3, 0, [_bad_crc()])),
    ("unknown kind", lambda: WriteCommand.of(SEG, 3, 0, [_unknown_kind()])),
    (
        "payload on a hole",
        lambda: WriteCommand.of(SEG, 3, 0, [StoredEntry(1, HOLE, 3, b"x", 0)]),
    ),
    (
        "entry over the size limit",
        lambda: WriteCommand.of(SEG, 3, 0, [ev(1, 3, b"x" * (EVENT_BYTES_MAX + 1))]),
    ),
    (
        "too many entries",
        lambda: WriteCommand.of(SEG, 3, 0, [ev(i) for i in range(1, WRITE_BATCH_ENTRIES_MAX + 2)]),
    ),
    (
        "batch over the byte limit",
        lambda: WriteCommand.of(
            SEG, 3, 0, [ev(i, 3, b"y" * EVENT_BYTES_MAX) for i in range(1, 10)]
        ),
    ),
    ("copy epoch above the writer epoch", lambda: WriteCommand.of(SEG, 3, 0, [ev(1, 4)])),
    ("writer epoch zero", lambda: WriteCommand.of(SEG, 0, 0, [])),
    ("missing stream id", lambda: WriteCommand.of(SegmentKey(0, 3), 3, 0, [ev(1)])),
    ("missing segment epoch", lambda: WriteCommand.of(SegmentKey(7, 0), 3, 0, [ev(1)])),
]


@pytest.mark.parametrize(("case", "make"), BAD_WRITES, ids=[c for c, _ in BAD_WRITES])
def test_a_malformed_write_is_refused_and_changes_nothing(
    core: CommandedCore, case: str, make: Callable[[], WriteCommand]
) -> None:
    core.write(SEG, 3, 1, events(1, 1))
    before, meta = snapshot(core.kv), core.catalog.meta(SEG)
    plan = core.plan([make()])
    assert isinstance(plan.outcomes[0], BadRequest), case
    core.apply(plan)
    assert snapshot(core.kv) == before and core.catalog.meta(SEG) == meta


@pytest.mark.parametrize("epoch", [0, 1 << 31])
def test_a_malformed_seal_is_refused(core: CommandedCore, epoch: int) -> None:
    with pytest.raises(BadRequest):
        core.seal(SEG, epoch)
    assert core.catalog.segments() == []


# ---- plans: group commit of several commands ----


def test_a_plan_sees_the_effects_of_its_earlier_commands(core: CommandedCore) -> None:
    other = SegmentKey(8, 1)
    plan = core.plan(
        [
            WriteCommand.of(SEG, 3, 0, events(1, 2)),
            WriteCommand.of(other, 1, 0, events(1, 1, epoch=1)),
            WriteCommand.of(SEG, 3, 0, [ev(2, 2)]),  # below the copy the plan just wrote
            WriteCommand.of(SEG, 3, 3, events(3, 4)),
            SealCommand(SEG, 4),
            WriteCommand.of(SEG, 3, 0, events(5, 5)),  # fenced by the seal above
        ]
    )
    core.apply(plan)
    outcomes = plan.outcomes
    assert outcomes[2].held_epochs == (3,)  # type: ignore[union-attr]
    assert outcomes[3].matched_index == 4 and outcomes[3].acked_index == 3  # type: ignore[union-attr]
    assert isinstance(outcomes[5], BelowFence)
    assert core.catalog.state(SEG).fence == 4 and core.catalog.state(SEG).last_index == 4
    assert core.catalog.state(other).matched_index == 1


def test_a_plan_is_invisible_until_published(core: CommandedCore) -> None:
    plan = core.plan([WriteCommand.of(SEG, 3, 1, events(1, 2))])
    core.write_plan(plan, sync=True)
    with pytest.raises(SegmentNotFound):
        core.catalog.state(SEG)
    core.publish(plan)
    assert core.catalog.state(SEG).acked_index == 1


def test_delete_then_write_in_one_plan_starts_the_segment_afresh(core: CommandedCore) -> None:
    core.write(SEG, 3, 0, events(1, 5))
    plan = core.plan(
        [
            WriteCommand.of(SEG, 3, 0, events(6, 6)),
            SealCommand(SEG, 4),
        ]
    )
    core.apply(plan)
    plan = core.plan([DeleteCommand(SEG), WriteCommand.of(SEG, 1, 0, [ev(2, 1)])])
    core.apply(plan)
    assert core.catalog.state(SEG).matched_index == 0 and core.catalog.state(SEG).fence == 0
    assert [e.index for e in core.reader.read(SEG, 1)] == [2]


# ---- reads, digest, delete ----


def test_read_returns_held_entries_in_order_and_acked_only_stops_at_acked(
    core: CommandedCore,
) -> None:
    core.write(SEG, 3, 0, events(1, 3))
    core.write(SEG, 3, 2, events(5, 6))
    assert [e.index for e in core.reader.read(SEG, 1)] == [1, 2, 3, 5, 6]
    assert [e.index for e in core.reader.read(SEG, 2, 5)] == [2, 3, 5]
    assert [e.index for e in core.reader.read(SEG, 1, 0, acked_only=True)] == [1, 2]
    assert [e.index for e in core.reader.read(SEG, 1, limit=2)] == [1, 2]
    assert core.reader.read(SEG, 7) == []
    assert core.reader.read(SEG, 1)[0] == ev(1)


def stored(entries: list[StoredEntry]) -> list[bytes]:
    return [encode_value(e.kind, e.epoch, e.crc32c, e.payload) for e in entries]


def test_read_run_serves_consecutive_values_cut_by_limit_bytes_and_the_first_gap(
    core: CommandedCore,
) -> None:
    core.write(SEG, 3, 0, events(1, 6))
    core.write(SEG, 3, 0, events(8, 9))
    assert core.catalog.state(SEG).matched_index == 6
    assert core.reader.read_run(SEG, 1, 9, 100, 0) == stored(events(1, 6))
    assert core.reader.read_run(SEG, 2, 4, 100, 0) == stored(events(2, 4))
    assert core.reader.read_run(SEG, 1, 9, 2, 0) == stored(events(1, 2))
    one_value = len(stored([ev(1)])[0])
    assert core.reader.read_run(SEG, 1, 9, 100, one_value + 1) == stored(events(1, 2))
    assert core.reader.read_run(SEG, 5, 9, 100, 0) == stored(events(5, 6))
    assert core.reader.read_run(SEG, 7, 9, 100, 0) == []
    assert core.reader.read_run(SEG, 8, 20, 100, 0) == stored(events(8, 9))
    assert core.reader.read_run(SEG, 10, 20, 100, 0) == []


def test_read_run_never_shifts_values_when_an_entry_below_matched_is_gone(
    core: CommandedCore,
) -> None:
    core.write(SEG, 3, 0, events(1, 6))
    core.kv.write([Delete(entry_key(SEG.stream_id, SEG.epoch, 3))], sync=True)
    assert core.reader.read_run(SEG, 1, 6, 100, 0) == stored(events(1, 2))
    assert core.reader.read_run(SEG, 4, 6, 100, 0) == stored(events(4, 6))


def test_read_of_a_segment_not_held_is_not_found(core: CommandedCore) -> None:
    with pytest.raises(SegmentNotFound):
        core.reader.read(SEG, 1)


def test_digest_differs_when_replicas_differ_anywhere(core: CommandedCore) -> None:
    twin = CommandedCore(MemoryKV())
    for store in (core, twin):
        store.write(SEG, 3, 3, events(1, 3))
    assert core.reader.digest(SEG, 3) == twin.reader.digest(SEG, 3)
    assert core.reader.digest(SEG).up_to_index == 3  # 0: up to the acked index
    twin.write(SEG, 4, 3, [StoredEntry.make(2, HOLE, 4)])
    assert core.reader.digest(SEG, 3).digest != twin.reader.digest(SEG, 3).digest
    gap = CommandedCore(MemoryKV())
    gap.write(SEG, 3, 0, [ev(1), ev(2)])
    gap.write(SEG, 3, 0, [ev(4)])
    full = CommandedCore(MemoryKV())
    full.write(SEG, 3, 0, events(1, 4))
    assert gap.reader.digest(SEG, 4).entries_held == 3
    assert gap.reader.digest(SEG, 4).digest != full.reader.digest(SEG, 4).digest
    # The copy's epoch is not content: a recovery rewrite keeps the digest.
    rewritten = CommandedCore(MemoryKV())
    rewritten.write(SEG, 5, 0, [e.with_epoch(5) for e in events(1, 4)])
    assert rewritten.reader.digest(SEG, 4).digest == full.reader.digest(SEG, 4).digest


def test_delete_removes_entries_and_metadata(core: CommandedCore) -> None:
    core.write(SEG, 3, 1, events(1, 3))
    core.write(SegmentKey(7, 4), 4, 0, events(1, 1, epoch=4))
    assert core.delete(SEG) is True
    assert core.delete(SEG) is False
    assert core.catalog.segments() == [SegmentKey(7, 4)]
    assert core.kv.scan(*segment_entries_range(SEG.stream_id, SEG.epoch)) == []


# ---- segment copy (CopySegment's steps, copy_rules) ----


def _copy_source() -> CommandedCore:
    """Epoch 3 acked 1..4; recovery at 4 put a hole at 5 and the bridge at 6; sealed at 4."""
    source = CommandedCore(MemoryKV())
    source.write(SEG, 3, 4, events(1, 4))
    source.write(SEG, 4, 6, [StoredEntry.make(5, HOLE, 4), StoredEntry.make(6, BRIDGE, 4)])
    source.seal(SEG, 4)
    return source


def _run_copy(source: CommandedCore, target: CommandedCore) -> int:
    """The copy's steps up to, not including, the confirmation; returns its fence."""
    info = source.catalog.state(SEG)
    local = target.catalog.meta(SEG)
    fence = copy_rules.copy_fence(
        SEG, 6, info.fence, info.acked_index, 4, local.fence if local else 0
    )
    target.execute(copy_rules.fence_command(SEG, fence))
    copied = PackedEntries.of(source.reader.read(SEG, 1, 6))
    target.execute(copy_rules.write_command(SEG, fence, copied))
    copy_rules.verify(SEG, 6, target.reader.digest(SEG, 6), source.reader.digest(SEG, 6).digest)
    return fence


def test_a_copy_is_fenced_first_and_raises_no_acked_index_before_it_is_confirmed(
    core: CommandedCore,
) -> None:
    source = _copy_source()
    core.write(SEG, 3, 2, events(1, 3))  # missed the bridge
    core.write(SEG, 3, 2, [ev(5, payload=b"stale")])
    fence = _run_copy(source, core)
    assert fence == 4 and core.catalog.state(SEG).fence == 4
    assert core.catalog.state(SEG).acked_index == 2, "verified is not yet confirmed"
    with pytest.raises(BelowFence):  # the old leader, delayed
        core.write(SEG, 3, 6, [ev(5, payload=b"late")])
    confirmed = core.confirm_copy(SEG, fence, 6)
    assert (confirmed.acked_index, core.catalog.state(SEG).bridge_index) == (6, 6)
    assert core.reader.read(SEG, 1, acked_only=True) == source.reader.read(SEG, 1, 6)


def test_a_copy_is_confirmed_only_while_it_holds_its_fence_and_every_index(
    core: CommandedCore,
) -> None:
    source = _copy_source()
    fence = _run_copy(source, core)
    core.delete(SEG)  # a delete in between drops the fence with the copy
    with pytest.raises(CopyRefused):
        core.confirm_copy(SEG, fence, 6)
    core.write(SEG, 4, 0, events(1, 3, epoch=4))
    core.seal(SEG, 4)
    with pytest.raises(CopyRefused):  # fenced again, but short of the final index
        core.confirm_copy(SEG, fence, 6)
    assert core.catalog.state(SEG).acked_index == 0


def test_the_copy_op_fences_copies_verifies_then_confirms(core: CommandedCore) -> None:
    """`CopyOp`, which the store's copy client and the simulated store both run: its
    actions in order, against real cores, and nothing served before the confirmation."""
    source = _copy_source()
    core.write(SEG, 3, 2, events(1, 3))  # missed the bridge
    op = copy_rules.CopyOp(SEG, "source:1", 6, requested_fence=4)
    assert op.start() == copy_rules.AskSourceState()
    info = source.catalog.state(SEG)
    fence_action = op.source_state(info.fence, info.acked_index, core.catalog.state(SEG).fence)
    assert fence_action == copy_rules.Submit(copy_rules.fence_command(SEG, 4))
    assert isinstance(fence_action, copy_rules.Submit)
    read = op.submitted(core.execute(fence_action.command))
    assert read == copy_rules.ReadSource(1, 6)
    for batch in (source.reader.read(SEG, 1, 3), source.reader.read(SEG, 4, 6)):
        write = op.source_entries(PackedEntries.of(batch))
        assert isinstance(write, copy_rules.Submit)
        assert op.submitted(core.execute(write.command)) is None
        assert core.catalog.state(SEG).acked_index == 2, "nothing new served before confirmation"
    assert op.source_read_ended() == copy_rules.AskDigests(6)
    confirm = op.digests(core.reader.digest(SEG, 6), source.reader.digest(SEG, 6).digest)
    assert isinstance(confirm, copy_rules.Submit)
    finished = op.submitted(core.execute(confirm.command))
    assert isinstance(finished, copy_rules.Finished)
    assert (finished.entries_copied, finished.acked_index) == (6, 6)
    assert core.reader.read(SEG, 1, acked_only=True) == source.reader.read(SEG, 1, 6)


def test_the_copy_op_leaves_a_copy_that_differs_unconfirmed(core: CommandedCore) -> None:
    source = _copy_source()
    op = copy_rules.CopyOp(SEG, "source:1", 6, requested_fence=4)
    op.start()
    info = source.catalog.state(SEG)
    fence_action = op.source_state(info.fence, info.acked_index, 0)
    assert isinstance(fence_action, copy_rules.Submit)
    op.submitted(core.execute(fence_action.command))
    # The reply lost its last entry.
    write = op.source_entries(PackedEntries.of(source.reader.read(SEG, 1, 5)))
    assert isinstance(write, copy_rules.Submit)
    op.submitted(core.execute(write.command))
    op.source_read_ended()
    with pytest.raises(CopyMismatch):
        op.digests(core.reader.digest(SEG, 6), source.reader.digest(SEG, 6).digest)
    assert core.catalog.state(SEG).acked_index == 0


def test_a_copy_never_lowers_the_fence_and_needs_a_sealed_source_acked_to_the_end(
    core: CommandedCore,
) -> None:
    assert copy_rules.copy_fence(SEG, 6, 4, 6, 4, local_fence=9) == 9
    assert copy_rules.copy_fence(SEG, 6, 4, 6, 5, local_fence=0) == 5
    with pytest.raises(CopyRefused):
        copy_rules.copy_fence(SEG, 6, SEG.epoch, 6, 4, 0)  # not sealed on the source
    with pytest.raises(CopyRefused):
        copy_rules.copy_fence(SEG, 6, 4, 5, 4, 0)  # the source never acked the bridge


def test_a_copy_differing_from_its_source_is_a_mismatch_and_stays_unconfirmed(
    core: CommandedCore,
) -> None:
    source = _copy_source()
    core.write(SEG, 5, 0, [ev(2, epoch=5, payload=b"higher")])  # kept by the overwrite rule
    with pytest.raises(CopyMismatch):
        _run_copy(source, core)
    assert core.catalog.state(SEG).acked_index == 0


def _refill_in_place(source: CommandedCore, target: CommandedCore) -> list[object]:
    """A copy with `replace_held` through `CopyOp`, against real cores; its actions."""
    op = copy_rules.CopyOp(SEG, "source:1", 6, requested_fence=4, replace_held=True)
    actions: list[object] = [op.start()]
    info = source.catalog.state(SEG)
    local = target.catalog.meta(SEG)
    action: copy_rules.CopyAction | None = op.source_state(
        info.fence, info.acked_index, local.fence if local else 0
    )
    while isinstance(action, copy_rules.Submit):
        actions.append(action)
        action = op.submitted(target.execute(action.command))
    assert action == copy_rules.ReadSource(1, 6)
    write = op.source_entries(PackedEntries.of(source.reader.read(SEG, 1, 6)))
    assert isinstance(write, copy_rules.Submit)
    assert op.submitted(target.execute(write.command)) is None
    assert op.source_read_ended() == copy_rules.AskDigests(6)
    confirm = op.digests(target.reader.digest(SEG, 6), source.reader.digest(SEG, 6).digest)
    assert isinstance(confirm, copy_rules.Submit)
    actions.append(op.submitted(target.execute(confirm.command)))
    return actions


def test_a_refill_in_place_drops_every_old_copy_after_the_fence_and_before_the_copy(
    core: CommandedCore,
) -> None:
    """A copy of a higher epoch is kept by the overwrite rule (the refill would differ
    from its source: see the test above); a refill in place drops it first, keeping
    the fence, and then equals the source."""
    source = _copy_source()
    core.write(SEG, 5, 0, [ev(2, epoch=5, payload=b"higher")])
    core.seal(SEG, 5)
    actions = _refill_in_place(source, core)
    assert actions[1:3] == [
        copy_rules.Submit(copy_rules.fence_command(SEG, 5)),
        copy_rules.Submit(copy_rules.drop_command(SEG, 5)),
    ]
    assert isinstance(actions[-1], copy_rules.Finished)
    assert core.catalog.state(SEG).fence == 5, "the fence is never dropped"
    assert core.reader.read(SEG, 1, acked_only=True) == source.reader.read(SEG, 1, 6)


def test_dropping_copies_keeps_the_fence_and_leaves_nothing_served(
    core: CommandedCore,
) -> None:
    core.write(SEG, 3, 4, events(1, 6))
    core.seal(SEG, 4)
    result = core.execute(DropCopiesCommand(SEG, 4))
    assert result == SealResult(4, 0, 0, 0)
    assert core.catalog.state(SEG) == SegmentStateInfo(4, 0, 0, 0, 0, 0)
    assert core.reader.read(SEG, 1, 6) == []
    with pytest.raises(BelowFence):  # the old leader, delayed, is still refused
        core.write(SEG, 3, 6, [ev(5, payload=b"late")])


def test_dropping_copies_is_refused_once_the_copy_lost_its_fence(core: CommandedCore) -> None:
    core.write(SEG, 3, 4, events(1, 6))
    core.seal(SEG, 4)
    before = snapshot(core.kv)
    with pytest.raises(CopyRefused):
        core.execute(DropCopiesCommand(SEG, 5))
    core.delete(SEG)
    with pytest.raises(CopyRefused):
        core.execute(DropCopiesCommand(SEG, 4))
    assert before and core.catalog.meta(SEG) is None


def _flip_in_tables(path: Path) -> None:
    """Two bits in the data blocks of the largest table (a third and half way in), as
    bit rot at rest would."""
    table = max(path.glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(table.read_bytes())
    for offset in (len(data) // 3, len(data) // 2):
        data[offset] ^= 0x10
    table.write_bytes(bytes(data))


def test_a_refill_in_place_reads_back_clean_over_a_damaged_block(tmp_path: Path) -> None:
    """Copies written over a damaged block are refused: the overwrite rule reads what
    is held at each index, and RocksDB fails the read of that block (reads of the range
    would pass over it too). Dropped first (a range deletion, which RocksDB skips on
    reads without touching the blocks it covers), the old copies are never read again
    and the refill reads back clean."""
    final = 3000
    payloads = [bytes([i % 251]) * 300 for i in range(1, final + 1)]
    entries = [ev(i, payload=p) for i, p in zip(range(1, final + 1), payloads, strict=True)]
    kv = RocksKV(tmp_path / "db")
    core = CommandedCore(kv)
    for start in range(0, final, 500):
        core.write(SEG, 3, 0, entries[start : start + 500])
    core.seal(SEG, 4)
    kv.close()  # the memtable goes to a table
    _flip_in_tables(tmp_path / "db")
    kv = RocksKV(tmp_path / "db")
    core = CommandedCore(kv)
    try:
        assert core.reader.certify(SEG, final).damaged
        with pytest.raises(StoredCopyCorrupt):  # the overwrite rule reads the old copies
            core.execute(copy_rules.write_command(SEG, 4, PackedEntries.of(entries)))
        core.execute(copy_rules.drop_command(SEG, 4))
        for start in range(0, final, 500):
            batch = PackedEntries.of(entries[start : start + 500])
            core.execute(copy_rules.write_command(SEG, 4, batch))
        copied = core.reader.certify(SEG, final)
        assert not copied.damaged, copied.detail
        assert [e.payload for e in core.reader.read(SEG, 1, final)] == payloads
    finally:
        kv.close()


# ---- restart ----


def _fill(core: CommandedCore) -> None:
    core.write(SEG, 3, 0, events(1, 4))
    core.write(SEG, 3, 3, events(6, 8))
    core.seal(SEG, 5)
    core.write(SEG, 5, 3, [ev(5, 5)])
    core.write(SEG, 5, 3, [StoredEntry.make(9, BRIDGE, 5)])
    core.write(SegmentKey(1, 1), 1, 1, [StoredEntry.make(1, BRIDGE, 1)])
    core.seal(SegmentKey(2, 2), 3)


def test_restart_recovers_every_segments_matched_fence_and_acked_exactly(
    tmp_path: Path,
) -> None:
    kv = RocksKV(tmp_path / "db")
    core = CommandedCore(kv)
    _fill(core)
    states = {segment: core.catalog.state(segment) for segment in core.catalog.segments()}
    entries = core.reader.read(SEG, 1)
    kv.close()
    del core
    reopened = CommandedCore(RocksKV(tmp_path / "db"))
    catalog = reopened.catalog
    assert {segment: catalog.state(segment) for segment in catalog.segments()} == states
    assert reopened.reader.read(SEG, 1) == entries
    assert reopened.catalog.state(SEG).matched_index == 9 and reopened.catalog.state(SEG).fence == 5
    assert reopened.catalog.state(SegmentKey(1, 1)).bridge_index == 1


def test_recover_reloads_what_the_kv_holds(core: CommandedCore) -> None:
    core.write(SEG, 3, 0, events(1, 2))
    # A write reported as refused that reached the KV's log after all.
    CommandedCore(core.kv).write(SEG, 3, 0, events(3, 4))
    assert core.catalog.state(SEG).matched_index == 2
    core.recover()
    assert core.catalog.state(SEG).matched_index == 4


def test_rocks_kv_reopens_on_recover_and_keeps_everything(tmp_path: Path) -> None:
    kv = RocksKV(tmp_path / "db", recover_free_bytes_min=0)
    core = CommandedCore(kv)
    core.write(SEG, 3, 2, events(1, 3))
    core.recover()
    assert [e.index for e in core.reader.read(SEG, 1)] == [1, 2, 3]
    core.write(SEG, 3, 3, events(4, 4))
    assert core.catalog.state(SEG).acked_index == 3 and core.catalog.state(SEG).matched_index == 4
    kv.close()


def test_rocks_kv_writes_tables_of_its_block_size(tmp_path: Path) -> None:
    kv = RocksKV(tmp_path / "db")
    kv.write([Put(b"k", b"v")], sync=True)
    kv.close()
    # RocksDB writes the options a database was opened with next to its files.
    options = max((tmp_path / "db").glob("OPTIONS-*")).read_text()
    assert f"block_size={BLOCK_BYTES}\n" in options and BLOCK_BYTES == 16 << 10


def test_rocks_kv_does_not_reopen_without_free_space(tmp_path: Path) -> None:
    kv = RocksKV(tmp_path / "db", recover_free_bytes_min=1 << 62)
    kv.write([Put(b"k", b"v")], sync=True)
    with pytest.raises(OSError, match="No space"):
        kv.recover()
    assert kv.get(b"k") == b"v"  # still open and serving
    kv.close()
    with pytest.raises(OSError, match="closed"):
        kv.get(b"k")


def test_a_crash_loses_unsynced_plans_whole_never_half(core: CommandedCore) -> None:
    kv = core.kv
    assert isinstance(kv, MemoryKV)
    core.write(SEG, 3, 2, events(1, 3))
    plan = core.plan([WriteCommand.of(SEG, 3, 3, events(4, 6)), SealCommand(SEG, 4)])
    core.apply(plan, sync=False)
    kv.crash()
    after = CommandedCore(kv)
    assert after.catalog.state(SEG).matched_index == 3 and after.catalog.state(SEG).fence == 0
    assert [e.index for e in after.reader.read(SEG, 1)] == [1, 2, 3]


# ---- the KV contract, both implementations ----


@pytest.fixture(params=["memory", "rocks"])
def any_kv(request: pytest.FixtureRequest, tmp_path: Path) -> KV:
    return MemoryKV() if request.param == "memory" else RocksKV(tmp_path / "kv")


def test_kv_scans_in_bytewise_order_within_bounds(any_kv: KV) -> None:
    any_kv.write([Put(b"b2", b"2"), Put(b"a", b"0"), Put(b"b1", b"1"), Put(b"c", b"3")], False)
    any_kv.sync()
    assert any_kv.scan(b"b", b"c") == [(b"b1", b"1"), (b"b2", b"2")]
    assert any_kv.scan(b"a", b"z", limit=2) == [(b"a", b"0"), (b"b1", b"1")]
    assert any_kv.scan_values(b"b", b"c") == [b"1", b"2"]
    assert any_kv.scan_values(b"a", b"z", limit=3) == [b"0", b"1", b"2"]
    assert any_kv.scan_values(b"a", b"z", max_bytes=2) == [b"0", b"1"]
    assert any_kv.scan_values(b"a", b"z", limit=4, max_bytes=3) == [b"0", b"1", b"2"]
    assert any_kv.scan_values(b"b", b"c", limit=5) == [b"1", b"2"]  # the range holds less
    any_kv.write([DeleteRange(b"b", b"c"), Delete(b"a"), Put(b"d", b"4")], True)
    assert any_kv.scan(b"", b"\xff") == [(b"c", b"3"), (b"d", b"4")]
    assert any_kv.get(b"d") == b"4" and any_kv.get(b"b1") is None
    any_kv.close()


def test_a_copy_corrupted_on_disk_is_reported_never_served(core: CommandedCore) -> None:
    core.write(SEG, 3, 2, events(1, 2))
    key = entry_key(SEG.stream_id, SEG.epoch, 2)
    value = bytearray(core.kv.get(key) or b"")
    value[-1] ^= 0x01
    core.kv.write([Put(key, bytes(value))], sync=True)
    assert core.reader.read(SEG, 1, 1) == [ev(1)]
    with pytest.raises(CorruptEntry):
        core.reader.read(SEG, 1)
    with pytest.raises(CorruptEntry):
        core.reader.digest(SEG)


def test_a_write_over_a_corrupt_stored_copy_is_refused_alone(core: CommandedCore) -> None:
    other = SegmentKey(8, 1)
    core.write(SEG, 3, 0, events(1, 2))
    core.kv.write([Put(entry_key(SEG.stream_id, SEG.epoch, 2), b"\x01")], sync=True)
    held_before = core.kv.scan(*segment_entries_range(SEG.stream_id, SEG.epoch))
    plan = core.plan(
        [
            WriteCommand.of(SEG, 3, 0, events(2, 3)),
            WriteCommand.of(other, 1, 0, events(1, 1, epoch=1)),
        ]
    )
    core.apply(plan)
    assert isinstance(plan.outcomes[0], StoredCopyCorrupt)
    assert isinstance(plan.outcomes[1], WriteResult)
    assert core.kv.scan(*segment_entries_range(SEG.stream_id, SEG.epoch)) == held_before
    assert core.catalog.state(SEG).last_index == 2 and core.catalog.state(other).matched_index == 1


# ---- damage found by reads ----


def _damaged_rocks(path: Path, rows: int) -> None:
    """A RocksDB of `rows` keys (8-byte big-endian index -> 200 bytes) in one SST with
    one bit flipped a third of the way in: a block in the middle fails its checksum."""
    from rocksdict import Options, Rdict

    db = Rdict(str(path), Options(raw_mode=True))
    for index in range(rows):
        db.put(index.to_bytes(8, "big"), b"%200d" % index)
    db.flush()
    db.close()
    (sst,) = path.glob("*.sst")
    with sst.open("r+b") as file:
        file.seek(sst.stat().st_size // 3)
        byte = file.read(1)[0]
        file.seek(-1, 1)
        file.write(bytes([byte ^ 0x10]))


def test_rocks_kv_raises_at_a_damaged_block_instead_of_ending_the_scan(tmp_path: Path) -> None:
    """rocksdict's own loops stop silently at a block that fails its checksum (S12 seed
    1: a store served a truncated sealed segment); RocksKV raises instead."""
    from streamengine.segment_store.core.kv import KVCorruption

    _damaged_rocks(tmp_path / "db", 20_000)
    kv = RocksKV(tmp_path / "db")
    start, end = (0).to_bytes(8, "big"), (20_000).to_bytes(8, "big")
    try:
        with pytest.raises(KVCorruption, match="Corruption"):
            kv.scan(start, end)
        with pytest.raises(KVCorruption):
            kv.scan_values(start, end)
        # With a limit of what the range holds (the store's reads), rocksdict's own
        # loop ends short at the damage, and the scan with keys that follows raises.
        with pytest.raises(KVCorruption):
            kv.scan_values(start, end, limit=20_000)
        damaged = next(index for index in range(20_000) if _get_raises(kv, index))
        assert 0 < damaged < 20_000
        with pytest.raises(KVCorruption):
            kv.get(damaged.to_bytes(8, "big"))
        # Short of the damage, and by limit, scans work as ever.
        assert len(kv.scan(start, end, limit=10)) == 10
        assert len(kv.scan_values(start, (damaged - 1).to_bytes(8, "big"))) == damaged - 1
        assert kv.scan_values(start, end, limit=damaged // 2) == [
            value for _, value in kv.scan(start, end, limit=damaged // 2)
        ]
    finally:
        kv.close()


def _get_raises(kv: RocksKV, index: int) -> bool:
    try:
        kv.get(index.to_bytes(8, "big"))
    except Exception:
        return True
    return False


class _DamagedKV(MemoryKV):
    """Reads of a segment's entries at or past `index` fail as a damaged block would."""

    def __init__(self) -> None:
        super().__init__()
        self.damaged_from: bytes | None = None

    def _check(self, end: bytes) -> None:
        from streamengine.segment_store.core.kv import KVCorruption

        if self.damaged_from is not None and end > self.damaged_from:
            raise KVCorruption("Corruption: block checksum mismatch (test)")

    def scan(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[tuple[bytes, bytes]]:
        self._check(end)
        return super().scan(start, end, limit, max_bytes)

    def scan_values(
        self, start: bytes, end: bytes, limit: int = 0, max_bytes: int = 0
    ) -> list[bytes]:
        self._check(end)
        return super().scan_values(start, end, limit, max_bytes)


def test_a_damaged_segment_is_reported_with_acked_zero_until_mended() -> None:
    """A read that meets damage raises and marks the segment; the master hears acked
    index 0 for it (and repairs it); a confirmed copy or a delete mends the mark."""
    kv = _DamagedKV()
    core = CommandedCore(kv)
    other = SegmentKey(8, 1)
    core.write(SEG, 3, 6, events(1, 6))
    core.write(other, 1, 1, events(1, 1, epoch=1))
    kv.damaged_from = entry_key(SEG.stream_id, SEG.epoch, 4)
    assert core.reader.read_run(SEG, 1, 3, 100, 0) == stored(events(1, 3))
    assert core.catalog.damaged() == set()
    with pytest.raises(CorruptEntry):
        core.reader.read_run(SEG, 1, 6, 100, 0)
    assert core.catalog.damaged() == {SEG}
    reported = core.catalog.reported_metas()
    assert reported[SEG].acked_index == 0 and reported[other].acked_index == 1
    assert core.catalog.metas()[SEG].acked_index == 6, "the store's own state is unchanged"
    kv.damaged_from = None
    fence = core.catalog.state(SEG).fence
    core.confirm_copy(SEG, fence, 6)
    assert core.catalog.damaged() == set()
    kv.damaged_from = entry_key(SEG.stream_id, SEG.epoch, 1)
    with pytest.raises(CorruptEntry):
        core.reader.digest(SEG)
    assert core.catalog.damaged() == {SEG}
    core.delete(SEG)
    assert core.catalog.damaged() == set()


# ---- the master's segment records ----


def test_a_segment_record_is_kept_beside_its_segment_and_goes_with_it(tmp_path: Path) -> None:
    from streamengine.protocol.segment_records import record_version
    from streamengine.segment_store.core.commands import KeepRecordsCommand, RecordsKept
    from streamengine.segment_store.core.keys import record_key

    kv = RocksKV(tmp_path / "db")
    store = CommandedCore(kv)
    held, other = SegmentKey(7, 2), SegmentKey(7, 3)
    store.write(held, 3, 0, [ev(1)])
    outcome = store.execute(KeepRecordsCommand(((held, b"record-a"), (other, b"record-b"))))
    # A record of a segment the store does not hold would outlive it: dropped.
    assert outcome == RecordsKept((held,))
    assert store.catalog.record_version(held) == record_version(b"record-a")
    assert store.catalog.record_version(other) == 0 and store.catalog.segment_record(other) == b""
    kv.close()
    # A restart knows the version of every record kept.
    kv = RocksKV(tmp_path / "db")
    store = CommandedCore(kv)
    assert store.catalog.segment_record(held) == b"record-a"
    assert store.catalog.record_version(held) == record_version(b"record-a")
    store.delete(held)
    assert store.catalog.record_version(held) == 0
    assert kv.get(record_key(7, 2)) is None
    kv.close()


def test_the_copy_set_of_the_first_grant_is_kept_beside_its_segment_and_goes_with_it(
    tmp_path: Path,
) -> None:
    """A master rebuilding its metadata names every member of a segment no record
    reached, those that never got a write too (the runtime world's seed 432)."""
    from streamengine.segment_store.core.keys import placed_key

    five, other = ("s2", "s0", "s1", "s3", "s4"), ("s9",)
    kv = RocksKV(tmp_path / "db")
    store = CommandedCore(kv)
    written, sealed, copied = SegmentKey(7, 2), SegmentKey(7, 3), SegmentKey(7, 4)
    store.execute(WriteCommand.of(written, 3, 0, [ev(1)], copy_set=five))
    # A later command of the segment does not change what the first one kept.
    store.execute(WriteCommand.of(written, 3, 0, [ev(2)], copy_set=other))
    # A seal that brings the segment here (a recovery's, of a store that got no write).
    store.execute(SealCommand(sealed, 5, copy_set=five))
    store.execute(SealCommand(sealed, 6, copy_set=other))
    # A copy the master made comes under no grant.
    store.execute(WriteCommand.of(copied, 5, 0, [ev(1, epoch=4)]))
    kv.close()
    # A restart reads them back.
    kv = RocksKV(tmp_path / "db")
    store = CommandedCore(kv)
    assert store.catalog.placed_copy_set(written) == five
    assert store.catalog.placed_copy_set(sealed) == five
    assert store.catalog.placed_copy_set(copied) == ()
    store.delete(written)
    assert store.catalog.placed_copy_set(written) == ()
    assert kv.get(placed_key(7, 2)) is None
    # Brought here again, the segment keeps what its new first command lists.
    store.execute(WriteCommand.of(written, 3, 0, [ev(1)], copy_set=other))
    assert store.catalog.placed_copy_set(written) == other
    kv.close()


def test_the_stream_a_grant_names_is_kept_with_the_first_command_of_a_segment(
    tmp_path: Path,
) -> None:
    """A master rebuilding its metadata names a stream none of whose records or cards
    reached a store as its grants said (the runtime world's seeds 4600 and 4989)."""
    kv = RocksKV(tmp_path / "db")
    store = CommandedCore(kv)
    first, sealed = SegmentKey(7, 2), SegmentKey(8, 1)
    assert store.catalog.granted_stream(7) == ("", 0)
    store.execute(
        WriteCommand(first, 3, 0, PackedEntries.of([ev(1)]), "acme", ("s1",), "acme/orders", 1)
    )
    store.execute(SealCommand(sealed, 2, "acme", ("s1", "s2", "s3"), "acme/clicks", 3))
    # A copy the master made, under no grant, names nothing.
    store.execute(WriteCommand.of(SegmentKey(9, 1), 1, 0, [ev(1, epoch=1)]))
    kv.close()
    kv = RocksKV(tmp_path / "db")
    store = CommandedCore(kv)
    assert store.catalog.granted_stream(7) == ("acme/orders", 1)
    assert store.catalog.granted_stream(8) == ("acme/clicks", 3)
    assert store.catalog.granted_stream(9) == ("", 0)
    # The segment deleted, the stream's name stays, as its tenant does.
    store.delete(first)
    assert store.catalog.granted_stream(7) == ("acme/orders", 1)
    kv.close()


def test_a_refused_write_keeps_no_copy_set(core: CommandedCore) -> None:
    segment = SegmentKey(4, 1)
    with pytest.raises(BadRequest):
        core.execute(WriteCommand.of(segment, 3, 0, [ev(1, epoch=9)], copy_set=("s1", "s2")))
    assert core.catalog.meta(segment) is None
    assert core.catalog.placed_copy_set(segment) == ()


def test_a_record_and_a_delete_of_its_segment_in_one_group_leave_no_record(
    core: CommandedCore,
) -> None:
    from streamengine.segment_store.core.commands import Command, DeleteCommand, KeepRecordsCommand
    from streamengine.segment_store.core.keys import record_key

    store = core
    segment = SegmentKey(4, 1)
    store.write(segment, 3, 0, [ev(1)])
    keep: Command = KeepRecordsCommand(((segment, b"r"),))
    delete: Command = DeleteCommand(segment)
    for commands in ([keep, delete], [delete, keep]):
        store.write(segment, 3, 0, [ev(1)])
        store.apply(store.plan(commands))
        assert store.catalog.record_version(segment) == 0
        assert store.kv.get(record_key(4, 1)) is None


def test_a_malformed_record_is_refused_and_keeps_nothing(core: CommandedCore) -> None:
    from streamengine.protocol.segment_records import RECORD_BYTES_MAX
    from streamengine.segment_store.core.commands import KeepRecordsCommand

    store = core
    segment = SegmentKey(4, 1)
    store.write(segment, 3, 0, [ev(1)])
    for raw in (b"", b"x" * (RECORD_BYTES_MAX + 1)):
        with pytest.raises(BadRequest):
            store.execute(KeepRecordsCommand(((segment, b"ok"), (segment, raw))))
        assert store.catalog.record_version(segment) == 0


def test_the_cluster_view_is_kept_whole_until_the_next_one(tmp_path: Path) -> None:
    """A master rebuilding its metadata reads back every store the lost master knew and
    the highest stream id it gave (the runtime world's seeds 2008 and 2092)."""
    from streamengine.protocol.segment_records import CLUSTER_VIEW_BYTES_MAX
    from streamengine.segment_store.core.commands import ClusterViewKept, KeepClusterViewCommand

    kv = RocksKV(tmp_path / "db")
    store = CommandedCore(kv)
    assert store.catalog.cluster_view() == b""
    assert store.execute(KeepClusterViewCommand(b"view-1")) == ClusterViewKept()
    store.execute(KeepClusterViewCommand(b"view-2"))
    for raw in (b"", b"x" * (CLUSTER_VIEW_BYTES_MAX + 1)):
        with pytest.raises(BadRequest):
            store.execute(KeepClusterViewCommand(raw))
    kv.close()
    kv = RocksKV(tmp_path / "db")
    assert CommandedCore(kv).catalog.cluster_view() == b"view-2"
    kv.close()


@pytest.mark.parametrize(
    ("parts", "entries", "packed_bytes", "refused"),
    [
        (1, 0, 0, False),
        (WRITE_REQUEST_PARTS_MAX, WRITE_BATCH_ENTRIES_MAX, WRITE_BATCH_BYTES_MAX, False),
        (WRITE_REQUEST_PARTS_MAX + 1, 0, 0, True),
        (2, WRITE_BATCH_ENTRIES_MAX + 1, 0, True),
        (2, 2, WRITE_BATCH_BYTES_MAX + 1, True),
    ],
)
def test_a_message_of_parts_is_bounded_whole_as_one_batch(
    parts: int, entries: int, packed_bytes: int, refused: bool
) -> None:
    """Rule: a Write message's parts add up to no more than one batch's entries and
    bytes, and no more than WRITE_REQUEST_PARTS_MAX parts (`WriteRequest.parts`)."""
    from streamengine.segment_store.core.writes import check_write_message

    if refused:
        with pytest.raises(BadRequest):
            check_write_message(parts, entries, packed_bytes)
    else:
        check_write_message(parts, entries, packed_bytes)
