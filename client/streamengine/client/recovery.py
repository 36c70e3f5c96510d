"""Sealing and recovering one earlier segment: the shell of `SegmentRecovery`.

The core (`client.core.recovery`) decides, timing included; this carries its
actions out: `Seal` as a unary gRPC call, `Read` as a data-plane Read on the client's
connection to the store (`framed_read`, the one its followers' reads and tails ride),
every recovery write (and the acked index raise) as a one-request `Write` on that
same connection (`write_once`) with `report_held`, written at the new leader's epoch,
and `SealSegment` at the master (through the client's lease session, which sends those
of the moment as one `SealSegments`: `LeaseSession.seal`). Each request is one attempt
in its own task (one per `request_key` at a time); its answer becomes an event, a
transport failure nothing: the core sends the request again when it decides to, gives a
silent store up and probes it.
A clock loop wakes the core at its `deadline_ms()`.

A store refusing with FAILED_PRECONDITION (a later fence), or the core deciding it was
deposed, ends the run with `Fenced`: the writer then steps down.

Recovery writes go on requests of their own, not on the writer's per-store Write stream
of the new segment: their answers must carry `held_epochs`, and a busy refusal or a
broken request then costs one request, never the new segment's pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from streamengine.client.channels import ChannelPool
from streamengine.client.core import recovery as sr
from streamengine.client.core.replicator import Tick
from streamengine.client.core.writer import RecoverSegment
from streamengine.client.errors import Fenced, StreamEngineError, fence_of
from streamengine.client.store_session import write_once
from streamengine.protocol import codec, framed_read
from streamengine.protocol.clock import monotonic_ms
from streamengine.protocol.entry import StoredEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.framing import StatusCode
from streamengine.protocol.producers import Run
from streamengine.protocol.status import FENCE_METADATA_KEY, FENCE_UNKNOWN
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

log = logging.getLogger(__name__)

# One attempt of a recovery request (a transport bound, not a protocol decision: the
# core retransmits and gives stores up on its own clock); a lagging store's rewrite
# batch is at most a few MB.
RPC_TIMEOUT_S = 5.0
# The seal at the master: a request and its timeout in, the sealed segment out, or the
# AioRpcError `SealSegment` raises.
SealAtMasterCall = Callable[
    [master_pb2.SealSegmentRequest, float], Coroutine[Any, Any, entry_pb2.Segment]
]


# A write the store refused for now, nothing written: its queue full (busy), or the
# tenant over its append quota there. Either goes out again after the core's pause; a
# refusal over quota taken as an answer holding nothing was sent again at once, as fast
# as the store answered, until the quota refilled (the simulator's stores under
# pressure: thousands of resends a run).
_REFUSED_FOR_NOW = (segment_store_pb2.REFUSED_BUSY, segment_store_pb2.REFUSED_QUOTA)


class _NoAnswer(Exception):
    """The store closed the stream without answering."""


class SegmentSealer:
    """Seals and recovers the segment of one `RecoverSegment` under its new epoch."""

    def __init__(
        self,
        seal_at_master: SealAtMasterCall,
        channels: ChannelPool,
        client_id: str,
        action: RecoverSegment,
        accept_loss: bool = False,
    ) -> None:
        """`accept_loss`: an operator's seal that decides from the stores that answer
        when fewer than R can (`SegmentRecovery`)."""
        grant = action.segment
        self.segment = grant.segment
        self.new_epoch = action.new_epoch
        # The signed grant of `new_epoch`: every seal and write of the recovery, and the
        # seal at the master, carry it.
        self.grant = action.grant
        self.op = sr.SegmentRecovery(
            action.policy,
            grant.epoch,
            action.new_epoch,
            [replica.store_id for replica in grant.copy_set],
            timing=sr.TIMING,
            known=action.known,
            accept_loss=accept_loss,
            producers=action.producers,
        )
        # The producer runs recovery found in the segment, once `run` returned.
        self.runs: tuple[tuple[str, Run], ...] = ()
        self._seal_at_master_call = seal_at_master
        self._client_id = client_id
        self._stubs = {
            replica.store_id: store_grpc.SegmentStoreStub(channels.get(replica.address))
            for replica in grant.copy_set
        }
        # Reads and writes go on the stores' data ports, on the client's connection to
        # each (`ChannelPool.data_call`): reads by `framed_read`, writes by `write_once`.
        self._channels = channels
        self._data_addresses = {
            replica.store_id: replica.data_address for replica in grant.copy_set
        }
        self._segment_id = entry_pb2.SegmentId(
            stream_id=self.segment.stream_id, epoch=self.segment.epoch, stream=self.segment.stream
        )
        self._events: asyncio.Queue[sr.Event] = asyncio.Queue()
        self._in_flight: dict[sr.RequestKey, asyncio.Task[None]] = {}

    async def run(self) -> int:
        """Seal, recover and bridge; the final index (the BRIDGE) once the master holds
        the segment as sealed. Raises `Fenced` when a later leader took over. Requests
        to slower stores may still be out: `finish` lets them complete, `close` ends
        them."""
        result = self._carry_out(self.op.start(monotonic_ms()))
        while result is None:
            result = await self._next()
        return result

    async def finish(self) -> None:
        """After `run`: go on bridging the stores that have not answered everything
        yet (so that every live replica reaches the bridge), as long as the core keeps
        at it (`RecoveryTiming.late_stores_ms`); then `close`."""
        try:
            while self.op.deadline_ms() is not None:
                await self._next()
        except Fenced:
            pass  # a later leader took over: its recovery bridges them
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = list(self._in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _next(self) -> int | None:
        """Wait for the next answer or the core's deadline, whichever comes first, and
        step the core with it."""
        deadline = self.op.deadline_ms()
        event: sr.Event
        try:
            timeout_s = None if deadline is None else max(0, deadline - monotonic_ms()) / 1000
            async with asyncio.timeout(timeout_s):
                event = await self._events.get()
        except TimeoutError:
            event = Tick()
        return self._carry_out(self.op.step(monotonic_ms(), event))

    # ---- carrying actions out ----

    def _carry_out(self, actions: list[sr.Action]) -> int | None:
        final: int | None = None
        for action in actions:
            if isinstance(action, sr.Deposed):
                raise Fenced(
                    f"{self.segment.stream}: recovering segment {self.segment.epoch} under "
                    f"epoch {self.new_epoch}: a later leader holds epoch {action.fence}",
                    action.fence,
                )
            if isinstance(action, sr.Done):
                log.info(
                    "%s: segment %d sealed at %d under epoch %d",
                    self.segment.stream,
                    self.segment.epoch,
                    action.final_index,
                    self.new_epoch,
                )
                final = action.final_index
                self.runs = action.runs
                continue
            self._send(action)
        return final

    def _send(self, request: sr.Request) -> None:
        key = sr.request_key(request)
        if key in self._in_flight:
            return  # its attempt is still running: its answer serves the repeat too
        task = asyncio.get_running_loop().create_task(self._request(key, request))
        self._in_flight[key] = task
        task.add_done_callback(lambda done: self._forget(key, done))

    def _forget(self, key: sr.RequestKey, task: asyncio.Task[None]) -> None:
        if self._in_flight.get(key) is task:
            del self._in_flight[key]

    async def _request(self, key: sr.RequestKey, request: sr.Request) -> None:
        event = await self._attempt(request)
        # Free the key before the core sees the answer: a repeat it asks for at once
        # (an answer that confirms nothing) must go out.
        if self._in_flight.get(key) is asyncio.current_task():
            del self._in_flight[key]
        if event is not None:
            self._events.put_nowait(event)

    async def _attempt(self, action: sr.Request) -> sr.Event | None:
        """One attempt of a request: its answer as an event, or None (no answer)."""
        if isinstance(action, sr.SealAtMaster):
            return await self._seal_at_master(action)
        store = action.store
        call: Callable[[], Coroutine[Any, Any, sr.Event]]
        if isinstance(action, sr.SendSeal):
            call = self._seal_call(store)
        elif isinstance(action, sr.SendRead):
            call = self._read_call(action)
        elif isinstance(action, sr.SendRewrite):
            call = self._write_call(store, action.entries, action.acked_index)
        else:
            call = self._write_call(store, (), action.acked_index)
        try:
            return await call()
        except (_NoAnswer, StreamEngineError):  # StreamEngineError: the client closed
            return None
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                fence = fence_of(error)
                return sr.RecoveryFenced(store, fence if fence is not None else FENCE_UNKNOWN)
            log.info(
                "%s: recovery of %d: store %s: %s",
                self.segment.stream,
                self.segment.epoch,
                store,
                error.code().name,
            )
            return None
        except CallError as error:  # a read's or a write's, on the data plane
            if error.code is StatusCode.FAILED_PRECONDITION:
                fence_text = error.metadata.get(FENCE_METADATA_KEY)
                return sr.RecoveryFenced(store, int(fence_text) if fence_text else FENCE_UNKNOWN)
            log.info(
                "%s: recovery of %d: store %s: %s",
                self.segment.stream,
                self.segment.epoch,
                store,
                error,
            )
            return None

    def _seal_call(self, store: str) -> Callable[[], Coroutine[Any, Any, sr.Event]]:
        request = segment_store_pb2.SealRequest(
            segment=self._segment_id, new_epoch=self.new_epoch, grant=self.grant
        )

        async def seal() -> sr.Event:
            reply = await self._stubs[store].Seal(request, timeout=RPC_TIMEOUT_S)
            return sr.SealAnswered(
                store, reply.fence, reply.acked_index, reply.matched_index, reply.last_index
            )

        return seal

    def _read_call(self, action: sr.SendRead) -> Callable[[], Coroutine[Any, Any, sr.Event]]:
        request = segment_store_pb2.ReadRequest(
            segment=self._segment_id, from_index=action.from_index, to_index=action.to_index
        )

        async def read() -> sr.Event:
            entries: list[StoredEntry] = []
            fence = 0
            replies = framed_read.read(
                self._data_addresses[action.store], self._channels.data_call, request, RPC_TIMEOUT_S
            )
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    fence = max(fence, reply.fence)
                    entries.extend(codec.entries_from_pb(reply.entries))
            return sr.ReadAnswered(
                action.store, action.from_index, action.to_index, tuple(entries), fence
            )

        return read

    def _write_call(
        self, store: str, entries: tuple[StoredEntry, ...], acked_index: int
    ) -> Callable[[], Coroutine[Any, Any, sr.Event]]:
        request = codec.write_request(
            entries,
            segment=self._segment_id,
            writer_epoch=self.new_epoch,
            acked_index=acked_index,
            request_id=1,
            report_held=True,
            grant=self.grant,
        )

        async def write() -> sr.Event:
            reply = await write_once(
                self._data_addresses[store], self._channels.data_call, request, RPC_TIMEOUT_S
            )
            if reply is None:
                raise _NoAnswer()  # the store ended the call without one
            if reply.status == segment_store_pb2.REFUSED:
                return self._write_refused(store, reply.error)
            if reply.status in _REFUSED_FOR_NOW:
                return sr.StoreBusy(store, entries[0].index if entries else 0)
            if not entries:
                return sr.WriteAnswered(store, 0, 0, (), reply.acked_index)
            return sr.WriteAnswered(
                store,
                reply.first_index,
                reply.last_index,
                tuple(reply.held_epochs),
                reply.acked_index,
            )

        return write

    def _write_refused(self, store: str, error: segment_store_pb2.WriteError) -> sr.Event:
        """A refused write: below the fence, the recovery is fenced; otherwise the
        store gave no answer (the core asks again, or decides from the others)."""
        if error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
            fence = error.metadata.get(FENCE_METADATA_KEY)
            return sr.RecoveryFenced(store, int(fence) if fence else FENCE_UNKNOWN)
        log.info(
            "%s: recovery of %d: store %s refused a write: %d %s",
            self.segment.stream,
            self.segment.epoch,
            store,
            error.code,
            error.details,
        )
        raise _NoAnswer()

    async def _seal_at_master(self, action: sr.SealAtMaster) -> sr.Event | None:
        final_index, certificate = action.final_index, action.certificate
        if action.lost_from_index:
            log.warning(
                "%s: sealing segment %d at %d accepting loss: indexes %d..%d may have held "
                "acknowledged events that are lost",
                self.segment.stream,
                self.segment.epoch,
                final_index,
                action.lost_from_index,
                final_index,
            )
        request = master_pb2.SealSegmentRequest(
            lost_from_index=action.lost_from_index,
            stream=self.segment.stream,
            segment_epoch=self.segment.epoch,
            writer_epoch=self.new_epoch,
            client_id=self._client_id,
            final_index=final_index,
            grant=self.grant,
        )
        if certificate is not None:
            request.certificate.CopyFrom(codec.certificate_to_pb(certificate))
        if action.producers is not None:
            request.producers.CopyFrom(codec.producer_positions_to_pb(action.producers))

        try:
            await self._seal_at_master_call(request, RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.ABORTED:
                # Sealed at another final index: a later leader recovered it.
                return sr.RecoveryFenced(sr.MASTER, self.new_epoch + 1)
            # The core asks again (the master's seal is idempotent).
            log.warning(
                "%s: SealSegment %d at %d: %s %s",
                self.segment.stream,
                self.segment.epoch,
                final_index,
                error.code().name,
                error.details(),
            )
            return None
        return sr.MasterSealed(final_index)
