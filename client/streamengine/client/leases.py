"""The client process's lease session: every writer's heartbeat in one call per interval.

A `StreamClient` owns one `LeaseSession`. Each writer's core still decides when it
heartbeats and what each answer means (`client.core.writer`); the session only carries
the heartbeats: those asked for within `LEASE_BATCH_WINDOW_MS` go to the master as one
`LeaseHeartbeat` call (several when more than `LEASE_BATCH_ENTRIES_MAX` wait), each
entry with its writer's own lease secret, and each writer gets its own entry's answer,
or its own refusal, as if it had called `WriterHeartbeat` alone. So the master's work
and the client's calls grow with the number of batches, not of leases held.

While it lives the session holds one `HoldLeaseSession` call open at the active master
(one per process, whatever the number of its leases), naming the random session bytes
every batch carries: when the process dies the kernel resets the call's connection and
the master ends, at once, every lease the session's batches renewed or granted, so a
standby need not wait them out. A call that ends with the process alive is opened again
after `HOLD_LEASE_REOPEN_MS`; it only shortens a takeover.

The session renews, in one step, every lease bound to it (docs/design.md, "Lease
sessions"): a writer's lease is bound once an answer to its heartbeat says so (the
batch named the session, held open at the master under an incarnation), and from then
on a `LeaseHeartbeat` with `renew_session` every lease/3 renews them all, however
many. The answer's time goes into `lease` (`client.core.writer.SessionLease`), which
every bound writer's core reads for its lease; a writer steps only when the master
names its stream (`ended`: bound no more, it heartbeats on its own again;
`attention`: a roll to hear of, it heartbeats now), or when the session's incarnation
is another than the one it was bound under (a new active master, a call opened
again). A bound writer's own heartbeats go every `SESSION_BOUND_HEARTBEAT_MS`. So ten
thousand idle leaders cost the master one call per lease/3, not ten thousand entries.

Rolls go as heartbeats do: those the writers ask within `LEASE_BATCH_WINDOW_MS` go to
the master as one `RollSegments` call (`roll`, through a `client.call_batches.CallBatcher`),
each answered as `RollSegment` alone would have answered it; a master without that
call gets lone `RollSegment` calls. A store lost to a process leading hundreds of
streams makes them all roll at once: the master then commits their new epochs in a few
transactions, not one each (issue #38). The seals that recoveries make at the master go
the same way (`seal`: `SealSegments`, each answered as `SealSegment` alone would have):
a failover of a process leading hundreds of streams recovers them all at once.

Releases go out as the writers close, each its own call, and the session waits for them
only when the client closes: a process that closes ten thousand writers one after the
other does not wait ten thousand round trips (issue #38: a close that took minutes).

Every background task (the batch loop, the calls in flight, the hold, the releases)
belongs to the session's TaskGroup, which the client's `async with` owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from streamengine.client.call_batches import CallBatcher, rpc_error
from streamengine.client.core.writer import HOLD_LEASE_REOPEN_MS, SessionLease
from streamengine.client.retrying import retry_unary
from streamengine.protocol.clock import monotonic_ms
from streamengine.protocol.limits import (
    HEARTBEATS_PER_LEASE,
    LEASE_BATCH_ENTRIES_MAX,
    LEASE_MS_DEFAULT,
)
from streamengine.protocol.status import DELETED_UNTIL_METADATA_KEY
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

log = logging.getLogger(__name__)

# Heartbeats asked for within this long go out in one call. Short beside the interval a
# leader heartbeats at (lease/3) and the 100 ms a follower asks at; long enough that a
# client leading thousands of streams sends a few calls a second, not thousands.
LEASE_BATCH_WINDOW_MS = 20
# A batch's call waits this long past the latest deadline of its heartbeats, so that a
# grant the master decides after a writer gave up on its heartbeat still reaches the
# writer (`late_grant`), with the only copy of its secret. The master counts a call's
# deadline from when it reads the request: one that sat unread in a paused or loaded
# master (issue #38) is decided after its caller's deadline by up to that wait, and
# before this grace such a grant reached nobody, and was granted again and again.
LATE_ANSWER_GRACE_MS = 2_000
# Random bytes naming the session (the master takes 16 to 64).
LEASE_SESSION_BYTES = 32
# The first batch waits this long at most for the session's call to be held, so that
# the leases it grants are bound to the session from the start (a leader cut off right
# after its grant still has its lease ended at once).
HOLD_OPEN_WAIT_S = 1.0
# How long closing the client waits for the releases still under way (each gives up
# after its own deadline sooner; a lease not released runs out by itself).
RELEASES_WAIT_S = 3.0


class BoundWriter(Protocol):
    """A writer whose lease the session renews (`client.writer.Writer`)."""

    def session_unbound(self) -> None: ...

    def session_attention(self) -> None: ...


@dataclass(slots=True)
class _Waiting:
    request: master_pb2.WriterHeartbeatRequest
    answer: asyncio.Future[master_pb2.WriterHeartbeatReply]
    deadline: float  # loop time
    late_grant: Callable[[master_pb2.WriterHeartbeatReply], None]


def refusal(
    answer: master_pb2.LeaseHeartbeatAnswer | master_pb2.SealSegmentAnswer,
) -> grpc.aio.AioRpcError:
    """One entry's refusal, as the error its lone call (`WriterHeartbeat`,
    `RollSegment`, `SealSegment`) would have raised."""
    code = next(c for c in grpc.StatusCode if c.value[0] == answer.code)
    trailing = grpc.aio.Metadata()
    if answer.deleted_until_ms:
        trailing.add(DELETED_UNTIL_METADATA_KEY, str(answer.deleted_until_ms))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, answer.message)


class LeaseSession:
    """See the module docstring. Made and closed by `StreamClient`."""

    def __init__(
        self,
        master: master_pb2_grpc.MasterAsyncStub,
        holding_master: Callable[[], master_pb2_grpc.MasterAsyncStub],
    ) -> None:
        self._master = master
        self._holding_master = holding_master
        self.session = secrets.token_bytes(LEASE_SESSION_BYTES)
        self._waiting: list[_Waiting] = []
        self._wake = asyncio.Event()
        # Set once the session's call was held (or could not be): batches may go.
        self._held = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._releases: set[asyncio.Task[None]] = set()
        # Batches in flight, with the streams whose heartbeats each carries.
        self._calls: dict[asyncio.Task[None], frozenset[str]] = {}
        self.batches_sent = 0
        self.entries_sent = 0  # writers' own heartbeats, each an entry of a batch
        # What every bound writer's core reads of the session's renewals.
        self.lease = SessionLease()
        # The writers whose lease is bound, by stream, with the incarnation of each.
        self._bound: dict[str, tuple[BoundWriter, bytes]] = {}
        self._bound_changed = asyncio.Event()
        self.renewals_sent = 0
        self.rolls = CallBatcher[master_pb2.RollSegmentRequest, master_pb2.WriterHeartbeatReply](
            "roll", self._roll_batch, self._roll_alone, LEASE_BATCH_WINDOW_MS
        )
        self.seals = CallBatcher[master_pb2.SealSegmentRequest, entry_pb2.Segment](
            "seal", self._seal_batch, self._seal_alone, LEASE_BATCH_WINDOW_MS
        )

    async def start(self) -> None:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        self._loops = [
            self._group.create_task(self._send_batches()),
            self._group.create_task(self._hold()),
            self._group.create_task(self._renew()),
        ]
        self.rolls.start(self._group)
        self.seals.start(self._group)

    async def close(self) -> None:
        """Wait (a bounded while) for the releases under way, then stop."""
        if self._group is None:
            return
        releases = list(self._releases)
        if releases:
            await asyncio.wait(releases, timeout=RELEASES_WAIT_S)
        for task in [*self._loops, *self._releases, *self._calls]:
            task.cancel()
        self.rolls.close()
        self.seals.close()
        for waiting in self._waiting:
            waiting.answer.cancel()
        self._waiting.clear()
        group, self._group = self._group, None
        await group.__aexit__(None, None, None)

    async def heartbeat(
        self,
        request: master_pb2.WriterHeartbeatRequest,
        timeout_s: float,
        late_grant: Callable[[master_pb2.WriterHeartbeatReply], None],
    ) -> master_pb2.WriterHeartbeatReply:
        """The answer to one writer's heartbeat, sent with the next batch; raises the
        AioRpcError that `WriterHeartbeat` would have (DEADLINE_EXCEEDED after
        `timeout_s`). An answer that grants the lease and comes after that goes to
        `late_grant`: it holds the only copy of the lease secret."""
        if self._group is None:
            raise rpc_error(grpc.StatusCode.CANCELLED, "the client is closed")
        loop = asyncio.get_running_loop()
        waiting = _Waiting(request, loop.create_future(), loop.time() + timeout_s, late_grant)
        self._waiting.append(waiting)
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(waiting.answer)
        except TimeoutError:
            raise rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to the lease heartbeat in time"
            ) from None
        finally:
            # Given up on (timed out, or the writer cancelled it as it closes): a batch
            # not yet sent leaves it out, one under way answers nobody. A closing writer
            # releases its lease next, and no heartbeat of it may be granted after that.
            waiting.answer.cancel()

    async def roll(
        self, request: master_pb2.RollSegmentRequest, timeout_s: float
    ) -> master_pb2.WriterHeartbeatReply:
        """The answer to one writer's roll, sent with the others of the moment; raises
        the AioRpcError that `RollSegment` would have (DEADLINE_EXCEEDED after
        `timeout_s`)."""
        return await self.rolls.call(request, timeout_s)

    async def _roll_batch(
        self, requests: list[master_pb2.RollSegmentRequest], timeout_s: float
    ) -> list[master_pb2.WriterHeartbeatReply | grpc.aio.AioRpcError]:
        request = master_pb2.RollSegmentsRequest(rolls=requests)
        reply = await self._master.RollSegments(request, timeout=timeout_s)
        return [refusal(answer) if answer.code else answer.reply for answer in reply.rolls]

    async def _roll_alone(
        self, request: master_pb2.RollSegmentRequest, timeout_s: float
    ) -> master_pb2.WriterHeartbeatReply:
        return await self._master.RollSegment(request, timeout=timeout_s)

    async def seal(
        self, request: master_pb2.SealSegmentRequest, timeout_s: float
    ) -> entry_pb2.Segment:
        """The answer to one recovery's seal at the master, sent with the others of the
        moment; raises the AioRpcError that `SealSegment` would have."""
        return await self.seals.call(request, timeout_s)

    async def _seal_batch(
        self, requests: list[master_pb2.SealSegmentRequest], timeout_s: float
    ) -> list[entry_pb2.Segment | grpc.aio.AioRpcError]:
        request = master_pb2.SealSegmentsRequest(seals=requests)
        reply = await self._master.SealSegments(request, timeout=timeout_s)
        return [refusal(answer) if answer.code else answer.segment for answer in reply.seals]

    async def _seal_alone(
        self, request: master_pb2.SealSegmentRequest, timeout_s: float
    ) -> entry_pb2.Segment:
        return await self._master.SealSegment(request, timeout=timeout_s)

    def bind(self, stream: str, writer: BoundWriter, incarnation: bytes) -> None:
        """`writer`'s lease of `stream` is bound to the session under `incarnation`
        (empty: bound no more)."""
        if incarnation:
            self._bound[stream] = (writer, incarnation)
            self._bound_changed.set()
        elif stream in self._bound and self._bound[stream][0] is writer:
            del self._bound[stream]

    def release(self, request: master_pb2.ReleaseLeaseRequest) -> None:
        """Give a lease back; the client's close waits for it, the caller does not."""
        if self._group is None:
            return  # closed: the lease runs out (or ended with the session)
        task = self._group.create_task(self._release(request))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    # ---- background ----

    async def _send_batches(self) -> None:
        assert self._group is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HOLD_OPEN_WAIT_S):
                await self._held.wait()
        while True:
            await self._wake.wait()
            await asyncio.sleep(LEASE_BATCH_WINDOW_MS / 1000)  # let the window fill
            self._wake.clear()
            waiting = [w for w in self._waiting if not w.answer.done()]
            self._waiting.clear()
            for start in range(0, len(waiting), LEASE_BATCH_ENTRIES_MAX):
                batch = waiting[start : start + LEASE_BATCH_ENTRIES_MAX]
                task = self._group.create_task(self._send(batch))
                self._calls[task] = frozenset(w.request.stream for w in batch)
                task.add_done_callback(self._call_done)

    async def _send(self, batch: list[_Waiting]) -> None:
        remaining_s = max(w.deadline for w in batch) - asyncio.get_running_loop().time()
        timeout_s = max(0.0, remaining_s) + LATE_ANSWER_GRACE_MS / 1000
        request = master_pb2.LeaseHeartbeatRequest(
            leases=[w.request for w in batch], session=self.session
        )
        self.batches_sent += 1
        self.entries_sent += len(batch)
        try:
            reply = await self._master.LeaseHeartbeat(request, timeout=timeout_s)
        except asyncio.CancelledError:
            for waiting in batch:
                waiting.answer.cancel()
            raise
        except grpc.aio.AioRpcError as error:
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(error)
            return
        if len(reply.leases) != len(batch):
            log.warning("a lease batch of %d answered %d", len(batch), len(reply.leases))
        for waiting, answer in zip(batch, reply.leases, strict=False):
            if waiting.answer.done():
                if not answer.code and answer.reply.lease_secret:
                    waiting.late_grant(answer.reply)
                continue
            if answer.code:
                waiting.answer.set_exception(refusal(answer))
            else:
                waiting.answer.set_result(answer.reply)

    async def _hold(self) -> None:
        request = master_pb2.HoldLeaseSessionRequest(session=self.session)
        while True:
            try:
                async for _ in self._holding_master().HoldLeaseSession(request):
                    self._held.set()
            except grpc.aio.AioRpcError as error:
                self._held.set()  # batches go on without it: leases then run out
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # a master from before the call existed: leases run out
                log.debug("lease session call ended: %s", error.code().name)
            await asyncio.sleep(HOLD_LEASE_REOPEN_MS / 1000)

    async def _renew(self) -> None:
        """Renews every bound lease each lease/3 while any is bound, the first time as
        soon as one is."""
        every_ms = LEASE_MS_DEFAULT // HEARTBEATS_PER_LEASE
        while True:
            if not self._bound:
                self._bound_changed.clear()
                await self._bound_changed.wait()
            sent_at_ms = monotonic_ms()
            request = master_pb2.LeaseHeartbeatRequest(session=self.session, renew_session=True)
            self.renewals_sent += 1
            try:
                timeout_s = HEARTBEATS_PER_LEASE * every_ms / 1000  # a lease
                reply = await self._master.LeaseHeartbeat(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as error:
                # As a writer's own heartbeat that failed: the next goes on schedule, and
                # the lease runs out meanwhile.
                log.debug("lease session renewal failed: %s", error.code().name)
            else:
                every_ms = reply.session.renew_every_ms or every_ms
                self._renewed(sent_at_ms, reply.session)
            await asyncio.sleep(max(1, every_ms) / 1000)

    def _renewed(self, sent_at_ms: int, renewal: master_pb2.SessionRenewal) -> None:
        incarnation = renewal.incarnation
        if incarnation != self.lease.incarnation:
            # Bound under another incarnation (or none held): renewed by nothing now.
            for stream, (writer, bound) in list(self._bound.items()):
                if bound != incarnation:
                    del self._bound[stream]
                    writer.session_unbound()
        self.lease.incarnation = incarnation
        if incarnation:
            self.lease.renewal_sent_at_ms = sent_at_ms
            self.lease.renewed_until_ms = sent_at_ms + renewal.lease_ms
            self.lease.renewal_answered_at_ms = monotonic_ms()
        for stream in renewal.ended:
            entry = self._bound.pop(stream, None)
            if entry is not None:
                entry[0].session_unbound()
        for stream in renewal.attention:
            entry = self._bound.get(stream)
            if entry is not None:
                entry[0].session_attention()

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.pop(task, None)

    async def _release(self, request: master_pb2.ReleaseLeaseRequest) -> None:
        # A heartbeat of this writer still in flight, decided after the release, would
        # find the lease free and win the next epoch for a writer that is gone: one epoch
        # spent, one empty segment to seal (a clean-clone run's failover test saw it).
        carrying = [task for task, streams in self._calls.items() if request.stream in streams]
        if carrying:
            await asyncio.wait(carrying)

        async def release() -> master_pb2.ReleaseLeaseReply:
            return await self._master.ReleaseLease(request, timeout=1.0)

        try:
            await retry_unary(release, deadline_s=2.0, attempts=4)
        except grpc.aio.AioRpcError as error:
            # The lease then runs out by itself.
            log.info(
                "%s: release of epoch %d failed: %s",
                request.stream,
                request.epoch,
                error.code().name,
            )
