"""The writer core's producer table (`Leader.producers`): built from the grant's
positions and the recovered segments, grown by its own marked batches, and what each
seal it asks for records."""

from __future__ import annotations

import pytest

from streamengine.client.core.replicator import Append, SendWrite, StoreConnected, Tick
from streamengine.client.core.writer import (
    Leader,
    RecoverSegment,
    ReleaseLease,
    SegmentSealed,
    SteppedDown,
)
from streamengine.protocol.entry import EntryKind, ProducerMark
from streamengine.protocol.producers import Dedup, ProducerPosition, Run
from streamengine.protocol.sequence import pack_sequence
from tests.unit.test_leader import STORES, answer_all, grant, leader_answer, of_type, step

P = "orders-ingest-7"
SEALED = (ProducerPosition(P, 9, pack_sequence(3, 12)),)


def marked(first: int, count: int) -> Append:
    mark = ProducerMark(P, first, count).encode()
    return Append((mark, *(b"e%d" % n for n in range(first, first + count))), marked=True)


def test_a_new_leader_starts_from_the_seal_and_adds_what_recovery_found() -> None:
    leader = Leader(0, recovery_supported=True, producer=True)
    step(leader, 0, Tick())
    actions = step(
        leader,
        5,
        leader_answer(0, unsealed=(grant(4),), producers=SEALED, stream_has_producers=True),
    )
    [recover] = of_type(actions, RecoverSegment)
    # Segment 4 is recovered from the positions the seal of segment 3 recorded.
    assert recover.producers is not None and not recover.producers.through_segment
    assert recover.producers.positions == SEALED
    step(leader, 6, SegmentSealed(4, ((P, Run(10, 5, pack_sequence(4, 2))),)))
    assert leader.producers.last_sequence(P) == 14
    assert leader.producers.decide(P, 13, 4) == Dedup(
        (pack_sequence(4, 5), pack_sequence(4, 6)), 15, 4
    )


def test_a_marked_batch_is_one_producer_entry_then_plain_events_and_counts_at_once() -> None:
    leader = Leader(0, recovery_supported=True, producer=True)
    step(leader, 0, Tick())
    step(leader, 5, leader_answer(0, producers=SEALED, stream_has_producers=True))
    for store in STORES:
        step(leader, 5, StoreConnected(store))
    sent = step(leader, 6, marked(10, 3))
    # Counted as soon as its indexes are taken: a retry decides against it.
    assert leader.producers.last_sequence(P) == 12
    assert leader.producers.decide(P, 12, 1).known == (pack_sequence(5, 4),)
    [first, *_] = of_type(sent, SendWrite)
    kinds = [e.kind for e in first.entries]
    assert kinds == [EntryKind.PRODUCER, EntryKind.EVENT, EntryKind.EVENT, EntryKind.EVENT]
    for entry in first.batch().entries():
        entry.verify()
    answer_all(leader, 7, sent)
    assert leader.replicator is not None and leader.replicator.acked_index == 4


@pytest.mark.parametrize(
    ("producer", "stream_has_producers", "recovery"),
    [
        # A plain stream: no mark anywhere, recovered from its tail as ever.
        (False, False, "plain"),
        # A plain writer on a stream a producer once led: read whole, positions kept.
        (False, True, "folded"),
        (True, True, "folded"),
        # A producer granted without the mark (an older master): it cannot lead.
        (True, False, "refused"),
    ],
)
def test_a_recovery_reads_a_segment_whole_only_on_a_stream_with_producers(
    producer: bool, stream_has_producers: bool, recovery: str
) -> None:
    leader = Leader(0, recovery_supported=True, producer=producer)
    step(leader, 0, Tick())
    actions = step(
        leader,
        5,
        leader_answer(
            0, unsealed=(grant(4),), producers=(), stream_has_producers=stream_has_producers
        ),
    )
    if recovery == "refused":
        assert of_type(actions, SteppedDown) and of_type(actions, ReleaseLease)
        assert not of_type(actions, RecoverSegment)
        return
    [recover] = of_type(actions, RecoverSegment)
    if recovery == "plain":
        assert recover.producers is None
    else:
        assert recover.producers is not None and not recover.producers.through_segment


@pytest.mark.parametrize("stream_has_producers", [False, True])
def test_two_unsealed_segments_recover_oldest_first_only_on_a_stream_with_producers(
    stream_has_producers: bool,
) -> None:
    """A seal's producer positions build on those of the segment before it, so on a
    stream with producers the second recovery starts once the first sealed; a plain
    stream recovers both at once."""
    leader = Leader(0, recovery_supported=True, producer=stream_has_producers)
    step(leader, 0, Tick())
    unsealed = (grant(3), grant(4))
    answer = leader_answer(
        0, unsealed=unsealed, producers=(), stream_has_producers=stream_has_producers
    )
    started = [r.segment.epoch for r in of_type(step(leader, 5, answer), RecoverSegment)]
    assert started == ([3] if stream_has_producers else [3, 4])
    after = [r.segment.epoch for r in of_type(step(leader, 6, SegmentSealed(3)), RecoverSegment)]
    assert after == ([4] if stream_has_producers else [])
