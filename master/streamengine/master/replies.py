"""What the Master service's replies say of a segment and of a stream: the master's
records as protobuf, with what only the live state knows (bytes, acked index, leader).
"""

from __future__ import annotations

from streamengine.master.core.model import SegmentRecord, SegmentState, StreamRecord
from streamengine.master.state import MasterState
from streamengine.protocol import codec
from streamengine.v1 import entry_pb2, master_pb2


def segment_pb(
    state: MasterState, record: SegmentRecord, details: bool = False
) -> entry_pb2.Segment:
    """The segment as listed; `details`: its certificate's chunks and the members
    verified against it."""
    stores = state.stores
    segment = entry_pb2.Segment(
        id=entry_pb2.SegmentId(
            stream_id=record.stream_id, epoch=record.epoch, stream=record.stream
        ),
        copy_set=[
            entry_pb2.Replica(
                store_id=m,
                address=stores[m].address if m in stores else "",
                zone=stores[m].zone if m in stores else "",
                data_address=stores[m].data_address if m in stores else "",
            )
            for m in record.copy_set
        ],
        state=int(record.state),  # type: ignore[arg-type]
        final_index=record.final_index,
        created_at_ms=record.created_at_ms,
        sealed_at_ms=record.sealed_at_ms,
        bytes=state.segment_bytes(record.key),
        acked_index=state.segment_acked_index(record),
        bad_stores=record.bad,
        lost_from_index=record.lost_from_index,
    )
    if record.certificate is not None:
        segment.certificate.CopyFrom(codec.certificate_to_pb(record.certificate, details))
        segment.certificate.certified_by = record.certified_by
    checks = state.checks.get(record.key)
    if details and checks is not None:
        segment.verified.extend(
            entry_pb2.ReplicaVerified(store_id=store, verified_at_ms=at)
            for store, at in sorted(checks.verified.items())
            if store in record.copy_set
        )
    return segment


def stream_info_pb(state: MasterState, record: StreamRecord, now_ms: int) -> master_pb2.StreamInfo:
    lease = state.leases.get(record.name)
    leader = lease.holder if lease is not None and lease.running(now_ms) else ""
    unsealed = state.unsealed(record.stream_id)
    open_epochs = [s.epoch for s in unsealed if s.state == SegmentState.OPEN]
    return master_pb2.StreamInfo(
        name=record.name,
        stream_id=record.stream_id,
        policy=entry_pb2.ReplicationPolicy(
            replicas=record.replicas, write_quorum=record.write_quorum
        ),
        segment_bytes=record.segment_bytes,
        segment_age_ms=record.segment_age_ms,
        epoch=record.epoch,
        leader_id=leader,
        acked_index=state.stream_acked_index(record.stream_id)[1],
        open_segment_epoch=open_epochs[-1] if open_epochs else 0,
        unsealed_segments=len(unsealed),
        created_at_ms=record.created_at_ms,
        retention_age_ms=record.retention_age_ms,
        retention_bytes=record.retention_bytes,
        trimmed_through_epoch=record.trimmed_through_epoch,
        first_retained_sequence=state.first_retained(record),
        deleted_until_ms=record.deleted_until_ms,
    )
