"""The writer's pre-serialized Write requests parse as the WriteRequest they stand for."""

from __future__ import annotations

from streamengine.client.core.replicator import SegmentRef, SendWrite
from streamengine.client.wire import BatchCache, LeaseSecret, serialize_write, write_message
from streamengine.protocol.entry import EntryKind, PackedEntries, StoredEntry, event_crcs
from streamengine.protocol.limits import LEASE_SECRET_BYTES
from streamengine.v1 import segment_store_pb2

SEGMENT = SegmentRef(stream_id=9, epoch=4, stream="acme/orders")


def send_write(
    store: str,
    request_id: int,
    acked: int,
    payloads: tuple[bytes, ...],
    first: int,
    grant: bytes = b"",
) -> SendWrite:
    """A replicator's SendWrite of EVENTs of epoch 4 from index `first`."""
    crcs = event_crcs(4, first, payloads)
    return SendWrite(store, SEGMENT, 4, request_id, acked, first, payloads, crcs, grant)


def test_a_batch_serialized_once_parses_per_store_with_its_own_fields() -> None:
    entries = tuple(StoredEntry.make(i, EntryKind.EVENT, 4, b"p%d" % i) for i in range(5, 9))
    cache = BatchCache()
    for store, request_id, acked in (("s1", 11, 3), ("s2", 12, 4)):
        send = send_write(store, request_id, acked, tuple(e.payload for e in entries), 5)
        assert send.entries == entries
        request = segment_store_pb2.WriteRequest.FromString(serialize_write(send, cache))
        assert (request.segment.stream_id, request.segment.epoch, request.segment.stream) == (
            9,
            4,
            "acme/orders",
        )
        assert (request.writer_epoch, request.acked_index, request.request_id) == (
            4,
            acked,
            request_id,
        )
        batch = PackedEntries.from_wire(
            request.first_index, request.packed_values, request.value_lengths
        )
        assert batch.entries() == list(entries)


def test_an_empty_request_carries_only_the_acked_index() -> None:
    send = send_write("s1", 1, 7, (), 0)
    request = segment_store_pb2.WriteRequest.FromString(serialize_write(send, BatchCache()))
    assert request.acked_index == 7 and not request.value_lengths and not request.first_index


def test_the_grant_rides_on_the_request_that_carries_it_only() -> None:
    cache = BatchCache()
    with_grant = send_write("s1", 1, 0, (b"p",), 1, grant=b"signed grant")
    without = send_write("s1", 2, 0, (b"p",), 1)
    parsed = [
        segment_store_pb2.WriteRequest.FromString(serialize_write(send, cache))
        for send in (with_grant, without)
    ]
    assert [request.grant for request in parsed] == [b"signed grant", b""]
    assert [len(request.value_lengths) for request in parsed] == [1, 1]


def test_the_lease_secret_is_drawn_by_the_writer_and_an_older_masters_kept() -> None:
    drawn = [LeaseSecret().shown() for _ in range(2)]
    assert len(drawn[0]) == LEASE_SECRET_BYTES and drawn[0] != drawn[1], "each its own"
    secret = LeaseSecret(b"d" * 32)
    assert secret.shown() == b"d" * 32, "shown from the first heartbeat on"
    secret.learn(b"")  # a renewal hands nothing; a newer master's grant, the same one
    assert secret.shown() == b"d" * 32
    secret.learn(b"k" * 32)  # an older master's grant hands its own
    secret.learn(b"")  # a renewal or a roll hands nothing: the secret holds
    assert secret.shown() == b"k" * 32
    secret.learn(b"n" * 32)  # the lease won again, after it was lost
    assert secret.shown() == b"n" * 32


def test_requests_framed_as_parts_parse_as_one_message_of_them() -> None:
    """`write_message` frames serialized requests as `WriteRequest.parts` without
    parsing them: the message parses to the same requests, in order, whatever their
    size (lengths of one to three varint bytes)."""
    cache = BatchCache()
    sends = [
        send_write("s1", 1, 0, (), 0),
        send_write("s1", 2, 0, (b"x",), 1, grant=b"g" * 40),
        send_write("s1", 3, 1, (b"y" * 200,), 2),
        send_write("s1", 4, 2, (b"z" * 20_000,), 3),
    ]
    parts = [serialize_write(send, cache) for send in sends]
    message = segment_store_pb2.WriteRequest.FromString(write_message(parts))
    assert len(message.ListFields()) == 1
    assert [part.SerializeToString() for part in message.parts] == [
        segment_store_pb2.WriteRequest.FromString(part).SerializeToString() for part in parts
    ]
    assert [part.request_id for part in message.parts] == [1, 2, 3, 4]
    assert write_message(parts[:1]) == parts[0], "one request alone is its own message"
