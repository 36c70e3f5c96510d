"""One side of a data-plane connection (docs/data-plane.md), for both ends: the socket
with its options, the frame decoder, the sending discipline (message frames one at a
time and drained, large ones from sender threads on plain TCP, control frames without
waiting), the liveness times both ends keep, and `CallError`, how a request ends. The
client's connections are `framed.py`'s, the server's `framed_server.py`'s.

Sockets get TCP keepalive and `TCP_USER_TIMEOUT` (a peer gone without a word is dropped
by the kernel within the dead-peer time even while data is unacknowledged).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import select
import socket
import ssl
import time
from collections.abc import Mapping, Sequence

from streamengine.protocol import framing
from streamengine.protocol.framing import Frame, FrameDecoder, FrameError, StatusCode
from streamengine.protocol.limits import FRAME_HEADER_BYTES, STREAM_CREDIT_BYTES
from streamengine.v1 import data_plane_pb2

# Liveness, as gRPC's keepalive on the control plane (channels.py): a client pings every
# interval when alive; either side drops a peer silent for the dead-peer time.
PING_INTERVAL_MS = 2_000
DEAD_PEER_MS = 8_000
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
        # Set once the connection failed (its peer silent, unanswering, gone or broken
        # the protocol): `close` drops it rather than wait on the peer.
        self.broken = False
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
        """Ends the connection without waiting on the peer. A graceful close waits
        until the transport's buffer is out (and, over TLS, for the peer's close_notify,
        up to 30 s): to a peer that takes nothing, cut off one way (its acks lost), that
        lasts until TCP's backed-off retransmission gets through or its user timeout
        ends the connection, to one that stopped reading for ever. So a connection
        that failed (`broken`), or whose transport still holds bytes (the kernel's
        buffer is full: the peer takes nothing), is aborted, what it buffered dropped;
        only a healthy one is closed gracefully, the kernel sending what it holds on
        its own (S7: a writer's Write stream found unanswered took 5 s more to close,
        neither dialling again nor serving its segments, and a second store's cut held
        appends 1 s)."""
        transport = self.writer.transport
        if self.broken or _buffered(transport):
            transport.abort()
        else:
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


def _buffered(transport: asyncio.WriteTransport) -> int:
    """What `transport` holds that the kernel has not taken. Python 3.11's TLS
    transport, closed twice, has let go of its protocol and cannot say: it holds
    nothing more that it will send."""
    try:
        return transport.get_write_buffer_size()
    except AttributeError:
        return 0


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
