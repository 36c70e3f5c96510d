"""`StreamClient`: the SDK's entry point, one per process and cluster.

```python
async with StreamClient("127.0.0.1:7070") as client:   # or "m1:7070,m2:7070,m3:7070"
    await client.create_stream("acme/orders", replicas=3, write_quorum=2)
    async with client.writer("acme/orders") as w:
        seq = await w.append(b"...")
    async for event in client.subscribe("acme/orders", start=0):
        ...
```

Secured clusters: `StreamClient(address, certs_dir=D, token=T)`. A tenant needs only
`D/ca.crt` and its token; given no token, `D/client.root.crt` (a cluster admin) is
used when it is there. The token travels as `authorization: Bearer <token>` on every
call, over TLS only. A process handed its credentials as bytes (a Spark executor: the
CA and a token) calls with them as they are: `StreamClient.from_transport(address, transport)`.

It owns one pool of gRPC channels (options in `client.channels`) shared by writers
and readers, one lease session (`client.leases`) that carries every writer's
heartbeats to the master in one call per interval, and one Write stream per store
(`client.store_session`) that carries every writer's batches to that store; control
calls retry transient failures (`client.retrying`). Given several masters, every master
call follows the active one (`protocol.master_calls`).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal, TypeVar

import grpc
import pyarrow as pa
from grpc_health.v1 import health_pb2

from streamengine.client import multiplex, subscription
from streamengine.client.channels import ChannelPool
from streamengine.client.core.replicator import ReplicatorLimits
from streamengine.client.core.subscription import StreamEvent
from streamengine.client.core.writer import APPEND_TIMEOUT_MS
from streamengine.client.errors import (
    InvalidArgument,
    LeadershipLost,
    Unavailable,
    from_rpc_error,
)
from streamengine.client.leases import LeaseSession
from streamengine.client.retrying import retry_unary
from streamengine.client.store_session import StoreSessions
from streamengine.client.timers import WriterTimers
from streamengine.client.types import SegmentInfo, StreamInfo
from streamengine.client.wire import segment_info, stream_info
from streamengine.client.writer import Writer
from streamengine.protocol import transport
from streamengine.protocol.limits import CREATE_STREAMS_PER_CALL_MAX
from streamengine.protocol.master_calls import AsyncMasters
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

T = TypeVar("T")

# How long `seal` waits by default: a running leader drains and rolls within a lease or
# two; without one, a takeover waits out the old lease first.
SEAL_TIMEOUT_S = 30.0
# How often `seal` looks at the master's segment list while a leader rolls.
SEAL_POLL_S = 0.05
# A leader that has not sealed the segment by then is asked again (or, if its lease
# has run out meanwhile, `seal` leads itself).
SEAL_ASK_AGAIN_S = 2.0


# The first call to the master: long enough for a TLS handshake on a loaded host, short
# enough that a wrong certs dir is reported at once.
FIRST_CONTACT_TIMEOUT_S = 5.0
# A TLS disagreement answers the same way every time; a master that went away while the
# first call was under way (killed after reading the request: the connection closes as a
# TLS server closes a plaintext client's) does not. So a first call that looks like one
# is asked again on fresh connections (a channel keeps its last failure for a while)
# before it is reported.
FIRST_CONTACT_ATTEMPTS = 3
FIRST_CONTACT_PAUSE_S = 0.1


async def first_contact(
    channel: grpc.aio.Channel, address: str, chosen: transport.Transport
) -> None:
    """Fail at once, naming TLS, when the master and this client disagree on TLS or on
    the CA (every one of `FIRST_CONTACT_ATTEMPTS` calls says so); any other failure (a
    master restarting) is left to the calls' retries. Without wait_for_ready: waiting
    would hide the handshake's error until a deadline."""
    problem = await _tls_problem_of(channel, chosen)
    for _ in range(FIRST_CONTACT_ATTEMPTS - 1):
        if not problem:
            return
        await asyncio.sleep(FIRST_CONTACT_PAUSE_S)
        fresh = chosen.aio_channel(address)
        try:
            problem = await _tls_problem_of(fresh, chosen)
        finally:
            await fresh.close()
    if problem:
        raise Unavailable(f"master at {address}: {problem}")


async def _tls_problem_of(channel: grpc.aio.Channel, chosen: transport.Transport) -> str:
    """What a health check on `channel` says of TLS ("" when it answered, or failed for
    another reason)."""
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    try:
        await check(health_pb2.HealthCheckRequest(), timeout=FIRST_CONTACT_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            return transport.tls_problem(error.details() or "", chosen.tls)
    return ""


class StreamClient:
    """A connection to one cluster, through its masters (`host:port`, or several
    separated by commas: calls follow the active one).

    `dial` maps addresses the cluster advertises (the master's, the stores') to the
    addresses this process must dial instead, when it reaches the cluster through NAT,
    port forwards or a proxy; the others are dialled as advertised."""

    def __init__(
        self,
        master_address: str,
        *,
        certs_dir: str | Path | None = None,
        token: str | None = None,
        dial: Mapping[str, str] | None = None,
    ) -> None:
        try:
            chosen = transport.Transport.for_client(
                Path(certs_dir) if certs_dir is not None else None, token or ""
            )
        except transport.TransportError as error:
            raise InvalidArgument(str(error)) from None
        self._set_up(master_address, chosen, dial)

    @classmethod
    def from_transport(
        cls,
        master_address: str,
        chosen: transport.Transport,
        *,
        dial: Mapping[str, str] | None = None,
    ) -> StreamClient:
        """A client calling with `chosen` as it is (the CA and a token a Spark executor
        was handed), not read from a certs dir."""
        client = cls.__new__(cls)
        client._set_up(master_address, chosen, dial)
        return client

    def _set_up(
        self, master_address: str, chosen: transport.Transport, dial: Mapping[str, str] | None
    ) -> None:
        self.master_address = master_address
        self._channels = ChannelPool(chosen, dial)
        # Parsed now: a malformed list fails here, not at the first call.
        self._masters = AsyncMasters(master_address, self._channels.get)
        self._master: master_pb2_grpc.MasterAsyncStub | None = None
        self._leases: LeaseSession | None = None
        # One Write stream per store, shared by every writer of this client.
        self._sessions = StoreSessions(self._channels)
        # One timer for every writer of this client, where each had a task.
        self._timers = WriterTimers()
        # Writers still open when the client closes stop leading at once (`close`).
        self._writers: weakref.WeakSet[Writer] = weakref.WeakSet()

    async def __aenter__(self) -> StreamClient:
        # The first master listed: a TLS disagreement is the same with every master, and
        # one that is down or standing by is left to the calls, which follow the list.
        first = self._masters.current
        try:
            await first_contact(self._channels.get(first), first, self._channels.transport)
        except BaseException:
            await self._channels.close()
            raise
        self._master = self._masters.stub
        self._leases = LeaseSession(self._master, self._masters.held_open)
        await self._leases.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel; writers still open stop leading first, and readers end
        with `StreamEngineError` (not their task cancelled), both at once."""
        self._master = None
        for writer in list(self._writers):
            writer.client_closed()
        self._timers.close()
        leases, self._leases = self._leases, None
        try:
            await self._sessions.close()
            if leases is not None:
                await leases.close()
        finally:
            await self._channels.close()

    @property
    def master(self) -> master_pb2_grpc.MasterAsyncStub:
        if self._master is None:
            raise RuntimeError("use StreamClient as `async with StreamClient(...) as client`")
        return self._master

    @property
    def channels(self) -> ChannelPool:
        return self._channels

    async def create_stream(
        self,
        name: str,
        replicas: int = 3,
        write_quorum: int = 2,
        segment_bytes: int = 0,
        segment_age_ms: int = 0,
        retention_age_ms: int = 0,
        retention_bytes: int = 0,
    ) -> StreamInfo:
        """Create `tenant/stream` (and the tenant on first use). `segment_bytes` and
        `segment_age_ms` are the roll thresholds; 0 takes the master's defaults. The
        master trims whole sealed segments older than `retention_age_ms`, or while the
        rest holds more than `retention_bytes` (0: no limit). Creating a stream that
        exists with the same policy returns it."""
        request = master_pb2.CreateStreamRequest(
            name=name,
            policy=entry_pb2.ReplicationPolicy(replicas=replicas, write_quorum=write_quorum),
            segment_bytes=segment_bytes,
            segment_age_ms=segment_age_ms,
            create_tenant=True,
            retention_age_ms=retention_age_ms,
            retention_bytes=retention_bytes,
        )

        async def create() -> master_pb2.StreamInfo:
            return await self.master.CreateStream(request, timeout=5.0)

        return stream_info(await self._control(create))

    async def create_streams(
        self,
        names: Sequence[str],
        replicas: int = 3,
        write_quorum: int = 2,
        segment_bytes: int = 0,
        segment_age_ms: int = 0,
        retention_age_ms: int = 0,
        retention_bytes: int = 0,
    ) -> list[StreamInfo]:
        """Create every stream of `names` with one policy, as `create_stream` would,
        `CREATE_STREAMS_PER_CALL_MAX` to a master commit: a call's streams are created
        together or not at all, and an error leaves the calls before it done. The
        streams, in the order named."""
        policy = entry_pb2.ReplicationPolicy(replicas=replicas, write_quorum=write_quorum)
        created: list[StreamInfo] = []
        for first in range(0, len(names), CREATE_STREAMS_PER_CALL_MAX):
            request = master_pb2.CreateStreamsRequest(
                streams=[
                    master_pb2.CreateStreamRequest(
                        name=name,
                        policy=policy,
                        segment_bytes=segment_bytes,
                        segment_age_ms=segment_age_ms,
                        create_tenant=True,
                        retention_age_ms=retention_age_ms,
                        retention_bytes=retention_bytes,
                    )
                    for name in names[first : first + CREATE_STREAMS_PER_CALL_MAX]
                ]
            )

            async def create(
                request: master_pb2.CreateStreamsRequest = request,
            ) -> master_pb2.CreateStreamsReply:
                return await self.master.CreateStreams(request, timeout=10.0)

            reply = await self._control(create)
            created += [stream_info(info) for info in reply.streams]
        return created

    async def describe_stream(self, name: str) -> StreamInfo:
        async def describe() -> master_pb2.StreamInfo:
            return await self.master.DescribeStream(
                master_pb2.DescribeStreamRequest(name=name), timeout=5.0
            )

        return stream_info(await self._control(describe))

    async def list_streams(
        self, tenant: str = "", name_prefix: str = "", page_size: int = 0
    ) -> AsyncIterator[StreamInfo]:
        """The streams the caller may see, in name order: a tenant's only, or those whose
        full name starts with `name_prefix`, fetched a page (`page_size` streams, 0: the
        master's most) at a time as the iteration goes."""
        token = ""
        while True:
            request = master_pb2.ListStreamsRequest(
                tenant=tenant, name_prefix=name_prefix, page_size=page_size, page_token=token
            )

            async def page(
                request: master_pb2.ListStreamsRequest = request,
            ) -> master_pb2.ListStreamsReply:
                return await self.master.ListStreams(request, timeout=5.0)

            reply = await self._control(page)
            for info in reply.streams:
                yield stream_info(info)
            token = reply.next_page_token
            if not token:
                return

    async def list_segments(self, name: str, from_epoch: int = 0) -> list[SegmentInfo]:
        """The segments of `name` not trimmed, oldest first, from epoch `from_epoch` on."""

        async def list_() -> master_pb2.ListSegmentsReply:
            return await self.master.ListSegments(
                master_pb2.ListSegmentsRequest(stream=name, from_epoch=from_epoch), timeout=5.0
            )

        return [segment_info(segment) for segment in (await self._control(list_)).segments]

    def writer(
        self,
        name: str,
        *,
        limits: ReplicatorLimits | None = None,
        leadership_timeout_s: float | None = None,
        client_id: str | None = None,
        rolling: bool = True,
        append_timeout_s: float = APPEND_TIMEOUT_MS / 1000,
        accept_loss: bool = False,
        producer_id: str | None = None,
        sequence_jumps: bool = False,
    ) -> Writer:
        """`async with client.writer(name) as w:` waits for leadership of `name`.
        The writer rolls its segment by the stream's size and age thresholds, when a
        store is lost, and when the master asks; `rolling=False` keeps one segment.
        An append not acknowledged within `append_timeout_s` raises `AppendTimedOut`
        (the writer goes on leading). `producer_id`, chosen by the application and kept
        across its restarts, makes `append_batch(..., producer_sequence=K)` exactly
        once (`Writer.append_batch`); with `sequence_jumps` its sequences need only
        increase (a batch may start anywhere above the last one)."""
        if self._leases is None:
            raise RuntimeError("use StreamClient as `async with StreamClient(...) as client`")
        writer = Writer(
            self.master,
            self._channels,
            name,
            self._leases,
            self._sessions,
            self._timers,
            limits=limits,
            leadership_timeout_s=leadership_timeout_s,
            client_id=client_id,
            rolling=rolling,
            append_timeout_s=append_timeout_s,
            accept_loss=accept_loss,
            producer_id=producer_id,
            sequence_jumps=sequence_jumps,
        )
        self._writers.add(writer)
        return writer

    async def seal(
        self, name: str, timeout_s: float = SEAL_TIMEOUT_S, accept_loss: bool = False
    ) -> int:
        """Seal the open segment of `name`, so that everything acked so far is in sealed
        segments (what Spark reads). Returns that segment's epoch, 0 if none was open.

        With a leader running, the master asks it to roll, and this waits until the
        segment is sealed (the leader's recovery under its next epoch). With nobody
        leading (or a leader that neither rolls nor keeps its lease), this client leads
        for a moment: it seals and recovers every unsealed segment, then gives the lease
        back (leaving a new, empty segment open). Raises `Unavailable` when that does
        not happen within `timeout_s`.

        `accept_loss` is the way out of a stuck stream, and only ever an operator's
        choice (role admin in the tenant): an unsealed segment that fewer than R of its
        stores can answer for (more than N - W replicas lost for good) is sealed at what
        the stores that answer hold, and the range whose acknowledged events may be lost
        is recorded (readers of it get `DataLossError`). It leads itself, so a running
        leader must be stopped first (`LeadershipLost` otherwise)."""
        if accept_loss:
            return await self._seal_accepting_loss(name, timeout_s)
        deadline = time.monotonic() + timeout_s
        epoch = 0
        leader = ""
        try:
            async with asyncio.timeout(timeout_s):
                asked = await self._request_roll(name)
                epoch, leader = asked.open_segment_epoch, asked.leader_id
                while True:
                    if not leader:
                        await self._seal_leading(name, deadline)
                        return epoch
                    if not epoch or await self._sealed_within(name, epoch, SEAL_ASK_AGAIN_S):
                        return epoch
                    info = await self.describe_stream(name)
                    leader = info.leader_id
                    if leader and info.open_segment_epoch == epoch:
                        # Not rolled yet (a new leader since?): ask again, for this
                        # segment only; once it rolled, asking would roll the next one.
                        leader = (await self._request_roll(name)).leader_id
        except TimeoutError:
            state = "the leader did not roll" if leader else "no leadership"
            raise Unavailable(
                f"{name}: segment {epoch} not sealed within {timeout_s} s ({state}; "
                f"leader: {leader or 'none'})"
            ) from None

    async def _request_roll(self, name: str) -> master_pb2.RequestRollReply:
        async def ask() -> master_pb2.RequestRollReply:
            return await self.master.RequestRoll(
                master_pb2.RequestRollRequest(stream=name), timeout=5.0
            )

        return await self._control(ask)

    async def _seal_leading(self, name: str, deadline: float, accept_loss: bool = False) -> None:
        if all(segment.sealed for segment in await self.list_segments(name)):
            return
        async with self.writer(name, rolling=False, accept_loss=accept_loss) as writer:
            await writer.wait_sealed(max(0.0, deadline - time.monotonic()))
            # Leaving the block would cut the bridging of the replicas past the W the
            # seal needed: a `verify` right after found one short of its bridge.
            await writer.wait_bridged(max(0.0, deadline - time.monotonic()))

    async def _seal_accepting_loss(self, name: str, timeout_s: float) -> int:
        info = await self.describe_stream(name)
        if info.leader_id:
            raise LeadershipLost(
                f"{name} is led by {info.leader_id}: stop that writer before sealing "
                "accepting loss (a running leader's own recovery cannot accept it)"
            )
        unsealed = [s.epoch for s in await self.list_segments(name) if not s.sealed]
        deadline = time.monotonic() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await self._seal_leading(name, deadline, accept_loss=True)
        except TimeoutError:
            raise Unavailable(
                f"{name}: not sealed within {timeout_s} s accepting loss (no store of an "
                "unsealed segment answered, or no leadership)"
            ) from None
        return max(unsealed, default=0)

    async def _sealed_within(self, name: str, epoch: int, seconds: float) -> bool:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            for segment in await self.list_segments(name, from_epoch=epoch):
                if segment.epoch == epoch and segment.sealed:
                    return True
            await asyncio.sleep(SEAL_POLL_S)
        return False

    def subscribe(self, name: str, start: subscription.Start = 0) -> AsyncIterator[StreamEvent]:
        """Every acked event of `name` from `start` (a sequence, "end", or "earliest": the
        first event retained), forever. A start (or a position reached) that a trim took
        away raises `Trimmed`, naming the first retained sequence."""
        return subscription.subscribe(self.master, self._channels, name, start)

    def subscribe_many(
        self,
        streams: Sequence[str] | None = None,
        *,
        prefix: str | None = None,
        start: subscription.Start = 0,
        positions: Mapping[str, int] | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Every acked event of many streams, forever, through one subscription:
        `streams` by name, or every stream whose name starts with `prefix` (such as
        "tenant/"), including those created later (found within about a second, and read
        from their first event); a stream deleted and undeleted meanwhile goes on from
        where the subscription left it. Events carry their stream's name
        (`StreamEvent.stream`); each stream's come in sequence order, and streams
        interleave. A stream starts at `start` ("end", "earliest" or a sequence) unless
        `positions` gives its own: to resume, keep per stream the sequence after the last
        event handled. One call per store carries the tails of every stream it serves; a
        slow consumer holds them back, as it does a single `subscribe`. `aclose()` ends
        its calls and tasks at once (else they end when it is collected, or with the
        client)."""
        selection = multiplex.selection_of(streams, prefix)
        return multiplex.subscribe_many(
            self.master, self._channels, selection, start, dict(positions or {})
        )

    def read(
        self,
        name: str,
        start: int | Literal["earliest"] = 0,
        end: int | None = None,
        *,
        give_up_after_s: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Acked events in `[start, end)`; `end=None` stops at the acked end now.
        `start="earliest"`: the first event retained; a trimmed start raises `Trimmed`.
        Every event of the range comes, or `Unavailable` naming the stores: once the read
        has not moved for `give_up_after_s` (default 10; more than 4, the silence that
        marks a store unreachable, else ValueError) and every store that may serve it has
        failed since (a hanging one is left after those 4 s of silence)."""
        timing = subscription.bounded_read_timing(give_up_after_s)
        return subscription.read(self.master, self._channels, name, start, end, timing)

    def subscribe_batches(
        self, name: str, start: subscription.Start = 0
    ) -> AsyncIterator[pa.RecordBatch]:
        """`subscribe` as Arrow record batches: columns epoch (int32), index, sequence
        (int64) and payload (binary), one row per event (holes and bridges never appear),
        in sequence order, none empty. The last row's sequence + 1 resumes after it."""
        return subscription.subscribe_batches(self.master, self._channels, name, start)

    def read_batches(
        self,
        name: str,
        start: int | Literal["earliest"] = 0,
        end: int | None = None,
        *,
        give_up_after_s: float | None = None,
    ) -> AsyncIterator[pa.RecordBatch]:
        """`read` as Arrow record batches (columns as `subscribe_batches`): what a
        catch-up reads in packed replies, with no Python object per event."""
        timing = subscription.bounded_read_timing(give_up_after_s)
        return subscription.read_batches(self.master, self._channels, name, start, end, timing)

    async def _control(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await retry_unary(call)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from error
