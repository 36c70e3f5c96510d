"""The producer positions a seal records (`SealSegmentRequest.producers`): kept in the
master's catalog and in the segment record the stores keep (so `master --rebuild` has
them), refused when malformed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streamengine.master.catalog import decode_segment, decode_stream, encode_segment, encode_stream
from streamengine.master.core.model import (
    SegmentRecord,
    SegmentState,
    StreamRecord,
    carry_producers,
)
from streamengine.master.records import record_from_bytes, record_pb
from streamengine.protocol import codec
from streamengine.protocol.producers import ProducerPosition
from streamengine.v1 import entry_pb2

ORDERS = StreamRecord("acme/orders", 5, 3, 2, 1 << 20, 60_000, 0, "", 10)
POSITIONS = (ProducerPosition("ingest-1", 41, 7 << 32 | 9), ProducerPosition("ingest-2", 0, 12))


def sealed(producers: tuple[ProducerPosition, ...] | None) -> SegmentRecord:
    return SegmentRecord(
        5,
        "acme/orders",
        4,
        ("s1", "s2", "s3"),
        SegmentState.SEALED,
        10,
        1,
        2,
        2,
        producers=producers,
    )


@pytest.mark.parametrize("producers", [POSITIONS, (), None])
def test_positions_survive_the_catalog_and_the_stores_record(
    producers: tuple[ProducerPosition, ...] | None,
) -> None:
    segment = sealed(producers)
    assert decode_segment(encode_segment(segment)) == segment
    encoded = record_pb(ORDERS, segment).SerializeToString(deterministic=True)
    assert record_from_bytes(encoded) == (ORDERS, segment)


def test_a_record_without_positions_keeps_the_bytes_it_had() -> None:
    assert b"producers" not in encode_segment(sealed(None))


@pytest.mark.parametrize(
    "positions",
    [
        [("", 1, 1)],  # no producer id
        [("p", 1, 0)],  # no stream sequence
        [("p", 1, 5), ("p", 2, 6)],  # a producer twice
    ],
)
def test_malformed_positions_are_refused(positions: list[tuple[str, int, int]]) -> None:
    message = entry_pb2.ProducerPositions(
        positions=[
            entry_pb2.ProducerPosition(producer_id=p, last_sequence=s, last_stream_sequence=t)
            for p, s, t in positions
        ]
    )
    with pytest.raises(codec.MalformedProducers):
        codec.producer_positions_from_pb(message)


def test_positions_come_back_by_producer_id() -> None:
    message = codec.producer_positions_to_pb(reversed(POSITIONS))
    assert codec.producer_positions_from_pb(message) == POSITIONS


LATER = (ProducerPosition("ingest-1", 50, 9 << 32 | 3),)


@pytest.mark.parametrize(
    ("rule", "kept_epoch", "epoch", "producers", "after"),
    [
        ("a seal with positions newer than the stream's replaces them", 4, 9, LATER, LATER),
        ("a seal that kept none leaves them", 4, 9, None, POSITIONS),
        ("a seal of an older segment leaves them", 4, 3, LATER, POSITIONS),
        ("a seal again of the same segment leaves them", 4, 4, LATER, POSITIONS),
        ("the first seal with positions sets them", 0, 2, LATER, LATER),
    ],
)
def test_the_stream_keeps_the_positions_of_its_newest_seal(
    rule: str,
    kept_epoch: int,
    epoch: int,
    producers: tuple[ProducerPosition, ...] | None,
    after: tuple[ProducerPosition, ...],
) -> None:
    kept = POSITIONS if kept_epoch else ()
    stream = replace(ORDERS, producers=kept, producers_epoch=kept_epoch)
    carried = carry_producers(stream, epoch, producers)
    assert carried.producers == after, rule
    assert decode_stream(encode_stream(carried)) == carried


def test_a_stream_record_without_producers_keeps_the_bytes_it_had() -> None:
    assert b"producers" not in encode_stream(ORDERS)
    assert decode_stream(encode_stream(ORDERS)) == ORDERS
