"""The producer table (`streamengine.protocol.producers`): each rule of its
docstring as a table test."""

from __future__ import annotations

import pytest

from streamengine.protocol import producers
from streamengine.protocol.entry import EntryKind, InvalidProducer, ProducerMark, StoredEntry
from streamengine.protocol.producers import (
    Dedup,
    ProducerPosition,
    ProducerTable,
    Run,
    SequenceGap,
    TooManyProducers,
)
from streamengine.protocol.sequence import pack_sequence

P = "orders-ingest-7"


def table_with(*runs: tuple[int, int, int]) -> ProducerTable:
    """P's runs as (first sequence, count, first stream sequence)."""
    table = ProducerTable()
    for run in runs:
        table.add_run(P, Run(*run))
    return table


# P holds 0..4 at stream sequences 101..105 and 5..6 at 201..202.
HELD = ((0, 5, 101), (5, 2, 201))


@pytest.mark.parametrize(
    "first, count, expected",
    [
        (7, 3, Dedup((), 7, 3)),  # the next batch: all written
        (0, 3, Dedup((101, 102, 103), 3, 3)),  # all below the mark: nothing written
        (3, 4, Dedup((104, 105, 201, 202), 7, 4)),  # across runs, all known
        (5, 4, Dedup((201, 202), 7, 4)),  # the first two known, the rest written
        (0, 9, Dedup((101, 102, 103, 104, 105, 201, 202), 7, 9)),  # resent from the start
    ],
)
def test_events_at_or_below_the_mark_are_answered_and_the_rest_written(
    first: int, count: int, expected: Dedup
) -> None:
    assert table_with(*HELD).decide(P, first, count) == expected


def test_a_batch_past_the_mark_plus_one_is_a_gap() -> None:
    with pytest.raises(SequenceGap, match="holds its events through 6") as raised:
        table_with(*HELD).decide(P, 8, 1)
    assert raised.value.expected == 7


def test_an_unknown_producer_starts_at_zero() -> None:
    table = ProducerTable()
    assert table.last_sequence(P) is None
    assert table.decide(P, 0, 2) == Dedup((), 0, 2)
    with pytest.raises(SequenceGap, match="holds none of its events"):
        table.decide(P, 1, 1)


def test_a_producer_id_that_cannot_be_written_is_refused() -> None:
    with pytest.raises(InvalidProducer):
        ProducerTable().decide("", 0, 1)


def test_a_table_from_seal_positions_knows_the_last_event_only() -> None:
    table = ProducerTable([ProducerPosition(P, 6, 202)])
    assert table.last_sequence(P) == 6
    # 6 is known exactly; 5 is durable but older than what the table keeps: 0.
    assert table.decide(P, 5, 3) == Dedup((0, 202), 7, 3)


def test_only_the_latest_runs_are_kept_and_older_events_are_still_never_rewritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(producers, "RUNS_PER_PRODUCER_MAX", 2)
    table = table_with((0, 1, 10), (1, 1, 20), (2, 1, 30))
    assert table.decide(P, 0, 4) == Dedup((0, 20, 30), 3, 4)


def test_positions_before_a_stream_sequence_are_what_a_seal_of_that_segment_records() -> None:
    table = table_with((0, 5, pack_sequence(3, 2)), (5, 2, pack_sequence(4, 2)))
    table.add_run("other", Run(0, 1, pack_sequence(4, 9)))
    assert table.positions(pack_sequence(4, 0)) == (ProducerPosition(P, 4, pack_sequence(3, 6)),)
    assert table.positions() == (
        ProducerPosition(P, 6, pack_sequence(4, 3)),
        ProducerPosition("other", 0, pack_sequence(4, 9)),
    )


def test_a_new_producer_past_the_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producers, "PRODUCERS_MAX", 1)
    table = table_with((0, 1, 10))
    assert table.decide(P, 1, 1) == Dedup((), 1, 1)
    with pytest.raises(TooManyProducers):
        table.decide("another", 0, 1)


def segment(*kinds_payloads: tuple[EntryKind, bytes]) -> list[StoredEntry]:
    return [
        StoredEntry.make(index, kind, 5, payload)
        for index, (kind, payload) in enumerate(kinds_payloads, 1)
    ]


def mark(producer_id: str, first: int, count: int) -> tuple[EntryKind, bytes]:
    return EntryKind.PRODUCER, ProducerMark(producer_id, first, count).encode()


EVENT = (EntryKind.EVENT, b"e")


def test_a_recovered_segment_is_folded_mark_by_mark() -> None:
    table = table_with((0, 2, pack_sequence(4, 1)))
    entries = segment(
        EVENT,  # 1: a plain event
        mark(P, 2, 2),  # 2: P's 2..3 at 3..4
        EVENT,
        EVENT,
        mark("other", 0, 3),  # 5: other's 0..2, of which recovery kept 0..1 (6..7)
        EVENT,
        EVENT,
        (EntryKind.BRIDGE, b""),
    )
    table.fold_segment(5, entries)
    assert table.positions() == (
        ProducerPosition(P, 3, pack_sequence(5, 4)),
        ProducerPosition("other", 1, pack_sequence(5, 7)),
    )
    # The retry of other's batch writes only what recovery did not keep.
    assert table.decide("other", 0, 3) == Dedup((pack_sequence(5, 6), pack_sequence(5, 7)), 2, 3)


def test_a_mark_whose_events_recovery_lost_entirely_adds_nothing() -> None:
    table = ProducerTable()
    table.fold_segment(5, segment(mark(P, 0, 2), (EntryKind.HOLE, b""), (EntryKind.BRIDGE, b"")))
    assert table.last_sequence(P) is None


def test_the_durable_sequence_counts_a_run_acked_in_part() -> None:
    table = table_with(*HELD)
    assert table.durable_sequence(P, 100) is None
    assert table.durable_sequence(P, 103) == 2
    assert table.durable_sequence(P, 150) == 4
    assert table.durable_sequence(P, 1_000) == 6


# With jumps, P holds 0..4 at 101..105 and (a batch that jumped) 1000..1001 at 201..202.
JUMPED = ((0, 5, 101), (1000, 2, 201))


@pytest.mark.parametrize(
    ("rule", "held", "first", "count", "expected"),
    [
        ("a batch may start anywhere above the mark", HELD, 2000, 3, Dedup((), 2000, 3)),
        ("the next batch as ever", HELD, 7, 3, Dedup((), 7, 3)),
        ("an unknown producer may start above 0", (), 4000, 2, Dedup((), 4000, 2)),
        ("at or below the mark: still not written", JUMPED, 1000, 2, Dedup((201, 202), 1002, 2)),
        (
            "a resend across a hole: the hole answered 0, never written",
            JUMPED,
            4,
            3,
            Dedup((105, 0, 0), 7, 3),
        ),
        (
            "a resend reaching past the mark writes the rest only",
            JUMPED,
            1001,
            3,
            Dedup((202,), 1002, 3),
        ),
    ],
)
def test_a_producer_whose_sequences_jump_is_deduplicated_at_or_below_its_mark(
    rule: str, held: tuple[tuple[int, int, int], ...], first: int, count: int, expected: Dedup
) -> None:
    assert table_with(*held).decide(P, first, count, jumps=True) == expected, rule


def test_without_the_opt_in_a_jump_is_still_a_gap() -> None:
    table = table_with(*JUMPED)  # runs with holes are taken from any writer
    assert table.last_sequence(P) == 1001
    with pytest.raises(SequenceGap):
        table.decide(P, 2000, 1)
    assert table.decide(P, 1002, 1) == Dedup((), 1002, 1)


# P holds 0..6 (HELD); batches of 7..11 wait in the shell, not assigned yet.
QUEUED_THROUGH = 11


@pytest.mark.parametrize(
    "first, count, jumps, expected",
    [
        (12, 3, False, Dedup((), 12, 3)),  # right behind the queued batches: all written
        (20, 3, True, Dedup((), 20, 3)),  # above them, sequences that may jump
        (11, 2, False, None),  # overlaps the last queued batch: decided once assigned
        (3, 2, False, None),  # a retry of what the table holds waits its turn too
    ],
)
def test_a_batch_behind_queued_batches_is_decided_against_the_last_of_them(
    first: int, count: int, jumps: bool, expected: Dedup | None
) -> None:
    table = table_with(*HELD)
    assert table.decide_behind(P, QUEUED_THROUGH, first, count, jumps) == expected


def test_a_batch_past_the_queued_batches_plus_one_is_a_gap() -> None:
    with pytest.raises(SequenceGap) as raised:
        table_with(*HELD).decide_behind(P, QUEUED_THROUGH, 13, 1)
    assert raised.value.expected == 12


def test_runs_taken_away_count_as_a_change_and_runs_added_do_not() -> None:
    table = table_with(*HELD)
    table.add_run(P, Run(7, 2, 301))
    assert table.changes == 0
    table.forget_from(301)
    assert table.changes == 1
    assert table.last_sequence(P) == 6
