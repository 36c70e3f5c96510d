"""The Master gRPC service: protobuf in, domain call, protobuf out.

Each handler first asks who calls and whether it may (`_require`: the principal of the
call, `protocol.callers`, then `protocol.auth.authorize` with the tenant the request
touches), converts its request, calls one `MasterState` (or `Repairer`) method and
converts the answer. Listings are filtered to the tenants the caller may see
(`auth.visible_tenant`). `SealSegment`, `ReleaseLease` and `RollSegment` also need the
master's grant of the caller's epoch (`master.authority.check_holder`). `_STATUS` is
the one table from domain errors to gRPC statuses; a domain error raised before the
catalog commit (a denial always is) leaves everything unchanged.

Every handler first asks the role (`master.role`) whether this master is the active
one now, in the same synchronous step as its state change: a standby (or an active
master that cannot confirm its election lease) answers UNAVAILABLE, naming the active
master in the trailing metadata when it knows it (`ACTIVE_MASTER_METADATA_KEY`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import grpc

from streamengine.master.console import ConsoleView
from streamengine.master.core import authority, errors, integrity, repair
from streamengine.master.core.durability import DURABILITY_WORST_MAX
from streamengine.master.core.model import (
    Held,
    SegmentKey,
    SegmentRecord,
    SegmentState,
    StreamRecord,
)
from streamengine.master.leadership import WriterView
from streamengine.master.metadata import MetadataError, NotActive
from streamengine.master.metrics import Metrics
from streamengine.master.records import RecordEncodings
from streamengine.master.repair import Repairer, TaskStatus
from streamengine.master.retention import Trimmed
from streamengine.master.role import MasterRole
from streamengine.master.state import MasterState
from streamengine.master.stores import Registered
from streamengine.protocol import codec, identity
from streamengine.protocol.auth import (
    Denial,
    Need,
    Principal,
    PrincipalKind,
    authorize,
    authorize_need,
    visible_tenant,
)
from streamengine.protocol.callers import Callers
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.limits import TENANT_APPEND_BYTES_PER_S_DEFAULT
from streamengine.protocol.logs import segment_fields
from streamengine.protocol.status import ACTIVE_MASTER_METADATA_KEY, DELETED_UNTIL_METADATA_KEY
from streamengine.protocol.status_view import segment_dict
from streamengine.protocol.tokens import TOKEN_ID_CHARS, mint_token
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

log = logging.getLogger("streamengine.master")

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]

_STATUS: dict[type[errors.MasterError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.NotLeader: grpc.StatusCode.FAILED_PRECONDITION,
    errors.TooManyUnsealed: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotEnoughStores: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SealConflict: grpc.StatusCode.ABORTED,
    errors.NotReady: grpc.StatusCode.UNAVAILABLE,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotTrimmable: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StreamDeleted: grpc.StatusCode.FAILED_PRECONDITION,
    errors.WrongCluster: grpc.StatusCode.FAILED_PRECONDITION,
    # A standby, a deposed master, or etcd not answering: another master (or a retry)
    # will.
    MetadataError: grpc.StatusCode.UNAVAILABLE,
}

# What a master rebuilding its metadata serves: the stores (they register and report),
# and the cluster's status.
SERVED_WHILE_REBUILDING = frozenset({"RegisterStore", "StoreHeartbeat", "GetClusterStatus"})

_TASK_STATE = {
    "PENDING": master_pb2.RepairTask.PENDING,
    "RUNNING": master_pb2.RepairTask.RUNNING,
    "DONE": master_pb2.RepairTask.DONE,
    "FAILED": master_pb2.RepairTask.FAILED,
}


def status_of(error: errors.MasterError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in _STATUS:
            return _STATUS[kind]
    return grpc.StatusCode.INTERNAL


class MasterService(master_pb2_grpc.MasterServicer):
    def __init__(
        self,
        role: MasterRole,
        clock_ms: Callable[[], int],
        metrics: Metrics,
        signer: identity.CertificateProof | None = None,
        *,
        tenant_append_bytes_per_s: int = TENANT_APPEND_BYTES_PER_S_DEFAULT,
    ):
        """`clock_ms` is wall-clock time (token lifetimes are); `signer`, under TLS, the
        master's certificate (it signs replies to stores); `tenant_append_bytes_per_s`
        is told to every store."""
        self.role = role
        self.clock_ms = clock_ms
        self.metrics = metrics
        # Under TLS the master's node certificate: it signs its replies to stores (delete
        # lists, signing keys, revocations), which take them from its certificate only.
        self.signer = signer
        self.tenant_append_bytes_per_s = tenant_append_bytes_per_s
        # Segment records as sent to the stores (`master.records`).
        self.records = RecordEncodings()
        # While the metadata is rebuilt from the stores (`master --rebuild`), only the
        # stores' calls and the status are served; every other call is UNAVAILABLE.
        self.rebuilding = False

    # ---- who calls ----

    def _require(self, context: Context, method: str, tenant: str = "") -> Principal:
        """The caller, when it may call `method` on `tenant`'s data; else PermissionDenied
        (raised inside `_call`'s action, before anything changes); Unauthenticated for a
        certificate proof that does not hold or a token that is not valid (forged,
        expired, revoked)."""
        state = self.state  # this activation's key and tokens
        callers = Callers(state.verifier, lambda: state.issuer.current_revocations(self.clock_ms()))
        try:
            principal = callers.principal(context)
        except identity.ProofRefused as refusal:
            raise errors.Unauthenticated(f"{method}: {refusal}") from None
        if isinstance(principal, Denial):
            log.info("refused the token of a %s call: %s", method, principal.reason)
            raise errors.Unauthenticated(f"{method}: {principal.reason}")
        denial = authorize(principal, f"Master/{method}", tenant)
        if denial is not None:
            log.info("denied %s: %s", method, denial.reason)
            raise errors.PermissionDenied(denial.reason)
        assert isinstance(principal, Principal)
        return principal

    def _require_store(self, context: Context, method: str, store_id: str) -> None:
        """A store registers and heartbeats only as the store its certificate names."""
        principal = self._require(context, method)
        if principal.kind is PrincipalKind.STORE and principal.name != store_id:
            reason = (
                f"{method} as store {store_id!r}: the caller's certificate is store "
                f"{principal.name!r}"
            )
            log.warning("refused: %s", reason)
            raise errors.PermissionDenied(reason)

    def _require_holder(
        self,
        principal: Principal,
        signed_grant: bytes,
        stream: StreamRecord,
        epoch: int,
        client_id: str,
        segment_epoch: int | None = None,
    ) -> None:
        admin = principal.kind is PrincipalKind.CLUSTER_ADMIN
        authority.check_holder(
            self.state.verifier, signed_grant, admin, stream, epoch, client_id, segment_epoch
        )

    @property
    def state(self) -> MasterState:
        """The active state; only inside `_call`, after the role said it serves."""
        assert self.role.state is not None, "used only while active"
        return self.role.state

    @property
    def repairer(self) -> Repairer:
        assert self.role.repairer is not None, "used only while active"
        return self.role.repairer

    async def _call(self, context: Context, method: str, action: Callable[[int], T]) -> T:
        now_ms = self.clock_ms()
        try:
            self.role.serving(now_ms)
            if self.rebuilding and method not in SERVED_WHILE_REBUILDING:
                raise errors.NotReady(
                    f"{method}: the master is rebuilding its metadata from the stores"
                )
            result = action(now_ms)
        except errors.MasterError as error:
            code = status_of(error)
            self.metrics.requests.labels(method, code.name).inc()
            trailing: tuple[tuple[str, str], ...] = ()
            if isinstance(error, NotActive):
                # The freshest word on who is active: the election's, not the error's.
                active = self.role.active_address or error.active_address
                if active and active != self.role.address:
                    trailing = ((ACTIVE_MASTER_METADATA_KEY, active),)
            if isinstance(error, errors.StreamDeleted):
                trailing = ((DELETED_UNTIL_METADATA_KEY, str(error.deleted_until_ms)),)
            await context.abort(code, str(error), trailing_metadata=trailing)
            raise AssertionError("abort returns only by raising") from None
        self.metrics.requests.labels(method, "OK").inc()
        return result

    # ---- conversions ----

    def _segment(self, record: SegmentRecord, details: bool = False) -> entry_pb2.Segment:
        """The segment as listed; `details`: its certificate's chunks and the members
        verified against it."""
        stores = self.state.stores
        segment = entry_pb2.Segment(
            id=entry_pb2.SegmentId(
                stream_id=record.stream_id, epoch=record.epoch, stream=record.stream
            ),
            copy_set=[
                entry_pb2.Replica(
                    store_id=m,
                    address=stores[m].address if m in stores else "",
                    zone=stores[m].zone if m in stores else "",
                )
                for m in record.copy_set
            ],
            state=int(record.state),  # type: ignore[arg-type]
            final_index=record.final_index,
            created_at_ms=record.created_at_ms,
            sealed_at_ms=record.sealed_at_ms,
            bytes=self.state.segment_bytes(record.key),
            acked_index=self.state.segment_acked_index(record),
            bad_stores=record.bad,
            lost_from_index=record.lost_from_index,
        )
        if record.certificate is not None:
            segment.certificate.CopyFrom(codec.certificate_to_pb(record.certificate, details))
            segment.certificate.certified_by = record.certified_by
        checks = self.state.checks.get(record.key)
        if details and checks is not None:
            segment.verified.extend(
                entry_pb2.ReplicaVerified(store_id=store, verified_at_ms=at)
                for store, at in sorted(checks.verified.items())
                if store in record.copy_set
            )
        return segment

    def _stream_info(self, record: StreamRecord, now_ms: int) -> master_pb2.StreamInfo:
        lease = self.state.leases.get(record.name)
        leader = lease.holder if lease is not None and lease.running(now_ms) else ""
        unsealed = self.state.unsealed(record.stream_id)
        open_epochs = [s.epoch for s in unsealed if s.state == SegmentState.OPEN]
        return master_pb2.StreamInfo(
            name=record.name,
            stream_id=record.stream_id,
            policy=entry_pb2.ReplicationPolicy(
                replicas=record.replicas, write_quorum=record.write_quorum
            ),
            segment_bytes=record.segment_bytes,
            segment_age_ms=record.segment_age_ms,
            epoch=record.epoch,
            leader_id=leader,
            acked_index=self.state.stream_acked_index(record.stream_id)[1],
            open_segment_epoch=open_epochs[-1] if open_epochs else 0,
            unsealed_segments=len(unsealed),
            created_at_ms=record.created_at_ms,
            retention_age_ms=record.retention_age_ms,
            retention_bytes=record.retention_bytes,
            trimmed_through_epoch=record.trimmed_through_epoch,
            first_retained_sequence=self.state.first_retained(record),
            deleted_until_ms=record.deleted_until_ms,
        )

    def _writer_reply(self, view: WriterView) -> master_pb2.WriterHeartbeatReply:
        record = view.stream
        reply = master_pb2.WriterHeartbeatReply(
            role=master_pb2.LEADER if view.leads else master_pb2.FOLLOWER,
            epoch=view.lease.epoch,
            lease_ms=self.state.lease_ms,
            leader_id=view.lease.holder if view.lease.running(self.clock_ms()) else "",
            stream_id=record.stream_id,
            policy=entry_pb2.ReplicationPolicy(
                replicas=record.replicas, write_quorum=record.write_quorum
            ),
            segment_bytes_max=record.segment_bytes,
            segment_age_ms_max=record.segment_age_ms,
        )
        if view.leads:
            if view.segment is not None:
                reply.segment.CopyFrom(self._segment(view.segment))
            reply.unsealed.extend(self._segment(s) for s in view.unsealed)
            reply.roll_requested = bool(view.roll_reason)
            reply.roll_reason = view.roll_reason
            reply.grant = self.state.grant_signer.sign(view.grant())
        return reply

    def _task(self, status: TaskStatus) -> master_pb2.RepairTask:
        task = status.task
        stream_id, epoch = task.segment
        return master_pb2.RepairTask(
            segment=entry_pb2.SegmentId(
                stream_id=stream_id, epoch=epoch, stream=self.state.stream_name(stream_id)
            ),
            source_store=task.source,
            target_store=task.target,
            replaced_store=task.replaced,
            state=_TASK_STATE[status.state],
            error=status.error,
            bytes=task.bytes,
            reason=task.reason,
        )

    def _plan(
        self, tasks: Iterable[repair.Task], before: dict[str, int], after: dict[str, int]
    ) -> master_pb2.RepairPlan:
        return master_pb2.RepairPlan(
            tasks=[self._task(TaskStatus(t, "PENDING")) for t in tasks],
            bytes_before=before,
            bytes_after=after,
        )

    # ---- stores ----

    async def RegisterStore(
        self, request: master_pb2.RegisterStoreRequest, context: Context
    ) -> master_pb2.RegisterStoreReply:
        def register(now: int) -> Registered:
            self._require_store(context, "RegisterStore", request.store_id)
            return self.state.registry.register_store(
                request.store_id,
                request.address,
                request.zone,
                request.free_bytes,
                now,
                request.incarnation,
                request.cluster_id,
            )

        registered = await self._call(context, "RegisterStore", register)
        if registered.lost:
            log.warning(
                "store %s registered as a new incarnation: its %d replicas are lost",
                request.store_id,
                len(registered.lost),
            )
        reply = master_pb2.RegisterStoreReply(
            heartbeat_interval_ms=registered.heartbeat_ms,
            signing_public_keys=[self.state.signing_key.public_key],
            cluster_id=registered.cluster_id,
            lost_segments=[
                entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch)
                for stream_id, epoch in registered.lost
            ],
        )
        self._sign_reply(context, "register", request.store_id, reply)
        return reply

    async def StoreHeartbeat(
        self, request: master_pb2.StoreHeartbeatRequest, context: Context
    ) -> master_pb2.StoreHeartbeatReply:
        held: dict[SegmentKey, Held] = {
            (h.segment.stream_id, h.segment.epoch): Held(
                h.fence, h.acked_index, h.last_index, h.bytes
            )
            for h in request.segments
        }
        versions = {
            (h.segment.stream_id, h.segment.epoch): h.record_version for h in request.segments
        }

        def beat(now: int) -> list[SegmentKey] | None:
            self._require_store(context, "StoreHeartbeat", request.store_id)
            return self.state.registry.store_heartbeat(
                request.store_id, request.used_bytes, request.free_bytes, held, now
            )

        deletes = await self._call(context, "StoreHeartbeat", beat)
        if deletes is None:
            return master_pb2.StoreHeartbeatReply(register_again=True)
        for scrubbed in request.scrubbed:
            self._replica_reported(request.store_id, scrubbed)
        revocations = self.state.issuer.current_revocations(self.clock_ms())
        reply = master_pb2.StoreHeartbeatReply(
            delete_segments=[
                entry_pb2.SegmentId(stream_id=s, epoch=e, stream=self.state.stream_name(s))
                for s, e in deletes
            ],
            signing_public_keys=[self.state.signing_key.public_key],
            revocations_version=revocations.version,
            tenant_append_bytes_per_s=self.tenant_append_bytes_per_s,
            scrub_first=[
                entry_pb2.SegmentId(stream_id=s, epoch=e, stream=self.state.stream_name(s))
                for s, e in self.state.integrity.take_scrub_first(request.store_id)
            ],
            deleted_streams=[
                master_pb2.DeletedStream(stream_id=r.stream_id, deleted_until_ms=r.deleted_until_ms)
                for r in self.state.streams.values()
                if r.deleted_until_ms
            ],
            segment_records=self.records.to_send(
                request.store_id,
                versions,
                self.state.segments,
                lambda stream_id: self.state.streams.get(self.state.stream_name(stream_id)),
            ),
        )
        if request.revocations_version != revocations.version:
            reply.revoked_tokens.extend(
                master_pb2.RevokedToken(token_id=token_id, expires_at_ms=expires_at_ms)
                for token_id, expires_at_ms in revocations.items()
            )
        self._sign_reply(context, "heartbeat", request.store_id, reply)
        return reply

    def _replica_reported(self, store_id: str, scrubbed: master_pb2.ScrubReport) -> None:
        """One replica a store's scrub read back: judged against the certificate."""
        key = (scrubbed.segment.stream_id, scrubbed.segment.epoch)
        stream = self.state.stream_name(key[0])
        fields = segment_fields(stream, key[1], store=store_id)
        report: integrity.Report
        if scrubbed.damaged:
            report = integrity.Damaged(scrubbed.detail)
        else:
            try:
                report = integrity.Clean(codec.certificate_from_pb(scrubbed.certificate))
            except MalformedCertificate as error:
                log.warning("malformed scrub report: %s", error, extra=fields)
                return
        had = self.state.segments.get(key)
        judgement = self.state.integrity.replica_reported(store_id, key, report, self.clock_ms())
        checks = self.state.checks.get(key)
        if judgement.certificate is not None:
            self.metrics.certificates.labels(integrity.REPLICAS).inc()
            contradicted = had is not None and had.certificate is not None
            (log.error if contradicted else log.info)(judgement.note, extra=fields)
        if judgement.bad:
            self.metrics.replicas_bad.inc(len(judgement.bad))
            log.warning(
                "replicas %s differ from the certificate: %s",
                ", ".join(judgement.bad),
                judgement.note,
                extra=fields,
            )
        if isinstance(report, integrity.Damaged):
            outcome = "damaged"
            log.warning(judgement.note, extra=fields)
        elif store_id in judgement.bad:
            outcome = "bad"
        elif checks is not None and store_id in checks.verified:
            outcome = "verified"
        else:
            outcome = "other"
        self.metrics.replica_checks.labels(outcome).inc()

    def _sign_reply(
        self,
        context: Context,
        kind: str,
        store_id: str,
        reply: master_pb2.RegisterStoreReply | master_pb2.StoreHeartbeatReply,
    ) -> None:
        """Under TLS, the master's certificate proof on a reply to a store: the store
        takes its delete list, signing keys and revocations only from the master."""
        if self.signer is not None:
            audience = identity.reply_audience(kind, store_id, reply)
            context.set_trailing_metadata(self.signer.metadata(audience, self.clock_ms()))

    # ---- tenants and streams ----

    async def CreateTenant(
        self, request: master_pb2.CreateTenantRequest, context: Context
    ) -> master_pb2.CreateTenantReply:
        def create(now: int) -> bool:
            self._require(context, "CreateTenant", request.tenant)
            return self.state.tenancy.create_tenant(request.tenant, now)

        created = await self._call(context, "CreateTenant", create)
        return master_pb2.CreateTenantReply(tenant=request.tenant, created=created)

    async def ListTenants(
        self, request: master_pb2.ListTenantsRequest, context: Context
    ) -> master_pb2.ListTenantsReply:
        def list_tenants(now: int) -> master_pb2.ListTenantsReply:
            principal = self._require(context, "ListTenants")
            tenants = [t for t in sorted(self.state.tenants) if visible_tenant(principal, t)]
            return master_pb2.ListTenantsReply(tenants=tenants)

        return await self._call(context, "ListTenants", list_tenants)

    async def CreateStream(
        self, request: master_pb2.CreateStreamRequest, context: Context
    ) -> master_pb2.StreamInfo:
        def create(now: int) -> master_pb2.StreamInfo:
            self._require(context, "CreateStream", authority.stream_tenant(request.name))
            record = self.state.tenancy.create_stream(
                request.name,
                request.policy.replicas,
                request.policy.write_quorum,
                request.segment_bytes,
                request.segment_age_ms,
                request.create_tenant,
                now,
                retention_age_ms=request.retention_age_ms,
                retention_bytes=request.retention_bytes,
            )
            return self._stream_info(record, now)

        info = await self._call(context, "CreateStream", create)
        log.info(
            "stream created",
            extra={
                "stream": info.name,
                "reason": f"N={info.policy.replicas} W={info.policy.write_quorum}",
            },
        )
        return info

    async def ListStreams(
        self, request: master_pb2.ListStreamsRequest, context: Context
    ) -> master_pb2.ListStreamsReply:
        def list_streams(now: int) -> master_pb2.ListStreamsReply:
            principal = self._require(context, "ListStreams")
            records = self.state.tenancy.list_streams(request.tenant)
            return master_pb2.ListStreamsReply(
                streams=[
                    self._stream_info(r, now)
                    for r in records
                    if visible_tenant(principal, r.tenant)
                ]
            )

        return await self._call(context, "ListStreams", list_streams)

    async def DescribeStream(
        self, request: master_pb2.DescribeStreamRequest, context: Context
    ) -> master_pb2.StreamInfo:
        def describe(now: int) -> master_pb2.StreamInfo:
            self._require(context, "DescribeStream", authority.stream_tenant(request.name))
            return self._stream_info(self.state.stream(request.name), now)

        return await self._call(context, "DescribeStream", describe)

    async def DeleteStream(
        self, request: master_pb2.DeleteStreamRequest, context: Context
    ) -> master_pb2.DeleteStreamReply:
        def delete(now: int) -> tuple[int, int]:
            self._require(context, "DeleteStream", authority.stream_tenant(request.name))
            return self.state.tenancy.delete_stream(request.name, now)

        count, until = await self._call(context, "DeleteStream", delete)
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
            self._require(context, "UndeleteStream", authority.stream_tenant(request.name))
            return self._stream_info(self.state.tenancy.undelete_stream(request.name), now)

        info = await self._call(context, "UndeleteStream", undelete)
        log.info("stream undeleted", extra={"stream": request.name})
        return info

    async def UpdateStream(
        self, request: master_pb2.UpdateStreamRequest, context: Context
    ) -> master_pb2.StreamInfo:
        def update(now: int) -> master_pb2.StreamInfo:
            self._require(context, "UpdateStream", authority.stream_tenant(request.name))
            record = self.state.tenancy.update_stream(
                request.name,
                request.retention_age_ms if request.HasField("retention_age_ms") else None,
                request.retention_bytes if request.HasField("retention_bytes") else None,
            )
            return self._stream_info(record, now)

        info = await self._call(context, "UpdateStream", update)
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
            self._require(context, "TrimStream", authority.stream_tenant(request.name))
            return self.state.retention.trim_stream(request.name, request.before_sequence, now)

        trimmed = await self._call(context, "TrimStream", trim)
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
            self.metrics.trimmed_segments.labels(by).inc(len(trimmed.epochs))
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
        now = self.clock_ms()
        try:
            self.role.serving(now)
            for trimmed in self.state.retention.apply_retention(now):
                self._trimmed(trimmed, "retention")
            streams, segments = self.state.retention.remove_due(now)
        except errors.MasterError as error:  # MetadataError, NotActive among them
            log.warning("retention pass failed: %s", error)
            return
        for name in streams:
            log.info("deleted stream removed: stores drop its replicas", extra={"stream": name})
        if streams:
            self.metrics.removed.labels("stream").inc(len(streams))
        if segments:
            self.metrics.removed.labels("segment").inc(len(segments))

    # ---- writers ----

    async def WriterHeartbeat(
        self, request: master_pb2.WriterHeartbeatRequest, context: Context
    ) -> master_pb2.WriterHeartbeatReply:
        def beat(now: int) -> WriterView:
            self._require(context, "WriterHeartbeat", authority.stream_tenant(request.stream))
            before = self.state.leases.get(request.stream)
            view = self.state.leadership.writer_heartbeat(
                request.stream,
                request.client_id,
                request.epoch,
                request.acked_index,
                request.segment_bytes,
                now,
            )
            if before is not None and view.lease.epoch != before.epoch:
                self.metrics.leases_granted.inc()
                log.info(
                    "lease granted",
                    extra=segment_fields(
                        request.stream, view.lease.epoch, client=request.client_id
                    ),
                )
            return view

        return self._writer_reply(await self._call(context, "WriterHeartbeat", beat))

    async def ReleaseLease(
        self, request: master_pb2.ReleaseLeaseRequest, context: Context
    ) -> master_pb2.ReleaseLeaseReply:
        def release(now: int) -> bool:
            principal = self._require(
                context, "ReleaseLease", authority.stream_tenant(request.stream)
            )
            record = self.state.stream(request.stream)
            self._require_holder(principal, request.grant, record, request.epoch, request.client_id)
            return self.state.leadership.release_lease(
                request.stream, request.client_id, request.epoch, now
            )

        released = await self._call(context, "ReleaseLease", release)
        return master_pb2.ReleaseLeaseReply(released=released)

    async def HoldLease(
        self, request: master_pb2.HoldLeaseRequest, context: Context
    ) -> AsyncIterator[master_pb2.HoldLeaseReply]:
        def hold(now: int) -> None:
            principal = self._require(context, "HoldLease", authority.stream_tenant(request.stream))
            record = self.state.stream(request.stream)
            self._require_holder(principal, request.grant, record, request.epoch, request.client_id)

        await self._call(context, "HoldLease", hold)
        try:
            yield master_pb2.HoldLeaseReply(held=True)
            await asyncio.Event().wait()  # until the call ends: the holder went
        finally:
            # A master that stops ends every call: its leases (memory only) go with it.
            # One that is no longer active leaves the lease to the active one.
            state = self.role.state
            if state is not None:
                now = self.clock_ms()
                if state.leadership.holder_gone(
                    request.stream, request.client_id, request.epoch, now
                ):
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
            principal = self._require(
                context, "RollSegment", authority.stream_tenant(request.stream)
            )
            record = self.state.stream(request.stream)
            self._require_holder(principal, request.grant, record, request.epoch, request.client_id)
            return self.state.leadership.roll_segment(
                request.stream, request.client_id, request.epoch, list(request.exclude_stores), now
            )

        view = await self._call(context, "RollSegment", roll)
        log.info(
            "segment rolled",
            extra=segment_fields(
                request.stream,
                view.lease.epoch,
                client=request.client_id,
                reason=f"from epoch {request.epoch}",
            ),
        )
        return self._writer_reply(view)

    async def RequestRoll(
        self, request: master_pb2.RequestRollRequest, context: Context
    ) -> master_pb2.RequestRollReply:
        def ask(now: int) -> tuple[str, int]:
            self._require(context, "RequestRoll", authority.stream_tenant(request.stream))
            return self.state.leadership.request_roll(request.stream, now)

        leader, open_epoch = await self._call(context, "RequestRoll", ask)
        log.info(
            "roll requested",
            extra=segment_fields(request.stream, open_epoch, client=leader or "(no leader)"),
        )
        return master_pb2.RequestRollReply(leader_id=leader, open_segment_epoch=open_epoch)

    # ---- segments ----

    async def ListSegments(
        self, request: master_pb2.ListSegmentsRequest, context: Context
    ) -> master_pb2.ListSegmentsReply:
        def list_segments(now: int) -> tuple[StreamRecord, list[SegmentRecord]]:
            self._require(context, "ListSegments", authority.stream_tenant(request.stream))
            return self.state.list_segments(request.stream, request.from_epoch, request.to_epoch)

        record, segments = await self._call(context, "ListSegments", list_segments)
        return master_pb2.ListSegmentsReply(
            stream_id=record.stream_id,
            segments=[self._segment(s, request.certificates) for s in segments],
            trimmed_through_epoch=record.trimmed_through_epoch,
            first_retained_sequence=self.state.first_retained(record),
        )

    async def SealSegment(
        self, request: master_pb2.SealSegmentRequest, context: Context
    ) -> entry_pb2.Segment:
        def seal(now: int) -> SegmentRecord:
            tenant = authority.stream_tenant(request.stream)
            principal = self._require(context, "SealSegment", tenant)
            if request.lost_from_index:
                denial = authorize_need(
                    principal, Need.TENANT_ADMIN, "SealSegment accepting loss", tenant
                )
                if denial is not None:
                    raise errors.PermissionDenied(denial.reason)
            record = self.state.stream(request.stream)
            self._require_holder(
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
            was = self.state.segments.get((record.stream_id, request.segment_epoch))
            sealed = self.state.integrity.seal_segment(
                request.stream,
                request.segment_epoch,
                request.writer_epoch,
                request.final_index,
                now,
                certificate,
                request.lost_from_index,
            )
            if certificate is not None and (was is None or was.certificate is None):
                self.metrics.certificates.labels(integrity.WRITER).inc()
            return sealed

        sealed = await self._call(context, "SealSegment", seal)
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
        return self._segment(sealed)

    async def ReportReplica(
        self, request: master_pb2.ReportReplicaRequest, context: Context
    ) -> master_pb2.ReportReplicaReply:
        def report(now: int) -> str:
            self._require(context, "ReportReplica", authority.stream_tenant(request.stream))
            return self.state.integrity.report_replica(
                request.stream, request.segment_epoch, request.store_address
            )

        store = await self._call(context, "ReportReplica", report)
        if store:
            self.metrics.reader_reports.inc()
            log.warning(
                "a reader reports a replica: %s; its store checks it first",
                request.problem[:200],
                extra=segment_fields(request.stream, request.segment_epoch, store=store),
            )
        return master_pb2.ReportReplicaReply(accepted=bool(store))

    # ---- administration ----

    async def GetClusterStatus(
        self, request: master_pb2.GetClusterStatusRequest, context: Context
    ) -> master_pb2.ClusterStatus:
        return await self._call(
            context,
            "GetClusterStatus",
            lambda now: self.cluster_status(now, self._require(context, "GetClusterStatus")),
        )

    def console_view(self) -> ConsoleView:
        """What the console serves, filtered per caller there: the whole status, each
        stream's segments, and what checks the callers' tokens. Only while this master
        is the active one (the caller checks `role.state`)."""
        now = self.clock_ms()
        state = self.state
        return ConsoleView(
            status=self.full_status(now),
            segments={
                record.name: [
                    segment_dict(self._segment(segment))
                    for segment in state.stream_segments(record.stream_id)
                ]
                for record in state.tenancy.list_streams("")
            },
            verifier=state.verifier,
            revocations=state.issuer.current_revocations(now),
        )

    def cluster_status(self, now: int, principal: Principal) -> master_pb2.ClusterStatus:
        """The status `principal` may see (`authority.visible_status`)."""
        return authority.visible_status(self.full_status(now), principal)

    def full_status(self, now: int) -> master_pb2.ClusterStatus:
        """The whole cluster's status, every tenant's: filter it before it leaves."""
        st = self.state
        views = st.store_views(now)
        stores = [
            master_pb2.StoreStatus(
                store_id=sid,
                address=st.stores[sid].address,
                zone=view.zone,
                alive=view.alive,
                draining=view.draining,
                used_bytes=view.used_bytes,
                free_bytes=st.live[sid].free_bytes,
                segments=view.segments,
                silent_ms=max(0, now - st.live[sid].last_seen_ms),
                incarnation=st.stores[sid].incarnation,
            )
            for sid, view in views.items()
        ]
        matched, unmatched, bad = st.integrity.replica_verification()
        return master_pb2.ClusterStatus(
            cluster_id=st.cluster_id,
            replica_verification=master_pb2.ReplicaVerification(
                matched=matched, unmatched=unmatched, bad=bad
            ),
            stores=stores,
            streams=[self._stream_info(r, now) for r in st.tenancy.list_streams("")],
            under_replicated=[self._segment(s) for s in st.replicas.under_replicated(now)],
            tasks=[self._task(t) for t in self.repairer.statuses()],
            granting_leases=st.granting_leases(now),
            durability_debt=[
                master_pb2.SegmentDebt(
                    segment=entry_pb2.SegmentId(
                        stream_id=debt.segment[0], epoch=debt.segment[1], stream=debt.stream
                    ),
                    good_replicas=debt.good,
                    replicas=debt.replicas,
                    below_n_ms=debt.below_n_ms,
                    below_w_ms=debt.below_w_ms,
                    bytes=debt.bytes,
                    exposed=debt.exposed,
                )
                for debt in st.durability.worst(DURABILITY_WORST_MAX)
            ],
            bytes_below_n=st.durability.bytes_below_n,
            bytes_below_w=st.durability.bytes_below_w,
            pending_deletes=[
                master_pb2.PendingDelete(
                    stream=p.stream,
                    segment_epoch=p.segment_epoch,
                    removed_at_ms=p.removal_at_ms,
                    bytes=p.bytes,
                )
                for p in st.retention.pending_removals()
            ],
        )

    async def DrainStore(
        self, request: master_pb2.DrainStoreRequest, context: Context
    ) -> master_pb2.RepairPlan:
        def drain(now: int) -> master_pb2.RepairPlan:
            self._require(context, "DrainStore")
            if request.cancel:
                self.state.registry.set_draining(request.store_id, now, draining=False)
                return master_pb2.RepairPlan()
            if request.dry_run:
                refusal = self.state.registry.drain_refusal(request.store_id, now)
                if refusal:
                    raise errors.NotEnoughStores(f"drain of {request.store_id} refused: {refusal}")
            else:
                self.state.registry.set_draining(request.store_id, now)
            tasks, before, after = self.state.replicas.drain_preview(request.store_id, now)
            return self._plan(tasks, before, after)

        plan = await self._call(context, "DrainStore", drain)
        self.repairer.wake()
        return plan

    async def Rebalance(
        self, request: master_pb2.RebalanceRequest, context: Context
    ) -> master_pb2.RepairPlan:
        def plan(now: int) -> tuple[list[repair.Task], dict[str, int], dict[str, int]]:
            self._require(context, "Rebalance")
            return self.state.replicas.rebalance_plan(now, self.repairer.running)

        tasks, before, after = await self._call(context, "Rebalance", plan)
        if not request.dry_run:
            self.repairer.plan_moves(tasks)
        return self._plan(tasks, before, after)

    # ---- tokens ----

    async def CreateToken(
        self, request: master_pb2.CreateTokenRequest, context: Context
    ) -> master_pb2.CreateTokenReply:
        def create(now: int) -> master_pb2.CreateTokenReply:
            self._require(context, "CreateToken")
            token_id = secrets.token_hex(TOKEN_ID_CHARS // 2)
            while token_id in self.state.tokens:
                token_id = secrets.token_hex(TOKEN_ID_CHARS // 2)
            claims = self.state.issuer.create_token(
                token_id, request.tenant, int(request.role), request.ttl_ms, now
            )
            return master_pb2.CreateTokenReply(
                token=mint_token(self.state.signing_key, claims),
                token_id=claims.token_id,
                expires_at_ms=claims.expires_at_ms,
            )

        reply = await self._call(context, "CreateToken", create)
        log.info(
            "token created",
            extra={"reason": f"id {reply.token_id} tenant {request.tenant} role {request.role}"},
        )
        return reply

    async def RevokeToken(
        self, request: master_pb2.RevokeTokenRequest, context: Context
    ) -> master_pb2.RevokeTokenReply:
        def revoke(now: int) -> bool:
            self._require(context, "RevokeToken")
            return self.state.issuer.revoke_token(request.token_id, now)

        revoked = await self._call(context, "RevokeToken", revoke)
        log.info("token revoked", extra={"reason": f"id {request.token_id}: {revoked}"})
        return master_pb2.RevokeTokenReply(revoked=revoked)
