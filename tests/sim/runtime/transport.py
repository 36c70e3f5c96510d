"""An in-process stand-in for the grpc.aio surface our shells use, over a faulty network.

Theory of operation. Each call is an exchange between two simulated nodes: the caller
(the node whose task opened the channel, `CURRENT_NODE`) and the node serving the
address dialed (`SimServer`). An exchange carries two ordered pipes, as an HTTP/2
stream does: requests, the half-close and a cancel towards the server; responses and
the final status towards the caller. Every message is serialized with the method's real
codecs on one side and parsed on the other, and takes a delay drawn from the seed
(`tests.sim.network.Faults`); messages of one pipe arrive in the order sent.

Faults, all drawn from the loop's seeded random source:
- loss: a message lost breaks its exchange (as a reset connection does; TCP never
  loses a message silently); both ends learn it after a detection delay, the caller as
  UNAVAILABLE, the server as its handler cancelled;
- duplication: a unary request may be handled twice by the server (a retried call whose
  first attempt arrived after all); the caller sees one answer;
- delay and reordering: each message its own delay, so calls overtake each other;
- partitions (`cut`, `heal`) and connection resets (`reset`) break the exchanges
  between two nodes; a call towards an address nobody serves, or across a cut, fails
  UNAVAILABLE;
- deadlines end the call DEADLINE_EXCEEDED at the caller and cancel the handler;
  `cancel()` ends it CANCELLED and cancels the handler when the cancel arrives.

Server side, `SimServer` takes what the generated `add_*Servicer_to_server` gives
(`add_generic_rpc_handlers`, `add_registered_method_handlers`) and the same server
interceptors a real server is built with (`RequestParsing`). Its handlers get a
`SimServicerContext`: `abort` (raising `grpc.aio.AbortError` in the handler, and
`grpc.aio.AioRpcError` with the same code, details and trailing metadata at the caller),
`write`, `read`, metadata both ways, `peer()`, `auth_context()` (plaintext), deadlines.

Channels land here through the seam `streamengine.protocol.transport.aio_channel_factory`
(`SimNetwork.installed`), so `Transport.aio_channel` hands the shells a `SimChannel`; the
master's etcd client has its own seams (`streamengine.master.etcd`), set there too.

Blocking calls (`SimBlockingChannel`: the master's etcd commits and reads, a
`grpc.Channel`'s unary calls) are handled at once, in the caller's step: the server's
handler runs to its end right there (it must answer without waiting), with the same
partitions, loss (of the request: nothing done; of the answer: done, the caller told
UNAVAILABLE), duplication and deadlines. The caller's thread then blocks for as long as
the call took, the message delays or the deadline (`SimLoop.block`): a node's event
loop runs nothing else meanwhile, as the real one does while it waits on a blocking
call, and everyone else runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc

from streamengine.master import etcd
from streamengine.protocol import transport
from tests.sim.network import BREAK_DETECTION_MS_MAX, Faults
from tests.sim.runtime.loop import SimLoop

log = logging.getLogger("tests.sim.runtime")

# The simulated node the running task belongs to: who calls, and who serves.
CURRENT_NODE: contextvars.ContextVar[str] = contextvars.ContextVar("sim_node")

# How a channel waits for its server to come back (grpc's reconnect backoff, shortened).
RECONNECT_S_MIN = 0.1
RECONNECT_S_MAX = 1.0

PLAINTEXT_AUTH_CONTEXT: dict[str, list[bytes]] = {
    "transport_security_type": [b"insecure"],
    "security_level": [b"TSI_SECURITY_NONE"],
}

Metadata = tuple[tuple[str, str | bytes], ...]
if TYPE_CHECKING:
    # grpcio's stubs make it generic; the runtime class is not subscriptable.
    Handler = grpc.RpcMethodHandler[Any, Any]


def node_context(node: str) -> contextvars.Context:
    """A context whose tasks run as `node`: pass it to `create_task(..., context=)`."""
    context = contextvars.copy_context()
    context.run(CURRENT_NODE.set, node)
    return context


def _metadata(pairs: Iterable[tuple[str, str | bytes]] | None) -> Metadata:
    return tuple((key, value) for key, value in pairs or ())


def _status_error(
    code: grpc.StatusCode, details: str, trailing: Metadata = (), debug: str = ""
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailing),
        details,
        debug or f"simulated: {code.name}: {details}",
    )


@dataclass(frozen=True, slots=True)
class _Status:
    code: grpc.StatusCode
    details: str = ""
    trailing: Metadata = ()


@dataclass(frozen=True, slots=True)
class _Start:
    method: str
    metadata: Metadata
    deadline_s: float | None
    request: bytes | None  # the request of a unary-request call


@dataclass(frozen=True, slots=True)
class _Request:
    raw: bytes


class _HalfClose:
    pass


class _Cancel:
    pass


@dataclass(frozen=True, slots=True)
class _Response:
    raw: bytes


@dataclass(frozen=True, slots=True)
class _HandlerCallDetails(grpc.HandlerCallDetails):
    method: str
    invocation_metadata: Metadata


# ---- the network ----


class SimNetwork:
    """The wire between simulated nodes: servers by address, faults, exchanges."""

    def __init__(self, loop: asyncio.AbstractEventLoop, faults: Faults | None = None) -> None:
        assert isinstance(loop, SimLoop), "a simulated network runs on the simulated loop"
        self.loop = loop
        self.rng = loop.rng
        self.faults = faults or Faults.none()
        self.servers: dict[str, SimServer] = {}
        self.cuts: set[tuple[str, str]] = set()
        self._exchanges: dict[int, _Exchange] = {}
        self._next_exchange = 0
        self.stats: dict[str, int] = {"calls": 0, "lost": 0, "duplicated": 0, "resets": 0}
        # A blocking call blocks the caller's node: the loop tells nodes apart by this.
        loop.node_var = CURRENT_NODE

    @contextlib.contextmanager
    def installed(self) -> Iterator[SimNetwork]:
        """Every `Transport.aio_channel` opens a `SimChannel` on this network meanwhile."""
        assert transport.aio_channel_factory is None, "one simulated network at a time"
        transport.aio_channel_factory = self.channel_for
        etcd.aio_channel_factory = self.etcd_channel_for
        etcd.channel_factory = self.blocking_channel_for
        try:
            yield self
        finally:
            transport.aio_channel_factory = None
            etcd.aio_channel_factory = etcd.channel_factory = None

    def channel_for(
        self, credentials: transport.Transport, address: str, options: transport.Options
    ) -> grpc.aio.Channel:
        metadata: Metadata = ()
        if credentials.token:
            # What `access_token_call_credentials` adds to every call.
            metadata = (("authorization", f"Bearer {credentials.token}"),)
        return SimChannel(self, CURRENT_NODE.get(), address, metadata)

    def etcd_channel_for(self, address: str) -> grpc.aio.Channel:
        return SimChannel(self, CURRENT_NODE.get(), address)

    def blocking_channel_for(self, address: str) -> grpc.Channel:
        return SimBlockingChannel(self, CURRENT_NODE.get(), address)

    # ---- faults ----

    def delay_s(self) -> float:
        f = self.faults
        if f.slow and self.rng.random() < f.slow:
            return self.rng.randint(1, f.slow_delay_ms_max) / 1000
        return self.rng.randint(1, f.delay_ms_max) / 1000

    def detection_s(self) -> float:
        return self.rng.randint(1, BREAK_DETECTION_MS_MAX) / 1000

    def partitioned(self, a: str, b: str) -> bool:
        return (min(a, b), max(a, b)) in self.cuts

    def cut(self, a: str, b: str) -> None:
        """Partition `a` from `b` both ways; the calls between them break."""
        self.cuts.add((min(a, b), max(a, b)))
        self.reset(a, b)

    def heal(self) -> None:
        self.cuts.clear()

    def reset(self, a: str, b: str) -> None:
        """Reset the connections between `a` and `b`: every call between them breaks."""
        for exchange in list(self._exchanges.values()):
            if {exchange.client_node, exchange.server_node} == {a, b}:
                exchange.break_(f"connection between {a} and {b} reset")

    def reachable(self, src: str, address: str) -> bool:
        server = self.servers.get(address)
        return server is not None and not self.partitioned(src, server.node)

    # ---- exchanges ----

    def _open(self, call: _ClientCall, start: _Start) -> None:
        self.stats["calls"] += 1
        server = self.servers.get(call.address)
        if server is None or self.partitioned(call.client_node, server.node):
            why = "connection refused" if server is None else "no route to host"
            self.loop.call_later(
                self.delay_s(),
                call.finish,
                _Status(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {call.address}: {why}"),
            )
            return
        self._next_exchange += 1
        exchange = _Exchange(self, self._next_exchange, call, server)
        self._exchanges[exchange.number] = exchange
        call.exchange = exchange
        exchange.to_server.send(start)

    def blocking_call(self, client_node: str, address: str, start: _Start) -> bytes:
        """One blocking unary call (see the module doc): the server handles it now, and
        the caller's thread blocks for as long as the call takes (`SimLoop.block`). The
        answer's bytes, or the status raised as `grpc.aio.AioRpcError` (a
        `grpc.RpcError`)."""
        self.stats["calls"] += 1
        loop = self.loop
        timeout_s = None if start.deadline_s is None else start.deadline_s - loop.time()

        def failed(code: grpc.StatusCode, details: str, after_s: float) -> grpc.aio.AioRpcError:
            if timeout_s is not None and after_s >= timeout_s:
                code, details, after_s = (
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "Deadline Exceeded",
                    timeout_s,
                )
            loop.block(after_s)
            return _status_error(code, details)

        server = self.servers.get(address)
        if server is None or not server.serving or self.partitioned(client_node, server.node):
            why = "connection refused" if server is None else "no route to host"
            raise failed(
                grpc.StatusCode.UNAVAILABLE,
                f"failed to connect to {address}: {why}",
                self.delay_s(),
            )
        request_s = self.delay_s()
        if self._lost():
            raise failed(
                grpc.StatusCode.UNAVAILABLE,
                "Connection reset: request lost",
                request_s + self.detection_s(),
            )
        if timeout_s is not None and request_s >= timeout_s:
            raise failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", timeout_s)
        status, raw = server.answer_at_once(client_node, start)
        if self.rng.random() < self.faults.duplicate:
            self.stats["duplicated"] += 1
            server.answer_at_once(client_node, start)
        answer_s = self.delay_s()
        if self._lost():
            raise failed(
                grpc.StatusCode.UNAVAILABLE,
                "Connection reset: answer lost",
                request_s + self.detection_s(),
            )
        if status.code != grpc.StatusCode.OK:
            raise failed(status.code, status.details, request_s + answer_s)
        if timeout_s is not None and request_s + answer_s >= timeout_s:
            raise failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", timeout_s)
        loop.block(request_s + answer_s)
        assert raw is not None
        return raw

    def _closed(self, exchange: _Exchange) -> None:
        self._exchanges.pop(exchange.number, None)

    def _lost(self) -> bool:
        if self.faults.loss and self.rng.random() < self.faults.loss:
            self.stats["lost"] += 1
            return True
        return False


class _Pipe:
    """One direction of an exchange: in order, each message delayed, any may be lost."""

    def __init__(
        self, exchange: _Exchange, src: str, dst: str, deliver: Callable[[object], None]
    ) -> None:
        self.exchange = exchange
        self.src = src
        self.dst = dst
        self._deliver = deliver
        self._in_flight: deque[object] = deque()
        self._last_arrival_s = 0.0

    def send(self, message: object) -> None:
        exchange = self.exchange
        network = exchange.network
        if exchange.broken:
            return
        if network.partitioned(self.src, self.dst) or network._lost():
            exchange.break_(f"lost a message from {self.src} to {self.dst}")
            return
        loop = network.loop
        arrival = max(self._last_arrival_s, loop.time() + network.delay_s())
        self._last_arrival_s = arrival
        self._in_flight.append(message)
        loop.call_at(arrival, self._arrive)

    def _arrive(self) -> None:
        # The head, whichever timer fires: timers of one instant run in any order.
        message = self._in_flight.popleft()
        exchange = self.exchange
        if exchange.broken:
            return
        if exchange.network.partitioned(self.src, self.dst):
            exchange.break_(f"{self.src} and {self.dst} partitioned")
            return
        self._deliver(message)


class _Exchange:
    """One call on the wire (an HTTP/2 stream): two pipes and both ends' state."""

    def __init__(
        self, network: SimNetwork, number: int, call: _ClientCall, server: SimServer
    ) -> None:
        self.network = network
        self.number = number
        self.call = call
        self.server = server
        self.client_node = call.client_node
        self.server_node = server.node
        self.broken = False
        self.to_server = _Pipe(self, self.client_node, self.server_node, self._at_server)
        self.to_client = _Pipe(self, self.server_node, self.client_node, self._at_client)
        self.handling: _Handling | None = None

    def _at_server(self, message: object) -> None:
        if isinstance(message, _Start):
            if not self.server.serving:
                self.break_("the server stopped")
                return
            self.handling = self.server.handle(self, message)
        elif self.handling is not None:
            self.handling.receive(message)

    def _at_client(self, message: object) -> None:
        self.call.receive(message)

    def break_(self, why: str) -> None:
        """Both ends learn, each after its own detection delay, that the call broke."""
        if self.broken:
            return
        self.broken = True
        self.network.stats["resets"] += 1
        self.network._closed(self)
        loop = self.network.loop
        status = _Status(grpc.StatusCode.UNAVAILABLE, f"Connection reset: {why}")
        loop.call_later(self.network.detection_s(), self.call.finish, status)
        if self.handling is not None:
            loop.call_later(self.network.detection_s(), self.handling.cancel)

    def closed(self) -> None:
        self.network._closed(self)


# ---- the client side ----


class _ClientCall:
    """A call as the caller sees it: what grpc.aio's call objects answer."""

    def __init__(
        self,
        channel: SimChannel,
        method: str,
        serialize: Callable[[Any], bytes] | None,
        deserialize: Callable[[bytes], Any] | None,
        timeout: float | None,
        metadata: Metadata,
    ) -> None:
        self.network = channel.network
        self.channel = channel
        self.client_node = channel.client_node
        self.address = channel.address
        self.method = method
        self._serialize = serialize
        self._deserialize = deserialize
        self.exchange: _Exchange | None = None
        loop = self.network.loop
        self._deadline_s = None if timeout is None else loop.time() + timeout
        self._metadata = (*channel.metadata, *metadata)
        self._responses: deque[bytes] = deque()
        self._status: _Status | None = None
        self._cancelled_locally = False
        self._half_closed = False
        self._changed = asyncio.Event()
        self._done_callbacks: list[Callable[[Any], None]] = []
        self._feeder: asyncio.Task[None] | None = None
        if self._deadline_s is not None:
            loop.call_at(self._deadline_s, self._deadline_passed)
        channel.calls[self] = None

    def start(self, request: Any | None) -> None:
        raw = None if request is None else self._encode(request)
        self.network._open(self, _Start(self.method, self._metadata, self._deadline_s, raw))

    def _encode(self, message: Any) -> bytes:
        raw = message if self._serialize is None else self._serialize(message)
        assert isinstance(raw, bytes), f"{self.method}: a request without a serializer is bytes"
        return raw

    def _send(self, message: object) -> None:
        if self.exchange is not None:
            self.exchange.to_server.send(message)

    # ---- what arrives ----

    def receive(self, message: object) -> None:
        if self._status is not None:
            return
        if isinstance(message, _Response):
            self._responses.append(message.raw)
            self._changed.set()
        else:
            assert isinstance(message, _Status)
            self.finish(message)

    def finish(self, status: _Status) -> None:
        if self._status is not None:
            return
        self._status = status
        self.channel.calls.pop(self, None)
        if self.exchange is not None:
            self.exchange.closed()
        if self._feeder is not None:
            self._feeder.cancel()
        self._changed.set()
        for callback in self._done_callbacks:
            callback(self)

    def _deadline_passed(self) -> None:
        if self._status is None:
            self._send(_Cancel())
            self.finish(_Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    # ---- grpc.aio.Call ----

    def cancel(self) -> bool:
        if self._status is not None:
            return False
        self._cancelled_locally = True
        self._send(_Cancel())
        self.finish(_Status(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        return True

    def cancelled(self) -> bool:
        return self._cancelled_locally

    def done(self) -> bool:
        return self._status is not None

    def time_remaining(self) -> float | None:
        if self._deadline_s is None:
            return None
        return max(0.0, self._deadline_s - self.network.loop.time())

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._status is not None:
            callback(self)
        else:
            self._done_callbacks.append(callback)

    async def _finished(self) -> _Status:
        while self._status is None:
            self._changed.clear()
            await self._changed.wait()
        return self._status

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*(await self._finished()).trailing)

    async def code(self) -> grpc.StatusCode:
        return (await self._finished()).code

    async def details(self) -> str:
        return (await self._finished()).details

    async def wait_for_connection(self) -> None:
        await asyncio.sleep(0)

    def _raise_for_status(self) -> None:
        status = self._status
        assert status is not None
        if self._cancelled_locally:
            raise asyncio.CancelledError()
        if status.code != grpc.StatusCode.OK:
            raise _status_error(status.code, status.details, status.trailing)

    # ---- responses ----

    async def read(self) -> Any:
        while not self._responses and self._status is None:
            self._changed.clear()
            await self._changed.wait()
        if self._responses:
            raw = self._responses.popleft()
            return raw if self._deserialize is None else self._deserialize(raw)
        self._raise_for_status()
        return grpc.aio.EOF

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._each()

    async def _each(self) -> AsyncIterator[Any]:
        while (response := await self.read()) is not grpc.aio.EOF:
            yield response

    async def _response(self) -> Any:
        await self._finished()
        self._raise_for_status()
        return await self.read()

    def __await__(self) -> Any:
        return self._response().__await__()

    # ---- requests ----

    async def write(self, request: Any) -> None:
        if self._feeder is not None:
            raise grpc.aio.UsageError("this call writes its request iterator itself")
        if self._status is not None:
            self._raise_for_status()
            raise asyncio.InvalidStateError("RPC already finished.")
        if self._half_closed:
            raise asyncio.InvalidStateError("RPC is half closed after calling done_writing.")
        self._send(_Request(self._encode(request)))
        # A write completes once the transport took the message: others run meanwhile.
        await asyncio.sleep(0)

    async def done_writing(self) -> None:
        if self._status is None and not self._half_closed:
            self._half_closed = True
            self._send(_HalfClose())
        await asyncio.sleep(0)

    def feed(self, requests: Any) -> None:
        """Write `requests` (an iterable or async iterable), then half-close."""

        async def write_all() -> None:
            if hasattr(requests, "__aiter__"):
                async for request in requests:
                    self._send(_Request(self._encode(request)))
            else:
                for request in requests:
                    self._send(_Request(self._encode(request)))
            self._half_closed = True
            self._send(_HalfClose())

        self._feeder = asyncio.get_running_loop().create_task(write_all())


class _MultiCallable:
    """`channel.unary_unary(...)` and its three siblings: calling it starts a call."""

    def __init__(
        self,
        channel: SimChannel,
        method: str,
        serialize: Callable[[Any], bytes] | None,
        deserialize: Callable[[bytes], Any] | None,
        unary_request: bool,
    ) -> None:
        self.channel = channel
        self.method = method
        self.serialize = serialize
        self.deserialize = deserialize
        self.unary_request = unary_request

    def __call__(
        self,
        request: Any = None,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str | bytes]] | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> _ClientCall:
        if self.channel.closed:
            raise grpc.aio.UsageError("Channel is closed.")
        call = _ClientCall(
            self.channel,
            self.method,
            self.serialize,
            self.deserialize,
            timeout,
            _metadata(metadata),
        )
        call.start(request if self.unary_request else None)
        if not self.unary_request and request is not None:
            call.feed(request)
        return call


class SimChannel(grpc.aio.Channel):
    """A channel from one node to one address on a `SimNetwork`."""

    def __init__(
        self, network: SimNetwork, client_node: str, address: str, metadata: Metadata = ()
    ) -> None:
        self.network = network
        self.client_node = client_node
        self.address = address
        self.metadata = metadata
        self.closed = False
        # Calls in progress, in the order they started (a dict: an ordered set).
        self.calls: dict[_ClientCall, None] = {}

    def _callable(self, method: str, serialize: Any, deserialize: Any, unary_request: bool) -> Any:
        return _MultiCallable(self, method, serialize, deserialize, unary_request)

    def unary_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        return self._callable(method, request_serializer, response_deserializer, True)

    def unary_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        return self._callable(method, request_serializer, response_deserializer, True)

    def stream_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        return self._callable(method, request_serializer, response_deserializer, False)

    def stream_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        return self._callable(method, request_serializer, response_deserializer, False)

    async def close(self, grace: float | None = None) -> None:
        self.closed = True
        for call in list(self.calls):
            call.cancel()

    async def __aenter__(self) -> SimChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        if self.closed:
            return grpc.ChannelConnectivity.SHUTDOWN
        if self.network.reachable(self.client_node, self.address):
            return grpc.ChannelConnectivity.READY
        return grpc.ChannelConnectivity.TRANSIENT_FAILURE

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        """As grpc's channel: it looks again after each reconnect backoff."""
        backoff_s = RECONNECT_S_MIN
        while self.get_state() == last_observed_state:
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, RECONNECT_S_MAX)

    async def channel_ready(self) -> None:
        """Reconnect with backoff until the address is served and not cut off."""
        backoff_s = RECONNECT_S_MIN
        while not self.network.reachable(self.client_node, self.address):
            await asyncio.sleep(backoff_s * (0.8 + 0.4 * self.network.rng.random()))
            backoff_s = min(backoff_s * 2, RECONNECT_S_MAX)
        # The handshake: one round trip.
        await asyncio.sleep(2 * self.network.delay_s())


class _BlockingCallable:
    """`channel.unary_unary(...)` of a blocking channel: calling it makes the call."""

    def __init__(
        self,
        channel: SimBlockingChannel,
        method: str,
        serialize: Callable[[Any], bytes] | None,
        deserialize: Callable[[bytes], Any] | None,
    ) -> None:
        self.channel = channel
        self.method = method
        self.serialize = serialize
        self.deserialize = deserialize

    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str | bytes]] | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        channel = self.channel
        if channel.closed:
            raise ValueError("Cannot invoke RPC: Channel closed!")
        raw = request if self.serialize is None else self.serialize(request)
        loop = channel.network.loop
        deadline_s = None if timeout is None else loop.time() + timeout
        start = _Start(self.method, _metadata(metadata), deadline_s, raw)
        answer = channel.network.blocking_call(channel.client_node, channel.address, start)
        return answer if self.deserialize is None else self.deserialize(answer)


class SimBlockingChannel(grpc.Channel):
    """A blocking channel from one node to one address: unary calls, handled at once,
    the caller's thread blocked for as long as they take (see the module doc)."""

    def __init__(self, network: SimNetwork, client_node: str, address: str) -> None:
        self.network = network
        self.client_node = client_node
        self.address = address
        self.closed = False

    def unary_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        return _BlockingCallable(self, method, request_serializer, response_deserializer)

    def _streaming(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("blocking streaming calls are not simulated")

    unary_stream = stream_unary = stream_stream = _streaming

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        raise NotImplementedError("channel connectivity of a blocking channel")

    def unsubscribe(self, callback: Any) -> None:
        raise NotImplementedError("channel connectivity of a blocking channel")

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> SimBlockingChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _at_once(awaitable: Any) -> Any:
    """The result of a coroutine that finishes without waiting (a handler a blocking
    call reaches: in one thread nothing else could wake it)."""
    coroutine = awaitable.__await__()
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise AssertionError("a handler a blocking call reaches must answer without waiting")


# ---- the server side ----


class SimServicerContext:
    """What a servicer's handler is given: grpc.aio.ServicerContext's surface."""

    def __init__(self, handling: _Handling, start: _Start) -> None:
        self._handling = handling
        self._start = start
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: Metadata = ()
        self._done_callbacks: list[Callable[[Any], None]] = []

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Any:
        if code == grpc.StatusCode.OK:
            raise grpc.aio.UsageError("abort with an OK status")
        if self._handling.status is not None:
            raise grpc.aio.UsageError("Abort was already called!")
        trailing = _metadata(trailing_metadata) or self._trailing
        self._handling.status = _Status(code, details, trailing)
        raise grpc.aio.AbortError()

    async def write(self, message: Any) -> None:
        self._handling.respond(message)
        await asyncio.sleep(0)

    async def read(self) -> Any:
        return await self._handling.read()

    async def send_initial_metadata(self, initial_metadata: Any) -> None:
        pass

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._trailing = _metadata(trailing_metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def invocation_metadata(self) -> Metadata:
        return self._start.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details

    def set_compression(self, compression: Any) -> None:
        pass

    def disable_next_message_compression(self) -> None:
        pass

    def peer(self) -> str:
        return f"sim:{self._handling.client_node}"

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, list[bytes]]:
        return dict(PLAINTEXT_AUTH_CONTEXT)

    def time_remaining(self) -> float | None:
        if self._start.deadline_s is None:
            return None
        return max(0.0, self._start.deadline_s - self._handling.loop.time())

    def cancelled(self) -> bool:
        return self._handling.cancelled

    def done(self) -> bool:
        return self._handling.finished

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._done_callbacks.append(callback)

    def _run_done_callbacks(self) -> None:
        for callback in self._done_callbacks:
            callback(self)


class _Handling:
    """One call at the server: its handler task, its requests, its answer."""

    def __init__(
        self, server: SimServer, exchange: _Exchange | None, client_node: str, start: _Start
    ) -> None:
        self.server = server
        self.loop = server.network.loop
        self.exchange = exchange  # None: a duplicate, whose answers go nowhere
        self.client_node = client_node
        self.start = start
        self.status: _Status | None = None
        self.cancelled = False
        self.finished = False
        self._requests: deque[bytes | None] = deque()  # None: the caller half-closed
        self._arrived = asyncio.Event()
        self.handler: Handler | None = None
        self.task: asyncio.Task[None] | None = None

    def receive(self, message: object) -> None:
        if isinstance(message, _Request):
            self._requests.append(message.raw)
        elif isinstance(message, _HalfClose):
            self._requests.append(None)
        else:
            assert isinstance(message, _Cancel)
            self.cancel()
            return
        self._arrived.set()

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.cancelled = True
            self.task.cancel()

    def _parse(self, raw: bytes) -> Any:
        assert self.handler is not None
        parse = self.handler.request_deserializer
        return raw if parse is None else parse(raw)

    async def read(self) -> Any:
        while not self._requests:
            self._arrived.clear()
            await self._arrived.wait()
        raw = self._requests[0]
        if raw is None:
            return grpc.aio.EOF
        self._requests.popleft()
        return self._parse(raw)

    async def requests(self) -> AsyncIterator[Any]:
        while (request := await self.read()) is not grpc.aio.EOF:
            yield request

    def respond(self, message: Any) -> None:
        assert self.handler is not None
        serialize = self.handler.response_serializer
        raw = message if serialize is None else serialize(message)
        assert isinstance(raw, bytes), f"{self.start.method}: a response is bytes"
        if self.exchange is not None:
            self.exchange.to_client.send(_Response(raw))

    def _answer(self, status: _Status) -> None:
        if self.exchange is not None:
            self.exchange.to_client.send(status)

    async def run(self) -> None:
        context = SimServicerContext(self, self.start)
        try:
            status = await self._serve(context)
        except grpc.aio.AbortError:
            assert self.status is not None
            status = self.status
        except asyncio.CancelledError:
            if not self.cancelled:
                raise
            return  # the caller went away: nobody to answer
        except Exception as error:
            log.exception("%s failed at %s", self.start.method, self.server.node)
            status = _Status(grpc.StatusCode.UNKNOWN, f"Unexpected {type(error)}: {error}")
        finally:
            self.finished = True
            context._run_done_callbacks()
        # A handler that caught its own abort still ends the call with it.
        self._answer(self.status or status)

    async def _serve(self, context: SimServicerContext) -> _Status:
        self.handler = handler = await self.server.lookup(self.start)
        if handler is None:
            return _Status(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        request: Any
        if self.start.request is not None:
            request = self._parse(self.start.request)
        else:
            request = self.requests()
        behaviour = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        assert behaviour is not None
        result: Any = behaviour(request, cast(Any, context))
        if inspect.isasyncgen(result):
            async for response in result:
                self.respond(response)
        else:
            response = await result
            if handler.unary_unary is not None or handler.stream_unary is not None:
                self.respond(response)
        return _Status(context._code or grpc.StatusCode.OK, context._details, context._trailing)


class SimServer(grpc.aio.Server):
    """One node's gRPC server: what `add_*Servicer_to_server` and `serve` need of one."""

    def __init__(
        self,
        network: SimNetwork,
        node: str,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.network = network
        self.node = node
        self.interceptors = tuple(interceptors)
        self.addresses: list[str] = []
        self.serving = False
        # Calls being handled, in the order they arrived.
        self.handlings: dict[int, _Handling] = {}
        self._handled = 0
        self._generic: list[grpc.GenericRpcHandler] = []
        self._methods: dict[str, Handler] = {}
        self._stopped = asyncio.Event()

    # ---- built as a grpc.aio.Server is ----

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Handler]) -> None:
        for name, handler in handlers.items():
            self._methods[f"/{service}/{name}"] = handler

    def add_insecure_port(self, address: str) -> int:
        self.addresses.append(address)
        return int(address.rpartition(":")[2] or 0) or 1

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        raise NotImplementedError("TLS is not simulated yet (tests/sim/runtime/README.md)")

    async def start(self) -> None:
        for address in self.addresses:
            assert address not in self.network.servers, f"{address} is served already"
            self.network.servers[address] = self
        self.serving = True

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving: the calls in progress break (a crash, or a stop without grace)."""
        self.serving = False
        for address in self.addresses:
            if self.network.servers.get(address) is self:
                del self.network.servers[address]
        for exchange in list(self.network._exchanges.values()):
            if exchange.server is self:
                exchange.break_(f"{self.node} stopped")
        for handling in list(self.handlings.values()):
            handling.cancel()
        self._stopped.set()

    # grpc.aio.Server's signature, timeout included.
    async def wait_for_termination(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        try:
            async with asyncio.timeout(timeout):
                await self._stopped.wait()
        except TimeoutError:
            return False
        return True

    # ---- serving ----

    def handle(self, exchange: _Exchange, start: _Start) -> _Handling:
        handling = self._spawn(exchange, start)
        faults = self.network.faults
        duplicated = start.request is not None and self.network.rng.random() < faults.duplicate
        if duplicated:
            self.network.stats["duplicated"] += 1
            self._spawn(None, start)
        return handling

    def _spawn(self, exchange: _Exchange | None, start: _Start) -> _Handling:
        handling = _Handling(self, exchange, exchange.client_node if exchange else "", start)
        self._handled += 1
        number = self._handled
        self.handlings[number] = handling
        loop = self.network.loop
        handling.task = loop.create_task(handling.run(), context=node_context(self.node))
        handling.task.add_done_callback(lambda _: self.handlings.pop(number, None))
        if start.deadline_s is not None:
            loop.call_at(start.deadline_s, handling.cancel)
        return handling

    def answer_at_once(self, client_node: str, start: _Start) -> tuple[_Status, bytes | None]:
        """A blocking unary call's handling, to its end in this step (module doc)."""
        assert start.request is not None
        handling = _Handling(self, None, client_node, start)
        context = SimServicerContext(handling, start)
        handling.handler = handler = _at_once(self.lookup(start))
        if handler is None or handler.unary_unary is None:
            return _Status(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"), None
        try:
            response = _at_once(handler.unary_unary(handling._parse(start.request), context))
        except grpc.aio.AbortError:
            assert handling.status is not None
            return handling.status, None
        except Exception as error:
            log.exception("%s failed at %s", start.method, self.node)
            return _Status(grpc.StatusCode.UNKNOWN, f"Unexpected {type(error)}: {error}"), None
        if handling.status is not None:
            return handling.status, None
        serialize = handler.response_serializer
        raw = response if serialize is None else serialize(response)
        assert isinstance(raw, bytes), f"{start.method}: a response is bytes"
        return _Status(context._code or grpc.StatusCode.OK, context._details), raw

    async def lookup(self, start: _Start) -> Handler | None:
        details = _HandlerCallDetails(start.method, start.metadata)

        async def continuation(call: grpc.HandlerCallDetails) -> Handler | None:
            handler = self._methods.get(call.method)
            for generic in self._generic:
                if handler is not None:
                    break
                handler = generic.service(call)
            return handler

        chain: Callable[[grpc.HandlerCallDetails], Any] = continuation
        for interceptor in reversed(self.interceptors):
            chain = _intercepted(interceptor, chain)
        return await chain(details)


def _intercepted(
    interceptor: grpc.aio.ServerInterceptor,
    continuation: Callable[[grpc.HandlerCallDetails], Any],
) -> Callable[[grpc.HandlerCallDetails], Any]:
    async def chained(details: grpc.HandlerCallDetails) -> Any:
        return await interceptor.intercept_service(continuation, details)

    return chained
