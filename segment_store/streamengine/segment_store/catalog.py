"""The calls on what the store holds: GetSegmentState, ListSegmentRecords (for a master
rebuilding its metadata), Delete, and CopySegment (a repair bringing a replica here, run
by `copy.SegmentCopy`). The shell of `core.catalog`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from streamengine.protocol import codec
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.entry import CorruptEntry
from streamengine.protocol.limits import GRPC_MESSAGE_BYTES_MAX
from streamengine.protocol.logs import segment_fields
from streamengine.protocol.segment_records import RECORD_BYTES_MAX
from streamengine.segment_store.copy import SegmentCopy
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import BadRequest, StoreError
from streamengine.segment_store.refusals import abort
from streamengine.segment_store.store_context import StoreContext, segment_key, segment_pb
from streamengine.v1 import segment_store_pb2

# Segments per ListSegmentRecords reply: each at most `RECORD_BYTES_MAX` bytes, a reply
# stays well under the gRPC message limit.
SEGMENT_RECORDS_PER_PAGE = 128
assert SEGMENT_RECORDS_PER_PAGE * (RECORD_BYTES_MAX + 1024) < GRPC_MESSAGE_BYTES_MAX

log = logging.getLogger("streamengine.store")


class CatalogCalls:
    """GetSegmentState, ListSegmentRecords, Delete and CopySegment."""

    def __init__(self, store: StoreContext) -> None:
        self.store = store

    def methods(self) -> dict[str, Callable[..., Any]]:
        return {
            "GetSegmentState": self.get_segment_state,
            "ListSegmentRecords": self.list_segment_records,
            "Delete": self.delete,
            "CopySegment": self.copy_segment,
        }

    async def delete(
        self,
        request: segment_store_pb2.DeleteRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.DeleteRequest, segment_store_pb2.DeleteReply
        ],
    ) -> segment_store_pb2.DeleteReply:
        try:
            self.store.require(context, "Delete")
            segment = segment_key(request.segment)
            existed = await self.store.delete(segment)
        except StoreError as error:  # refused, malformed, or the store cannot write now
            await abort(context, error, request.segment)
        if existed:
            log.info("segment deleted", extra=segment_fields(request.segment.stream, segment.epoch))
        return segment_store_pb2.DeleteReply(existed=existed)

    async def get_segment_state(
        self,
        request: segment_store_pb2.GetSegmentStateRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.GetSegmentStateRequest, segment_store_pb2.SegmentStateReply
        ],
    ) -> segment_store_pb2.SegmentStateReply:
        try:
            segment = segment_key(request.segment)
            self.store.require_reader(context, "GetSegmentState", segment)
            state = self.store.core.catalog.state(segment)
        except StoreError as error:
            await abort(context, error)
        return segment_store_pb2.SegmentStateReply(
            segment=request.segment,
            fence=state.fence,
            acked_index=state.acked_index,
            matched_index=state.matched_index,
            last_index=state.last_index,
            bytes=state.bytes,
            bridge_index=state.bridge_index,
        )

    async def list_segment_records(
        self,
        request: segment_store_pb2.ListSegmentRecordsRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.ListSegmentRecordsRequest,
            segment_store_pb2.ListSegmentRecordsReply,
        ],
    ) -> segment_store_pb2.ListSegmentRecordsReply:
        try:
            self.store.require(context, "ListSegmentRecords")
        except StoreError as error:
            await abort(context, error)
        catalog = self.store.core.catalog
        after = SegmentKey(request.after_stream_id, request.after_epoch)
        segments = catalog.segments()
        start = bisect.bisect_right(segments, after)
        page = segments[start : start + SEGMENT_RECORDS_PER_PAGE]
        records = await self.store.in_thread(
            lambda: [(catalog.segment_record(s), catalog.placed_copy_set(s)) for s in page]
        )
        reply = segment_store_pb2.ListSegmentRecordsReply(
            more=start + len(page) < len(segments), cluster_id=catalog.cluster_id()
        )
        view = await self.store.in_thread(catalog.cluster_view)
        if view:
            try:
                reply.cluster_view.ParseFromString(view)
            except DecodeError:
                log.warning("the cluster view kept here does not decode: not listed")
        for segment, (record, copy_set) in zip(page, records, strict=True):
            meta = catalog.meta(segment)
            if meta is None:
                continue  # deleted meanwhile
            name, write_quorum = catalog.granted_stream(segment.stream_id)
            reply.segments.append(
                segment_store_pb2.HeldSegmentRecord(
                    segment=segment_pb(segment),
                    fence=meta.fence,
                    acked_index=meta.acked_index,
                    last_index=meta.last_index,
                    bridge_index=meta.bridge_index,
                    tenant=catalog.tenant_of(segment.stream_id),
                    record=record,
                    copy_set=copy_set,
                    stream_name=name,
                    write_quorum=write_quorum,
                )
            )
        return reply

    async def copy_segment(
        self,
        request: segment_store_pb2.CopySegmentRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.CopySegmentRequest, segment_store_pb2.CopySegmentReply
        ],
    ) -> segment_store_pb2.CopySegmentReply:
        try:
            self.store.require(context, "CopySegment")
        except StoreError as error:
            await abort(context, error, request.segment)
        try:
            certificate = (
                codec.certificate_from_pb(request.certificate)
                if request.HasField("certificate")
                else None
            )
            copy = SegmentCopy(
                self.store.core,
                self.store.committer,
                self.store.in_thread,
                self.store.members,
                segment_key(request.segment),
                request.source_address,
                request.source_data_address,
                request.final_index,
                request.fence,
                request.tenant,
                certificate,
                request.replace_held,
            )
            report = await copy.run()
        except MalformedCertificate as error:
            await abort(context, BadRequest(f"certificate: {error}"), request.segment)
        except (StoreError, CorruptEntry) as error:
            log.warning(
                "segment copy failed: %s",
                error,
                extra=segment_fields(
                    request.segment.stream, request.segment.epoch, source=request.source_address
                ),
            )
            await abort(context, error, request.segment)
        log.info(
            "segment copied",
            extra=segment_fields(
                request.segment.stream,
                request.segment.epoch,
                source=request.source_address,
                final_index=request.final_index,
            ),
        )
        return segment_store_pb2.CopySegmentReply(
            entries_copied=report.entries_copied,
            digest=report.digest,
            acked_index=report.acked_index,
        )
