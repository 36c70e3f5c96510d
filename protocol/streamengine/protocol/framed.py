"""The data plane's asyncio shell: connections speaking `framing`'s frames over TCP,
with TLS from the cluster's certificates (docs/data-plane.md); its server side is
`framed_server.py`, on the pieces below.

- A client holds one connection per server (`connect`, an async context manager) and
  opens requests on it (`DataConnection.call`): each a `ClientCall` that sends request
  messages as its credit allows and receives replies until the server's End or Error.
  A background reader dispatches frames to calls; a pinger pings while the connection
  lives and drops it when the server has been silent for its dead-peer time, or has
  answered nothing the client sent for `UNANSWERED_MS_MAX`. All are
  owned by the connection's TaskGroup; a failure reaches every call as `CallError`.
- Sockets get TCP keepalive and `TCP_USER_TIMEOUT` (a peer gone without a word is
  dropped by the kernel within the dead-peer time even while data is unacknowledged).

Connections are opened and servers started through `open_connection` and
`start_server` below, with the signatures of asyncio's: the deterministic simulator
puts its in-memory network there.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import select
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from google.protobuf.message import Message

from streamengine.protocol import framing
from streamengine.protocol.framing import (
    VERSIONS,
    Frame,
    FrameDecoder,
    FrameError,
    Kind,
    Method,
    ReceiveWindow,
    SendCredit,
    StatusCode,
)
from streamengine.protocol.limits import (
    FRAME_HEADER_BYTES,
    FRAME_PAYLOAD_BYTES_MAX,
    STREAM_CREDIT_BYTES,
)
from streamengine.protocol.transport import Transport
from streamengine.v1 import data_plane_pb2

log = logging.getLogger("streamengine.framed")

# The seams: where connections are opened and servers started.
open_connection = asyncio.open_connection
start_server = asyncio.start_server

# Liveness, as gRPC's keepalive on the control plane (channels.py): a client pings every
# interval when alive; either side drops a peer silent for the dead-peer time.
PING_INTERVAL_MS = 2_000
DEAD_PEER_MS = 8_000
# A client that sent something and has heard nothing since pings after this long, and
# drops the connection when still nothing came this long after what it sent. A live
# server answers a ping at once; a connection whose sends sit in the kernel's
# retransmission backoff (a one-way partition healed a moment ago: the next retry can be
# seconds away) or whose peer stopped reading is dialled anew, rather than counted as a
# working member of a copy set until the dead-peer time (S7: a second store's fault then
# left one store answering, and appends stalled a second until the backoff ended).
UNANSWERED_PROBE_MS = 250
UNANSWERED_MS_MAX = 1_500
# A hello must come this soon after the connection opens: a stranger holds nothing long.
HELLO_TIMEOUT_MS = 5_000
# Bytes read from a socket at once.
READ_CHUNK_BYTES = 256 << 10
# Control frames (credits, pongs, errors) wait in the socket's buffer without a drain;
# a peer that lets this much pile up is not reading and is dropped.
UNREAD_CONTROL_BYTES_MAX = 1 << 20

# A message this large, on a plain TCP socket, is sent by a sender thread rather than on
# the event loop: the kernel's send (on loopback, the receiving side's work too) held a
# batched writer's loop for 40 % of its time, where gRPC sends from threads of its own.
# Smaller messages (a lone append, replies, control frames) go out on the loop at once.
THREADED_SEND_BYTES_MIN = 32 << 10
_SENDERS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="framed-send")

assert DEAD_PEER_MS >= 3 * PING_INTERVAL_MS, "a dead peer is one that missed pings"
assert UNANSWERED_PROBE_MS < UNANSWERED_MS_MAX < DEAD_PEER_MS
assert HELLO_TIMEOUT_MS < DEAD_PEER_MS


class CallError(Exception):
    """A request ended by an Error frame (the server's status), or by its connection's
    end (UNAVAILABLE). A server's handler raises it to answer with its status."""

    def __init__(
        self, code: StatusCode, details: str, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.metadata = dict(metadata or {})

    @classmethod
    def of_frame(cls, frame: Frame) -> CallError:
        error = framing.parse_control(frame)
        assert isinstance(error, data_plane_pb2.Error)
        try:
            code = StatusCode(error.code)
        except ValueError:
            code = StatusCode.UNKNOWN
        return cls(code, error.details, error.metadata)

    def frame(self, request_id: int) -> bytes:
        return framing.error_frame(request_id, self.code, self.details, self.metadata)


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (a bracketed IPv6 host too) as asyncio takes it."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


def configure_socket(writer: asyncio.StreamWriter, dead_peer_ms: int) -> None:
    """Keepalive and a user timeout on a real TCP socket (none in the simulator)."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    interval_s = max(1, PING_INTERVAL_MS // 1000)
    for option, value in (
        ("TCP_KEEPIDLE", interval_s),
        ("TCP_KEEPINTVL", interval_s),
        ("TCP_KEEPCNT", max(1, dead_peer_ms // 1000 // interval_s - 1)),
        ("TCP_USER_TIMEOUT", dead_peer_ms),
    ):
        if hasattr(socket, option):  # Linux has them all; other systems some
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Peer:
    """One side of a connection: its socket, decoder and the sending discipline."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, decoder: FrameDecoder
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = decoder
        self.frames: collections.deque[Frame] = collections.deque()
        self.last_heard = asyncio.get_running_loop().time()
        # When the first frame sent since the peer was last heard went (None: nothing
        # sent since); `unanswered` is set meanwhile.
        self.unanswered_since: float | None = None
        self.unanswered = asyncio.Event()
        self.send_lock = asyncio.Lock()  # one message frame at a time, drained
        # A plain TCP socket's own descriptor for the sender threads (a duplicate: its
        # number stays this connection's until `close`, whatever the transport does);
        # None until a large message needs it, or where there is no such socket (TLS,
        # the simulator).
        self._thread_socket: socket.socket | None = None
        self._threaded = self._plain_tcp()
        # Control frames written while a sender thread owns the socket, sent after it.
        self._held: list[bytes] | None = None
        self._thread_send: asyncio.Future[None] | None = None

    async def read_frame(self) -> Frame | None:
        """The next frame; None when the peer closed."""
        while not self.frames:
            data = await self.reader.read(READ_CHUNK_BYTES)
            if not data:
                return None
            self.frames.extend(self.decoder.feed(data))
            self.last_heard = asyncio.get_running_loop().time()
            self.unanswered_since = None
            self.unanswered.clear()
        return self.frames.popleft()

    def _sending(self) -> None:
        if self.unanswered_since is None:
            self.unanswered_since = asyncio.get_running_loop().time()
            self.unanswered.set()

    def send_control(self, frame: bytes) -> None:
        """A control frame, without waiting: a peer not reading them is dropped."""
        if self.writer.is_closing():
            return
        self._sending()
        if self._held is not None:
            self._held.append(frame)
            if len(self._held) * FRAME_HEADER_BYTES > UNREAD_CONTROL_BYTES_MAX:
                raise FrameError(StatusCode.RESOURCE_EXHAUSTED, "the peer reads nothing it is sent")
            return
        self.writer.write(frame)
        buffered = self.writer.transport.get_write_buffer_size()
        if buffered > UNREAD_CONTROL_BYTES_MAX + STREAM_CREDIT_BYTES:
            raise FrameError(StatusCode.RESOURCE_EXHAUSTED, "the peer reads nothing it is sent")

    async def send_message(self, parts: Sequence[bytes]) -> None:
        async with self.send_lock:
            if self.writer.is_closing():
                raise CallError(StatusCode.UNAVAILABLE, "the connection is closed")
            await self._thread_send_done()
            self._sending()
            try:
                if self._threaded and sum(map(len, parts)) >= THREADED_SEND_BYTES_MIN:
                    await self._send_in_thread(parts)
                else:
                    self.writer.writelines(parts)
                    await self.writer.drain()
            except (OSError, ssl.SSLError) as error:
                raise CallError(StatusCode.UNAVAILABLE, f"connection lost: {error}") from None

    async def _send_in_thread(self, parts: Sequence[bytes]) -> None:
        """`parts` sent by a sender thread, once what the transport holds is out; the
        control frames written meanwhile follow them."""
        await self.writer.drain()
        if self.writer.transport.get_write_buffer_size():
            self.writer.writelines(parts)  # the peer reads slowly: no hurry then
            await self.writer.drain()
            return
        if self._thread_socket is None:
            sock = self.writer.get_extra_info("socket")
            self._thread_socket = sock.dup()
        self._held = []
        sending = asyncio.get_running_loop().run_in_executor(
            _SENDERS, _send_all, self._thread_socket, b"".join(parts), DEAD_PEER_MS / 1000
        )
        sending.add_done_callback(self._sent_in_thread)
        self._thread_send = sending
        # A caller cancelled leaves the thread to finish (half a frame would break the
        # connection); the socket is the thread's until then.
        await asyncio.shield(sending)

    def _sent_in_thread(self, sending: asyncio.Future[None]) -> None:
        if not sending.cancelled():
            sending.exception()  # raised to the sender, if it still waits
        held, self._held = self._held, None
        if held and not self.writer.is_closing():
            self.writer.writelines(held)

    async def _thread_send_done(self) -> None:
        if self._thread_send is not None and not self._thread_send.done():
            await asyncio.wait([self._thread_send])

    def _plain_tcp(self) -> bool:
        sock = self.writer.get_extra_info("socket")
        return (
            sock is not None
            and sock.family in (socket.AF_INET, socket.AF_INET6)
            and self.writer.get_extra_info("sslcontext") is None
        )

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError, asyncio.CancelledError):
            await self.writer.wait_closed()
        if self._thread_socket is not None:
            with contextlib.suppress(OSError):  # ends a send under way: the peer is gone
                self._thread_socket.shutdown(socket.SHUT_RDWR)
            await self._thread_send_done()
            self._thread_socket.close()

    def silent_s(self) -> float:
        return asyncio.get_running_loop().time() - self.last_heard


def _send_all(sock: socket.socket, data: bytes, silent_s: float) -> None:
    """All of `data` on the non-blocking `sock`, waiting while its buffer is full (in a
    sender thread); raises TimeoutError when the peer takes nothing for `silent_s`."""
    view = memoryview(data)
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    waited_since: float | None = None
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            now = time.monotonic()
            waited_since = waited_since or now
            if now - waited_since > silent_s:
                raise TimeoutError(f"the peer took nothing for {silent_s:.0f} s") from None
            poller.poll(int(silent_s * 1000))
            continue
        waited_since = None
        view = view[sent:]


class RequestStream:
    """What each side keeps of one request: its credits and the frames received."""

    def __init__(self, request_id: int, method: Method, send_bytes: int, window: int) -> None:
        self.request_id = request_id
        self.method = method
        self.credit = SendCredit(send_bytes)
        self.credit_changed = asyncio.Event()
        self.window = ReceiveWindow(window)
        # Messages and the end (None: End; CallError: an Error or the connection's end).
        # Bounded by `window` in bytes: each message frame was received against it.
        self.inbox: asyncio.Queue[Frame | CallError | None] = asyncio.Queue()
        self.ended = False  # this side sent its End, Cancel or Error
        # Why nothing more may be sent: the peer ended the request, or the connection.
        self.finished: CallError | None = None

    def finish(self, why: CallError) -> None:
        if self.finished is None:
            self.finished = why
            self.credit_changed.set()

    def granted(self, frame: Frame) -> None:
        credit = framing.parse_control(frame)
        assert isinstance(credit, data_plane_pb2.Credit)
        self.credit.grant(credit)
        self.credit_changed.set()

    def received(self, frame: Frame) -> None:
        self.window.receive(frame.size)
        self.inbox.put_nowait(frame)

    async def wait_credit(self, frame_bytes: int) -> None:
        while True:
            if self.finished is not None:
                raise self.finished
            if self.credit.can_send(frame_bytes):
                return
            self.credit_changed.clear()
            await self.credit_changed.wait()

    async def next_message(self, peer: Peer, message_type: type[Message]) -> Message | None:
        """The next message received, granting its bytes back; None at the peer's End."""
        item = await self.inbox.get()
        if item is None or isinstance(item, CallError):
            self.inbox.put_nowait(item)  # the end stays the end
            if isinstance(item, CallError):
                raise item
            return None
        granted = self.window.consume(item.size)
        if granted:
            peer.send_control(
                framing.encode(Kind.CREDIT, self.request_id, data_plane_pb2.Credit(bytes=granted))
            )
        return framing.parse(item, message_type)


# The client.


class ClientCall:
    """One request on a `DataConnection`."""

    def __init__(self, connection: DataConnection, stream: RequestStream) -> None:
        self._connection = connection
        self._stream = stream

    @property
    def request_id(self) -> int:
        return self._stream.request_id

    @property
    def buffered_bytes(self) -> int:
        """Reply frames received and not yet taken (`receive`): never more than the
        credit this side granted."""
        return self._stream.window.buffered

    async def send(self, message: Message) -> None:
        await self.send_parts((message.SerializeToString(),))

    async def send_parts(self, parts: Sequence[bytes]) -> None:
        """A request message already serialized in pieces; waits for credit."""
        stream = self._stream
        assert not stream.ended, "sent after the call's end"
        payload_bytes = sum(len(part) for part in parts)
        bound = self._connection.hello_ok.frame_payload_bytes_max
        if payload_bytes > bound:
            raise CallError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"a request of {payload_bytes} bytes is over the server's {bound} bytes bound",
            )
        frame = framing.encode_parts(stream.method.request_kind, stream.request_id, parts)
        frame_bytes = FRAME_HEADER_BYTES + payload_bytes
        await stream.wait_credit(frame_bytes)
        stream.credit.spend(frame_bytes)
        await self._connection.peer.send_message(frame)

    async def receive(self) -> Message | None:
        """The next reply; None after the server's End. Raises CallError."""
        return await self._stream.next_message(
            self._connection.peer, self._stream.method.reply_type
        )

    async def end(self) -> None:
        """No more requests: the server answers what it has and ends the call."""
        if not self._stream.ended:
            self._stream.ended = True
            self._control(Kind.END, data_plane_pb2.End())

    def cancel(self) -> None:
        """Gives the call up: the server stops it, its replies are dropped."""
        if not self._stream.ended:
            self._stream.ended = True
            self._control(Kind.CANCEL, data_plane_pb2.Cancel())
        self._connection.forget(self._stream.request_id)

    def _control(self, kind: Kind, message: Message) -> None:
        if self._connection.failure is None:
            with contextlib.suppress(FrameError):
                self._connection.peer.send_control(
                    framing.encode(kind, self._stream.request_id, message)
                )


class DataConnection:
    """A client's connection to one server: see the module doc."""

    def __init__(self, peer: Peer, hello_ok: data_plane_pb2.HelloOk) -> None:
        self.peer = peer
        self.hello_ok = hello_ok
        self.failure: CallError | None = None
        self._streams: dict[int, RequestStream] = {}
        self._request_ids = itertools.count(1)
        self._ping_nonces = itertools.count(1)
        self._room = asyncio.Event()  # set when a request ends or the connection
        self._over = asyncio.Event()  # set by `fail`

    @property
    def has_room(self) -> bool:
        """Whether a request opens at once (`call` waits while the server's bound of
        open requests is reached)."""
        return self.failure is None and len(self._streams) < self.hello_ok.requests_max

    async def call(self, method: Method) -> ClientCall:
        """Opens a request (when fewer than the server's bound are open)."""
        while self.failure is None and len(self._streams) >= self.hello_ok.requests_max:
            self._room.clear()
            await self._room.wait()
        if self.failure is not None:
            raise self.failure
        request_id = next(self._request_ids)
        stream = RequestStream(
            request_id, method, self.hello_ok.stream_credit_bytes, STREAM_CREDIT_BYTES
        )
        self._streams[request_id] = stream
        return ClientCall(self, stream)

    def forget(self, request_id: int, why: CallError | None = None) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finish(why or CallError(StatusCode.CANCELLED, "the call was given up"))
            self._room.set()

    async def read_loop(self) -> None:
        try:
            while (frame := await self.peer.read_frame()) is not None:
                self._dispatch(frame)
            self.fail(CallError(StatusCode.UNAVAILABLE, "the server closed the connection"))
        except FrameError as error:
            with contextlib.suppress(FrameError):
                self.peer.send_control(framing.error_frame(0, error.code, error.details))
            self.fail(CallError(error.code, f"the server broke the protocol: {error.details}"))
        except (OSError, ssl.SSLError) as error:
            self.fail(CallError(StatusCode.UNAVAILABLE, f"connection lost: {error}"))

    def _dispatch(self, frame: Frame) -> None:
        framing.check_direction(frame, from_client=False)
        if frame.kind is Kind.PING:
            ping = framing.parse_control(frame)
            assert isinstance(ping, data_plane_pb2.Ping)
            self.peer.send_control(
                framing.encode(Kind.PONG, 0, data_plane_pb2.Pong(nonce=ping.nonce))
            )
            return
        if frame.kind is Kind.PONG:
            return  # heard: that is all a pong says
        if frame.request_id == 0:  # an Error: the connection's end
            self.fail(CallError.of_frame(frame))
            return
        stream = self._streams.get(frame.request_id)
        if stream is None:
            return  # a call given up: what was in flight is dropped
        if frame.kind is Kind.CREDIT:
            stream.granted(frame)
        elif frame.kind is Kind.END:
            stream.inbox.put_nowait(None)
            self.forget(frame.request_id, CallError(StatusCode.CANCELLED, "the call has ended"))
        elif frame.kind is Kind.ERROR:
            error = CallError.of_frame(frame)
            stream.inbox.put_nowait(error)
            self.forget(frame.request_id, error)
        else:
            if frame.kind is not stream.method.reply_kind:
                raise FrameError(StatusCode.INVALID_ARGUMENT, f"{frame.kind.name} on a call")
            stream.received(frame)

    async def ping_loop(self) -> None:
        interval_s = self.hello_ok.ping_interval_ms / 1000
        dead_s = self.hello_ok.dead_peer_ms / 1000
        while self.failure is None:
            silent_s = self.peer.silent_s()
            if silent_s >= dead_s:
                self.fail(
                    CallError(StatusCode.UNAVAILABLE, f"the server was silent for {silent_s:.1f} s")
                )
                return
            with contextlib.suppress(FrameError):
                ping = data_plane_pb2.Ping(nonce=next(self._ping_nonces))
                self.peer.send_control(framing.encode(Kind.PING, 0, ping))
            await asyncio.sleep(min(interval_s, dead_s - silent_s))

    async def answer_loop(self) -> None:
        """Drops the connection when what the client sent goes unanswered for
        `UNANSWERED_MS_MAX` (a ping after `UNANSWERED_PROBE_MS` asks for an answer)."""
        peer = self.peer
        while self.failure is None:
            await peer.unanswered.wait()
            since = peer.unanswered_since
            if since is None:
                continue
            loop = asyncio.get_running_loop()
            await asyncio.sleep(max(0.0, since + UNANSWERED_PROBE_MS / 1000 - loop.time()))
            if peer.unanswered_since != since:
                continue  # answered
            with contextlib.suppress(FrameError):
                ping = data_plane_pb2.Ping(nonce=next(self._ping_nonces))
                peer.send_control(framing.encode(Kind.PING, 0, ping))
            await asyncio.sleep(max(0.0, since + UNANSWERED_MS_MAX / 1000 - loop.time()))
            if peer.unanswered_since == since and self.failure is None:
                self.fail(
                    CallError(
                        StatusCode.UNAVAILABLE,
                        f"the server answered nothing sent {UNANSWERED_MS_MAX} ms ago",
                    )
                )

    def fail(self, error: CallError) -> None:
        """Ends every call with `error`: the connection is over."""
        if self.failure is not None:
            return
        self.failure = error
        for stream in self._streams.values():
            stream.inbox.put_nowait(error)
            stream.finish(error)
        self._streams.clear()
        self.peer.writer.close()
        self._room.set()
        self._over.set()

    async def wait_failed(self) -> None:
        """Until the connection is over (`failure` says why): what a holder of a
        long-lived connection waits for before it dials again."""
        await self._over.wait()


@contextlib.asynccontextmanager
async def connect(
    address: str, transport: Transport, versions: framing.VersionRange = VERSIONS
) -> AsyncIterator[DataConnection]:
    """A connection to the data plane of the server at `address`, for the `async with`
    block. Raises CallError (UNAVAILABLE when it cannot connect; the server's status
    when it refuses the hello)."""
    try:
        host, port = split_address(address)
    except ValueError as error:
        raise CallError(StatusCode.INVALID_ARGUMENT, f"no data address to dial: {error}") from None
    context = transport.ssl_context()
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_MS / 1000):
            reader, writer = await open_connection(
                host, port, ssl=context, server_hostname=host if context else None
            )
    except (OSError, ssl.SSLError, TimeoutError) as error:
        raise CallError(StatusCode.UNAVAILABLE, f"cannot connect to {address}: {error}") from None
    configure_socket(writer, DEAD_PEER_MS)
    peer = Peer(reader, writer, FrameDecoder())
    try:
        hello_ok = await _hello(peer, transport, versions, address)
        connection = DataConnection(peer, hello_ok)
        # What the `async with` block raised: raised as it is, not inside the group of
        # the TaskGroup's errors (the loops never fail: they end the connection).
        raised: Exception | None = None
        async with asyncio.TaskGroup() as tasks:
            loops = (
                tasks.create_task(connection.read_loop()),
                tasks.create_task(connection.ping_loop()),
                tasks.create_task(connection.answer_loop()),
            )
            try:
                yield connection
            except Exception as error:
                raised = error
            finally:
                connection.fail(CallError(StatusCode.CANCELLED, "the connection was closed"))
                for loop in loops:
                    loop.cancel()
        if raised is not None:
            raise raised
    finally:
        await peer.close()


async def _hello(
    peer: Peer, transport: Transport, versions: framing.VersionRange, address: str
) -> data_plane_pb2.HelloOk:
    hello = data_plane_pb2.Hello(
        version_min=versions.low,
        version_max=versions.high,
        token=transport.token,
        stream_credit_bytes=STREAM_CREDIT_BYTES,
    )
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_MS / 1000):
            await peer.send_message((framing.encode(Kind.HELLO, 0, hello),))
            frame = await peer.read_frame()
        if frame is None:
            raise CallError(StatusCode.UNAVAILABLE, f"{address} closed the connection")
        framing.check_direction(frame, from_client=False)
        if frame.kind is Kind.ERROR:
            raise CallError.of_frame(frame)
        if frame.kind is not Kind.HELLO_OK:
            raise FrameError(StatusCode.INVALID_ARGUMENT, f"{frame.kind.name} before HelloOk")
        hello_ok = framing.parse_control(frame)
        assert isinstance(hello_ok, data_plane_pb2.HelloOk)
        framing.check_hello_ok(hello_ok, versions)
    except FrameError as error:
        raise CallError(error.code, f"{address}: {error.details}") from None
    except (OSError, ssl.SSLError, TimeoutError) as error:
        raise CallError(StatusCode.UNAVAILABLE, f"{address}: hello failed: {error!r}") from None
    # The server's bound is on what it accepts; what it sends is held to the protocol's.
    peer.decoder.allow_payload_bytes(FRAME_PAYLOAD_BYTES_MAX)
    return hello_ok
