"""The data plane's server: accepts connections on a store's data port, hears each
hello and runs each request in a handler of its method table (docs/data-plane.md).

The caller of a connection is known once, at its hello: the certificate of its TLS
handshake (a member, an admin; `identity.principal_of_peer_certificate`) and the token
of its hello (a tenant), made a principal by the same function the gRPC servers call
(`Callers.principal_of`). Each request is then authorized by its handler, as the gRPC
servicers authorize each call. A handler ends its request with an error by raising
`CallError`; returning ends it with End. The connection's requests run in its
TaskGroup; `DataServer.stop` ends every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from google.protobuf.message import Message

from streamengine.protocol import auth, framed, framing, identity
from streamengine.protocol.framed import HELLO_TIMEOUT_MS, RequestStream
from streamengine.protocol.framed_peer import (
    DEAD_PEER_MS,
    PING_INTERVAL_MS,
    CallError,
    Peer,
    configure_socket,
    split_address,
)
from streamengine.protocol.framing import (
    METHODS,
    VERSIONS,
    Frame,
    FrameDecoder,
    FrameError,
    Kind,
    Method,
    StatusCode,
)
from streamengine.protocol.limits import (
    DATA_HELLOS_MAX,
    DATA_REQUESTS_MAX,
    FRAME_HEADER_BYTES,
    FRAME_PAYLOAD_BYTES_MAX,
    STREAM_CREDIT_BYTES,
)
from streamengine.protocol.signing import NoVerifyingKey
from streamengine.v1 import data_plane_pb2

log = logging.getLogger("streamengine.framed")


@dataclass
class ServerCall:
    """One request as its handler sees it."""

    principal: auth.Principal
    method: Method
    _stream: RequestStream
    _peer: Peer

    @property
    def request_id(self) -> int:
        return self._stream.request_id

    async def receive(self) -> Message | None:
        """The next request message; None after the client's End."""
        return await self._stream.next_message(self._peer, self.method.request_type)

    async def __aiter__(self) -> AsyncIterator[Message]:
        while (message := await self.receive()) is not None:
            yield message

    async def send(self, message: Message) -> None:
        """A reply; waits for the client's credit."""
        stream = self._stream
        payload = message.SerializeToString()
        frame_bytes = FRAME_HEADER_BYTES + len(payload)
        await stream.wait_credit(frame_bytes)
        stream.credit.spend(frame_bytes)
        await self._peer.send_message(
            (framing.header(self.method.reply_kind, stream.request_id, len(payload)), payload)
        )


Handler = Callable[[ServerCall], Awaitable[None]]
# The caller of a connection: its identity (the TLS client certificate, or INSECURE
# over plaintext) and its hello's token (None: none) make a principal, or a Denial
# (UNAUTHENTICATED). `Callers.principal_of` of the gRPC servers.
Authenticate = Callable[[auth.Principal, str | None], auth.Principal | auth.Denial]


@dataclass
class DataServer:
    """Serves the methods of `handlers` on a data port: see the module doc."""

    handlers: Mapping[Kind, Handler]
    authenticate: Authenticate
    ping_interval_ms: int = PING_INTERVAL_MS
    dead_peer_ms: int = DEAD_PEER_MS
    requests_max: int = DATA_REQUESTS_MAX
    hellos_max: int = DATA_HELLOS_MAX
    frame_payload_bytes_max: int = FRAME_PAYLOAD_BYTES_MAX
    stream_credit_bytes: int = STREAM_CREDIT_BYTES
    # Told of each connection whose hello the server accepted (a store counts them:
    # how many connections its clients hold open and how often they dial).
    on_connection: Callable[[], None] | None = None
    _server: asyncio.Server | None = None
    _connections: set[asyncio.Task[None]] = field(default_factory=set)
    # Connections whose hello has not been accepted yet (`hellos_max`).
    before_hello: int = 0

    def __post_init__(self) -> None:
        assert all(kind in METHODS for kind in self.handlers), self.handlers
        assert 0 < self.ping_interval_ms < self.dead_peer_ms
        assert 0 < self.frame_payload_bytes_max <= FRAME_PAYLOAD_BYTES_MAX
        assert self.stream_credit_bytes >= FRAME_HEADER_BYTES + self.frame_payload_bytes_max

    async def start(self, listen: str, context: ssl.SSLContext | None) -> int:
        """Listens on `listen` (`host:0` picks a port); returns the port."""
        host, port = split_address(listen)
        if context is None:
            self._server = await framed.start_server(self._accepted, host, port)
        else:
            self._server = await framed.start_server(
                self._accepted,
                host,
                port,
                ssl=context,
                ssl_handshake_timeout=HELLO_TIMEOUT_MS / 1000,
            )
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self) -> None:
        """Stops listening and ends every connection (their calls are cancelled)."""
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._server.wait_closed()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # asyncio runs this in a task of its own: kept, so `stop` ends it.
        task = asyncio.current_task()
        assert task is not None
        if self.before_hello >= self.hellos_max:
            # Callers that never say who they are hold nothing past this bound: a flood
            # of silent connections costs an accept and a close each.
            writer.close()
            log.warning("data port: %d connections wait for their hello, one more closed",
                        self.before_hello)
            return
        self._connections.add(task)
        try:
            await _ServerConnection(self, Peer(reader, writer, FrameDecoder())).serve()
        except asyncio.CancelledError:
            # Only `stop` cancels it; asyncio's callback would log a cancelled task.
            pass
        except Exception:
            log.exception("data connection failed")
        finally:
            self._connections.discard(task)


class _ServerConnection:
    def __init__(self, server: DataServer, peer: Peer) -> None:
        self.server = server
        self.peer = peer
        self.principal = auth.ANONYMOUS
        self.streams: dict[int, RequestStream] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.last_request_id = 0
        self.client_credit_bytes = 0
        self.failure: FrameError | None = None  # the client broke the protocol

    async def serve(self) -> None:
        configure_socket(self.peer.writer, self.server.dead_peer_ms)
        try:
            self.server.before_hello += 1
            try:
                await self._hello()
            finally:
                self.server.before_hello -= 1
            if self.server.on_connection is not None:
                self.server.on_connection()
            async with asyncio.TaskGroup() as tasks:
                watchdog = tasks.create_task(self._watch_liveness())
                try:
                    await self._read(tasks)
                finally:
                    watchdog.cancel()
                    for task in self.tasks.values():
                        task.cancel()
            if self.failure is not None:
                raise self.failure
        except FrameError as error:
            with contextlib.suppress(FrameError):
                self.peer.send_control(framing.error_frame(0, error.code, error.details))
        except (OSError, ssl.SSLError, TimeoutError):
            pass  # the client went away, or never said hello in time
        finally:
            await self.peer.close()

    async def _read(self, tasks: asyncio.TaskGroup) -> None:
        """Frames until the client closes; the peer's faults end it here, not as a group
        of the TaskGroup's errors: a FrameError is raised to be answered, a lost or
        silent connection just ends."""
        try:
            while (frame := await self.peer.read_frame()) is not None:
                self._take(frame, tasks)
        except FrameError as error:
            self.failure = error
        except (OSError, ssl.SSLError):
            pass  # the client went away

    async def _hello(self) -> None:
        async with asyncio.timeout(HELLO_TIMEOUT_MS / 1000):
            frame = await self.peer.read_frame()
        if frame is None:
            raise OSError("closed before its hello")
        framing.check_direction(frame, from_client=True)
        if frame.kind is not Kind.HELLO:
            raise FrameError(StatusCode.INVALID_ARGUMENT, f"{frame.kind.name} before Hello")
        hello = framing.parse_control(frame)
        assert isinstance(hello, data_plane_pb2.Hello)
        version = framing.accept_hello(
            hello, VERSIONS, FRAME_HEADER_BYTES + FRAME_PAYLOAD_BYTES_MAX
        )
        self.principal = self._authenticate(hello.token or None)
        self.client_credit_bytes = hello.stream_credit_bytes
        hello_ok = data_plane_pb2.HelloOk(
            version=version,
            stream_credit_bytes=self.server.stream_credit_bytes,
            frame_payload_bytes_max=self.server.frame_payload_bytes_max,
            requests_max=self.server.requests_max,
            ping_interval_ms=self.server.ping_interval_ms,
            dead_peer_ms=self.server.dead_peer_ms,
        )
        self.peer.send_control(framing.encode(Kind.HELLO_OK, 0, hello_ok))
        self.peer.decoder.allow_payload_bytes(self.server.frame_payload_bytes_max)

    def _authenticate(self, token: str | None) -> auth.Principal:
        ssl_object = self.peer.writer.get_extra_info("ssl_object")
        if ssl_object is None:
            known = auth.INSECURE
        else:
            known = identity.principal_of_peer_certificate(ssl_object.getpeercert(binary_form=True))
        try:
            principal = self.server.authenticate(known, token)
        except NoVerifyingKey as error:
            raise FrameError(
                StatusCode.UNAVAILABLE, f"cannot check the token yet: {error}"
            ) from None
        if isinstance(principal, auth.Denial):
            raise FrameError(StatusCode.UNAUTHENTICATED, principal.reason)
        return principal

    async def _watch_liveness(self) -> None:
        dead_s = self.server.dead_peer_ms / 1000
        while True:
            silent_s = self.peer.silent_s()
            if silent_s >= dead_s:
                break
            await asyncio.sleep(dead_s - silent_s)
        log.info("data connection dropped: the client was silent for %.1f s", silent_s)
        self.peer.broken = True
        self.peer.writer.close()

    def _take(self, frame: Frame, tasks: asyncio.TaskGroup) -> None:
        framing.check_direction(frame, from_client=True)
        if frame.kind is Kind.PING:
            ping = framing.parse_control(frame)
            assert isinstance(ping, data_plane_pb2.Ping)
            pong = data_plane_pb2.Pong(nonce=ping.nonce)
            self.peer.send_control(framing.encode(Kind.PONG, 0, pong))
        elif frame.kind is Kind.HELLO:
            raise FrameError(StatusCode.INVALID_ARGUMENT, "a second Hello")
        elif frame.kind is not Kind.PONG:
            self._dispatch(frame, tasks)

    def _dispatch(self, frame: Frame, tasks: asyncio.TaskGroup) -> None:
        stream = self.streams.get(frame.request_id)
        if stream is None:
            if frame.request_id <= self.last_request_id:
                return  # a request that ended: what the client sent meanwhile is dropped
            if frame.kind not in METHODS:
                raise FrameError(StatusCode.INVALID_ARGUMENT, f"{frame.kind.name} on no request")
            stream = self._open(frame, tasks)
        if frame.kind is Kind.CREDIT:
            stream.granted(frame)
        elif frame.kind is Kind.END:
            stream.inbox.put_nowait(None)
        elif frame.kind is Kind.CANCEL:
            stream.ended = True
            self.tasks[frame.request_id].cancel()
            # Off the bound at once: the client counts the request gone as it cancels,
            # and may open the next one in the same read of the socket, before the
            # cancelled handler has run its end.
            del self.streams[frame.request_id]
        elif frame.kind is stream.method.request_kind:
            stream.received(frame)
        else:
            raise FrameError(StatusCode.INVALID_ARGUMENT, f"{frame.kind.name} on a request")

    def _open(self, frame: Frame, tasks: asyncio.TaskGroup) -> RequestStream:
        """A new request (its id above every one before: ids are never reused)."""
        if len(self.streams) >= self.server.requests_max:
            raise FrameError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"more than {self.server.requests_max} requests open at once",
            )
        self.last_request_id = frame.request_id
        method = METHODS[frame.kind]
        stream = RequestStream(
            frame.request_id, method, self.client_credit_bytes, self.server.stream_credit_bytes
        )
        self.streams[frame.request_id] = stream
        handler = self.server.handlers.get(frame.kind)
        call = ServerCall(self.principal, method, stream, self.peer)
        self.tasks[frame.request_id] = tasks.create_task(self._run(call, handler))
        return stream

    async def _run(self, call: ServerCall, handler: Handler | None) -> None:
        stream = call._stream
        try:
            if handler is None:
                raise CallError(StatusCode.UNIMPLEMENTED, f"{call.method.name} is not served here")
            await handler(call)
            ending = framing.encode(Kind.END, stream.request_id, data_plane_pb2.End())
        except CallError as error:
            ending = error.frame(stream.request_id)
        except FrameError as error:
            ending = framing.error_frame(stream.request_id, error.code, error.details)
        except asyncio.CancelledError:
            # Cancelled by the client (nothing more to say), or the connection ends.
            stream.finish(CallError(StatusCode.CANCELLED, "cancelled"))
            raise
        except Exception:
            log.exception("%s failed", call.method.name)
            ending = framing.error_frame(stream.request_id, StatusCode.INTERNAL, "internal error")
        finally:
            self.streams.pop(stream.request_id, None)  # gone already when cancelled
            del self.tasks[stream.request_id]
        if not stream.ended:
            with contextlib.suppress(FrameError):
                self.peer.send_control(ending)
