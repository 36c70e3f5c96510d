"""Wire conversion: master replies into the writer's core events and into the SDK's
answers (`client.types`), Write requests serialized once per batch for every store."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Sequence

from streamengine.client.core.replicator import (
    SegmentRef,
    SendWrite,
)
from streamengine.client.core.writer import (
    HeartbeatAnswered,
    Replica,
    SegmentGrant,
)
from streamengine.client.types import SegmentInfo, SegmentState, StreamInfo
from streamengine.protocol import codec
from streamengine.protocol.limits import (
    LEASE_SECRET_BYTES,
    LEASE_SECRET_BYTES_MAX,
    LEASE_SECRET_BYTES_MIN,
)
from streamengine.protocol.policy import InvalidPolicy, ReplicationPolicy
from streamengine.protocol.producers import ProducerPosition
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2

log = logging.getLogger(__name__)

# Converted entries kept for reuse: every store is usually sent the same batch.
ENTRY_CACHE_BATCHES = 64

# The key of `WriteRequest.parts` on the wire: field 11, length-delimited.
_PARTS_KEY = bytes([segment_store_pb2.WriteRequest.PARTS_FIELD_NUMBER << 3 | 2])
assert len(_PARTS_KEY) == 1, "a one-byte key: field numbers up to 15"


def grant_from_pb(segment: entry_pb2.Segment) -> SegmentGrant:
    return SegmentGrant(
        SegmentRef(segment.id.stream_id, segment.id.epoch, segment.id.stream),
        tuple(Replica(r.store_id, r.address, r.zone, r.data_address) for r in segment.copy_set),
    )


SEGMENT_STATES = {
    entry_pb2.OPEN: SegmentState.OPEN,
    entry_pb2.SEALING: SegmentState.SEALING,
    entry_pb2.SEALED: SegmentState.SEALED,
}


def stream_info(info: master_pb2.StreamInfo) -> StreamInfo:
    return StreamInfo(
        name=info.name,
        stream_id=info.stream_id,
        replicas=info.policy.replicas,
        write_quorum=info.policy.write_quorum,
        segment_bytes=info.segment_bytes,
        segment_age_ms=info.segment_age_ms,
        epoch=info.epoch,
        leader_id=info.leader_id,
        acked_index=info.acked_index,
        open_segment_epoch=info.open_segment_epoch,
        unsealed_segments=info.unsealed_segments,
        created_at_ms=info.created_at_ms,
        retention_age_ms=info.retention_age_ms,
        retention_bytes=info.retention_bytes,
        trimmed_through_epoch=info.trimmed_through_epoch,
        first_retained_sequence=info.first_retained_sequence,
        deleted_until_ms=info.deleted_until_ms,
    )


def segment_info(segment: entry_pb2.Segment) -> SegmentInfo:
    return SegmentInfo(
        stream=segment.id.stream,
        stream_id=segment.id.stream_id,
        epoch=segment.id.epoch,
        state=SEGMENT_STATES[segment.state],
        copy_set=tuple(
            Replica(r.store_id, r.address, r.zone, r.data_address) for r in segment.copy_set
        ),
        final_index=segment.final_index,
        acked_index=segment.acked_index,
        created_at_ms=segment.created_at_ms,
        sealed_at_ms=segment.sealed_at_ms,
        bytes=segment.bytes,
        bad_stores=tuple(segment.bad_stores),
        lost_from_index=segment.lost_from_index,
        certified_by=segment.certificate.certified_by,
    )


def heartbeat_answer(sent_at_ms: int, reply: master_pb2.WriterHeartbeatReply) -> HeartbeatAnswered:
    policy: ReplicationPolicy | None = None
    if reply.HasField("policy"):
        with contextlib.suppress(InvalidPolicy):
            policy = ReplicationPolicy(reply.policy.replicas, reply.policy.write_quorum)
    return HeartbeatAnswered(
        sent_at_ms=sent_at_ms,
        leader=reply.role == master_pb2.LEADER,
        epoch=reply.epoch,
        lease_ms=reply.lease_ms,
        leader_id=reply.leader_id,
        segment=grant_from_pb(reply.segment) if reply.HasField("segment") else None,
        unsealed=tuple(grant_from_pb(segment) for segment in reply.unsealed),
        policy=policy,
        roll_requested=reply.roll_requested,
        roll_reason=reply.roll_reason,
        segment_bytes_max=reply.segment_bytes_max,
        segment_age_ms_max=reply.segment_age_ms_max,
        grant=reply.grant,
        producers=_producer_positions(reply),
        stream_has_producers=reply.stream_has_producers,
        lease_won=bool(reply.lease_secret),
        session_incarnation=reply.session_incarnation,
    )


def _producer_positions(
    reply: master_pb2.WriterHeartbeatReply,
) -> tuple[ProducerPosition, ...] | None:
    """The grant's producer positions; None when they do not parse (it cannot lead)."""
    try:
        return codec.producer_positions_from_pb(reply.producers)
    except codec.MalformedProducers as error:
        log.warning("a grant with producer positions that do not parse: %s", error)
        return None


class LeaseSecret:
    """This writer's lease secret: drawn by the writer, shown with its every call
    (heartbeat, hold, release, roll) from the first heartbeat on, so that the grant it
    wins holds it whether or not the grant's answer reaches it (docs/design.md,
    "Leadership"). The client id alone is published, and proves nothing. An older master
    hands a secret of its own with each grant: that one is kept from then on. Kept
    beside the grant, in the shell: the core never needs it."""

    def __init__(self, drawn: bytes | None = None) -> None:
        self._secret = secrets.token_bytes(LEASE_SECRET_BYTES) if drawn is None else drawn
        assert LEASE_SECRET_BYTES_MIN <= len(self._secret) <= LEASE_SECRET_BYTES_MAX

    def learn(self, secret: bytes) -> None:
        """Keep the secret of an answer that granted the lease (empty: nothing new)."""
        if secret:
            self._secret = secret

    def shown(self) -> bytes:
        return self._secret

    def answered_without_it(self, shown: bytes, leader: bool) -> bool:
        """A FOLLOWER answer to a heartbeat that showed another secret than the one held
        now (an older master's, handed while the answer was on its way): the master
        could not tell this writer from a follower, so the answer says nothing of its
        lease."""
        return not leader and shown != self._secret


class BatchCache:
    """Each batch serialized once, not once per store: a `WriteRequest` holding only the
    packed entries, to which each store's request prepends its own other fields
    (protobuf merges concatenated messages)."""

    def __init__(self) -> None:
        self._batches: dict[tuple[int, int, int], bytes] = {}

    def entries(self, send: SendWrite) -> bytes:
        key = (send.segment.epoch, send.first_index, send.last_index)
        found = self._batches.get(key)
        if found is None:
            found = codec.write_request(send.batch()).SerializeToString()
            if len(self._batches) >= ENTRY_CACHE_BATCHES:
                del self._batches[next(iter(self._batches))]
            self._batches[key] = found
        return found


def serialize_write(send: SendWrite, cache: BatchCache) -> bytes:
    """The `WriteRequest` of `send`, as bytes."""
    head = segment_store_pb2.WriteRequest(
        segment=entry_pb2.SegmentId(
            stream_id=send.segment.stream_id, epoch=send.segment.epoch, stream=send.segment.stream
        ),
        writer_epoch=send.writer_epoch,
        acked_index=send.acked_index,
        request_id=send.request_id,
        grant=send.grant,
    ).SerializeToString()
    return head + cache.entries(send) if send.payloads else head


def write_message(parts: Sequence[bytes]) -> bytes:
    """One Write message of the serialized requests `parts` (`serialize_write`): the
    request itself when alone, else a `WriteRequest` carrying them as its `parts`,
    each framed as protobuf frames a repeated message (key, length, bytes), so no
    request is parsed or serialized again."""
    return b"".join(write_message_pieces(parts))


def write_message_pieces(parts: Sequence[bytes]) -> list[bytes]:
    """`write_message` in pieces to send in order, the requests themselves not copied."""
    if len(parts) == 1:
        return [parts[0]]
    pieces: list[bytes] = []
    for part in parts:
        pieces += (_PARTS_KEY + _varint(len(part)), part)
    return pieces


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
