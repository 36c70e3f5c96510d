"""The segment record each copy-set store keeps, from which a master rebuilds.

The master sends each copy-set store its record of a segment (`v1.SegmentRecord`) with
a heartbeat reply whenever the record changed (the store reports the version it keeps;
`record_version` of the bytes), so that a master that lost its metadata rebuilds it
from the stores (`master.rebuild`). This module converts between the catalog's records
and the wire's, and remembers each record's encoding until the record changes, so a
heartbeat costs a lookup per segment held, not an encoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from streamengine.master.core.errors import InvalidArgument
from streamengine.master.core.model import (
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StreamRecord,
    validate_name_part,
    validate_stream_name,
)
from streamengine.master.core.rebuild import View
from streamengine.protocol import codec
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.policy import InvalidPolicy, ReplicationPolicy
from streamengine.protocol.segment_records import RECORDS_PER_HEARTBEAT_MAX, record_version
from streamengine.v1 import entry_pb2


class MalformedRecord(ValueError):
    """A store's record that does not decode."""


def record_pb(stream: StreamRecord, segment: SegmentRecord) -> entry_pb2.SegmentRecord:
    assert stream.stream_id == segment.stream_id and stream.name == segment.stream
    message = entry_pb2.SegmentRecord(
        id=entry_pb2.SegmentId(
            stream_id=segment.stream_id, epoch=segment.epoch, stream=stream.name
        ),
        policy=entry_pb2.ReplicationPolicy(
            replicas=stream.replicas, write_quorum=stream.write_quorum
        ),
        segment_bytes=stream.segment_bytes,
        segment_age_ms=stream.segment_age_ms,
        stream_created_at_ms=stream.created_at_ms,
        copy_set=list(segment.copy_set),
        state=int(segment.state),  # type: ignore[arg-type]
        final_index=segment.final_index,
        created_at_ms=segment.created_at_ms,
        sealed_at_ms=segment.sealed_at_ms,
        settled_at_ms=segment.settled_at_ms,
        bad_stores=list(segment.bad),
        lost_from_index=segment.lost_from_index,
        verified_stores=list(segment.verified),
        stream_has_producers=stream.has_producers,
    )
    if segment.certificate is not None:
        message.certificate.CopyFrom(codec.certificate_to_pb(segment.certificate))
        message.certificate.certified_by = segment.certified_by
    if segment.producers is not None:
        message.producers.CopyFrom(codec.producer_positions_to_pb(segment.producers))
    # Only in the records of the segments from that seal on: the older ones' bytes stay,
    # so a seal does not send the stores every record of the stream again, and once a
    # trim took the sealed ones the newest segments still carry them.
    if stream.producers_epoch and segment.epoch >= stream.producers_epoch:
        message.stream_producers.CopyFrom(codec.producer_positions_to_pb(stream.producers))
        message.stream_producers_epoch = stream.producers_epoch
    return message


def record_from_bytes(raw: bytes) -> tuple[StreamRecord, SegmentRecord]:
    """The stream (epoch 0, no holder: the record does not know them) and the segment
    a store's record describes; raises MalformedRecord."""
    message = entry_pb2.SegmentRecord()
    try:
        message.ParseFromString(raw)
        state = SegmentState(message.state)
        certificate = (
            codec.certificate_from_pb(message.certificate)
            if message.HasField("certificate")
            else None
        )
        producers = (
            codec.producer_positions_from_pb(message.producers)
            if message.HasField("producers")
            else None
        )
        stream_producers = codec.producer_positions_from_pb(message.stream_producers)
    except (DecodeError, ValueError, MalformedCertificate) as error:
        raise MalformedRecord(f"a segment record that does not decode: {error}") from None
    if not message.id.stream_id or not message.id.epoch:
        raise MalformedRecord("a segment record without its segment")
    try:
        validate_stream_name(message.id.stream)
        ReplicationPolicy(message.policy.replicas, message.policy.write_quorum)
    except (InvalidArgument, InvalidPolicy) as error:
        raise MalformedRecord(f"a segment record of a stream that cannot be: {error}") from None
    stream = StreamRecord(
        name=message.id.stream,
        stream_id=message.id.stream_id,
        replicas=message.policy.replicas,
        write_quorum=message.policy.write_quorum,
        segment_bytes=message.segment_bytes,
        segment_age_ms=message.segment_age_ms,
        epoch=0,
        leader_id="",
        created_at_ms=message.stream_created_at_ms,
        has_producers=message.stream_has_producers,
        producers=stream_producers if message.stream_producers_epoch else (),
        producers_epoch=message.stream_producers_epoch,
    )
    segment = SegmentRecord(
        stream_id=message.id.stream_id,
        stream=message.id.stream,
        epoch=message.id.epoch,
        copy_set=tuple(message.copy_set),
        state=state,
        final_index=message.final_index,
        created_at_ms=message.created_at_ms,
        sealed_at_ms=message.sealed_at_ms,
        settled_at_ms=message.settled_at_ms,
        certificate=certificate,
        certified_by=message.certificate.certified_by if certificate is not None else "",
        bad=tuple(message.bad_stores),
        lost_from_index=message.lost_from_index,
        verified=tuple(message.verified_stores),
        producers=producers,
    )
    return stream, segment


# Records a heartbeat encodes afresh at most (some 15 us each). A master that starts over
# 100,000 streams knows none of the versions its stores keep: encoding the 200,000 a
# store holds took 3 s on the loop at its first heartbeat (and as long for each store),
# which serves every request and keeps an etcd master's election lease alive. Bounded,
# a store's records are known after some hundred heartbeats, and a record that changes
# once they are is sent at the next.
ENCODINGS_PER_HEARTBEAT_MAX = 2000


@dataclass(frozen=True, slots=True)
class _Encoded:
    stream: StreamRecord
    segment: SegmentRecord
    message: entry_pb2.SegmentRecord
    version: int


class RecordEncodings:
    """Each segment's record as sent, with its version, until the records it was made
    of change (they are frozen: a change is a new object)."""

    def __init__(self) -> None:
        self._encoded: dict[SegmentKey, _Encoded] = {}

    def encoded(self, stream: StreamRecord, segment: SegmentRecord) -> _Encoded:
        known = self._encoded.get(segment.key)
        if known is not None and known.segment is segment and known.stream is stream:
            return known
        message = record_pb(stream, segment)
        version = record_version(message.SerializeToString(deterministic=True))
        fresh = _Encoded(stream, segment, message, version)
        self._encoded[segment.key] = fresh
        return fresh

    def to_send(
        self,
        store_id: str,
        versions: dict[SegmentKey, int],
        segments: dict[SegmentKey, SegmentRecord],
        stream_of: Callable[[int], StreamRecord | None],
    ) -> list[entry_pb2.SegmentRecord]:
        """The records `store_id` should keep and does not (`versions`: what it keeps of
        each segment it holds), for segments whose copy set names it; at most
        `RECORDS_PER_HEARTBEAT_MAX`, and at most `ENCODINGS_PER_HEARTBEAT_MAX` records
        encoded afresh: after a start every record is, and the rest wait for the next
        heartbeats."""
        out: list[entry_pb2.SegmentRecord] = []
        fresh = 0
        for key, version in sorted(versions.items()):
            segment = segments.get(key)
            stream = stream_of(key[0])
            if segment is None or stream is None or store_id not in segment.copy_set:
                continue
            known = self._encoded.get(key)
            if known is None or known.segment is not segment or known.stream is not stream:
                if fresh >= ENCODINGS_PER_HEARTBEAT_MAX:
                    continue
                fresh += 1
            encoded = self.encoded(stream, segment)
            if encoded.version != version:
                out.append(encoded.message)
                if len(out) >= RECORDS_PER_HEARTBEAT_MAX:
                    break
        if len(self._encoded) > 2 * len(segments) + RECORDS_PER_HEARTBEAT_MAX:
            # Deleted segments' encodings, dropped now and then (each drop costs a pass).
            for key in [k for k in self._encoded if k not in segments]:
                del self._encoded[key]
        return out


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster view the stores keep (`v1.ClusterView`): every store the master
    knows, the highest stream id it gave and the streams no store keeps a record of;
    with its version as a store reports it (`record_version` of the bytes)."""

    message: entry_pb2.ClusterView
    version: int


def card_pb(stream: StreamRecord) -> entry_pb2.StreamCard:
    return entry_pb2.StreamCard(
        stream_id=stream.stream_id,
        name=stream.name,
        policy=entry_pb2.ReplicationPolicy(
            replicas=stream.replicas, write_quorum=stream.write_quorum
        ),
        segment_bytes=stream.segment_bytes,
        segment_age_ms=stream.segment_age_ms,
        created_at_ms=stream.created_at_ms,
        has_producers=stream.has_producers,
    )


def cluster_view_pb(
    stores: Iterable[str], stream_ids_through: int, streams: Iterable[StreamRecord] = ()
) -> entry_pb2.ClusterView:
    return entry_pb2.ClusterView(
        stores=sorted(stores),
        stream_ids_through=stream_ids_through,
        streams=[card_pb(s) for s in streams],
    )


class ClusterViews:
    """The master's cluster view, encoded again only when its stores, its next stream
    id or its unrecorded streams changed (`streams_key`: a count of their changes), so
    that a heartbeat costs a pass over the store ids, not a sort and a digest."""

    def __init__(self) -> None:
        self._key: tuple[tuple[str, ...], int, object] | None = None
        self._view: ClusterView | None = None

    def current(
        self,
        stores: Iterable[str],
        stream_ids_through: int,
        streams_key: object = None,
        streams: Callable[[], Iterable[StreamRecord]] = tuple,
    ) -> ClusterView:
        key = (tuple(stores), stream_ids_through, streams_key)
        if self._view is None or key != self._key:
            message = cluster_view_pb(key[0], stream_ids_through, streams())
            raw = message.SerializeToString(deterministic=True)
            self._key, self._view = key, ClusterView(message, record_version(raw))
        return self._view


def cluster_view_from_pb(message: entry_pb2.ClusterView) -> View:
    """The view a store keeps, as a rebuild reads it: stores and stream cards that
    cannot be are left out."""
    stores = []
    for store_id in message.stores:
        try:
            validate_name_part("store id", store_id)
        except InvalidArgument:
            continue
        stores.append(store_id)
    streams = []
    for card in message.streams:
        try:
            validate_stream_name(card.name)
            ReplicationPolicy(card.policy.replicas, card.policy.write_quorum)
        except (InvalidArgument, InvalidPolicy):
            continue
        if not 0 < card.stream_id < message.stream_ids_through + 1:
            continue
        streams.append(
            StreamRecord(
                name=card.name,
                stream_id=card.stream_id,
                replicas=card.policy.replicas,
                write_quorum=card.policy.write_quorum,
                segment_bytes=card.segment_bytes,
                segment_age_ms=card.segment_age_ms,
                epoch=0,
                leader_id="",
                created_at_ms=card.created_at_ms,
                has_producers=card.has_producers,
            )
        )
    return View(tuple(sorted(set(stores))), message.stream_ids_through, tuple(streams))
