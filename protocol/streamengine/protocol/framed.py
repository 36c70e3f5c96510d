"""The data plane's asyncio shell: connections speaking `framing`'s frames over TCP,
with TLS from the cluster's certificates (docs/data-plane.md); its server side is
`framed_server.py`; both stand on `framed_peer.py` (a connection's end: its socket,
sending discipline and liveness times) and `RequestStream` below.

- A client holds one connection per server (`connect`, an async context manager) and
  opens requests on it (`DataConnection.call`): each a `ClientCall` that sends request
  messages as its credit allows and receives replies until the server's End or Error.
  A background reader dispatches frames to calls; a pinger pings while the connection
  lives and drops it when the server has been silent for its dead-peer time, or has
  answered nothing the client sent for `UNANSWERED_MS_MAX`. All are
  owned by the connection's TaskGroup; a failure reaches every call as `CallError`.

Connections are opened and servers started through `open_connection` and
`start_server` below, with the signatures of asyncio's: the deterministic simulator
puts its in-memory network there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections.abc import AsyncIterator, Sequence

from google.protobuf.message import Message

from streamengine.protocol import framing
from streamengine.protocol.framed_peer import (
    DEAD_PEER_MS,
    Peer,
    configure_socket,
    split_address,
)

# Where every caller has met it: each request on a connection ends in one.
from streamengine.protocol.framed_peer import CallError as CallError
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
# A client's dial (TCP, and TLS's handshake) given up after this long, so the next goes
# with a fresh SYN: one that waits in the kernel's SYN retransmission (1 s, then 2, then
# 4) can miss a healed partition by seconds (S7 in the clean-clone run: a store back 3 s
# late, so a second store's fault stalled appends 1.12 s).
CONNECT_TIMEOUT_MS = 1_500
# While a dial's SYN goes unanswered, another goes this often, the earlier ones still
# waiting: a partition healed during the dial is crossed by the next fresh SYN, not the
# kernel's retransmission a second or two later (S7 on affe1fc: a writer's store, cut
# off one way, came back while its dial hung, and a second store's cut 2 s after the
# heal stalled appends 1.15 s). Only the TCP handshake is repeated: TLS's, the server's
# work, runs once on the connection that answered.
DIAL_HEDGE_MS = 250
assert DIAL_HEDGE_MS < CONNECT_TIMEOUT_MS
assert UNANSWERED_PROBE_MS < UNANSWERED_MS_MAX < DEAD_PEER_MS
assert HELLO_TIMEOUT_MS < DEAD_PEER_MS
assert CONNECT_TIMEOUT_MS <= HELLO_TIMEOUT_MS


async def _dial(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to `host:port`: a fresh SYN every `DIAL_HEDGE_MS` while none is
    answered; the first connection wins and the others are closed. A refusal (or an
    unreachable host) is an answer and ends the dial at once. The caller bounds it."""
    dials: set[asyncio.Task[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = set()
    try:
        while True:
            dials.add(asyncio.ensure_future(open_connection(host, port)))
            done, dials = await asyncio.wait(
                dials, timeout=DIAL_HEDGE_MS / 1000, return_when=asyncio.FIRST_COMPLETED
            )
            answered = [dial for dial in done if dial.exception() is None]
            for extra in answered[1:]:
                extra.result()[1].close()
            if answered:
                return answered[0].result()
            if done:
                error = next(iter(done)).exception()
                assert error is not None
                raise error
    finally:
        for dial in dials:
            dial.cancel()
            dial.add_done_callback(_close_unused)


def _close_unused(dial: asyncio.Task[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    if not dial.cancelled() and dial.exception() is None:
        dial.result()[1].close()


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
        """Gives the call up: the server stops it, its replies are dropped, and its slot
        on the connection is free at once. A call still open at the server is cancelled
        there even after this side's End (a read left early: otherwise the server would
        go on sending it and count it against the connection's bound); one the server
        ended, or whose connection is over, needs no word."""
        stream = self._stream
        if stream.finished is None:
            self._control(Kind.CANCEL, data_plane_pb2.Cancel())
        stream.ended = True
        self._connection.forget(stream.request_id)

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
            self._ping()
            await asyncio.sleep(min(interval_s, dead_s - silent_s))

    async def answer_loop(self) -> None:
        """Drops the connection when what the client sent goes unanswered for
        `UNANSWERED_MS_MAX` (a ping after `UNANSWERED_PROBE_MS` asks for an answer)."""
        peer = self.peer
        loop = asyncio.get_running_loop()
        while self.failure is None:
            await peer.unanswered.wait()
            since = peer.unanswered_since
            if since is None:
                continue
            await asyncio.sleep(max(0.0, since + UNANSWERED_PROBE_MS / 1000 - loop.time()))
            if peer.unanswered_since != since:
                continue  # answered
            self._ping()
            await asyncio.sleep(max(0.0, since + UNANSWERED_MS_MAX / 1000 - loop.time()))
            if peer.unanswered_since == since and self.failure is None:
                self.fail(
                    CallError(
                        StatusCode.UNAVAILABLE,
                        f"the server answered nothing sent {UNANSWERED_MS_MAX} ms ago",
                    )
                )

    def _ping(self) -> None:
        with contextlib.suppress(FrameError):
            ping = data_plane_pb2.Ping(nonce=next(self._ping_nonces))
            self.peer.send_control(framing.encode(Kind.PING, 0, ping))

    def fail(self, error: CallError, broken: bool = True) -> None:
        """Ends every call with `error`: the connection is over. `broken` (anything
        but its holder's own close): the peer is dropped, not waited on
        (`Peer.close`)."""
        if self.failure is not None:
            return
        self.failure = error
        self.peer.broken = broken
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
        async with asyncio.timeout(CONNECT_TIMEOUT_MS / 1000):
            reader, writer = await _dial(host, port)
            if context is not None:
                try:
                    await writer.start_tls(context, server_hostname=host)
                except BaseException:
                    writer.close()
                    raise
    except (OSError, ssl.SSLError, TimeoutError) as error:
        raise CallError(StatusCode.UNAVAILABLE, f"cannot connect to {address}: {error}") from None
    configure_socket(writer, DEAD_PEER_MS)
    peer = Peer(reader, writer, FrameDecoder())
    try:
        hello_ok = await _hello(peer, transport, versions, address)
        connection = DataConnection(peer, hello_ok)
        # What the `async with` block raised: raised as it is, not inside the group of
        # the TaskGroup's errors (the loops never fail: they end the connection). That
        # includes GeneratorExit: a generator reading in the block closed at its yield
        # (a read left early by `aclose`, as a cancelled copy leaves its source's).
        raised: BaseException | None = None
        async with asyncio.TaskGroup() as tasks:
            loops = (
                tasks.create_task(connection.read_loop()),
                tasks.create_task(connection.ping_loop()),
                tasks.create_task(connection.answer_loop()),
            )
            try:
                yield connection
            except (Exception, GeneratorExit) as error:
                raised = error
            finally:
                closed = CallError(StatusCode.CANCELLED, "the connection was closed")
                connection.fail(closed, broken=False)
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
