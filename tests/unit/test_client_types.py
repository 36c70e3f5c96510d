"""The SDK answers with its own frozen structs, converted from the master's replies in
`client.wire`, never with wire messages."""

from __future__ import annotations

import dataclasses

import pytest

from streamengine.client.types import Replica, SegmentInfo, SegmentState, StreamInfo
from streamengine.client.wire import segment_info, stream_info
from streamengine.v1 import entry_pb2, master_pb2


def test_a_stream_info_carries_the_masters_answer_in_plain_ints() -> None:
    answer = master_pb2.StreamInfo(
        name="acme/orders",
        stream_id=7,
        policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
        segment_bytes=1 << 20,
        segment_age_ms=60_000,
        epoch=5,
        leader_id="writer-1",
        acked_index=42,
        open_segment_epoch=5,
        unsealed_segments=1,
        created_at_ms=1_700_000_000_000,
        retention_age_ms=3_600_000,
        retention_bytes=1 << 30,
        trimmed_through_epoch=2,
        first_retained_sequence=(3 << 32) | 1,
        deleted_until_ms=0,
    )
    info = stream_info(answer)
    assert info == StreamInfo(
        name="acme/orders",
        stream_id=7,
        replicas=3,
        write_quorum=2,
        segment_bytes=1 << 20,
        segment_age_ms=60_000,
        epoch=5,
        leader_id="writer-1",
        acked_index=42,
        open_segment_epoch=5,
        unsealed_segments=1,
        created_at_ms=1_700_000_000_000,
        retention_age_ms=3_600_000,
        retention_bytes=1 << 30,
        trimmed_through_epoch=2,
        first_retained_sequence=(3 << 32) | 1,
        deleted_until_ms=0,
    )
    assert not info.deleted
    assert dataclasses.replace(info, deleted_until_ms=1).deleted
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.epoch = 6  # type: ignore[misc]


def test_a_segment_info_names_its_state_and_stores() -> None:
    listed = entry_pb2.Segment(
        id=entry_pb2.SegmentId(stream_id=7, epoch=3, stream="acme/orders"),
        copy_set=[
            entry_pb2.Replica(store_id="s1", address="10.0.0.1:7071", zone="a"),
            entry_pb2.Replica(store_id="s2", address="10.0.0.2:7071", zone="b"),
        ],
        state=entry_pb2.SEALED,
        final_index=101,
        created_at_ms=1_700_000_000_000,
        sealed_at_ms=1_700_000_060_000,
        bytes=4096,
        acked_index=100,
        certificate=entry_pb2.SegmentCertificate(final_index=101, certified_by="writer"),
        bad_stores=["s2"],
        lost_from_index=0,
    )
    segment = segment_info(listed)
    assert segment == SegmentInfo(
        stream="acme/orders",
        stream_id=7,
        epoch=3,
        state=SegmentState.SEALED,
        copy_set=(Replica("s1", "10.0.0.1:7071", "a"), Replica("s2", "10.0.0.2:7071", "b")),
        final_index=101,
        acked_index=100,
        created_at_ms=1_700_000_000_000,
        sealed_at_ms=1_700_000_060_000,
        bytes=4096,
        bad_stores=("s2",),
        lost_from_index=0,
        certified_by="writer",
    )
    assert segment.sealed and segment.state == "sealed"
    assert not segment_info(entry_pb2.Segment(state=entry_pb2.OPEN)).sealed


@pytest.mark.parametrize("struct", [StreamInfo, SegmentInfo, Replica])
def test_the_structs_are_frozen_and_hold_no_wire_message(struct: type) -> None:
    assert dataclasses.is_dataclass(struct)
    assert struct.__dataclass_params__.frozen  # type: ignore[attr-defined]
    for field in dataclasses.fields(struct):
        assert "pb2" not in str(field.type), (struct.__name__, field.name)
