"""Registration and heartbeats to the master.

The store serves whether or not the master answers: registration retries forever with
backoff (`STORE_REGISTER`), a failed heartbeat is logged and retried at the next tick, and a
master that forgot the store (`register_again`) gets a new registration. Segments the
master lists in a heartbeat reply are deleted. Given several masters (`--master
a:7070,b:7070`), calls follow the active one (`protocol.master_calls`); a master that
becomes active loads every registered store from the metadata, so no new registration
is needed after a failover.

The master's replies also carry its authority: its signing keys and its token
revocations (the store's `StoreAuthority` takes them, and keeps them durably when they
change, before the next heartbeat), and the tenants' append quota. A new master (one
rebuilt from the stores) brings a new key: the store takes it as any key change. They
carry the certificates revoked too (`protocol.cert_revocations`: the whole list with
the registration, and with a heartbeat whose version differs from the store's), which
the store's server identity refuses from then on; kept in `revoked-certs.json` of its
data dir, so that a store restarted while the master is away still refuses them.

Identity: the store registers with its incarnation and the cluster id it keeps. A
master of another cluster refuses it: the store stops (`WrongCluster`). The first
registration's answer gives the cluster id to keep, and each registration's answer the
replicas an earlier incarnation of the store lost (`join`): until the store joined, it
takes no writes or seals (`SegmentStoreCore.check_takes_part`). A master rebuilding its
metadata answers without an id until it adopted the stores'; the store registers again.

Segment records: each heartbeat says which version of the master's record of each
segment the store keeps; the reply carries the records that differ, which the store
keeps beside their segments (`keep_records`) for a master that must rebuild its
metadata from the stores. So does the cluster view (every store the master knows and
the highest stream id it gave): the heartbeat says which version the store keeps, and
a reply whose view differs carries it, kept whole (`keep_cluster_view`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from tenacity import AsyncRetrying, retry_if_exception_type

from streamengine.protocol import auth, codec, identity, transport
from streamengine.protocol.backoff import STORE_REGISTER, tenacity_wait
from streamengine.protocol.cert_revocations import REVOKED_CERTS_MAX, CertRevocations
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.master_calls import AsyncMasters
from streamengine.protocol.private_files import write_private
from streamengine.protocol.segment_records import record_version
from streamengine.segment_store import metrics
from streamengine.segment_store.core.authority import AppendQuota, Deletion, StoreAuthority
from streamengine.segment_store.core.commands import Joined, SegmentKey
from streamengine.segment_store.core.errors import BadRequest, StoreUnavailable
from streamengine.segment_store.core.held_reports import HeldReport, HeldReports, Reported
from streamengine.segment_store.core.scrub import ScanResult
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.scrub import Scrubber
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

log = logging.getLogger("streamengine.store")

# Until the master says otherwise.
HEARTBEAT_MS_DEFAULT = 1000
# Bounds on what the master may ask for: never a busy loop, never silent for minutes.
HEARTBEAT_MS_MIN = 50
HEARTBEAT_MS_MAX = 30_000
MASTER_CALL_TIMEOUT_S = 2.0


class WrongCluster(Exception):
    """The master belongs to another cluster than the one this store's data is of."""


@dataclass(frozen=True)
class StoreIdentity:
    store_id: str
    address: str
    zone: str
    data_dir: Path
    # Where the data plane serves (Write), `host:port`, as the master hands it out.
    data_address: str = ""


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class MasterLink:
    def __init__(
        self,
        master_address: str,
        identity: StoreIdentity,
        core: SegmentStoreCore,
        delete_segment: Callable[[SegmentKey], Awaitable[bool]],
        authority: StoreAuthority,
        keep_authority: Callable[[], Awaitable[None]],
        quota: AppendQuota,
        members: transport.Transport = transport.PLAINTEXT,
        master_identity: identity.ServerIdentity | None = None,
        scrubber: Scrubber | None = None,
        keep_records: Callable[[list[tuple[SegmentKey, bytes]]], Awaitable[int]] | None = None,
        join: Callable[[str, Sequence[SegmentKey]], Awaitable[Joined]] | None = None,
        keep_cluster_view: Callable[[bytes], Awaitable[None]] | None = None,
        raise_acked: Callable[[list[tuple[SegmentKey, int]]], Awaitable[int]] | None = None,
    ) -> None:
        self.master_address = master_address
        self.identity = identity
        self.core = core
        self.delete_segment = delete_segment
        self.authority = authority
        self.keep_authority = keep_authority
        self.quota = quota
        # Under TLS the store's node certificate: the master takes registrations and
        # heartbeats only from the store its certificate names.
        self.members = members
        # ... and the store takes what the master's replies say (delete lists, signing
        # keys, revocations) only signed by the master's certificate.
        self.master_identity = master_identity
        self.interval_s = HEARTBEAT_MS_DEFAULT / 1000
        # As the master last said; refused by this server's identity (`take_revocations`).
        self.cert_revocations = CertRevocations()
        self._adopt_cert_revocations(read_revoked_certs(identity.data_dir / REVOKED_CERTS_FILE))
        self.registered = False
        # What each heartbeat reports of the segments held: whole, or what changed.
        self.held_reports = HeldReports()
        # What the scrub read back goes with the heartbeats; the master asks for checks.
        self.scrubber = scrubber
        self.keep_records = keep_records
        self.join = join
        self.keep_cluster_view = keep_cluster_view
        # Acked indexes of leaders that let go, which the master passes on.
        self.raise_acked = raise_acked
        view = core.catalog.cluster_view()
        # The version of the cluster view the store keeps (0: none).
        self.cluster_view_version = record_version(view) if view else 0

    async def run(self) -> None:
        channels: dict[str, grpc.aio.Channel] = {}

        def channel(address: str) -> grpc.aio.Channel:
            if address not in channels:
                channels[address] = self.members.aio_channel(address)
            return channels[address]

        stub = AsyncMasters(self.master_address, channel).stub
        try:
            while True:
                try:
                    if not self.registered:
                        await self._register(stub)
                    await self._heartbeat(stub)
                except WrongCluster:
                    raise
                except grpc.aio.AioRpcError as error:
                    metrics.HEARTBEAT_FAILURES.inc()
                    log.info("heartbeat to master %s failed: %s", self.master_address, error.code())
                except StoreUnavailable as error:
                    # A full disk: the store cannot keep what the master said (its
                    # cluster id at a join, records, a view) and goes on serving reads.
                    metrics.HEARTBEAT_FAILURES.inc()
                    log.warning("cannot keep the master %s's reply: %s", self.master_address, error)
                except Exception:
                    # Whatever went wrong with the master or a delete it asked for, the
                    # store goes on serving; the next heartbeat tries again.
                    metrics.HEARTBEAT_FAILURES.inc()
                    log.exception("heartbeat to master %s failed", self.master_address)
                await asyncio.sleep(self.interval_s)
        finally:
            for open_channel in channels.values():
                await open_channel.close()

    async def _register(self, stub: master_pb2_grpc.MasterAsyncStub) -> None:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(grpc.aio.AioRpcError),
            wait=tenacity_wait(STORE_REGISTER, random.random),
            before_sleep=lambda state: metrics.HEARTBEAT_FAILURES.inc(),
            reraise=True,
        ):
            with attempt:
                call = stub.RegisterStore(
                    master_pb2.RegisterStoreRequest(
                        store_id=self.identity.store_id,
                        address=self.identity.address,
                        zone=self.identity.zone,
                        free_bytes=_free_bytes(self.identity.data_dir),
                        incarnation=self.core.catalog.incarnation(),
                        cluster_id=self.core.catalog.cluster_id(),
                        data_address=self.identity.data_address,
                    ),
                    timeout=MASTER_CALL_TIMEOUT_S,
                )
                try:
                    reply = await call
                except grpc.aio.AioRpcError as error:
                    if _refused_for_good(error):
                        raise WrongCluster(error.details() or "refused by the master") from None
                    raise
                trailing = await call.trailing_metadata()
        interval_ms = reply.heartbeat_interval_ms or HEARTBEAT_MS_DEFAULT
        self.interval_s = min(max(interval_ms, HEARTBEAT_MS_MIN), HEARTBEAT_MS_MAX) / 1000
        if not self._from_the_master(reply, "register", trailing):
            return
        await self._take_authority(reply.signing_public_keys, None, None)
        self._take_cert_revocations(reply.revoked_certificates)
        if not reply.cluster_id:
            log.info("master %s has no cluster id yet (rebuilding)", self.master_address)
            return
        if self.join is not None:
            lost = [SegmentKey(s.stream_id, s.epoch) for s in reply.lost_segments]
            joined = await self.join(reply.cluster_id, lost)
            if joined.lost:
                log.warning(
                    "%d replicas were lost with an earlier incarnation of this store",
                    len(joined.lost),
                )
        self.registered = True
        self.held_reports.forget()
        log.info("registered with master %s as %s", self.master_address, self.identity.store_id)

    def _from_the_master(
        self,
        reply: master_pb2.StoreHeartbeatReply | master_pb2.RegisterStoreReply,
        kind: str,
        trailing: Iterable[Any] | None,
    ) -> bool:
        """Whether the master's certificate signed this reply for this store (always true
        over plaintext, which proves nothing either way): only then does the store take
        its delete list, signing keys and revocations."""
        if self.master_identity is None:
            return True
        audience = identity.reply_audience(kind, self.identity.store_id, reply)
        try:
            signer = self.master_identity.principal(
                identity.metadata_dict(trailing), wall_ms(), audience
            )
        except identity.ProofRefused as refusal:
            signer, reason = auth.ANONYMOUS, str(refusal)
        else:
            reason = "unsigned" if signer is auth.ANONYMOUS else f"signed by a {signer.kind.value}"
        if signer.kind is auth.PrincipalKind.MASTER:
            return True
        metrics.HEARTBEAT_FAILURES.inc()
        log.warning("ignoring a %s reply not from the master's certificate: %s", kind, reason)
        return False

    async def _heartbeat(self, stub: master_pb2_grpc.MasterAsyncStub) -> None:
        scrubbed = self.scrubber.take_reports() if self.scrubber is not None else {}
        try:
            await self._send_heartbeat(stub, scrubbed)
        except BaseException:
            if self.scrubber is not None:
                self.scrubber.give_back(scrubbed)
            raise

    async def _send_heartbeat(
        self, stub: master_pb2_grpc.MasterAsyncStub, scrubbed: dict[SegmentKey, ScanResult]
    ) -> None:
        # A damaged segment is reported with acked index 0: the master repairs it.
        metas = self.core.catalog.reported_metas()
        catalog = self.core.catalog
        held = {
            s: Reported(
                m.fence, m.acked_index, m.last_index, m.payload_bytes, catalog.record_version(s)
            )
            for s, m in metas.items()
        }
        report = self.held_reports.report(held, monotonic_ms())
        request = master_pb2.StoreHeartbeatRequest(
            store_id=self.identity.store_id,
            address=self.identity.address,
            zone=self.identity.zone,
            used_bytes=sum(m.payload_bytes for m in metas.values()),
            free_bytes=_free_bytes(self.identity.data_dir),
            segments=held_segments(report),
            delta=not report.full,
            removed=[
                entry_pb2.SegmentId(stream_id=s.stream_id, epoch=s.epoch) for s in report.removed
            ],
            revocations_version=self.authority.revocations.version,
            certificate_revocations_version=self.cert_revocations.version,
            cluster_view_version=self.cluster_view_version,
            scrubbed=[scrub_report(s, result) for s, result in sorted(scrubbed.items())],
        )
        call = stub.StoreHeartbeat(request, timeout=MASTER_CALL_TIMEOUT_S)
        reply = await call
        if reply.register_again:
            self.registered = False
            return
        if not self._from_the_master(reply, "heartbeat", await call.trailing_metadata()):
            return
        self.held_reports.answered(report, monotonic_ms(), reply.deltas_taken, reply.report_full)
        if self.scrubber is not None:
            for segment in reply.scrub_first:
                if segment.stream_id and segment.epoch:
                    self.scrubber.check_first(SegmentKey(segment.stream_id, segment.epoch))
        self.quota.bytes_per_s = reply.tenant_append_bytes_per_s
        self.authority.deleted_streams = {
            d.stream_id: Deletion(d.deleted_until_ms, d.fenced_through_epoch)
            for d in reply.deleted_streams
        }
        revoked = [(t.token_id, t.expires_at_ms) for t in reply.revoked_tokens]
        await self._take_authority(reply.signing_public_keys, reply.revocations_version, revoked)
        if reply.certificate_revocations_version != self.cert_revocations.version:
            self._take_cert_revocations(reply.revoked_certificates)
        if reply.HasField("cluster_view") and self.keep_cluster_view is not None:
            await self._keep_cluster_view(reply.cluster_view)
        if reply.segment_records and self.keep_records is not None:
            records = [
                (SegmentKey(r.id.stream_id, r.id.epoch), r.SerializeToString(deterministic=True))
                for r in reply.segment_records
            ]
            try:
                await self.keep_records(records)
            except StoreUnavailable as error:
                # A full or read-only disk: the versions reported stay old, and the
                # master sends the records again.
                log.info("cannot keep %d segment records now: %s", len(records), error)
        if reply.leader_acked and self.raise_acked is not None:
            raised = [
                (SegmentKey(a.segment.stream_id, a.segment.epoch), a.acked_index)
                for a in reply.leader_acked
            ]
            try:
                await self.raise_acked(raised)
            except StoreUnavailable as error:
                log.info("cannot raise %d acked indexes now: %s", len(raised), error)
            except BadRequest as error:
                log.warning("ignoring the master's acked indexes: %s", error)
        for segment in reply.delete_segments:
            key = SegmentKey(segment.stream_id, segment.epoch)
            if key.stream_id and key.epoch:
                try:
                    existed = await self.delete_segment(key)
                except StoreUnavailable as error:
                    # A full or read-only disk: the master asks again at a later beat.
                    log.info("cannot delete segment %s/%s now: %s", key.stream_id, key.epoch, error)
                    return
                log.info(
                    "deleted segment %s/%s at the master's request (held: %s)",
                    key.stream_id,
                    key.epoch,
                    existed,
                )

    async def _keep_cluster_view(self, view: entry_pb2.ClusterView) -> None:
        assert self.keep_cluster_view is not None
        raw = view.SerializeToString(deterministic=True)
        if not raw or record_version(raw) == self.cluster_view_version:
            return
        try:
            await self.keep_cluster_view(raw)
        except (StoreUnavailable, BadRequest) as error:
            # A full or read-only disk (the version reported stays old, and the master
            # sends the view again), or a view too large to keep.
            log.info("cannot keep the cluster view now: %s", error)
            return
        self.cluster_view_version = record_version(raw)

    async def _take_authority(
        self,
        keys: Sequence[bytes],
        revocations_version: int | None,
        revoked: list[tuple[str, int]] | None,
    ) -> None:
        """What the master trusts, taken and kept before it is relied on after a restart
        (a crash before it is kept loses nothing the master will not say again)."""
        version = self.authority.revocations.version
        if revocations_version is not None and revocations_version != version:
            version = revocations_version
        else:
            revoked = None  # the same version: the list we hold is the master's
        if self.authority.update(keys, version, revoked, wall_ms()):
            await self.keep_authority()
            log.info(
                "master authority taken: %d keys, %d revocations (version %d)",
                len(self.authority.master_keys),
                len(self.authority.revocations),
                self.authority.revocations.version,
            )

    def _take_cert_revocations(self, revoked: Iterable[master_pb2.RevokedCertificate]) -> None:
        """The master's whole list of revoked certificates, refused from now on (an entry
        no certificate can have is left out, with a warning)."""
        entries = []
        for message in revoked:
            try:
                entries.append(codec.revoked_cert_from_pb(message))
            except ValueError as error:
                log.warning("ignoring a revoked certificate the master sent: %s", error)
        taken = CertRevocations.of(entries[:REVOKED_CERTS_MAX])
        if taken != self.cert_revocations:
            log.info("certificates revoked: %d", len(taken.revoked))
            write_revoked_certs(self.identity.data_dir / REVOKED_CERTS_FILE, taken)
        self._adopt_cert_revocations(taken)

    def _adopt_cert_revocations(self, revocations: CertRevocations) -> None:
        self.cert_revocations = revocations
        identity.take_revocations(revocations)


REVOKED_CERTS_FILE = "revoked-certs.json"


class RevokedCertsDamaged(Exception):
    """The kept list of revoked certificates does not parse: the store does not start
    (it cannot tell whom to refuse)."""


def write_revoked_certs(path: Path, revocations: CertRevocations) -> None:
    entries = [json_format.MessageToDict(codec.revoked_cert_to_pb(r)) for r in revocations.revoked]
    write_private(path, json.dumps(entries).encode())


def read_revoked_certs(path: Path) -> CertRevocations:
    """What `write_revoked_certs` kept; none when there is no such file. A file that
    does not parse is refused at start (the store cannot tell whom to refuse)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return CertRevocations()
    try:
        entries = [
            codec.revoked_cert_from_pb(json_format.ParseDict(e, master_pb2.RevokedCertificate()))
            for e in json.loads(raw)
        ]
    except (ValueError, TypeError, json_format.ParseError) as error:
        raise RevokedCertsDamaged(
            f"{path} is damaged ({error}): remove it, the master sends the list again"
        ) from None
    return CertRevocations.of(entries[:REVOKED_CERTS_MAX])


def held_segments(report: HeldReport) -> list[master_pb2.HeldSegment]:
    return [
        master_pb2.HeldSegment(
            segment=entry_pb2.SegmentId(stream_id=s.stream_id, epoch=s.epoch),
            fence=r.fence,
            acked_index=r.acked_index,
            last_index=r.last_index,
            bytes=r.bytes,
            record_version=r.record_version,
        )
        for s, r in sorted(report.changed.items())
    ]


def _refused_for_good(error: BaseException) -> bool:
    """The master refused the registration for a reason retrying does not change."""
    return (
        isinstance(error, grpc.aio.AioRpcError)
        and error.code() == grpc.StatusCode.FAILED_PRECONDITION
    )


def scrub_report(segment: SegmentKey, result: ScanResult) -> master_pb2.ScrubReport:
    report = master_pb2.ScrubReport(
        segment=entry_pb2.SegmentId(stream_id=segment.stream_id, epoch=segment.epoch),
        final_index=result.final_index,
        damaged=result.damaged,
        detail=result.detail,
    )
    if result.certificate is not None:
        report.certificate.CopyFrom(codec.certificate_to_pb(result.certificate))
    return report
