"""The Master service's RPCs for segments: listing, sealing, and readers' reports of
suspect replicas.

`SealSegments` carries many recoveries' seals in one call: each entry is authorized and
decided as a lone `SealSegment` (the batch of one), and answered on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamengine.master import replies
from streamengine.master.batches import check_batch_size
from streamengine.master.core import authority, errors, integrity
from streamengine.master.core.model import SegmentRecord, StreamRecord
from streamengine.master.integrity import Seal
from streamengine.master.service_calls import Context, Handlers, log, status_of
from streamengine.protocol import codec
from streamengine.protocol.auth import Need, Principal, authorize, authorize_need
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.logs import segment_fields
from streamengine.v1 import entry_pb2, master_pb2


class SegmentHandlers(Handlers):
    """Segments listed, sealed and reported."""

    RPCS = (
        "ListSegments",
        "SealSegment",
        "SealSegments",
        "ReportReplica",
    )

    async def ListSegments(
        self, request: master_pb2.ListSegmentsRequest, context: Context
    ) -> master_pb2.ListSegmentsReply:
        def list_segments(now: int) -> tuple[StreamRecord, list[SegmentRecord]]:
            self.calls.require(
                context, "ListSegments", authority.stream_tenant(request.stream), request.stream
            )
            return self.state.list_segments(
                request.stream, request.from_epoch, request.to_epoch, request.segments_max
            )

        record, segments = await self.calls.call(context, "ListSegments", list_segments)
        return master_pb2.ListSegmentsReply(
            stream_id=record.stream_id,
            segments=[replies.segment_pb(self.state, s, request.certificates) for s in segments],
            trimmed_through_epoch=record.trimmed_through_epoch,
            first_retained_sequence=self.state.first_retained(record),
        )

    async def SealSegment(
        self, request: master_pb2.SealSegmentRequest, context: Context
    ) -> entry_pb2.Segment:
        def seal(now: int) -> SegmentRecord:
            principal = self.calls.caller(context, "SealSegment")
            (answer,) = self._seal([request], principal, now)
            if isinstance(answer, errors.MasterError):
                raise answer
            return answer

        # Awaited before the reply is built: at a standby, `self.state` is none, and the
        # call is what refuses it (an argument evaluated first raised AssertionError).
        sealed = await self.calls.call(context, "SealSegment", seal)
        return replies.segment_pb(self.state, sealed)

    async def SealSegments(
        self, request: master_pb2.SealSegmentsRequest, context: Context
    ) -> master_pb2.SealSegmentsReply:
        def seal(now: int) -> list[SegmentRecord | errors.MasterError]:
            principal = self.calls.caller(context, "SealSegments")
            check_batch_size(len(request.seals), "seals")
            return self._seal(request.seals, principal, now)

        answers = await self.calls.call(context, "SealSegments", seal)
        reply = master_pb2.SealSegmentsReply()
        for answer in answers:
            entry = reply.seals.add()
            if isinstance(answer, errors.MasterError):
                entry.code = status_of(answer).value[0]
                entry.message = str(answer)
                if isinstance(answer, errors.StreamDeleted):
                    entry.deleted_until_ms = answer.deleted_until_ms
            else:
                entry.segment.CopyFrom(replies.segment_pb(self.state, answer))
        return reply

    def _seal(
        self, requests: Sequence[master_pb2.SealSegmentRequest], principal: Principal, now: int
    ) -> list[SegmentRecord | errors.MasterError]:
        """Each seal of a batch, authorized and checked on its own as a lone SealSegment
        is, decided together (`Integrity.seal_segments`)."""
        seals: list[Seal | errors.MasterError] = []
        certified_before: list[bool] = []
        for request in requests:
            try:
                seals.append(self._seal_of(request, principal))
            except errors.MasterError as error:
                seals.append(error)
            record = self.state.streams.get(request.stream)
            key = (record.stream_id if record else 0, request.segment_epoch)
            was = self.state.segments.get(key)
            certified_before.append(was is not None and was.certificate is not None)
        answers = self.state.integrity.seal_segments(seals, now)
        for request, answer, certified in zip(requests, answers, certified_before, strict=True):
            if isinstance(answer, errors.MasterError):
                continue
            if request.HasField("certificate") and not certified:
                self.calls.metrics.certificates.labels(integrity.WRITER).inc()
            log.info(
                "segment sealed",
                extra=segment_fields(
                    request.stream,
                    request.segment_epoch,
                    final_index=request.final_index,
                    writer_epoch=request.writer_epoch,
                    reason=(
                        "certified by its writer"
                        if answer.certificate is not None
                        else "no certificate: W replicas will certify it"
                    ),
                ),
            )
        return answers

    def _seal_of(self, request: master_pb2.SealSegmentRequest, principal: Principal) -> Seal:
        """The seal `request` asks for, once its caller may ask it (as `require` and
        `require_holder` decide a lone call) and its certificate and producers parse;
        else the error it is answered."""
        tenant = authority.stream_tenant(request.stream)
        denial = authorize(principal, "Master/SealSegment", tenant)
        if denial is None and request.lost_from_index:
            denial = authorize_need(
                principal, Need.TENANT_ADMIN, "SealSegment accepting loss", tenant
            )
        if denial is not None:
            log.info("denied SealSegment: %s", denial.reason)
            raise errors.PermissionDenied(denial.reason)
        record = self.state.stream(request.stream)
        self.calls.require_holder(
            principal,
            request.grant,
            record,
            request.writer_epoch,
            request.client_id,
            request.segment_epoch,
        )
        certificate = None
        if request.HasField("certificate"):
            try:
                certificate = codec.certificate_from_pb(request.certificate)
            except MalformedCertificate as error:
                raise errors.InvalidArgument(f"certificate: {error}") from None
        producers = None
        if request.HasField("producers"):
            try:
                producers = codec.producer_positions_from_pb(request.producers)
            except codec.MalformedProducers as error:
                raise errors.InvalidArgument(f"producers: {error}") from None
        return Seal(
            request.stream,
            request.segment_epoch,
            request.writer_epoch,
            request.final_index,
            certificate,
            request.lost_from_index,
            producers,
        )

    async def ReportReplica(
        self, request: master_pb2.ReportReplicaRequest, context: Context
    ) -> master_pb2.ReportReplicaReply:
        def report(now: int) -> str:
            self.calls.require(
                context, "ReportReplica", authority.stream_tenant(request.stream), request.stream
            )
            return self.state.integrity.report_replica(
                request.stream, request.segment_epoch, request.store_address
            )

        store = await self.calls.call(context, "ReportReplica", report)
        if store:
            self.calls.metrics.reader_reports.inc()
            log.warning(
                "a reader reports a replica: %s; its store checks it first",
                request.problem[:200],
                extra=segment_fields(request.stream, request.segment_epoch, store=store),
            )
        return master_pb2.ReportReplicaReply(accepted=bool(store))
