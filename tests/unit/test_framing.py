"""The data plane's pure protocol (protocol/framing.py): frames, the decoder and its
bound, the hello's negotiation, flow control. Tables first, then property-based fuzzing
of the decoder: whatever the bytes, the answer is frames or one FrameError, never
another exception, never more held than the bound; what the encoder made decodes back.

Deterministic (`derandomize`): a failure repeats with the same examples.
"""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamengine.protocol import auth, framing
from streamengine.protocol.framing import (
    HEADER,
    Frame,
    FrameDecoder,
    FrameError,
    Kind,
    ReceiveWindow,
    SendCredit,
    StatusCode,
    VersionRange,
)
from streamengine.protocol.limits import (
    FRAME_PAYLOAD_BYTES_MAX,
    HELLO_PAYLOAD_BYTES_MAX,
    STREAM_CREDIT_BYTES,
)
from streamengine.v1 import data_plane_pb2, entry_pb2, segment_store_pb2

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None)
SMALL_BOUND = 256


def raw_header(length: int, kind: int, flags: int = 0, reserved: int = 0, rid: int = 1) -> bytes:
    return struct.pack("!IBBHQ", length, kind, flags, reserved, rid)


def test_the_header_is_sixteen_bytes_in_network_order() -> None:
    frame = framing.encode(Kind.CREDIT, 0x0102030405060708, data_plane_pb2.Credit(bytes=5))
    assert frame[:16] == bytes([0, 0, 0, 2, 4, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert frame[16:] == data_plane_pb2.Credit(bytes=5).SerializeToString()


def test_a_frame_round_trips_in_any_pieces() -> None:
    request = segment_store_pb2.WriteRequest(request_id=7, packed_values=b"x" * 100)
    wire = framing.encode(Kind.WRITE_REQUEST, 3, request) + framing.encode(
        Kind.END, 3, data_plane_pb2.End()
    )
    decoder = FrameDecoder(FRAME_PAYLOAD_BYTES_MAX)
    frames = [frame for byte in wire for frame in decoder.feed(bytes([byte]))]
    assert [(f.kind, f.request_id) for f in frames] == [(Kind.WRITE_REQUEST, 3), (Kind.END, 3)]
    assert framing.parse(frames[0], segment_store_pb2.WriteRequest) == request
    assert decoder.buffered_bytes == 0


def test_parts_encode_as_the_message_they_join() -> None:
    request = segment_store_pb2.WriteRequest(request_id=9, packed_values=b"abc")
    data = request.SerializeToString()
    parts = framing.encode_parts(Kind.WRITE_REQUEST, 5, [data[:3], data[3:]])
    assert b"".join(parts) == framing.encode(Kind.WRITE_REQUEST, 5, request)


@pytest.mark.parametrize(
    ("wire", "code", "words"),
    [
        (raw_header(SMALL_BOUND + 1, Kind.WRITE_REQUEST), StatusCode.RESOURCE_EXHAUSTED, "over"),
        (raw_header(0, 99), StatusCode.INVALID_ARGUMENT, "unknown frame kind"),
        (raw_header(0, 0), StatusCode.INVALID_ARGUMENT, "unknown frame kind"),
        (raw_header(0, Kind.END, flags=1), StatusCode.INVALID_ARGUMENT, "must be zero"),
        (raw_header(0, Kind.END, reserved=1), StatusCode.INVALID_ARGUMENT, "must be zero"),
        (raw_header(0xFFFFFFFF, Kind.HELLO), StatusCode.RESOURCE_EXHAUSTED, "over"),
    ],
)
def test_a_bad_header_is_refused_before_its_payload(
    wire: bytes, code: StatusCode, words: str
) -> None:
    decoder = FrameDecoder(SMALL_BOUND)
    with pytest.raises(FrameError) as raised:
        decoder.feed(wire)  # the header alone: no payload was waited for
    assert raised.value.code is code and words in raised.value.details
    # The first error is final.
    with pytest.raises(FrameError):
        decoder.feed(framing.encode(Kind.END, 1, data_plane_pb2.End()))


def test_before_the_hello_frames_are_held_to_the_hello_bound() -> None:
    decoder = FrameDecoder()
    assert decoder.payload_bytes_max == HELLO_PAYLOAD_BYTES_MAX
    with pytest.raises(FrameError):
        decoder.feed(raw_header(HELLO_PAYLOAD_BYTES_MAX + 1, Kind.WRITE_REQUEST))
    known = FrameDecoder()
    known.allow_payload_bytes(FRAME_PAYLOAD_BYTES_MAX)
    assert known.feed(raw_header(HELLO_PAYLOAD_BYTES_MAX + 1, Kind.WRITE_REQUEST)) == []


def test_a_payload_that_does_not_parse_is_the_peers_fault() -> None:
    with pytest.raises(FrameError) as raised:
        framing.parse(Frame(Kind.CREDIT, 1, b"\xff\xff\xff"), data_plane_pb2.Credit)
    assert raised.value.code is StatusCode.INVALID_ARGUMENT


def test_our_own_frame_over_the_bound_is_refused() -> None:
    with pytest.raises(FrameError) as raised:
        framing.header(Kind.WRITE_REQUEST, 1, FRAME_PAYLOAD_BYTES_MAX + 1)
    assert raised.value.code is StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("kind", "request_id", "from_client", "allowed"),
    [
        (Kind.HELLO, 0, True, True),
        (Kind.HELLO, 1, True, False),  # the hello is the connection's
        (Kind.HELLO, 0, False, False),  # servers answer HelloOk
        (Kind.HELLO_OK, 0, False, True),
        (Kind.WRITE_REQUEST, 1, True, True),
        (Kind.WRITE_REQUEST, 0, True, False),  # a request needs its id
        (Kind.WRITE_REQUEST, 1, False, False),
        (Kind.WRITE_REPLY, 1, False, True),
        (Kind.WRITE_REPLY, 1, True, False),
        (Kind.READ_REQUEST, 1, True, True),
        (Kind.READ_REQUEST, 0, True, False),
        (Kind.READ_REQUEST, 1, False, False),
        (Kind.READ_REPLY, 1, False, True),
        (Kind.READ_REPLY, 1, True, False),
        (Kind.SUBSCRIBE_REQUEST, 1, True, True),
        (Kind.SUBSCRIBE_REQUEST, 0, True, False),
        (Kind.SUBSCRIBE_REQUEST, 1, False, False),
        (Kind.SUBSCRIBE_REPLY, 1, False, True),
        (Kind.SUBSCRIBE_REPLY, 1, True, False),
        (Kind.ERROR, 0, False, True),  # the connection's end
        (Kind.ERROR, 4, False, True),  # a request's end
        (Kind.ERROR, 4, True, False),  # a client cancels instead
        (Kind.CANCEL, 4, True, True),
        (Kind.CANCEL, 4, False, False),
        (Kind.PING, 0, False, True),
        (Kind.PONG, 2, True, False),
        (Kind.CREDIT, 2, False, True),
        (Kind.CREDIT, 0, True, False),
        (Kind.END, 2, True, True),
        (Kind.END, 2, False, True),
    ],
)
def test_who_sends_what_on_which_request_id(
    kind: Kind, request_id: int, from_client: bool, allowed: bool
) -> None:
    frame = Frame(kind, request_id)
    if allowed:
        framing.check_direction(frame, from_client)
    else:
        with pytest.raises(FrameError):
            framing.check_direction(frame, from_client)


@pytest.mark.parametrize(
    ("ours", "theirs", "chosen"),
    [
        (VersionRange(1, 1), VersionRange(1, 1), 1),
        (VersionRange(1, 2), VersionRange(1, 1), 1),  # an old client, a new server
        (VersionRange(1, 1), VersionRange(1, 3), 1),  # a new client, an old server
        (VersionRange(2, 4), VersionRange(1, 3), 3),  # the highest both speak
        (VersionRange(2, 3), VersionRange(1, 1), None),
        (VersionRange(1, 1), VersionRange(2, 2), None),
    ],
)
def test_the_hello_picks_the_highest_common_version(
    ours: VersionRange, theirs: VersionRange, chosen: int | None
) -> None:
    if chosen is None:
        with pytest.raises(FrameError) as raised:
            framing.negotiate(ours, theirs)
        assert raised.value.code is StatusCode.FAILED_PRECONDITION
        assert str(theirs) in raised.value.details and "upgrade" in raised.value.details
    else:
        assert framing.negotiate(ours, theirs) == chosen


FRAME_BYTES = HEADER.size + FRAME_PAYLOAD_BYTES_MAX


@pytest.mark.parametrize(
    ("hello", "words"),
    [
        (data_plane_pb2.Hello(version_min=2, version_max=1), "no range"),
        (data_plane_pb2.Hello(version_min=0, version_max=1), "no range"),
        (data_plane_pb2.Hello(version_min=1, version_max=1, stream_credit_bytes=10), "credit"),
        (data_plane_pb2.Hello(version_min=1, version_max=1, stream_credit_bytes=1 << 60), "credit"),
        (
            data_plane_pb2.Hello(version_min=5, version_max=9, stream_credit_bytes=FRAME_BYTES),
            "no common protocol version",
        ),
    ],
)
def test_a_server_refuses_a_hello_it_cannot_honour(hello: data_plane_pb2.Hello, words: str) -> None:
    with pytest.raises(FrameError) as raised:
        framing.accept_hello(hello, framing.VERSIONS, FRAME_BYTES)
    assert words in raised.value.details


def test_a_server_accepts_a_hello_of_a_range_it_shares() -> None:
    hello = data_plane_pb2.Hello(version_min=1, version_max=4, stream_credit_bytes=FRAME_BYTES)
    assert framing.accept_hello(hello, framing.VERSIONS, FRAME_BYTES) == 1


def good_hello_ok() -> data_plane_pb2.HelloOk:
    return data_plane_pb2.HelloOk(
        version=1,
        stream_credit_bytes=STREAM_CREDIT_BYTES,
        frame_payload_bytes_max=FRAME_PAYLOAD_BYTES_MAX,
        requests_max=8,
        ping_interval_ms=1000,
        dead_peer_ms=5000,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("version", 2),
        ("frame_payload_bytes_max", 0),
        ("frame_payload_bytes_max", FRAME_PAYLOAD_BYTES_MAX + 1),
        ("stream_credit_bytes", 100),
        ("requests_max", 0),
        ("ping_interval_ms", 0),
        ("dead_peer_ms", 1000),
    ],
)
def test_a_client_refuses_a_hello_ok_out_of_range(field: str, value: int) -> None:
    framing.check_hello_ok(good_hello_ok(), framing.VERSIONS)
    hello_ok = good_hello_ok()
    setattr(hello_ok, field, value)
    with pytest.raises(FrameError):
        framing.check_hello_ok(hello_ok, framing.VERSIONS)


def test_a_sender_spends_what_it_was_granted() -> None:
    credit = SendCredit(100)
    assert credit.can_send(100) and not credit.can_send(101)
    credit.spend(60)
    assert not credit.can_send(41)
    credit.grant(data_plane_pb2.Credit(bytes=50))
    assert credit.available == 90
    with pytest.raises(FrameError):
        credit.grant(data_plane_pb2.Credit(bytes=0))
    with pytest.raises(FrameError):
        credit.grant(data_plane_pb2.Credit(bytes=framing.CREDIT_BYTES_MAX))


def test_a_receiver_buffers_no_more_than_its_window() -> None:
    window = ReceiveWindow(100)
    window.receive(40)
    window.receive(60)
    with pytest.raises(FrameError) as raised:
        window.receive(1)  # the peer sent past its credit
    assert raised.value.code is StatusCode.RESOURCE_EXHAUSTED
    assert window.consume(40) == 0  # under half a window: not yet
    assert window.consume(10) == 50  # half a window taken: granted back at once
    assert window.remaining == 50 and window.buffered == 50


def test_credit_granted_back_lets_a_flow_go_on_forever() -> None:
    window, credit = ReceiveWindow(1000), SendCredit(1000)
    for _ in range(10_000):
        assert credit.can_send(70)
        credit.spend(70)
        window.receive(70)
        granted = window.consume(70)
        if granted:
            credit.grant(data_plane_pb2.Credit(bytes=granted))
    assert credit.available == window.remaining


# Fuzzing the decoder.

KINDS = st.sampled_from(list(Kind))


@st.composite
def frames(draw: st.DrawFn) -> tuple[Kind, int, bytes]:
    return (
        draw(KINDS),
        draw(st.integers(0, framing.REQUEST_ID_MAX)),
        draw(st.binary(max_size=SMALL_BOUND)),
    )


def encoded(made: list[tuple[Kind, int, bytes]]) -> bytes:
    return b"".join(framing.header(kind, rid, len(data)) + data for kind, rid, data in made)


def feed_in_pieces(decoder: FrameDecoder, wire: bytes, cuts: list[int]) -> list[Frame]:
    found: list[Frame] = []
    start = 0
    for cut in [*sorted(cut % (len(wire) + 1) for cut in cuts), len(wire)]:
        found += decoder.feed(wire[start:cut] if cut >= start else b"")
        start = max(start, cut)
        assert decoder.buffered_bytes < HEADER.size + SMALL_BOUND
    return found


@FUZZ
@given(st.lists(frames(), max_size=8), st.lists(st.integers(0, 1 << 16), max_size=6))
def test_what_the_encoder_made_decodes_back(
    made: list[tuple[Kind, int, bytes]], cuts: list[int]
) -> None:
    wire = encoded(made)
    decoded = feed_in_pieces(FrameDecoder(SMALL_BOUND), wire, cuts)
    assert [(f.kind, f.request_id, f.payload) for f in decoded] == made


@FUZZ
@given(st.binary(max_size=2048), st.lists(st.integers(0, 1 << 16), max_size=6))
def test_random_bytes_give_frames_or_one_frame_error(data: bytes, cuts: list[int]) -> None:
    decoder = FrameDecoder(SMALL_BOUND)
    try:
        for frame in feed_in_pieces(decoder, data, cuts):
            check_frame_fully(frame)
    except FrameError:
        pass


@FUZZ
@given(
    st.lists(frames(), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_mutated_frames_give_frames_or_one_frame_error(
    made: list[tuple[Kind, int, bytes]], flips: list[tuple[int, int]]
) -> None:
    wire = bytearray(encoded(made))
    for position, value in flips:
        wire[position % len(wire)] = value
    decoder = FrameDecoder(SMALL_BOUND)
    try:
        for frame in decoder.feed(bytes(wire)):
            check_frame_fully(frame)
    except FrameError:
        pass
    assert decoder.buffered_bytes < HEADER.size + SMALL_BOUND


# Each message kind's payload type: methods' requests and replies.
MESSAGE_TYPES = {m.request_kind: m.request_type for m in framing.METHODS.values()} | {
    m.reply_kind: m.reply_type for m in framing.METHODS.values()
}


def check_frame_fully(frame: Frame) -> None:
    """Every step a receiver takes with a frame: its direction either way, and its
    payload as the message its kind names; each may only refuse with a FrameError."""
    for from_client in (True, False):
        with contextlib.suppress(FrameError):
            framing.check_direction(frame, from_client)
    if framing.is_message(frame.kind):
        framing.parse(frame, MESSAGE_TYPES[frame.kind])
    else:
        framing.parse_control(frame)


def test_each_method_has_its_kinds_messages_and_security_name() -> None:
    """The method table as the spec's kinds table has it (docs/data-plane.md): a request
    kind even, its reply the next, each under its gRPC call's name in `auth.RPC_NEEDS`."""
    subscribe = framing.METHODS[Kind.SUBSCRIBE_REQUEST]
    assert (subscribe.name, subscribe.reply_kind) == ("SegmentStore/Subscribe", 37)
    assert subscribe.request_type is segment_store_pb2.SubscribeRequest
    assert subscribe.reply_type is segment_store_pb2.SubscribeReply
    assert framing.METHODS[Kind.WRITE_REQUEST].name == "SegmentStore/Write"
    assert framing.METHODS[Kind.READ_REQUEST].name == "SegmentStore/Read"
    for kind, method in framing.METHODS.items():
        assert kind == method.request_kind and kind % 2 == 0
        assert method.reply_kind == kind + 1
        assert framing.is_message(kind) and framing.is_message(method.reply_kind)
        assert method.name in auth.RPC_NEEDS


READ_REQUEST_WIRE = framing.encode(
    Kind.READ_REQUEST,
    1,
    segment_store_pb2.ReadRequest(
        segment=entry_pb2.SegmentId(stream_id=7, epoch=3, stream="t/s"),
        from_index=1,
        to_index=9,
        acked_only=True,
        packed=True,
    ),
)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 10), st.integers(0, 255)), min_size=1, max_size=8))
def test_a_mutated_read_request_is_a_read_request_or_one_frame_error(
    flips: list[tuple[int, int]],
) -> None:
    """A Read request's frame with bytes changed anywhere (header or payload): what
    decodes is checked and parsed as its kind says, or refused with a FrameError."""
    wire = bytearray(READ_REQUEST_WIRE)
    for position, value in flips:
        wire[position % len(wire)] = value
    decoder = FrameDecoder(SMALL_BOUND)
    try:
        for frame in decoder.feed(bytes(wire)):
            check_frame_fully(frame)
            if frame.kind is Kind.READ_REQUEST:
                parsed = framing.parse(frame, framing.READ.request_type)
                assert isinstance(parsed, segment_store_pb2.ReadRequest)
    except FrameError:
        pass
    assert decoder.buffered_bytes < HEADER.size + SMALL_BOUND
