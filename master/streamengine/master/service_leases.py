"""The Master service's RPCs for writers: leases, epochs and rolls.

`ReleaseLease`, `HoldLease` and `RollSegment` also need the master's grant of the
caller's epoch (`MasterCalls.require_holder`). `LeaseHeartbeat` and `RollSegments` carry
many writers' calls in one: each entry is authorized and decided as its lone call
(`WriterHeartbeat`, `RollSegment`, each the batch of one), and answered on its own.
Every call that renews, holds, releases or rolls a lease, or answers with its grant,
holds the caller to its `Claim`: the client id it names, the lease secret it shows and
the principal it calls as (`core.leadership`, "Who is the holder").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from streamengine.master import replies
from streamengine.master.batches import check_batch_size
from streamengine.master.core import authority, errors, leadership
from streamengine.master.core.leadership import Claim
from streamengine.master.leadership import (
    Beat,
    Roll,
    SessionRenewal,
    WriterView,
    grant_producers,
)
from streamengine.master.service_calls import Context, Handlers, log, status_of
from streamengine.protocol import codec
from streamengine.protocol.auth import Principal, authorize
from streamengine.protocol.limits import HEARTBEATS_PER_LEASE, INDEX_MAX
from streamengine.protocol.logs import segment_fields
from streamengine.v1 import entry_pb2, master_pb2

# A lease session is random bytes the client draws: long enough never to be guessed,
# short enough to keep in memory for every client.
LEASE_SESSION_BYTES_MIN = 16
LEASE_SESSION_BYTES_MAX = 64


class LeaseHandlers(Handlers):
    """Writer heartbeats, lease release and hold, rolls."""

    RPCS = (
        "WriterHeartbeat",
        "LeaseHeartbeat",
        "HoldLeaseSession",
        "ReleaseLease",
        "HoldLease",
        "RollSegment",
        "RollSegments",
        "RequestRoll",
    )

    async def WriterHeartbeat(
        self, request: master_pb2.WriterHeartbeatRequest, context: Context
    ) -> master_pb2.WriterHeartbeatReply:
        def beat(now: int) -> WriterView:
            (answer,) = self._decide("WriterHeartbeat", [request], b"", context, now)
            if isinstance(answer, errors.MasterError):
                raise answer
            return answer

        return self._writer_reply(await self.calls.call(context, "WriterHeartbeat", beat))

    async def LeaseHeartbeat(
        self, request: master_pb2.LeaseHeartbeatRequest, context: Context
    ) -> master_pb2.LeaseHeartbeatReply:
        def beat(now: int) -> tuple[list[WriterView | errors.MasterError], SessionRenewal | None]:
            check_batch_size(len(request.leases), "leases")
            answers = self._decide("LeaseHeartbeat", request.leases, request.session, context, now)
            renewal = None
            if request.renew_session:
                principal = self.calls.caller(context, "LeaseHeartbeat")
                renewal = self.state.leadership.renew_session(
                    request.session, authority.principal_key(principal), now
                )
                self.calls.metrics.lease_session_renewals.inc()
            return answers, renewal

        answers, renewal = await self.calls.call(context, "LeaseHeartbeat", beat)
        reply = master_pb2.LeaseHeartbeatReply()
        if renewal is not None:
            reply.session.incarnation = renewal.incarnation
            reply.session.lease_ms = leadership.session_lease_ms(self.state.lease_ms)
            reply.session.renew_every_ms = self.state.lease_ms // HEARTBEATS_PER_LEASE
            reply.session.ended.extend(renewal.ended)
            reply.session.attention.extend(renewal.attention)
        reply.leases.extend(self._batch_answer(answer) for answer in answers)
        return reply

    def _batch_answer(
        self, answer: WriterView | errors.MasterError
    ) -> master_pb2.LeaseHeartbeatAnswer:
        """One entry's answer in a batch: its reply, or the status and message a lone
        call would have been refused with."""
        if isinstance(answer, WriterView):
            return master_pb2.LeaseHeartbeatAnswer(reply=self._writer_reply(answer))
        entry = master_pb2.LeaseHeartbeatAnswer(
            code=status_of(answer).value[0], message=str(answer)
        )
        if isinstance(answer, errors.StreamDeleted):
            entry.deleted_until_ms = answer.deleted_until_ms
        return entry

    def _decide(
        self,
        method: str,
        requests: Sequence[master_pb2.WriterHeartbeatRequest],
        session: bytes,
        context: Context,
        now: int,
    ) -> list[WriterView | errors.MasterError]:
        """Each heartbeat of a batch, authorized on its own, decided together
        (`Leadership.writer_heartbeats`) before the caller's deadline."""
        principal = self.calls.caller(context, method)
        self.calls.metrics.lease_heartbeats.inc(len(requests))
        beats: list[Beat | errors.MasterError] = []
        for request in requests:
            tenant = authority.stream_tenant(request.stream)
            denial = authorize(principal, f"Master/{method}", tenant)
            if denial is not None:
                log.info("denied %s: %s", method, denial.reason)
                beats.append(errors.PermissionDenied(denial.reason))
                continue
            try:
                claim = _claim(request, principal)
            except errors.MasterError as error:
                beats.append(error)
                continue
            beats.append(
                Beat(
                    request.stream,
                    claim,
                    request.epoch,
                    request.acked_index,
                    request.segment_bytes,
                    request.producer,
                    request.seen_epoch if request.HasField("seen_epoch") else None,
                )
            )
        remaining_s = context.time_remaining()
        answer_by = None if remaining_s is None else now + int(remaining_s * 1000)
        answers = self.state.leadership.writer_heartbeats(beats, now, answer_by, session)
        for request, answer in zip(requests, answers, strict=True):
            if isinstance(answer, WriterView) and answer.won:
                self.calls.metrics.leases_granted.inc()
                log.info(
                    "lease granted",
                    extra=segment_fields(
                        request.stream, answer.lease.epoch, client=request.client_id
                    ),
                )
        return answers

    async def HoldLeaseSession(
        self, request: master_pb2.HoldLeaseSessionRequest, context: Context
    ) -> AsyncIterator[master_pb2.HoldLeaseReply]:
        session = request.session

        def hold(now: int) -> None:
            principal = self.calls.require(context, "HoldLeaseSession")
            if not LEASE_SESSION_BYTES_MIN <= len(session) <= LEASE_SESSION_BYTES_MAX:
                raise errors.InvalidArgument(
                    f"a lease session of {len(session)} bytes (from {LEASE_SESSION_BYTES_MIN} "
                    f"to {LEASE_SESSION_BYTES_MAX})"
                )
            key = authority.principal_key(principal)
            if not self.state.leadership.open_session(session, key):
                raise errors.AlreadyExists("that lease session is held open already")

        await self.calls.call(context, "HoldLeaseSession", hold)
        try:
            yield master_pb2.HoldLeaseReply(held=True)
            await asyncio.Event().wait()  # until the call ends: the client went
        finally:
            state = self.calls.role.state
            if state is not None:
                ended = state.leadership.session_gone(session, self.calls.clock_ms())
                for stream, epoch in ended:
                    log.info(
                        "the holder's session ended: its lease ends now",
                        extra=segment_fields(stream, epoch),
                    )

    async def ReleaseLease(
        self, request: master_pb2.ReleaseLeaseRequest, context: Context
    ) -> master_pb2.ReleaseLeaseReply:
        def release(now: int) -> bool:
            principal = self.calls.require(
                context, "ReleaseLease", authority.stream_tenant(request.stream)
            )
            record = self.state.stream(request.stream)
            self.calls.require_holder(
                principal, request.grant, record, request.epoch, request.client_id
            )
            if request.acked_index > INDEX_MAX:
                raise errors.InvalidArgument(
                    f"acked index {request.acked_index} is over {INDEX_MAX}"
                )
            return self.state.leadership.release_lease(
                request.stream, _claim(request, principal), request.epoch, now, request.acked_index
            )

        released = await self.calls.call(context, "ReleaseLease", release)
        return master_pb2.ReleaseLeaseReply(released=released)

    async def HoldLease(
        self, request: master_pb2.HoldLeaseRequest, context: Context
    ) -> AsyncIterator[master_pb2.HoldLeaseReply]:
        def hold(now: int) -> Claim:
            principal = self.calls.require(
                context, "HoldLease", authority.stream_tenant(request.stream)
            )
            record = self.state.stream(request.stream)
            self.calls.require_holder(
                principal, request.grant, record, request.epoch, request.client_id
            )
            claim = _claim(request, principal)
            self.state.leadership.check_holds(request.stream, claim, request.epoch)
            return claim

        claim = await self.calls.call(context, "HoldLease", hold)
        try:
            yield master_pb2.HoldLeaseReply(held=True)
            await asyncio.Event().wait()  # until the call ends: the holder went
        finally:
            # A master that stops ends every call: its leases (memory only) go with it.
            # One that is no longer active leaves the lease to the active one.
            state = self.calls.role.state
            if state is not None:
                now = self.calls.clock_ms()
                if state.leadership.holder_gone(request.stream, claim, request.epoch, now):
                    log.info(
                        "the holder's call ended: its lease ends now",
                        extra=segment_fields(
                            request.stream, request.epoch, holder=request.client_id
                        ),
                    )

    async def RollSegment(
        self, request: master_pb2.RollSegmentRequest, context: Context
    ) -> master_pb2.WriterHeartbeatReply:
        def roll(now: int) -> WriterView:
            principal = self.calls.caller(context, "RollSegment")
            (answer,) = self._roll([request], principal, now)
            if isinstance(answer, errors.MasterError):
                raise answer
            return answer

        return self._writer_reply(await self.calls.call(context, "RollSegment", roll))

    async def RollSegments(
        self, request: master_pb2.RollSegmentsRequest, context: Context
    ) -> master_pb2.RollSegmentsReply:
        def roll(now: int) -> list[WriterView | errors.MasterError]:
            principal = self.calls.caller(context, "RollSegments")
            check_batch_size(len(request.rolls), "rolls")
            return self._roll(request.rolls, principal, now)

        answers = await self.calls.call(context, "RollSegments", roll)
        return master_pb2.RollSegmentsReply(rolls=[self._batch_answer(a) for a in answers])

    def _roll(
        self, requests: Sequence[master_pb2.RollSegmentRequest], principal: Principal, now: int
    ) -> list[WriterView | errors.MasterError]:
        """Each roll of a batch, authorized on its own as a lone RollSegment is, decided
        together (`Leadership.roll_segments`)."""
        rolls: list[Roll | errors.MasterError] = []
        for request in requests:
            try:
                rolls.append(self._roll_of(request, principal))
            except errors.MasterError as error:
                rolls.append(error)
        answers = self.state.leadership.roll_segments(rolls, now)
        for request, answer in zip(requests, answers, strict=True):
            if isinstance(answer, WriterView):
                log.info(
                    "segment rolled",
                    extra=segment_fields(
                        request.stream,
                        answer.lease.epoch,
                        client=request.client_id,
                        reason=f"from epoch {request.epoch}",
                    ),
                )
        return answers

    def _roll_of(self, request: master_pb2.RollSegmentRequest, principal: Principal) -> Roll:
        """The roll `request` asks for, once its caller may ask it (as `require` and
        `require_holder` decide a lone call); else the error it is answered."""
        denial = authorize(principal, "Master/RollSegment", authority.stream_tenant(request.stream))
        if denial is not None:
            log.info("denied RollSegment: %s", denial.reason)
            raise errors.PermissionDenied(denial.reason)
        record = self.state.stream(request.stream)
        self.calls.require_holder(
            principal, request.grant, record, request.epoch, request.client_id
        )
        return Roll(
            request.stream,
            _claim(request, principal),
            request.epoch,
            tuple(request.exclude_stores),
        )

    async def RequestRoll(
        self, request: master_pb2.RequestRollRequest, context: Context
    ) -> master_pb2.RequestRollReply:
        def ask(now: int) -> tuple[str, int]:
            self.calls.require(context, "RequestRoll", authority.stream_tenant(request.stream))
            return self.state.leadership.request_roll(request.stream, now)

        leader, open_epoch = await self.calls.call(context, "RequestRoll", ask)
        log.info(
            "roll requested",
            extra=segment_fields(request.stream, open_epoch, client=leader or "(no leader)"),
        )
        return master_pb2.RequestRollReply(leader_id=leader, open_segment_epoch=open_epoch)

    def _writer_reply(self, view: WriterView) -> master_pb2.WriterHeartbeatReply:
        record = view.stream
        reply = master_pb2.WriterHeartbeatReply(
            role=master_pb2.LEADER if view.leads else master_pb2.FOLLOWER,
            epoch=view.lease.epoch,
            lease_ms=self.state.lease_ms,
            leader_id=view.lease.holder if view.lease.running(self.calls.clock_ms()) else "",
            stream_id=record.stream_id,
            policy=entry_pb2.ReplicationPolicy(
                replicas=record.replicas, write_quorum=record.write_quorum
            ),
            segment_bytes_max=record.segment_bytes,
            segment_age_ms_max=record.segment_age_ms,
        )
        if view.leads:
            if view.segment is not None:
                reply.segment.CopyFrom(replies.segment_pb(self.state, view.segment))
            reply.unsealed.extend(replies.segment_pb(self.state, s) for s in view.unsealed)
            reply.roll_requested = bool(view.roll_reason)
            reply.roll_reason = view.roll_reason
            reply.grant = self.state.keys.grant_signer(self.calls.clock_ms()).sign(view.grant())
            reply.lease_secret = view.secret
            # The new leader builds its producer table from these and what it recovers.
            segments = self.state.stream_segments(view.stream.stream_id)
            positions = grant_producers(view, segments)
            if positions:
                reply.producers.CopyFrom(codec.producer_positions_to_pb(positions))
            reply.stream_has_producers = record.has_producers
            reply.session_incarnation = view.session_incarnation
        return reply


def _claim(
    request: master_pb2.WriterHeartbeatRequest
    | master_pb2.HoldLeaseRequest
    | master_pb2.ReleaseLeaseRequest
    | master_pb2.RollSegmentRequest,
    principal: Principal,
) -> Claim:
    """Who the caller says it is (raises InvalidArgument for a malformed secret)."""
    return Claim(request.client_id, request.lease_secret, authority.principal_key(principal))
