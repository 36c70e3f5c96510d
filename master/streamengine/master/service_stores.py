"""The Master service's RPCs for the stores: registration and heartbeats.

A heartbeat's reply carries what the store must do (deletes, replicas to check first,
segment records, the cluster view, token and certificate revocations); under TLS the
master signs it (`_sign_reply`).
"""

from __future__ import annotations

from streamengine.master.core import integrity
from streamengine.master.core.model import Held, SegmentKey
from streamengine.master.records import ClusterViews, RecordEncodings
from streamengine.master.service_calls import Context, Handlers, MasterCalls, log
from streamengine.master.stores import Registered
from streamengine.master.unrecorded import every_store_reported
from streamengine.protocol import codec, identity
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.logs import segment_fields
from streamengine.v1 import entry_pb2, master_pb2

# What a store's heartbeat decided: the segments it may delete, whether it must report
# everything, the record versions to check, the leaders' acked indexes it is owed.
_Beaten = tuple[list[SegmentKey], bool, dict[SegmentKey, int], list[tuple[SegmentKey, int]]]


class StoreHandlers(Handlers):
    """RegisterStore and StoreHeartbeat."""

    RPCS = (
        "RegisterStore",
        "StoreHeartbeat",
    )

    def __init__(self, calls: MasterCalls) -> None:
        super().__init__(calls)
        # Segment records as sent to the stores (`master.records`).
        self.records = RecordEncodings()
        # The cluster view every store keeps (`master.records.ClusterViews`).
        self.views = ClusterViews()

    async def RegisterStore(
        self, request: master_pb2.RegisterStoreRequest, context: Context
    ) -> master_pb2.RegisterStoreReply:
        def register(now: int) -> Registered:
            self.calls.require_store(context, "RegisterStore", request.store_id)
            self.state.keys.retire_due(now)
            return self.state.registry.register_store(
                request.store_id,
                request.address,
                request.zone,
                request.free_bytes,
                now,
                request.incarnation,
                request.cluster_id,
                request.data_address,
            )

        registered = await self.calls.call(context, "RegisterStore", register)
        if registered.lost:
            log.warning(
                "store %s registered: %d replicas lost with an earlier incarnation",
                request.store_id,
                len(registered.lost),
            )
        reply = master_pb2.RegisterStoreReply(
            heartbeat_interval_ms=registered.heartbeat_ms,
            signing_public_keys=self.state.keys.public_keys(),
            cluster_id=registered.cluster_id,
            lost_segments=[
                entry_pb2.SegmentId(stream_id=stream_id, epoch=epoch)
                for stream_id, epoch in registered.lost
            ],
        )
        certs = self.state.revoker.current(self.calls.clock_ms())
        reply.certificate_revocations_version = certs.version
        reply.revoked_certificates.extend(map(codec.revoked_cert_to_pb, certs.revoked))
        self._sign_reply(context, "register", request.store_id, reply)
        return reply

    async def StoreHeartbeat(
        self, request: master_pb2.StoreHeartbeatRequest, context: Context
    ) -> master_pb2.StoreHeartbeatReply:
        # One pass over what may be ten thousand reports, each field read once.
        held: dict[SegmentKey, Held] = {}
        # Streams the store keeps a record of (a delta names those that changed: the
        # others were in an earlier report).
        recorded: set[int] = set()
        for h in request.segments:
            segment = h.segment
            held[segment.stream_id, segment.epoch] = Held(
                h.fence, h.acked_index, h.last_index, h.bytes, h.record_version
            )
            if h.record_version:
                recorded.add(segment.stream_id)
        removed = tuple((s.stream_id, s.epoch) for s in request.removed) if request.delta else None

        def beat(now: int) -> _Beaten | None:
            """The segments to delete, whether the delta did not apply (the store must
            report everything), the record versions to check and the leaders' acked
            indexes the store is owed; None: it must register again."""
            self.calls.require_store(context, "StoreHeartbeat", request.store_id)
            # Stores heartbeat every second: keys are retired within one of their time.
            self.state.keys.retire_due(now)
            registry = self.state.registry
            if removed is not None and not registry.takes_delta(request.store_id):
                if request.store_id not in self.state.stores:
                    return None
                answer: _Beaten = ([], True, {}, [])
            else:
                deletes = registry.store_heartbeat(
                    request.store_id, request.used_bytes, request.free_bytes, held, now, removed
                )
                if deletes is None:
                    return None
                checked = registry.judged_held(request.store_id, now, held)
                versions = {key: h.record_version for key, h in checked.items()}
                live = self.state.live.get(request.store_id)
                owed = (
                    self.state.leader_acked.to_tell(request.store_id, live.held)
                    if live is not None and live.whole
                    else []
                )
                answer = (deletes, False, versions, owed)
                self.state.unrecorded.note_recorded(recorded)
            # Judged in the call, so a commit the metadata refuses (a master cut off
            # from etcd) is UNAVAILABLE and the store sends its reports again, not
            # UNKNOWN with a traceback (the fault suite's S17).
            for scrubbed in request.scrubbed:
                self._replica_reported(request.store_id, scrubbed)
            return answer

        answer = await self.calls.call(context, "StoreHeartbeat", beat)
        if answer is None:
            return master_pb2.StoreHeartbeatReply(register_again=True)
        deletes, report_full, versions, owed = answer
        revocations = self.state.issuer.current_revocations(self.calls.clock_ms())
        reply = master_pb2.StoreHeartbeatReply(
            deltas_taken=True,
            report_full=report_full,
            delete_segments=[
                entry_pb2.SegmentId(stream_id=s, epoch=e, stream=self.state.stream_name(s))
                for s, e in deletes
            ],
            signing_public_keys=self.state.keys.public_keys(),
            revocations_version=revocations.version,
            tenant_append_bytes_per_s=self.calls.tenant_append_bytes_per_s,
            scrub_first=[
                entry_pb2.SegmentId(stream_id=s, epoch=e, stream=self.state.stream_name(s))
                for s, e in self.state.integrity.take_scrub_first(request.store_id)
            ],
            deleted_streams=[
                master_pb2.DeletedStream(
                    stream_id=r.stream_id,
                    deleted_until_ms=r.deleted_until_ms,
                    fenced_through_epoch=r.epoch,
                )
                for r in map(self.state.streams.__getitem__, sorted(self.state.deleted))
            ],
            segment_records=self.records.to_send(
                request.store_id,
                versions,
                self.state.segments,
                lambda stream_id: self.state.streams.get(self.state.stream_name(stream_id)),
            ),
            leader_acked=[
                master_pb2.LeaderAcked(
                    segment=entry_pb2.SegmentId(
                        stream_id=s, epoch=e, stream=self.state.stream_name(s)
                    ),
                    acked_index=acked,
                )
                for (s, e), acked in owed
            ],
        )
        if request.revocations_version != revocations.version:
            reply.revoked_tokens.extend(
                master_pb2.RevokedToken(token_id=token_id, expires_at_ms=expires_at_ms)
                for token_id, expires_at_ms in revocations.items()
            )
        certs = self.state.revoker.current(self.calls.clock_ms())
        reply.certificate_revocations_version = certs.version
        if request.certificate_revocations_version != certs.version:
            reply.revoked_certificates.extend(map(codec.revoked_cert_to_pb, certs.revoked))
        state = self.state
        reported = every_store_reported(
            state.live.values(), state.store_timeout_ms, self.calls.clock_ms()
        )
        if not self.calls.rebuilding and reported:
            # A rebuilding master knows nothing yet, nor a master whose stores have not
            # all said what they keep since it started: the view the store keeps stays
            # what a rebuild would read.
            view = self.views.current(
                state.stores,
                state.next_stream_id - 1,
                (state.loaded, state.unrecorded.changes),
                lambda: state.unrecorded.newest(lambda i: state.streams[state.names[i]]),
            )
            if request.cluster_view_version != view.version:
                reply.cluster_view.CopyFrom(view.message)
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
        judgement = self.state.integrity.replica_reported(
            store_id, key, report, self.calls.clock_ms()
        )
        checks = self.state.checks.get(key)
        if judgement.certificate is not None:
            self.calls.metrics.certificates.labels(integrity.REPLICAS).inc()
            contradicted = had is not None and had.certificate is not None
            (log.error if contradicted else log.info)(judgement.note, extra=fields)
        if judgement.bad:
            self.calls.metrics.replicas_bad.inc(len(judgement.bad))
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
        self.calls.metrics.replica_checks.labels(outcome).inc()

    def _sign_reply(
        self,
        context: Context,
        kind: str,
        store_id: str,
        reply: master_pb2.RegisterStoreReply | master_pb2.StoreHeartbeatReply,
    ) -> None:
        """Under TLS, the master's certificate proof on a reply to a store: the store
        takes its delete list, signing keys and revocations only from the master."""
        if self.calls.signer is not None:
            audience = identity.reply_audience(kind, store_id, reply)
            context.set_trailing_metadata(
                self.calls.signer.metadata(audience, self.calls.clock_ms())
            )
