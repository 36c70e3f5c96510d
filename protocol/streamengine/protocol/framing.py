"""The data plane's frames, as plain bookkeeping: no socket, no clock (docs/data-plane.md).

Theory of operation. A connection is a byte stream of frames, each a fixed header and a
payload:

    length u32 | kind u8 | flags u8 | reserved u16 | request id u64     (network order)

`length` counts the payload alone. The payload is one protobuf message: the protocol's
own (data_plane.proto: Hello, HelloOk, Error, Credit, Ping, Pong, Cancel, End) or a
method's request or reply (WriteRequest and WriteReply, ReadRequest and ReadReply,
SubscribeRequest and SubscribeReply). The kind says which, so a receiver parses nothing
it did not expect. Flags and the reserved field are zero in version 1: a receiver
refuses anything else (a later version, negotiated by the hello, may give them a
meaning).

- The client opens with Hello on request id 0; the server answers HelloOk (the highest
  version both speak, `negotiate`) or Error and closes. Until then a frame is held to
  `HELLO_PAYLOAD_BYTES_MAX`: a stranger costs the server a few kilobytes.
- A request is a request id the client chose (nonzero, never reused on a connection)
  and the frames that carry it: the method's request messages (the first opens it),
  then the client's End; the server answers with reply messages and its End (success)
  or an Error (a gRPC status, `StatusCode`). Cancel gives a request up. Requests are
  multiplexed: frames of different requests interleave freely.
- Flow control per request and per direction, in bytes of message frames (header
  included): each side may send what its peer granted, its initial credit from the
  hello, more with each Credit frame the peer sends as it takes frames out of its
  buffer (`SendCredit`, `ReceiveWindow`). Control frames (everything but messages) cost
  nothing and need no credit. So neither side buffers more than a window per request.
- Liveness: Ping on request id 0 is answered by a Pong with its nonce; a side that hears
  nothing from its peer for `dead_peer_ms` drops the connection (the shell's clock).

Errors are by who is at fault: a `FrameError` is the peer breaking the protocol (or
asking what this side cannot do), carrying the status to send it before closing;
assertions are this side's bugs.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from streamengine.protocol.limits import (
    FRAME_HEADER_BYTES,
    FRAME_PAYLOAD_BYTES_MAX,
    HELLO_PAYLOAD_BYTES_MAX,
)
from streamengine.v1 import data_plane_pb2, segment_store_pb2

HEADER = struct.Struct("!IBBHQ")
assert HEADER.size == FRAME_HEADER_BYTES
REQUEST_ID_MAX = (1 << 64) - 1
# Credit a side may hold on one request: far above any window, far below overflow.
CREDIT_BYTES_MAX = 1 << 48


class StatusCode(enum.IntEnum):
    """gRPC's status codes (google.rpc.Code), by number: the data plane answers with the
    statuses the gRPC calls answered."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class FrameError(Exception):
    """The peer broke the protocol, or asked for what this side refuses: the status to
    answer it with (an Error frame), after which the request or connection ends."""

    def __init__(self, code: StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Kind(enum.IntEnum):
    """What a frame's payload is. 1-31: the protocol's own; 32 and up: methods' messages,
    a request kind (even) and its reply kind (the next number)."""

    HELLO = 1
    HELLO_OK = 2
    ERROR = 3
    CREDIT = 4
    PING = 5
    PONG = 6
    CANCEL = 7
    END = 8
    WRITE_REQUEST = 32
    WRITE_REPLY = 33
    READ_REQUEST = 34
    READ_REPLY = 35
    SUBSCRIBE_REQUEST = 36
    SUBSCRIBE_REPLY = 37
    # Kept for the method that may follow: COPY_SEGMENT 38/39.


@dataclass(frozen=True)
class Method:
    """A method of the data plane: its name (as the security table names it), the kinds
    and messages of its requests and replies."""

    name: str
    request_kind: Kind
    reply_kind: Kind
    request_type: type[Message]
    reply_type: type[Message]


WRITE = Method(
    "SegmentStore/Write",
    Kind.WRITE_REQUEST,
    Kind.WRITE_REPLY,
    segment_store_pb2.WriteRequest,
    segment_store_pb2.WriteReply,
)
READ = Method(
    "SegmentStore/Read",
    Kind.READ_REQUEST,
    Kind.READ_REPLY,
    segment_store_pb2.ReadRequest,
    segment_store_pb2.ReadReply,
)
SUBSCRIBE = Method(
    "SegmentStore/Subscribe",
    Kind.SUBSCRIBE_REQUEST,
    Kind.SUBSCRIBE_REPLY,
    segment_store_pb2.SubscribeRequest,
    segment_store_pb2.SubscribeReply,
)
METHODS: dict[Kind, Method] = {method.request_kind: method for method in (WRITE, READ, SUBSCRIBE)}
_REPLY_KINDS = {method.reply_kind: method for method in METHODS.values()}

_CONTROL_TYPES: dict[Kind, type[Message]] = {
    Kind.HELLO: data_plane_pb2.Hello,
    Kind.HELLO_OK: data_plane_pb2.HelloOk,
    Kind.ERROR: data_plane_pb2.Error,
    Kind.CREDIT: data_plane_pb2.Credit,
    Kind.PING: data_plane_pb2.Ping,
    Kind.PONG: data_plane_pb2.Pong,
    Kind.CANCEL: data_plane_pb2.Cancel,
    Kind.END: data_plane_pb2.End,
}
# Who sends what, and on which request id: the connection's (0) or a request's.
_CONNECTION_KINDS = frozenset({Kind.HELLO, Kind.HELLO_OK, Kind.PING, Kind.PONG})
_CLIENT_KINDS = frozenset(
    {Kind.HELLO, Kind.PING, Kind.PONG, Kind.CREDIT, Kind.CANCEL, Kind.END, *METHODS}
)
_SERVER_KINDS = frozenset(
    {Kind.HELLO_OK, Kind.ERROR, Kind.PING, Kind.PONG, Kind.CREDIT, Kind.END, *_REPLY_KINDS}
)
_KNOWN_KINDS = frozenset(kind.value for kind in Kind)


def is_message(kind: Kind) -> bool:
    """A method's message: it costs flow-control credit."""
    return kind >= Kind.WRITE_REQUEST


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    request_id: int
    payload: bytes = b""

    @property
    def size(self) -> int:
        """Bytes on the wire, header included: what a message frame costs in credit."""
        return HEADER.size + len(self.payload)


def header(kind: Kind, request_id: int, payload_bytes: int) -> bytes:
    assert 0 <= request_id <= REQUEST_ID_MAX, request_id
    if payload_bytes > FRAME_PAYLOAD_BYTES_MAX:
        raise FrameError(
            StatusCode.RESOURCE_EXHAUSTED,
            f"a frame of {payload_bytes} bytes is over the {FRAME_PAYLOAD_BYTES_MAX} bytes bound",
        )
    return HEADER.pack(payload_bytes, kind, 0, 0, request_id)


def encode(kind: Kind, request_id: int, message: Message) -> bytes:
    """One frame holding `message`."""
    payload = message.SerializeToString()
    return header(kind, request_id, len(payload)) + payload


def encode_parts(kind: Kind, request_id: int, parts: Sequence[bytes]) -> list[bytes]:
    """One frame whose payload is `parts` joined (a message serialized in pieces, as
    the writer's `MessageParts`), without copying them: write them in order."""
    return [header(kind, request_id, sum(len(part) for part in parts)), *parts]


def parse(frame: Frame, message_type: type[Message]) -> Message:
    """The frame's payload as `message_type`; bytes that are no such message are the
    peer's fault."""
    try:
        return message_type.FromString(frame.payload)
    except DecodeError as error:
        raise FrameError(
            StatusCode.INVALID_ARGUMENT, f"{frame.kind.name} frame does not parse: {error}"
        ) from None


def parse_control(frame: Frame) -> Message:
    """A protocol frame's message (Hello, Credit, ...)."""
    return parse(frame, _CONTROL_TYPES[frame.kind])


def check_direction(frame: Frame, from_client: bool) -> None:
    """Refuses a frame its sender's side never sends, or on the wrong request id."""
    allowed = _CLIENT_KINDS if from_client else _SERVER_KINDS
    side = "client" if from_client else "server"
    if frame.kind not in allowed:
        raise FrameError(StatusCode.INVALID_ARGUMENT, f"a {side} never sends {frame.kind.name}")
    on_connection = frame.kind in _CONNECTION_KINDS
    if on_connection != (frame.request_id == 0) and frame.kind is not Kind.ERROR:
        where = "request id 0" if on_connection else "a nonzero request id"
        raise FrameError(StatusCode.INVALID_ARGUMENT, f"{frame.kind.name} goes on {where}")


class FrameDecoder:
    """Cuts frames out of the bytes a connection receives, in any pieces.

    The header is checked before its payload is waited for: a length over the bound is
    refused from the header alone, so what the decoder holds after `feed` is less than a
    header and one payload of the bound. The first error is final: a stream of frames
    cannot be resynchronized, the connection ends.
    """

    def __init__(self, payload_bytes_max: int = HELLO_PAYLOAD_BYTES_MAX) -> None:
        assert 0 < payload_bytes_max <= FRAME_PAYLOAD_BYTES_MAX
        # Raised once the peer is known (the hello accepted): `allow_payload_bytes`.
        self.payload_bytes_max = payload_bytes_max
        self._buffer = bytearray()
        self._pending: tuple[Kind, int, int] | None = None  # kind, request id, length
        self._failed: FrameError | None = None

    def allow_payload_bytes(self, payload_bytes_max: int) -> None:
        assert 0 < payload_bytes_max <= FRAME_PAYLOAD_BYTES_MAX
        self.payload_bytes_max = payload_bytes_max

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """The frames `data` completes, in order. Raises FrameError for malformed input."""
        if self._failed is not None:
            raise self._failed
        self._buffer += data
        frames: list[Frame] = []
        try:
            while (frame := self._next()) is not None:
                frames.append(frame)
        except FrameError as error:
            self._failed = error
            self._buffer.clear()
            raise
        assert len(self._buffer) < HEADER.size + self.payload_bytes_max
        return frames

    def _next(self) -> Frame | None:
        buffer = self._buffer
        if self._pending is None:
            if len(buffer) < HEADER.size:
                return None
            self._pending = self._read_header(buffer)
            del buffer[: HEADER.size]
        kind, request_id, length = self._pending
        if len(buffer) < length:
            return None
        # One copy out of the buffer (slicing the bytearray first would make two).
        view = memoryview(buffer)
        try:
            with view[:length] as part:
                payload = bytes(part)
        finally:
            view.release()
        del buffer[:length]
        self._pending = None
        return Frame(kind, request_id, payload)

    def _read_header(self, buffer: bytearray) -> tuple[Kind, int, int]:
        length, kind, flags, reserved, request_id = HEADER.unpack_from(buffer)
        if length > self.payload_bytes_max:
            raise FrameError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"a frame of {length} bytes is over the {self.payload_bytes_max} bytes bound",
            )
        if kind not in _KNOWN_KINDS:
            raise FrameError(StatusCode.INVALID_ARGUMENT, f"unknown frame kind {kind}")
        if flags or reserved:
            raise FrameError(
                StatusCode.INVALID_ARGUMENT,
                f"flags {flags:#x} and reserved {reserved:#x} must be zero in version 1",
            )
        return Kind(kind), request_id, length


# The hello.


@dataclass(frozen=True)
class VersionRange:
    low: int
    high: int

    def __post_init__(self) -> None:
        assert 1 <= self.low <= self.high, self

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


# What this code speaks. A release that adds a version keeps the one before in its range
# until every member speaks the new one (a rolling upgrade mixes them).
VERSIONS = VersionRange(1, 1)


def negotiate(ours: VersionRange, theirs: VersionRange) -> int:
    """The highest version both speak; FrameError (FAILED_PRECONDITION) when none."""
    version = min(ours.high, theirs.high)
    if version < max(ours.low, theirs.low):
        raise FrameError(
            StatusCode.FAILED_PRECONDITION,
            f"no common protocol version: the client speaks {theirs}, the server {ours} "
            "(upgrade the older side)",
        )
    return version


def accept_hello(hello: data_plane_pb2.Hello, ours: VersionRange, frame_bytes: int) -> int:
    """The version a server speaks with the client of `hello`, whose windows must hold
    a frame of `frame_bytes` (header included). Raises FrameError when it cannot."""
    if not 1 <= hello.version_min <= hello.version_max:
        raise FrameError(
            StatusCode.INVALID_ARGUMENT,
            f"hello's versions {hello.version_min}-{hello.version_max} are no range",
        )
    if not frame_bytes <= hello.stream_credit_bytes <= CREDIT_BYTES_MAX:
        raise FrameError(
            StatusCode.INVALID_ARGUMENT,
            f"hello's stream credit of {hello.stream_credit_bytes} bytes is outside "
            f"{frame_bytes}-{CREDIT_BYTES_MAX} (it must hold the largest frame)",
        )
    return negotiate(ours, VersionRange(hello.version_min, hello.version_max))


def check_hello_ok(hello_ok: data_plane_pb2.HelloOk, ours: VersionRange) -> None:
    """A client's check of the server's answer: a version it offered, windows and bounds
    it can live with."""
    if not ours.low <= hello_ok.version <= ours.high:
        raise FrameError(
            StatusCode.FAILED_PRECONDITION,
            f"the server chose version {hello_ok.version}, not one of {ours}",
        )
    if not 0 < hello_ok.frame_payload_bytes_max <= FRAME_PAYLOAD_BYTES_MAX:
        raise FrameError(
            StatusCode.INVALID_ARGUMENT,
            f"the server's frame bound {hello_ok.frame_payload_bytes_max} is out of range",
        )
    if not HEADER.size + hello_ok.frame_payload_bytes_max <= hello_ok.stream_credit_bytes:
        raise FrameError(
            StatusCode.INVALID_ARGUMENT,
            f"the server's stream credit of {hello_ok.stream_credit_bytes} bytes does not "
            "hold its largest frame",
        )
    if hello_ok.stream_credit_bytes > CREDIT_BYTES_MAX or not hello_ok.requests_max:
        raise FrameError(StatusCode.INVALID_ARGUMENT, "the server's windows are out of range")
    if not 0 < hello_ok.ping_interval_ms < hello_ok.dead_peer_ms:
        raise FrameError(
            StatusCode.INVALID_ARGUMENT,
            f"the server's ping interval {hello_ok.ping_interval_ms} ms is not below its "
            f"dead-peer time {hello_ok.dead_peer_ms} ms",
        )


# Flow control.


class SendCredit:
    """What this side may still send on one request (bytes of message frames)."""

    def __init__(self, initial_bytes: int) -> None:
        assert 0 < initial_bytes <= CREDIT_BYTES_MAX
        self.available = initial_bytes

    def can_send(self, frame_bytes: int) -> bool:
        return frame_bytes <= self.available

    def spend(self, frame_bytes: int) -> None:
        assert frame_bytes <= self.available, (frame_bytes, self.available)
        self.available -= frame_bytes

    def grant(self, credit: data_plane_pb2.Credit) -> None:
        """The peer's Credit frame; nothing or an overflow is the peer's mistake."""
        if not 0 < credit.bytes <= CREDIT_BYTES_MAX - self.available:
            raise FrameError(
                StatusCode.INVALID_ARGUMENT,
                f"credit of {credit.bytes} bytes on top of {self.available} is out of range",
            )
        self.available += credit.bytes


class ReceiveWindow:
    """What the peer may still send on one request, and what to grant it back.

    A window's bytes are always in one of three places: `remaining` (granted, not yet
    received), `buffered` (received, not yet taken by the application) or `ungranted`
    (taken, not yet granted again). Their sum is the window: the peer cannot make this
    side buffer more. Credit goes back in batches of half a window, so a steady flow
    costs a Credit frame per half window, not one per frame.
    """

    def __init__(self, window_bytes: int) -> None:
        assert 0 < window_bytes <= CREDIT_BYTES_MAX
        self.window_bytes = window_bytes
        self.remaining = window_bytes
        self.buffered = 0
        self.ungranted = 0

    def receive(self, frame_bytes: int) -> None:
        if frame_bytes > self.remaining:
            raise FrameError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"a frame of {frame_bytes} bytes is over the {self.remaining} bytes of "
                "credit granted",
            )
        self.remaining -= frame_bytes
        self.buffered += frame_bytes
        self._check()

    def consume(self, frame_bytes: int) -> int:
        """The application took a frame out: the credit to grant now (0: not yet)."""
        assert frame_bytes <= self.buffered, (frame_bytes, self.buffered)
        self.buffered -= frame_bytes
        self.ungranted += frame_bytes
        granted = 0
        if self.ungranted * 2 >= self.window_bytes:
            granted, self.ungranted = self.ungranted, 0
            self.remaining += granted
        self._check()
        return granted

    def _check(self) -> None:
        assert self.remaining + self.buffered + self.ungranted == self.window_bytes
        assert min(self.remaining, self.buffered, self.ungranted) >= 0


def error_frame(
    request_id: int, code: StatusCode, details: str, metadata: dict[str, str] | None = None
) -> bytes:
    return encode(
        Kind.ERROR,
        request_id,
        data_plane_pb2.Error(code=code, details=details, metadata=metadata or {}),
    )
