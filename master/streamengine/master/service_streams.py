"""The Master service's RPCs for tenants and streams, with trims and the retention
pass the server's loop runs (`enforce_retention`).
"""

from __future__ import annotations

from streamengine.master import replies
from streamengine.master.core import authority, errors
from streamengine.master.retention import Trimmed
from streamengine.master.service_calls import Context, Handlers, log
from streamengine.master.tenancy import StreamSpec
from streamengine.protocol.auth import PrincipalKind, visible_tenant
from streamengine.v1 import master_pb2


class StreamHandlers(Handlers):
    """Tenants, streams and their trims."""

    RPCS = (
        "CreateTenant",
        "ListTenants",
        "CreateStream",
        "CreateStreams",
        "ListStreams",
        "DescribeStream",
        "DeleteStream",
        "UndeleteStream",
        "UpdateStream",
        "TrimStream",
    )

    async def CreateTenant(
        self, request: master_pb2.CreateTenantRequest, context: Context
    ) -> master_pb2.CreateTenantReply:
        def create(now: int) -> bool:
            self.calls.require(context, "CreateTenant", request.tenant)
            return self.state.tenancy.create_tenant(request.tenant, now)

        created = await self.calls.call(context, "CreateTenant", create)
        return master_pb2.CreateTenantReply(tenant=request.tenant, created=created)

    async def ListTenants(
        self, request: master_pb2.ListTenantsRequest, context: Context
    ) -> master_pb2.ListTenantsReply:
        def list_tenants(now: int) -> master_pb2.ListTenantsReply:
            principal = self.calls.require(context, "ListTenants")
            tenants = [t for t in sorted(self.state.tenants) if visible_tenant(principal, t)]
            return master_pb2.ListTenantsReply(tenants=tenants)

        return await self.calls.call(context, "ListTenants", list_tenants)

    async def CreateStream(
        self, request: master_pb2.CreateStreamRequest, context: Context
    ) -> master_pb2.StreamInfo:
        def create(now: int) -> master_pb2.StreamInfo:
            self.calls.require(context, "CreateStream", authority.stream_tenant(request.name))
            record = self.state.tenancy.create_streams([stream_spec(request)], now)[0]
            return replies.stream_info_pb(self.state, record, now)

        info = await self.calls.call(context, "CreateStream", create)
        log.info(
            "stream created",
            extra={
                "stream": info.name,
                "reason": f"N={info.policy.replicas} W={info.policy.write_quorum}",
            },
        )
        return info

    async def CreateStreams(
        self, request: master_pb2.CreateStreamsRequest, context: Context
    ) -> master_pb2.CreateStreamsReply:
        def create(now: int) -> master_pb2.CreateStreamsReply:
            # Each tenant once: a caller is resolved (its token checked) per require.
            tenants = {authority.stream_tenant(stream.name) for stream in request.streams}
            for tenant in sorted(tenants) or [""]:
                self.calls.require(context, "CreateStreams", tenant)
            specs = [stream_spec(stream) for stream in request.streams]
            records = self.state.tenancy.create_streams(specs, now)
            return master_pb2.CreateStreamsReply(
                streams=[replies.stream_info_pb(self.state, r, now) for r in records]
            )

        reply = await self.calls.call(context, "CreateStreams", create)
        log.info("streams created", extra={"reason": f"{len(reply.streams)} asked"})
        return reply

    async def ListStreams(
        self, request: master_pb2.ListStreamsRequest, context: Context
    ) -> master_pb2.ListStreamsReply:
        def list_streams(now: int) -> master_pb2.ListStreamsReply:
            principal = self.calls.require(context, "ListStreams")
            tenant = request.tenant
            if principal.kind is PrincipalKind.TENANT:
                # Its own streams only: the filter that fills its pages.
                if tenant and tenant != principal.tenant:
                    return master_pb2.ListStreamsReply()
                tenant = principal.tenant
            records, next_page_token = self.state.tenancy.list_page(
                tenant, request.name_prefix, request.page_token, request.page_size
            )
            return master_pb2.ListStreamsReply(
                streams=[
                    replies.stream_info_pb(self.state, r, now)
                    for r in records
                    if visible_tenant(principal, r.tenant)
                ],
                next_page_token=next_page_token,
            )

        return await self.calls.call(context, "ListStreams", list_streams)

    async def DescribeStream(
        self, request: master_pb2.DescribeStreamRequest, context: Context
    ) -> master_pb2.StreamInfo:
        def describe(now: int) -> master_pb2.StreamInfo:
            self.calls.require(
                context, "DescribeStream", authority.stream_tenant(request.name), request.name
            )
            return replies.stream_info_pb(self.state, self.state.stream(request.name), now)

        return await self.calls.call(context, "DescribeStream", describe)

    async def DeleteStream(
        self, request: master_pb2.DeleteStreamRequest, context: Context
    ) -> master_pb2.DeleteStreamReply:
        def delete(now: int) -> tuple[int, int]:
            self.calls.require(context, "DeleteStream", authority.stream_tenant(request.name))
            return self.state.tenancy.delete_stream(request.name, now)

        count, until = await self.calls.call(context, "DeleteStream", delete)
        log.info(
            "stream deleted",
            extra={
                "stream": request.name,
                "index": count,
                "reason": f"its data goes at {until} unless undeleted",
            },
        )
        return master_pb2.DeleteStreamReply(segments=count, deleted_until_ms=until)

    async def UndeleteStream(
        self, request: master_pb2.UndeleteStreamRequest, context: Context
    ) -> master_pb2.StreamInfo:
        def undelete(now: int) -> master_pb2.StreamInfo:
            self.calls.require(context, "UndeleteStream", authority.stream_tenant(request.name))
            return replies.stream_info_pb(
                self.state, self.state.tenancy.undelete_stream(request.name), now
            )

        info = await self.calls.call(context, "UndeleteStream", undelete)
        log.info("stream undeleted", extra={"stream": request.name})
        return info

    async def UpdateStream(
        self, request: master_pb2.UpdateStreamRequest, context: Context
    ) -> master_pb2.StreamInfo:
        def update(now: int) -> master_pb2.StreamInfo:
            self.calls.require(context, "UpdateStream", authority.stream_tenant(request.name))
            record = self.state.tenancy.update_stream(
                request.name,
                request.retention_age_ms if request.HasField("retention_age_ms") else None,
                request.retention_bytes if request.HasField("retention_bytes") else None,
            )
            return replies.stream_info_pb(self.state, record, now)

        info = await self.calls.call(context, "UpdateStream", update)
        log.info(
            "stream updated",
            extra={
                "stream": info.name,
                "reason": f"retention {info.retention_age_ms} ms, {info.retention_bytes} bytes",
            },
        )
        return info

    async def TrimStream(
        self, request: master_pb2.TrimStreamRequest, context: Context
    ) -> master_pb2.TrimStreamReply:
        def trim(now: int) -> Trimmed:
            self.calls.require(context, "TrimStream", authority.stream_tenant(request.name))
            return self.state.retention.trim_stream(request.name, request.before_sequence, now)

        trimmed = await self.calls.call(context, "TrimStream", trim)
        self._trimmed(trimmed, "hand")
        return master_pb2.TrimStreamReply(
            trimmed_epochs=trimmed.epochs,
            trimmed_entries=trimmed.entries,
            trimmed_bytes=trimmed.bytes,
            first_retained_sequence=trimmed.first_retained_sequence,
            removed_at_ms=trimmed.removal_at_ms,
        )

    def _trimmed(self, trimmed: Trimmed, by: str) -> None:
        if trimmed.epochs:
            self.calls.metrics.trimmed_segments.labels(by).inc(len(trimmed.epochs))
            log.info(
                "segments %s trimmed (by %s): their data goes at %d",
                ",".join(map(str, trimmed.epochs)),
                by,
                trimmed.removal_at_ms,
                extra={"stream": trimmed.stream},
            )

    def enforce_retention(self) -> None:
        """One pass of the master's loop: trim what the streams' limits say, and remove
        what waited out its grace. Only while active; a commit that fails is tried
        again on the next pass."""
        now = self.calls.clock_ms()
        try:
            self.calls.role.serving(now)
            for trimmed in self.state.retention.apply_retention(now):
                self._trimmed(trimmed, "retention")
            streams, segments = self.state.retention.remove_due(now)
        except errors.MasterError as error:  # MetadataError, NotActive among them
            log.warning("retention pass failed: %s", error)
            return
        for name in streams:
            log.info("deleted stream removed: stores drop its replicas", extra={"stream": name})
        if streams:
            self.calls.metrics.removed.labels("stream").inc(len(streams))
        if segments:
            self.calls.metrics.removed.labels("segment").inc(len(segments))


def stream_spec(request: master_pb2.CreateStreamRequest) -> StreamSpec:
    return StreamSpec(
        request.name,
        request.policy.replicas,
        request.policy.write_quorum,
        request.segment_bytes,
        request.segment_age_ms,
        request.create_tenant,
        request.retention_age_ms,
        request.retention_bytes,
    )
