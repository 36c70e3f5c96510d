"""The Master service's RPCs for segments: listing, sealing, and readers' reports of
suspect replicas.
"""

from __future__ import annotations

from streamengine.master import replies
from streamengine.master.core import authority, errors, integrity
from streamengine.master.core.model import SegmentRecord, StreamRecord
from streamengine.master.service_calls import Context, Handlers, log
from streamengine.protocol import codec
from streamengine.protocol.auth import Need, authorize_need
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.logs import segment_fields
from streamengine.v1 import entry_pb2, master_pb2


class SegmentHandlers(Handlers):
    """Segments listed, sealed and reported."""

    RPCS = (
        "ListSegments",
        "SealSegment",
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
            tenant = authority.stream_tenant(request.stream)
            principal = self.calls.require(context, "SealSegment", tenant)
            if request.lost_from_index:
                denial = authorize_need(
                    principal, Need.TENANT_ADMIN, "SealSegment accepting loss", tenant
                )
                if denial is not None:
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
            was = self.state.segments.get((record.stream_id, request.segment_epoch))
            sealed = self.state.integrity.seal_segment(
                request.stream,
                request.segment_epoch,
                request.writer_epoch,
                request.final_index,
                now,
                certificate,
                request.lost_from_index,
                producers,
            )
            if certificate is not None and (was is None or was.certificate is None):
                self.calls.metrics.certificates.labels(integrity.WRITER).inc()
            return sealed

        sealed = await self.calls.call(context, "SealSegment", seal)
        log.info(
            "segment sealed",
            extra=segment_fields(
                request.stream,
                request.segment_epoch,
                final_index=request.final_index,
                writer_epoch=request.writer_epoch,
                reason=(
                    "certified by its writer"
                    if sealed.certificate is not None
                    else "no certificate: W replicas will certify it"
                ),
            ),
        )
        return replies.segment_pb(self.state, sealed)

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
