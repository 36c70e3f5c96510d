"""An in-process stand-in for the grpc.aio surface our shells use, over a faulty network.

Theory of operation. Each call is an exchange between two simulated nodes: the caller
(the node whose task opened the channel, `CURRENT_NODE`) and the node serving the
address dialed (`SimServer`). An exchange carries two ordered pipes, as an HTTP/2
stream does: requests, the half-close and a cancel towards the server; responses and
the final status towards the caller. Every message is serialized with the method's real
codecs on one side and parsed on the other, and takes a delay drawn from the seed
(`tests.sim.faults.Faults`); messages of one pipe arrive in the order sent.

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
  `cancel()` ends it CANCELLED and cancels the handler when the cancel arrives;
- lost answers, chosen by the world (`lose_answers`): the next answers of one method to
  one node are lost after the server handled the call, and the caller sees a reset.

`call_observers` hear how every call ended for its caller (its node, the address, the
method and the status code).

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

Byte streams (`SimNetwork.open_connection`, `SimNetwork.start_server`: asyncio's
streams, for the framed data plane) are TCP connections, not calls: bytes arrive in
order and never go missing (a lost piece arrives a retransmission later), each piece
delayed as `Faults` draws it; a write is split at points drawn from the seed and pieces
of one instant coalesce, so a reader meets partial frames. `drain` waits while the peer
holds `StreamFaults.send_buffer_bytes` unread. A reset between two nodes reaches both
ends as `ConnectionResetError` after a detection delay; a cut does that too or, as
drawn (`StreamFaults.silent_cut`), leaves the connection silent: nothing arrives and no
error comes; a SYN sent across a cut is dropped as silently, as drawn, and sent again
on the kernel's retransmission timeout. An end closed while asyncio still holds bytes
for a silent peer (`get_write_buffer_size`) waits in `wait_closed` until TCP's user
timeout (asyncio closes once its buffer is out, and nobody acknowledges it); one
aborted does not (`SimNetwork.close_waits` keeps those waits). A connection belongs to
its process (`Incarnation`, `start_node`): when its task ends, each end it holds closes as the
kernel closes a dead process's socket, a FIN after what it sent, or a reset when bytes
it never read were left.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import inspect
import logging
import ssl
import weakref
from collections import deque
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from streamengine.master import etcd
from streamengine.protocol import framed, identity, transport
from streamengine.protocol.framed_peer import DEAD_PEER_MS
from tests.sim.faults import BREAK_DETECTION_MS_MAX, Faults
from tests.sim.runtime import blocking
from tests.sim.runtime.loop import SimLoop

log = logging.getLogger("tests.sim.runtime")
T = TypeVar("T")

# The simulated node the running task belongs to: who calls, and who serves.
CURRENT_NODE: contextvars.ContextVar[str] = contextvars.ContextVar("sim_node")

# How a channel waits for its server to come back (grpc's reconnect backoff, shortened).
RECONNECT_S_MIN = 0.1
RECONNECT_S_MAX = 1.0

PLAINTEXT_AUTH_CONTEXT: dict[str, list[bytes]] = {
    "transport_security_type": [b"insecure"],
    "security_level": [b"TSI_SECURITY_NONE"],
}
# What grpc's auth context says of a call over TLS without a client certificate in the
# handshake (servers ask for none: `transport.server_credentials`).
TLS_AUTH_CONTEXT: dict[str, list[bytes]] = {
    "transport_security_type": [b"ssl"],
    "security_level": [b"TSI_PRIVACY_AND_INTEGRITY"],
    "ssl_session_reused": [b"false"],
}
# What grpc-core says when a channel and its server disagree on TLS (the words
# `transport.tls_problem` reads).
PLAINTEXT_TO_TLS = "Socket closed"
TLS_TO_PLAINTEXT = "Tls handshake failed: WRONG_VERSION_NUMBER"

Metadata = tuple[tuple[str, str | bytes], ...]
if TYPE_CHECKING:
    # grpcio's stubs make it generic; the runtime class is not subscriptable.
    Handler = grpc.RpcMethodHandler[Any, Any]


def node_context(
    node: str, incarnation: Incarnation | None = None, base: contextvars.Context | None = None
) -> contextvars.Context:
    """A context whose tasks run as `node` (in a new process unless `incarnation` is
    given): pass it to `create_task(..., context=)`. A copy of `base` when given (a
    server's handlers: the context it started in), else of the current one."""
    context = (base or contextvars.copy_context()).copy()
    context.run(CURRENT_NODE.set, node)
    context.run(CURRENT_INCARNATION.set, incarnation or Incarnation(node))
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

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        faults: Faults | None = None,
        stream_faults: StreamFaults | None = None,
    ) -> None:
        assert isinstance(loop, SimLoop), "a simulated network runs on the simulated loop"
        self.loop = loop
        self.rng = loop.rng
        self.faults = faults or Faults.none()
        self.stream_faults = stream_faults or StreamFaults()
        self.servers: dict[str, SimServer] = {}
        self.stream_servers: dict[str, SimStreamServer] = {}
        self.cuts: set[tuple[str, str]] = set()
        self._exchanges: dict[int, _Exchange] = {}
        self._next_exchange = 0
        self._connections: dict[int, _Connection] = {}
        self._next_connection = 0
        self._next_port = EPHEMERAL_PORT_FIRST
        self.stats: dict[str, int] = {
            "calls": 0,
            "lost": 0,
            "duplicated": 0,
            "resets": 0,
            "connections": 0,
            "stream_resets": 0,
            "silent_cuts": 0,
            "silent_syns": 0,
        }
        # (client's node, server's host) -> when the client last sent a SYN to it (a
        # dial, or the kernel's retransmission of one).
        self.syns_sent: dict[tuple[str, str], float] = {}
        # (client's node, server's node) -> the dials whose SYN a cut dropped silently,
        # still waiting for an answer.
        self.unanswered_dials: dict[tuple[str, str], set[asyncio.Future[_Connection]]] = {}
        # Closes waiting on a silent peer for their buffer to go out: (node, peer's
        # node, when the wait began) -> when it ended (None: waiting still).
        self.close_waits: dict[tuple[str, str, float], float | None] = {}
        # Told of every call's end, as its caller sees it: (caller's node, address,
        # method, status code).
        self.call_observers: list[Callable[[str, str, str, grpc.StatusCode], None]] = []
        # (caller's node, method) -> how many of its next answers are lost: the server
        # handled the call, and its caller sees the connection reset.
        self._answers_to_lose: dict[tuple[str, str], int] = {}
        self._proofs: dict[tuple[bytes, bytes], identity.CertificateProof] = {}
        # A blocking call blocks the caller's node: the loop tells nodes apart by this.
        loop.node_var = CURRENT_NODE

    @contextlib.contextmanager
    def installed(self) -> Iterator[SimNetwork]:
        """Every `Transport.aio_channel` opens a `SimChannel` on this network meanwhile,
        and synchronous code run in a `blocking.BlockingThread` calls through it too."""
        assert transport.aio_channel_factory is None, "one simulated network at a time"
        transport.aio_channel_factory = self.channel_for
        etcd.aio_channel_factory = self.etcd_channel_for
        etcd.channel_factory = self.blocking_channel_for
        # The framed data plane (issue #39) opens connections and starts servers
        # through two seams shaped as `asyncio.open_connection`/`asyncio.start_server`.
        framed.open_connection = self.open_connection  # type: ignore[assignment]
        framed.start_server = self.start_server  # type: ignore[assignment]
        # The data plane's handshake presents the certificate its ssl context holds.
        load_chain = transport._load_chain
        transport._load_chain = _presenting(load_chain)
        saved_identity = identity._process_identity
        try:
            with blocking.installed(self):
                yield self
        finally:
            transport._load_chain = load_chain
            identity._process_identity = saved_identity
            transport.aio_channel_factory = None
            etcd.aio_channel_factory = etcd.channel_factory = None
            framed.open_connection = asyncio.open_connection
            framed.start_server = asyncio.start_server

    def channel_for(
        self, credentials: transport.Transport, address: str, options: transport.Options
    ) -> grpc.aio.Channel:
        metadata: Metadata = ()
        if credentials.token:
            # What `access_token_call_credentials` adds to every call.
            metadata = (("authorization", f"Bearer {credentials.token}"),)
        proof = None
        if credentials.cert_pem:
            # What `metadata_call_credentials(CertificateProof(...))` adds to every call.
            key = (credentials.cert_pem, credentials.key_pem)
            proof = self._proofs.get(key)
            if proof is None:
                proof = self._proofs[key] = identity.CertificateProof(*key)
        return SimChannel(
            self, CURRENT_NODE.get(), address, metadata, tls=credentials.tls, proof=proof
        )

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
        """Partition `a` from `b` both ways: the calls between them break, and their
        byte streams are reset or go silent (`StreamFaults.silent_cut`). A silent
        connection stays dead after `heal`."""
        self.cuts.add((min(a, b), max(a, b)))
        self._break_exchanges(a, b)
        for connection in self._connections_between(a, b):
            connection.cut()

    def heal(self) -> None:
        self.cuts.clear()

    def reset(self, a: str, b: str) -> None:
        """Reset the connections between `a` and `b`: every call and byte stream between
        them breaks, both ends told after a detection delay."""
        self._break_exchanges(a, b)
        for connection in self._connections_between(a, b):
            connection.reset(f"connection between {a} and {b} reset")

    def _break_exchanges(self, a: str, b: str) -> None:
        for exchange in list(self._exchanges.values()):
            if {exchange.client_node, exchange.server_node} == {a, b}:
                exchange.break_(f"connection between {a} and {b} reset")

    def _connections_between(self, a: str, b: str) -> list[_Connection]:
        return [c for c in list(self._connections.values()) if c.nodes == {a, b}]

    def lose_answers(self, client_node: str, method: str, count: int = 1) -> None:
        """The next `count` answers to `client_node`'s calls of `method` (its full
        name, `/package.Service/Method`) are lost on their way back."""
        key = (client_node, method)
        self._answers_to_lose[key] = self._answers_to_lose.get(key, 0) + count

    def _answer_lost(self, client_node: str, method: str) -> bool:
        key = (client_node, method)
        left = self._answers_to_lose.get(key, 0)
        if not left:
            return False
        self.stats["answers lost"] = self.stats.get("answers lost", 0) + 1
        if left == 1:
            del self._answers_to_lose[key]
        else:
            self._answers_to_lose[key] = left - 1
        return True

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
        if server.tls != call.channel.tls:
            # The handshake fails: grpc says so in words of its own.
            why = PLAINTEXT_TO_TLS if server.tls else TLS_TO_PLAINTEXT
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

    # ---- byte streams (see "byte streams" below) ----

    async def start_server(
        self,
        client_connected_cb: Callable[[Any, Any], Any],
        host: str | None = None,
        port: int | None = None,
        *,
        ssl: object = None,
        **kwargs: Any,
    ) -> SimStreamServer:
        """`asyncio.start_server` as the current node: port 0 (or None) takes a free one.
        Given an ssl context, its connections are TLS: a client that does not start TLS
        is reset at its first bytes, one that does presents its certificate."""
        if host in (None, "", "0.0.0.0", "::"):
            host = CURRENT_NODE.get()
        if not port:
            self._next_port += 1
            port = self._next_port
        address = f"{host}:{port}"
        if address in self.stream_servers or address in self.servers:
            raise OSError(errno.EADDRINUSE, f"address already in use: {address}")
        server = SimStreamServer(self, address, client_connected_cb, ssl not in (None, False))
        self.stream_servers[address] = server
        return server

    async def open_connection(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        ssl: object = None,
        server_hostname: str | None = None,
        **kwargs: Any,
    ) -> tuple[SimStreamReader, SimStreamWriter]:
        """`asyncio.open_connection` from the current node: the handshake takes a round
        trip; nobody listening refuses it; a cut leaves the host unreachable or, as
        drawn (`StreamFaults.silent_cut`), drops the SYN without a word, and the kernel
        sends it again 1 s later, then 2 s, 4 s..., until one crosses a healed cut or
        the caller gives up."""
        _refuse_tls(ssl)
        client = (CURRENT_NODE.get(), CURRENT_INCARNATION.get(None))
        connected: asyncio.Future[_Connection] = self.loop.create_future()
        self._send_syn(client, f"{host}:{port}", connected, SYN_RETRANSMIT_FIRST_S)
        try:
            connection = await connected
        except asyncio.CancelledError:
            if connected.done() and not connected.cancelled():
                connected.result().client.close()
            raise
        return SimStreamReader(connection.client), SimStreamWriter(connection.client)

    def _send_syn(
        self,
        client: tuple[str, Incarnation | None],
        address: str,
        connected: asyncio.Future[_Connection],
        retransmit_s: float,
    ) -> None:
        if connected.done():  # the caller gave up: its kernel sends no more
            return
        self.syns_sent[(client[0], address.rpartition(":")[0])] = self.loop.time()
        self.loop.call_later(
            self.delay_s(), self._syn_arrives, client, address, connected, retransmit_s
        )

    def _syn_arrives(
        self,
        client: tuple[str, Incarnation | None],
        address: str,
        connected: asyncio.Future[_Connection],
        retransmit_s: float,
    ) -> None:
        node, incarnation = client
        server = self.stream_servers.get(address)
        if server is None:
            refused = ConnectionRefusedError(errno.ECONNREFUSED, f"Connect call failed {address}")
            self.loop.call_later(self.delay_s(), _fail_unless_done, connected, refused)
            return
        if self.partitioned(node, server.node):
            if self.rng.random() < self.stream_faults.silent_cut:
                # Dropped without a word (iptables DROP): the kernel sends the SYN
                # again after its retransmission timeout, doubled each time.
                self.stats["silent_syns"] += 1
                waiting = self.unanswered_dials.setdefault((node, server.node), set())
                if connected not in waiting:
                    waiting.add(connected)
                    connected.add_done_callback(waiting.discard)
                self.loop.call_later(
                    retransmit_s, self._send_syn, client, address, connected, 2 * retransmit_s
                )
                return
            unreachable = OSError(errno.EHOSTUNREACH, f"No route to host {address}")
            after_s = self.delay_s() + self.detection_s()
            self.loop.call_later(after_s, _fail_unless_done, connected, unreachable)
            return
        self._next_connection += 1
        self._next_port += 1
        number = self._next_connection
        client_address = f"{node}:{self._next_port}"
        connection = _Connection(
            self,
            number,
            (node, incarnation, client_address),
            (server.node, server.incarnation, address),
        )
        self._connections[number] = connection
        self.stats["connections"] += 1
        server.accept(connection)
        self.loop.call_later(self.delay_s(), self._syn_ack_arrives, connection, connected)

    def _syn_ack_arrives(
        self, connection: _Connection, connected: asyncio.Future[_Connection]
    ) -> None:
        if connected.done():  # the caller gave up: its kernel resets the half-open one
            connection.reset("connect abandoned")
        elif connection.state != "open":
            connected.set_exception(
                ConnectionResetError(errno.ECONNRESET, "reset while connecting")
            )
        else:
            connected.set_result(connection)

    def pieces(self, data: bytes) -> list[bytes]:
        """`data` split at points drawn from the seed (`StreamFaults.split`)."""
        if len(data) < 2 or self.rng.random() >= self.stream_faults.split:
            return [data]
        count = min(self.rng.randint(1, SPLITS_PER_WRITE_MAX), len(data) - 1)
        cuts = sorted(self.rng.sample(range(1, len(data)), count))
        return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]

    def _closed(self, exchange: _Exchange) -> None:
        self._exchanges.pop(exchange.number, None)

    def _lost(self) -> bool:
        if self.faults.loss and self.rng.random() < self.faults.loss:
            self.stats["lost"] += 1
            return True
        return False


def _fail_unless_done(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


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
        if self.network._answer_lost(self.client_node, self.call.method):
            self.break_("the answer was lost")
            return
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
        self._metadata = (*channel.call_metadata(method), *metadata)
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
        for observer in self.network.call_observers:
            observer(self.client_node, self.address, self.method, status.code)
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


@dataclass(frozen=True)
class _AuthMetadataContext(grpc.AuthMetadataContext):
    service_url: str
    method_name: str


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
        self,
        network: SimNetwork,
        client_node: str,
        address: str,
        metadata: Metadata = (),
        tls: bool = False,
        proof: grpc.AuthMetadataPlugin | None = None,
    ) -> None:
        self.network = network
        self.client_node = client_node
        self.address = address
        self.metadata = metadata
        self.tls = tls
        self.proof = proof  # the channel's call credentials' plugin
        self.closed = False
        # Calls in progress, in the order they started (a dict: an ordered set).
        self.calls: dict[_ClientCall, None] = {}

    def _callable(self, method: str, serialize: Any, deserialize: Any, unary_request: bool) -> Any:
        return _MultiCallable(self, method, serialize, deserialize, unary_request)

    def call_metadata(self, method: str) -> Metadata:
        """What a call of `method` carries from the channel: its token, and what its
        plugin adds, asked as grpc asks it (`service_url`: `https://host:port/Service`,
        the address dialed, at the call's start)."""
        if self.proof is None:
            return self.metadata
        service, _, name = method.rpartition("/")
        added: list[tuple[str, str | bytes]] = []

        def callback(metadata: Any, error: Exception | None) -> None:
            if error is not None:
                raise error
            added.extend(metadata)

        self.proof(
            _AuthMetadataContext(f"https://{self.address}{service}", name), cast(Any, callback)
        )
        return (*self.metadata, *added)

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


class SimBlockingChannel(blocking.UnaryChannel):
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

    def close(self) -> None:
        self.closed = True


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
        return dict(TLS_AUTH_CONTEXT if self._handling.server.tls else PLAINTEXT_AUTH_CONTEXT)

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
        self.tls = False  # its ports serve TLS (`add_secure_port`)
        # The context it started in, where its handlers run (with what the process
        # set before: its `identity.install`).
        self._context: contextvars.Context | None = None
        # Calls being handled, in the order they arrived.
        self.handlings: dict[int, _Handling] = {}
        self._handled = 0
        self._generic: list[grpc.GenericRpcHandler] = []
        self._methods: dict[str, Handler] = {}
        self._stopped = asyncio.Event()
        # The process serving: connections its handlers open die with it.
        incarnation = CURRENT_INCARNATION.get(None)
        self._incarnation = incarnation if incarnation and incarnation.node == node else None

    # ---- built as a grpc.aio.Server is ----

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Handler]) -> None:
        for name, handler in handlers.items():
            self._methods[f"/{service}/{name}"] = handler

    def add_insecure_port(self, address: str) -> int:
        assert not self.tls, "one server, plaintext or TLS"
        self.addresses.append(address)
        return int(address.rpartition(":")[2] or 0) or 1

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        assert self.tls or not self.addresses, "one server, plaintext or TLS"
        self.tls = True
        self.addresses.append(address)
        return int(address.rpartition(":")[2] or 0) or 1

    async def start(self) -> None:
        self._context = contextvars.copy_context()
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
        context = node_context(self.node, self._incarnation, self._context)
        handling.task = loop.create_task(handling.run(), context=context)
        handling.task.add_done_callback(lambda _: self.handlings.pop(number, None))
        if start.deadline_s is not None:
            loop.call_at(start.deadline_s, handling.cancel)
        return handling

    def answer_at_once(self, client_node: str, start: _Start) -> tuple[_Status, bytes | None]:
        """A blocking unary call's handling, to its end in this step (module doc)."""
        assert start.request is not None
        if self._context is not None:
            return self._context.copy().run(self._answer_at_once, client_node, start)
        return self._answer_at_once(client_node, start)

    def _answer_at_once(self, client_node: str, start: _Start) -> tuple[_Status, bytes | None]:
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
        return _Status(
            context._code or grpc.StatusCode.OK, context._details, context._trailing
        ), raw

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


# ---- byte streams: asyncio's streams on the same wire (the framed data plane) ----


# asyncio's default high-water mark of a transport's write buffer.
SEND_BUFFER_BYTES_DEFAULT = 64 * 1024


@dataclass(frozen=True, slots=True)
class StreamFaults:
    """How simulated TCP connections misbehave, beyond the delays `Faults` draws."""

    # How often a write is split into pieces that arrive apart (a reader meets partial
    # frames); pieces of one instant arrive together, so writes also coalesce.
    split: float = 0.5
    # How often a cut leaves a connection silent (nothing arrives either way and no
    # error comes: the peer is detected only by the reader's own timeout) rather than
    # reset at both ends after a detection delay.
    silent_cut: float = 0.5
    # Bytes one direction holds written and unread before `drain` waits (asyncio's
    # default high-water mark); it waits until the reader brings it down to a quarter.
    send_buffer_bytes: int = SEND_BUFFER_BYTES_DEFAULT

    def __post_init__(self) -> None:
        assert 0 <= self.split <= 1 and 0 <= self.silent_cut <= 1
        assert self.send_buffer_bytes >= 4


# A piece of a write lost on the way comes again after TCP's minimum retransmission
# timeout: TCP turns loss into delay, never into a gap.
RETRANSMIT_S = 0.2
# A SYN nobody answers is sent again after this long, then after twice as long, and so
# on (Linux's initial retransmission timeout).
SYN_RETRANSMIT_FIRST_S = 1.0
SPLITS_PER_WRITE_MAX = 3
EPHEMERAL_PORT_FIRST = 40000


class Incarnation:
    """One run of a node's process: the connections and listeners it holds die with it,
    as the kernel closes a dead process's sockets (`start_node`)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.ended = False
        self._held: dict[int, Callable[[], None]] = {}
        self._next_key = 0

    def hold(self, release: Callable[[], None]) -> int:
        """`release` runs when the process ends; the key lets it go sooner (`let_go`)."""
        self._next_key += 1
        self._held[self._next_key] = release
        return self._next_key

    def let_go(self, key: int) -> None:
        self._held.pop(key, None)

    def end(self) -> None:
        self.ended = True
        while self._held:
            _, release = self._held.popitem()
            release()


CURRENT_INCARNATION: contextvars.ContextVar[Incarnation] = contextvars.ContextVar("sim_incarnation")


def start_node(
    group: asyncio.TaskGroup, node: str, coroutine: Coroutine[Any, Any, T]
) -> asyncio.Task[T]:
    """Run `coroutine` as a process of `node` in `group`: once its task is done (it
    returned, failed or was cancelled: a crash), the connections it holds close."""
    context = node_context(node)
    task = group.create_task(coroutine, context=context)
    task.add_done_callback(lambda _: context[CURRENT_INCARNATION].end())
    return task


# The certificate each data-plane ssl context presents in its handshakes (DER).
_PRESENTED: weakref.WeakKeyDictionary[ssl.SSLContext, bytes] = weakref.WeakKeyDictionary()


def _presenting(load_chain: Callable[..., None]) -> Callable[..., None]:
    """`transport._load_chain`, remembering the certificate each context is given."""

    def loading(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
        load_chain(context, cert_pem, key_pem)
        certificate = x509.load_pem_x509_certificate(cert_pem)
        _PRESENTED[context] = certificate.public_bytes(serialization.Encoding.DER)

    return loading


class _SimSSLObject:
    """What a TLS connection's `ssl_object` tells of its peer."""

    def __init__(self, peer_cert: bytes | None) -> None:
        self._peer_cert = peer_cert

    def getpeercert(self, binary_form: bool = False) -> Any:
        if binary_form:
            return self._peer_cert
        return {} if self._peer_cert else None


def _refuse_tls(ssl: object) -> None:
    if ssl not in (None, False):
        raise NotImplementedError("TLS is not simulated yet (tests/sim/runtime/README.md)")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class _Flow:
    """One direction of a connection: bytes in order, each piece delayed, none lost."""

    def __init__(self, connection: _Connection, src: _End, dst: _End) -> None:
        self.connection = connection
        self.src = src
        self.dst = dst
        # Written and not yet read: in flight and in the receiver's buffer.
        self.unread = 0
        self.paused = False
        self._in_flight: deque[bytes | None] = deque()  # None: the FIN
        self._last_arrival_s = 0.0

    def send(self, data: bytes) -> None:
        connection = self.connection
        if connection.state == "reset":
            return
        network = connection.network
        self.unread += len(data)
        if self.unread > network.stream_faults.send_buffer_bytes:
            self.paused = True
        if connection.state == "silent":
            return  # into a dead route: it piles up, nobody learns
        for piece in network.pieces(data):
            self._schedule(piece)

    def send_fin(self) -> None:
        if self.connection.state == "open":
            self._schedule(None)

    def _schedule(self, piece: bytes | None) -> None:
        network = self.connection.network
        delay_s = network.delay_s()
        if network._lost():
            delay_s += RETRANSMIT_S
        arrival_s = max(self._last_arrival_s, network.loop.time() + delay_s)
        self._last_arrival_s = arrival_s
        self._in_flight.append(piece)
        network.loop.call_at(arrival_s, self._arrive)

    def _arrive(self) -> None:
        # The head, whichever timer fires: timers of one instant run in any order.
        piece = self._in_flight.popleft()
        if self.connection.state != "open":
            return
        if self.dst.closed:
            if piece is not None:
                # Bytes for a socket its owner closed: its kernel answers with a reset.
                self.connection.reset(f"{self.dst.node} closed the connection")
            return
        self.dst.receive(piece)

    def consumed(self, size: int) -> None:
        self.unread -= size
        assert self.unread >= 0
        low_water = self.connection.network.stream_faults.send_buffer_bytes // 4
        if self.paused and self.unread <= low_water:
            self.paused = False
            self.src.wake()

    @property
    def in_flight(self) -> bool:
        return any(piece is not None for piece in self._in_flight)


class _Connection:
    """One TCP connection between a client's end and a server's end."""

    def __init__(
        self,
        network: SimNetwork,
        number: int,
        client: tuple[str, Incarnation | None, str],
        server: tuple[str, Incarnation | None, str],
    ) -> None:
        self.network = network
        self.number = number
        self.state = "open"  # "silent": cut, unannounced; "reset": both ends told
        self.silent_since: float | None = None
        # Its server serves TLS; the client started TLS, presenting this certificate.
        self.server_tls = False
        self.tls = False
        self.client_cert: bytes | None = None
        self.client = _End(self, *client, peer_address=server[2])
        self.server = _End(self, *server, peer_address=client[2])
        self.client.outgoing = self.client.peer_incoming = _Flow(self, self.client, self.server)
        self.server.outgoing = self.server.peer_incoming = _Flow(self, self.server, self.client)
        self.client.incoming = self.server.outgoing
        self.server.incoming = self.client.outgoing

    @property
    def nodes(self) -> set[str]:
        return {self.client.node, self.server.node}

    def cut(self) -> None:
        """A partition: the route is gone, announced (a reset after a detection delay,
        as an ICMP error or a keepalive gives it) or not, as drawn."""
        if self.state != "open":
            return
        if self.network.rng.random() < self.network.stream_faults.silent_cut:
            self.state = "silent"
            self.silent_since = self.network.loop.time()
            self.network.stats["silent_cuts"] += 1
        else:
            self.reset("the route to the peer was cut")

    def reset(self, why: str) -> None:
        """Both ends that are still open learn, each after its own detection delay."""
        if self.state == "reset":
            return
        self.state = "reset"
        self.network.stats["stream_resets"] += 1
        loop = self.network.loop
        for end in (self.client, self.server):
            if not end.closed:
                error = ConnectionResetError(errno.ECONNRESET, f"Connection reset: {why}")
                loop.call_later(self.network.detection_s(), end.lost, error)
        self.network._connections.pop(self.number, None)

    def ended(self) -> None:
        if self.client.closed and self.server.closed:
            self.network._connections.pop(self.number, None)


class _End:
    """One end of a connection: its receive buffer, its state, what its process holds."""

    outgoing: _Flow
    incoming: _Flow
    peer_incoming: _Flow

    def __init__(
        self,
        connection: _Connection,
        node: str,
        incarnation: Incarnation | None,
        address: str,
        peer_address: str,
    ) -> None:
        self.connection = connection
        self.node = node
        self.address = address
        self.peer_address = peer_address
        self.buffer = bytearray()
        self.eof = False
        self.fin_sent = False
        self.error: Exception | None = None
        self.closed = False
        self.aborted = False
        self._changed = asyncio.Event()
        self._incarnation = incarnation
        self._hold = None if incarnation is None else incarnation.hold(self.close)

    def wake(self) -> None:
        self._changed.set()

    async def wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    def receive(self, piece: bytes | None) -> None:
        if piece is None:
            self.eof = True
        else:
            self.buffer += piece
        self.wake()

    def take(self, size: int) -> bytes:
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        self.incoming.consumed(len(data))
        return data

    def lost(self, error: Exception) -> None:
        """The connection broke under this end: its reads and drains raise `error`."""
        if self.closed:
            return
        self.error = error
        self.wake()

    def write_eof(self) -> None:
        if not self.fin_sent:
            self.fin_sent = True
            self.outgoing.send_fin()

    def close(self) -> None:
        """The owner closed it (or died): a FIN after what it wrote, or a reset when
        bytes it never read are left (what the kernel does with a closed socket)."""
        if self.closed:
            return
        self.closed = True
        if self._incarnation is not None and self._hold is not None:
            self._incarnation.let_go(self._hold)
        connection = self.connection
        if connection.state != "open":
            pass  # reset already, or its route is dead: nothing it sends gets there
        elif self.buffer or self.incoming.in_flight:
            connection.reset(f"{self.node} closed the connection with bytes unread")
        else:
            self.write_eof()
        self.eof = True
        self.wake()
        connection.ended()

    def abort(self) -> None:
        """The owner dropped it at once (`transport.abort()`, also after a `close`
        still flushing): a reset, whatever was buffered either way lost; across a dead
        route the reset gets nowhere."""
        if self.aborted:
            return
        self.aborted = True
        self.outgoing.unread = 0
        self.outgoing.paused = False
        if self.connection.state == "open":
            self.connection.reset(f"{self.node} aborted the connection")
        self.close()


class SimStreamReader:
    """asyncio.StreamReader's reading surface over one end of a simulated connection."""

    def __init__(self, end: _End) -> None:
        self._end = end

    def exception(self) -> Exception | None:
        return self._end.error

    def at_eof(self) -> bool:
        return self._end.eof and not self._end.buffer

    async def read(self, n: int = -1) -> bytes:
        end = self._end
        if end.error is not None:
            raise end.error
        if n == 0:
            return b""
        if n < 0:
            while not end.eof:
                await self._wait()
            return end.take(len(end.buffer))
        while not end.buffer and not end.eof:
            await self._wait()
        return end.take(n)

    async def readexactly(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        end = self._end
        if end.error is not None:
            raise end.error
        while len(end.buffer) < n:
            if end.eof:
                partial = end.take(len(end.buffer))
                raise asyncio.IncompleteReadError(partial, n)
            await self._wait()
        return end.take(n)

    async def _wait(self) -> None:
        await self._end.wait_change()
        if self._end.error is not None:
            raise self._end.error


class SimStreamWriter:
    """asyncio.StreamWriter's surface over one end of a simulated connection."""

    def __init__(self, end: _End) -> None:
        self._end = end

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        end = self._end
        connection = end.connection
        # The server's end knows the client's certificate; a client's, what it needs
        # of its own (nothing: it verified the server as it started TLS).
        peer_cert = connection.client_cert if end is connection.server else None
        ssl_object = _SimSSLObject(peer_cert) if connection.tls else None
        info: dict[str, Any] = {
            "peername": _host_port(end.peer_address),
            "sockname": _host_port(end.address),
            "peercert": ssl_object.getpeercert() if ssl_object is not None else None,
            "socket": None,
            "sslcontext": None,
            "ssl_object": ssl_object,
        }
        return info.get(name, default)

    async def start_tls(
        self,
        sslcontext: ssl.SSLContext,
        *,
        server_hostname: str | None = None,
        ssl_handshake_timeout: float | None = None,
        ssl_shutdown_timeout: float | None = None,
    ) -> None:
        """The client's handshake, in the instant (its round trips are not simulated):
        refused by a plaintext server, else presenting the certificate its context
        holds (`_presenting`)."""
        connection = self._end.connection
        if not connection.server_tls:
            connection.reset("TLS handshake with a plaintext server")
            raise ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
        connection.tls = True
        connection.client_cert = _PRESENTED.get(sslcontext)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        connection = self._end.connection
        if connection.server_tls and not connection.tls and self._end is connection.client:
            # Plaintext where the server waits for a TLS hello: it drops the connection.
            connection.reset("plaintext sent to a TLS server")
            return
        end = self._end
        if end.fin_sent and not end.closed:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data or end.closed or end.error is not None:
            return  # asyncio drops bytes written to a lost connection
        end.outgoing.send(bytes(data))

    def writelines(self, data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(data))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self._end.write_eof()

    async def drain(self) -> None:
        """Wait while the peer has not read enough of what was written (back-pressure);
        raise once the connection is known lost."""
        end = self._end
        while True:
            if end.error is not None:
                raise end.error
            if end.closed:
                await asyncio.sleep(0)
                raise ConnectionResetError("Connection lost")
            if not end.outgoing.paused:
                return
            await end.wait_change()

    def close(self) -> None:
        self._end.close()

    def abort(self) -> None:
        self._end.abort()

    def is_closing(self) -> bool:
        return self._end.closed or self._end.error is not None

    async def wait_closed(self) -> None:
        """At once, unless the end was closed (not aborted) with bytes asyncio still
        holds for a peer cut off without a word: asyncio's close waits for its buffer
        to go out, and the kernel takes it only as the peer acknowledges, so the wait
        lasts until TCP's user timeout (set to the dead-peer time,
        `framed_peer.configure_socket`) ends the connection: a silent route never
        comes back here."""
        end = self._end
        connection = end.connection
        network = connection.network
        if (
            end.closed
            and not end.aborted
            and self.get_write_buffer_size()
            and connection.state == "silent"
        ):
            assert connection.silent_since is not None, "set as it went silent"
            loop = network.loop
            key = (end.node, connection.nodes.difference({end.node}).pop(), loop.time())
            network.close_waits[key] = None
            give_up_at = connection.silent_since + DEAD_PEER_MS / 1000
            await asyncio.sleep(max(0.0, give_up_at - loop.time()))
            network.close_waits[key] = loop.time()
        await asyncio.sleep(0)

    @property
    def transport(self) -> SimStreamWriter:
        """What the framed shell asks of `StreamWriter.transport`: the write buffer."""
        return self

    def get_write_buffer_size(self) -> int:
        """What asyncio holds that the kernel has not taken: the bytes written and
        not yet read by the peer beyond what the kernel's buffers hold
        (`StreamFaults.send_buffer_bytes`, the send buffer and the peer's receive
        buffer together): some once `drain` would wait."""
        flow = self._end.outgoing
        return max(0, flow.unread - self._end.connection.network.stream_faults.send_buffer_bytes)


class _SimSocket:
    """What `Server.sockets` lists: enough to learn the port a server took."""

    def __init__(self, address: str) -> None:
        self._address = address

    def getsockname(self) -> tuple[str, int]:
        return _host_port(self._address)


class SimStreamServer:
    """asyncio.Server's surface for one listening address of a node."""

    def __init__(
        self,
        network: SimNetwork,
        address: str,
        client_connected_cb: Callable[[Any, Any], Any],
        tls: bool = False,
    ) -> None:
        self.network = network
        self.tls = tls
        self.node = CURRENT_NODE.get()
        self.address = address
        self._incarnation = CURRENT_INCARNATION.get(None)
        self._callback = client_connected_cb
        # The context the callback's tasks run in: this node and its process.
        self._context = contextvars.copy_context()
        self._handlers: dict[int, asyncio.Task[Any]] = {}
        self._serving = True
        self._closed = asyncio.Event()
        self._hold = None if self._incarnation is None else self._incarnation.hold(self._died)

    @property
    def incarnation(self) -> Incarnation | None:
        return self._incarnation

    @property
    def sockets(self) -> tuple[_SimSocket, ...]:
        return (_SimSocket(self.address),) if self._serving else ()

    def is_serving(self) -> bool:
        return self._serving

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.network.loop

    def close(self) -> None:
        """Stop listening; connections already accepted stay (as asyncio's, 3.11)."""
        if not self._serving:
            return
        self._serving = False
        if self.network.stream_servers.get(self.address) is self:
            del self.network.stream_servers[self.address]
        if self._incarnation is not None and self._hold is not None:
            self._incarnation.let_go(self._hold)
        self._closed.set()

    def _died(self) -> None:
        self._hold = None
        self.close()
        for task in list(self._handlers.values()):
            task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.sleep(0)

    async def start_serving(self) -> None:
        pass

    async def serve_forever(self) -> None:
        try:
            await self._closed.wait()
        except asyncio.CancelledError:
            self.close()
            raise

    async def __aenter__(self) -> SimStreamServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
        await self.wait_closed()

    def accept(self, connection: _Connection) -> None:
        end = connection.server
        connection.server_tls = self.tls
        result = self._context.copy().run(
            self._callback, SimStreamReader(end), SimStreamWriter(end)
        )
        if not asyncio.iscoroutine(result):
            return
        number = connection.number
        task = self.network.loop.create_task(result, context=self._context.copy())
        self._handlers[number] = task

        def done(task: asyncio.Task[Any]) -> None:
            self._handlers.pop(number, None)
            if not task.cancelled() and task.exception() is not None:
                log.error("%s: a connection's handler failed", self.node, exc_info=task.exception())
                end.close()

        task.add_done_callback(done)
