"""The SegmentStore gRPC service: a thin adapter from the wire to `SegmentStoreCore`.

Every mutation goes through the group committer; reads run in worker threads. One
table (`_STATUS`) maps the core's errors to gRPC statuses; a refused request changes
nothing.

Every call first resolves its caller (`protocol.callers`) and is authorized
(`protocol.auth.authorize`) with the tenant of the stream it touches: for Write and
Seal the tenant of their grant, which must also list the segment and this store
(`segment_store.authority`); for reads the tenant this store keeps for the stream.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc

from streamengine.protocol import codec, identity, transport
from streamengine.protocol.auth import Denial, Principal, authorize
from streamengine.protocol.callers import Callers
from streamengine.protocol.certificate import MalformedCertificate
from streamengine.protocol.clock import monotonic_ms, wall_ms
from streamengine.protocol.entry import (
    CorruptEntry,
    PackedEntries,
    first_corrupt_value,
)
from streamengine.protocol.limits import (
    EVENT_BYTES_MAX,
    GRPC_MESSAGE_BYTES_MAX,
    INDEX_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
)
from streamengine.protocol.logs import segment_fields
from streamengine.protocol.segment_records import RECORD_BYTES_MAX
from streamengine.protocol.signing import NoVerifyingKey
from streamengine.protocol.status import (
    DELETED_UNTIL_METADATA_KEY,
    FENCE_METADATA_KEY,
    TOO_LARGE_METADATA_KEY,
)
from streamengine.segment_store import metrics
from streamengine.segment_store.copy import CopySourceUnavailable, SegmentCopy
from streamengine.segment_store.core import tail
from streamengine.segment_store.core.authority import (
    AppendQuota,
    CallerRefused,
    CallerUnproven,
    GrantRefused,
    NoSigningKeyYet,
    StoreAuthority,
    StreamDeleted,
    WriteStreamGrants,
)
from streamengine.segment_store.core.commands import (
    AuthorityKept,
    DeleteCommand,
    DeleteResult,
    JoinCommand,
    Joined,
    KeepAuthorityCommand,
    KeepRecordsCommand,
    Outcome,
    RecordsKept,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
    check_epoch,
    check_segment,
)
from streamengine.segment_store.core.errors import (
    BadRequest,
    BelowFence,
    CopyMismatch,
    CopyRefused,
    NotJoined,
    ReplicaLost,
    SegmentNotFound,
    StoredCopyCorrupt,
    StoreError,
    StoreUnavailable,
    TooLarge,
)
from streamengine.segment_store.core.keys import SegmentMeta, entry_index
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.group_commit import GroupCommitter, SegmentWatch
from streamengine.v1 import entry_pb2, segment_store_pb2, segment_store_pb2_grpc

log = logging.getLogger("streamengine.store")
T = TypeVar("T")

# Replies a Write stream may have in flight: past it the store stops reading that
# stream, and HTTP/2 flow control holds the leader back.
WRITE_STREAM_INFLIGHT_MAX = 64
# Read replies: entries and bytes per message, far below the gRPC message limit.
READ_REPLY_ENTRIES_DEFAULT = 256
READ_REPLY_BYTES_MAX = 4 << 20
# A packed Read reply: no message per entry. Sized so that a reply of small events
# makes one whole Arrow batch for Spark (ARROW_BATCH_ROWS), and far below the limit.
PACKED_REPLY_ENTRIES_MAX = 65536
PACKED_REPLY_BYTES_MAX = 8 << 20
# Subscribe: how long the first message may take; the live tail's own limits and
# decisions are in `segment_store.tail`.
SUBSCRIBE_START_TIMEOUT_S = 10.0
SUBSCRIBE_BUFFER_BATCHES_DEFAULT = tail.BUFFER_MESSAGES_DEFAULT
SUBSCRIBE_STALL_MS_DEFAULT = tail.STALL_MS_DEFAULT

assert READ_REPLY_BYTES_MAX <= WRITE_BATCH_BYTES_MAX
# A packed reply is cut once it reaches its limit, so it passes it by at most one value,
# and carries a length (a few bytes) per entry.
assert (
    PACKED_REPLY_BYTES_MAX + EVENT_BYTES_MAX + 8 * PACKED_REPLY_ENTRIES_MAX
    <= GRPC_MESSAGE_BYTES_MAX
)


# A Write stream with no request answered-but-unread and none arriving for this long is
# closed: an abandoned stream holds no server resources. A leader that appends sends far
# more often; one that idles reconnects in one pause (`client.store_link`), well within
# the time after which it would count the store as lost.
WRITE_STREAM_IDLE_MS_DEFAULT = 60_000


@dataclass(frozen=True)
class ServiceConfig:
    subscribe_buffer_batches: int = SUBSCRIBE_BUFFER_BATCHES_DEFAULT
    subscribe_stall_ms: int = SUBSCRIBE_STALL_MS_DEFAULT
    write_stream_idle_ms: int = WRITE_STREAM_IDLE_MS_DEFAULT


class _Refused(Exception):
    """A request refused with a status (the service's own, beyond the core's errors)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(details)


_STATUS: dict[type[Exception], grpc.StatusCode] = {
    BelowFence: grpc.StatusCode.FAILED_PRECONDITION,
    CopyRefused: grpc.StatusCode.FAILED_PRECONDITION,
    CopyMismatch: grpc.StatusCode.DATA_LOSS,
    CopySourceUnavailable: grpc.StatusCode.UNAVAILABLE,
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SegmentNotFound: grpc.StatusCode.NOT_FOUND,
    StoreUnavailable: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CorruptEntry: grpc.StatusCode.DATA_LOSS,
    StoredCopyCorrupt: grpc.StatusCode.DATA_LOSS,
    GrantRefused: grpc.StatusCode.PERMISSION_DENIED,
    CallerRefused: grpc.StatusCode.PERMISSION_DENIED,
    CallerUnproven: grpc.StatusCode.UNAUTHENTICATED,
    NoSigningKeyYet: grpc.StatusCode.UNAVAILABLE,
    StreamDeleted: grpc.StatusCode.FAILED_PRECONDITION,
    # No answer about the segment, as from a store that is down: a recovery decides
    # from the others, a writer goes on with them.
    NotJoined: grpc.StatusCode.UNAVAILABLE,
    ReplicaLost: grpc.StatusCode.UNAVAILABLE,
}


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any],
    error: Exception,
    segment: entry_pb2.SegmentId | None = None,
) -> NoReturn:
    if isinstance(error, _Refused):
        await context.abort(error.code, error.details)
    code = next((c for t, c in _STATUS.items() if isinstance(error, t)), grpc.StatusCode.INTERNAL)
    trailing: tuple[tuple[str, str], ...] = ()
    fields = segment_fields(segment.stream, segment.epoch) if segment is not None else {}
    if isinstance(error, StreamDeleted):
        trailing = ((DELETED_UNTIL_METADATA_KEY, str(error.deleted_until_ms)),)
        log.info("refused: %s", error, extra=fields)
    elif isinstance(error, BelowFence):
        trailing = ((FENCE_METADATA_KEY, str(error.fence)),)
        log.info("refused below the fence: %s", error, extra=fields | {"fence": error.fence})
    elif isinstance(error, BadRequest):
        if isinstance(error, TooLarge):
            trailing = ((TOO_LARGE_METADATA_KEY, str(error.bytes_max)),)
        metrics.BAD_REQUESTS.inc()
        log.info("bad request: %s", error, extra=fields)
    elif isinstance(error, GrantRefused | CallerRefused):
        metrics.DENIED.inc()
        log.info("denied: %s", error, extra=fields)
    elif code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL):
        log.error("%s: %s", code.name, error, extra=fields)
    await context.abort(code, str(error), trailing_metadata=trailing)


# Segments per ListSegmentRecords reply: each at most `RECORD_BYTES_MAX` bytes, a reply
# stays well under the gRPC message limit.
SEGMENT_RECORDS_PER_PAGE = 128
assert SEGMENT_RECORDS_PER_PAGE * (RECORD_BYTES_MAX + 1024) < GRPC_MESSAGE_BYTES_MAX


def segment_key(segment: entry_pb2.SegmentId) -> SegmentKey:
    key = SegmentKey(segment.stream_id, segment.epoch)
    check_segment(key)
    return key


def batch_of(request: segment_store_pb2.WriteRequest) -> PackedEntries:
    """The entries of a Write; values whose lengths do not add up are bad input. The
    count is checked before any value is cut out: an oversized batch costs nothing."""
    if len(request.value_lengths) > WRITE_BATCH_ENTRIES_MAX:
        raise BadRequest(
            f"batch of {len(request.value_lengths)} entries is over {WRITE_BATCH_ENTRIES_MAX}"
        )
    try:
        return PackedEntries.from_wire(
            request.first_index, request.packed_values, request.value_lengths
        )
    except CorruptEntry as error:
        raise BadRequest(str(error)) from None


def _segment_pb(segment: SegmentKey) -> entry_pb2.SegmentId:
    return entry_pb2.SegmentId(stream_id=segment.stream_id, epoch=segment.epoch)


class SegmentStoreService(segment_store_pb2_grpc.SegmentStoreServicer):
    def __init__(
        self,
        core: SegmentStoreCore,
        committer: GroupCommitter,
        watch: SegmentWatch,
        config: ServiceConfig,
        authority: StoreAuthority,
        members: transport.Transport = transport.PLAINTEXT,
    ) -> None:
        self.core = core
        self.committer = committer
        self.watch = watch
        self.config = config
        self.authority = authority
        self.callers = Callers(authority.verifier, lambda: authority.revocations)
        # The master tells the rate with every heartbeat reply (`MasterLink`).
        self.quota = AppendQuota(0)
        # How this store reaches its peers (copies): its node certificate under TLS.
        self.members = members
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="store-read")

    # ---- who calls ----

    def caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        """The call's principal; raises CallerUnproven (a certificate proof that does not
        hold, a token that is not valid: forged, expired, revoked), NoSigningKeyYet."""
        try:
            principal = self.callers.principal(context)
        except NoVerifyingKey as error:
            raise NoSigningKeyYet(str(error)) from None
        except identity.ProofRefused as refusal:
            raise CallerUnproven(str(refusal)) from None
        if isinstance(principal, Denial):
            raise CallerUnproven(principal.reason)
        return principal

    def require(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, tenant: str = ""
    ) -> Principal:
        """The caller, when it may call `method` on `tenant`'s data; else raises
        CallerRefused."""
        principal = self.caller(context)
        denial = authorize(principal, f"SegmentStore/{method}", tenant)
        if denial is not None:
            raise CallerRefused(denial.reason)
        return principal

    def require_reader(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, segment: SegmentKey
    ) -> None:
        self.require(context, method, self.core.catalog.tenant_of(segment.stream_id))

    async def keep_authority(self) -> None:
        """Write what the store now trusts (`self.authority`) durably."""
        record = self.authority.record().encode()
        outcome = await self.committer.submit(KeepAuthorityCommand(record))
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, AuthorityKept)

    async def join(self, cluster_id: str, lost: Sequence[SegmentKey]) -> Joined:
        """Keep the cluster id the master answered a registration with, and mark the
        replicas the store's earlier incarnation lost (`JoinCommand`)."""
        outcome = await self.committer.submit(JoinCommand(cluster_id, tuple(lost)))
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, Joined)
        return outcome

    async def keep_records(self, records: Sequence[tuple[SegmentKey, bytes]]) -> int:
        """Keep the master's records of segments this store holds, durably; returns how
        many were kept (a record of a segment not held is dropped)."""
        outcome = await self.committer.submit(KeepRecordsCommand(tuple(records)))
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, RecordsKept)
        return len(outcome.kept)

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)

    def read_entries(
        self,
        segment: SegmentKey,
        first: int,
        upper: int,
        acked_only: bool,
        limit: int,
        verify: bool = True,
    ) -> list[entry_pb2.Entry]:
        """One reply's worth of wire entries (off the event loop: it reads RocksDB).
        `verify=False` where the receiver checks every crc itself (followers do; RocksDB's
        block checksums still guard the disk)."""
        reader = self.core.reader
        with reader.reading(segment):
            if acked_only:
                meta = self.core.catalog.meta(segment)
                upper = min(upper, meta.acked_index) if meta is not None else upper
                # Every acked index is held (acked <= matched): a run, read by value alone.
                values = reader.read_run(segment, first, upper, limit, READ_REPLY_BYTES_MAX)
                return codec.entries_from_values(range(first, first + len(values)), values, verify)
            rows = reader.read_rows(segment, first, upper, False, limit, READ_REPLY_BYTES_MAX)
            indexes = [entry_index(key) for key, _ in rows]
            return codec.entries_from_values(indexes, [value for _, value in rows], verify)

    async def in_thread(self, function: Callable[[], T]) -> T:
        """Run a read of the KV off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, function)

    # ---- Write ----

    # Replies go out through `context.write` (grpc.aio allows it for streaming handlers).
    async def Write(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[segment_store_pb2.WriteRequest],
        context: grpc.aio.ServicerContext[
            segment_store_pb2.WriteRequest, segment_store_pb2.WriteReply
        ],
    ) -> None:
        try:
            grants = WriteStreamGrants(self.authority, self.caller(context))
        except StoreError as error:
            await _abort(context, error)
        inflight = asyncio.Semaphore(WRITE_STREAM_INFLIGHT_MAX)
        # Tickets, not requests, wait for their replies: a refused batch's entries are
        # freed at once, so memory is the committer's queue plus one message per stream.
        answers: asyncio.Queue[tuple[_Ticket, _Admitted] | None] = asyncio.Queue()

        idle_s = self.config.write_stream_idle_ms / 1000
        unanswered = 0  # requests read whose reply is not written yet
        last_activity = time.monotonic()

        async def read_requests() -> None:
            nonlocal unanswered, last_activity
            try:
                # No timer per request: `close_when_idle` watches the clock apart.
                async for request in request_iterator:
                    last_activity = time.monotonic()
                    await inflight.acquire()
                    unanswered += 1
                    answers.put_nowait((_Ticket.of(request), self._admit(request, grants)))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read_requests())

        async def close_when_idle() -> None:
            """Ends the stream once nothing is unanswered and nothing arrived (nor was
            answered) for `idle_s`."""
            while True:
                quiet_s = time.monotonic() - last_activity
                if not unanswered and quiet_s >= idle_s:
                    metrics.WRITE_STREAMS_IDLE_CLOSED.inc()
                    reader.cancel()
                    return
                await asyncio.sleep(idle_s - quiet_s if quiet_s < idle_s else idle_s)

        watchdog = asyncio.create_task(close_when_idle())
        try:
            while (item := await answers.get()) is not None:
                ticket, admitted = item
                if isinstance(admitted, Exception):
                    await _abort(context, admitted, ticket.segment)
                if isinstance(admitted, tuple):  # refused for now: busy, or over the quota
                    status, held = admitted
                    reply = ticket.reply(segment_store_pb2.WriteStatus.ValueType(status), held)
                else:
                    outcome = await admitted
                    if isinstance(outcome, Exception):
                        await _abort(context, outcome, ticket.segment)
                    assert isinstance(outcome, WriteResult)
                    reply = ticket.reply(segment_store_pb2.ACCEPTED, outcome)
                await context.write(reply)
                unanswered -= 1
                last_activity = time.monotonic()
                inflight.release()
            # The reader ended: the client closed its side, or the watchdog the stream.
            await asyncio.wait({reader})
            if not reader.cancelled():
                reader.result()
        finally:
            watchdog.cancel()
            reader.cancel()
            for task in (watchdog, reader):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _admit(
        self, request: segment_store_pb2.WriteRequest, grants: WriteStreamGrants
    ) -> _Admitted:
        """The write under way; or, for a batch refused for now (the store too busy, the
        tenant over its quota: nothing written), its status and what the segment holds
        (the batch itself is dropped at once: memory is the committer's queue, not every
        refused batch waiting for its reply); or why it was refused (an Exception, which
        ends the stream)."""
        try:
            segment = segment_key(request.segment)
            # Malformed before unauthorized: a bad request says what is wrong with it.
            check_epoch(request.writer_epoch, "writer epoch")
            batch = batch_of(request)
            grant = grants.admit(request.grant, segment, request.writer_epoch)
            self.authority.check_not_deleted(segment.stream_id)
            self.core.check_takes_part(segment)
            command = WriteCommand(
                segment, request.writer_epoch, request.acked_index, batch, grant.tenant
            )
        except StoreError as error:
            return error
        if not len(batch):
            return self.committer.submit(command)
        payload_bytes = batch.payload_bytes()
        if not self.quota.admit(grant.tenant, payload_bytes, monotonic_ms()):
            metrics.REFUSED_QUOTA.inc()
            return self._held_back(segment_store_pb2.REFUSED_QUOTA, command)
        future = self.committer.try_submit(command)
        if future is None:
            metrics.REFUSED_BUSY.inc()
            return self._held_back(segment_store_pb2.REFUSED_BUSY, command)
        return future

    def _held_back(self, status: int, command: WriteCommand) -> _Admitted:
        """A batch refused for now: its status and what the segment holds, or, below the
        fence, that error (as for any write)."""
        held = self.core.refused_busy(command)
        return held if isinstance(held, Exception) else (status, held)

    # ---- Seal, Delete, state ----

    async def Seal(
        self,
        request: segment_store_pb2.SealRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.SealRequest, segment_store_pb2.SealReply
        ],
    ) -> segment_store_pb2.SealReply:
        try:
            principal = self.caller(context)
            segment = segment_key(request.segment)
            check_epoch(request.new_epoch, "seal epoch")
            grant = self.authority.grant_for(
                principal, "SegmentStore/Seal", request.grant, segment, request.new_epoch
            )
            self.core.check_takes_part(segment)
            command = SealCommand(segment, request.new_epoch, grant.tenant)
        except StoreError as error:
            await _abort(context, error, request.segment)
        outcome = await self.committer.submit(command)
        if isinstance(outcome, Exception):
            await _abort(context, outcome, request.segment)
        assert isinstance(outcome, SealResult)
        log.info(
            "segment sealed",
            extra=segment_fields(
                request.segment.stream,
                request.segment.epoch,
                fence=outcome.fence,
                index=outcome.acked_index,
            ),
        )
        return segment_store_pb2.SealReply(
            fence=outcome.fence,
            acked_index=outcome.acked_index,
            matched_index=outcome.matched_index,
            last_index=outcome.last_index,
        )

    async def Delete(
        self,
        request: segment_store_pb2.DeleteRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.DeleteRequest, segment_store_pb2.DeleteReply
        ],
    ) -> segment_store_pb2.DeleteReply:
        try:
            self.require(context, "Delete")
            segment = segment_key(request.segment)
            existed = await self.delete(segment)
        except StoreError as error:  # refused, malformed, or the store cannot write now
            await _abort(context, error, request.segment)
        if existed:
            log.info("segment deleted", extra=segment_fields(request.segment.stream, segment.epoch))
        return segment_store_pb2.DeleteReply(existed=existed)

    async def delete(self, segment: SegmentKey) -> bool:
        outcome = await self.committer.submit(DeleteCommand(segment))
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, DeleteResult)
        return outcome.existed

    async def GetSegmentState(
        self,
        request: segment_store_pb2.GetSegmentStateRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.GetSegmentStateRequest, segment_store_pb2.SegmentStateReply
        ],
    ) -> segment_store_pb2.SegmentStateReply:
        try:
            segment = segment_key(request.segment)
            self.require_reader(context, "GetSegmentState", segment)
            state = self.core.catalog.state(segment)
        except StoreError as error:
            await _abort(context, error)
        return segment_store_pb2.SegmentStateReply(
            segment=request.segment,
            fence=state.fence,
            acked_index=state.acked_index,
            matched_index=state.matched_index,
            last_index=state.last_index,
            bytes=state.bytes,
            bridge_index=state.bridge_index,
        )

    async def ListSegmentRecords(
        self,
        request: segment_store_pb2.ListSegmentRecordsRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.ListSegmentRecordsRequest,
            segment_store_pb2.ListSegmentRecordsReply,
        ],
    ) -> segment_store_pb2.ListSegmentRecordsReply:
        try:
            self.require(context, "ListSegmentRecords")
        except StoreError as error:
            await _abort(context, error)
        after = SegmentKey(request.after_stream_id, request.after_epoch)
        segments = self.core.catalog.segments()
        start = bisect.bisect_right(segments, after)
        page = segments[start : start + SEGMENT_RECORDS_PER_PAGE]
        records = await self.in_thread(lambda: [self.core.catalog.segment_record(s) for s in page])
        reply = segment_store_pb2.ListSegmentRecordsReply(
            more=start + len(page) < len(segments), cluster_id=self.core.catalog.cluster_id()
        )
        for segment, record in zip(page, records, strict=True):
            meta = self.core.catalog.meta(segment)
            if meta is None:
                continue  # deleted meanwhile
            reply.segments.append(
                segment_store_pb2.HeldSegmentRecord(
                    segment=_segment_pb(segment),
                    fence=meta.fence,
                    acked_index=meta.acked_index,
                    last_index=meta.last_index,
                    bridge_index=meta.bridge_index,
                    tenant=self.core.catalog.tenant_of(segment.stream_id),
                    record=record,
                )
            )
        return reply

    # ---- Read, Digest ----

    async def Read(
        self,
        request: segment_store_pb2.ReadRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.ReadRequest, segment_store_pb2.ReadReply
        ],
    ) -> AsyncIterator[segment_store_pb2.ReadReply]:
        try:
            segment = segment_key(request.segment)
            self.require_reader(context, "Read", segment)
            meta = self.core.catalog.meta(segment)
            if meta is None:
                raise SegmentNotFound(
                    f"segment {segment.stream_id}/{segment.epoch} is not held here"
                )
            if request.to_index and request.to_index < request.from_index:
                raise BadRequest(f"to_index {request.to_index} < from_index {request.from_index}")
        except StoreError as error:
            await _abort(context, error)
        per_reply = min(
            request.max_entries_per_reply or READ_REPLY_ENTRIES_DEFAULT, WRITE_BATCH_ENTRIES_MAX
        )
        upper = min(request.to_index or meta.last_index, meta.last_index, INDEX_MAX)
        if request.acked_only:
            upper = min(upper, meta.acked_index)
        next_index = max(request.from_index, 1)
        if request.packed:
            replies = self._read_packed(
                context, segment, meta, next_index, upper, verify=not request.reader_verifies
            )
            async for reply in replies:
                yield reply
            return
        sent = False
        while True:
            entries: list[entry_pb2.Entry] = []
            if next_index <= upper:
                try:
                    entries = await self.in_thread(
                        functools.partial(
                            self.read_entries,
                            segment,
                            next_index,
                            upper,
                            request.acked_only,
                            per_reply,
                        )
                    )
                except (StoreError, CorruptEntry) as error:
                    await _abort(context, error)
            if entries or not sent:
                metrics.READ_ENTRIES.labels("read").inc(len(entries))
                yield segment_store_pb2.ReadReply(
                    entries=entries,
                    acked_index=meta.acked_index,
                    matched_index=meta.matched_index,
                    last_index=meta.last_index,
                    fence=meta.fence,
                )
                sent = True
            if not entries or entries[-1].index >= upper:
                return
            next_index = entries[-1].index + 1

    async def _read_packed(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        segment: SegmentKey,
        meta: SegmentMeta,
        next_index: int,
        upper: int,
        verify: bool,
    ) -> AsyncIterator[segment_store_pb2.ReadReply]:
        """Read's bulk form: values back to back, a reply per batch of consecutive
        indexes, ending before the first index the store lacks. `verify=False` where
        the reader checks what it hands out against the certificate (`reader_verifies`)."""
        per_reply = PACKED_REPLY_ENTRIES_MAX

        def read_ahead(index: int) -> asyncio.Future[tuple[int, list[bytes]]]:
            return asyncio.ensure_future(
                self.in_thread(
                    functools.partial(self.read_values, segment, index, upper, per_reply, verify)
                )
            )

        # The next run is read (and checked) while the reply before it goes out: the
        # store's reading and the network's sending overlap.
        ahead = read_ahead(next_index) if next_index <= upper else None
        try:
            while True:
                first, values = next_index, list[bytes]()
                if ahead is not None:
                    try:
                        first, values = await ahead
                    except (StoreError, CorruptEntry) as error:
                        await _abort(context, error, _segment_pb(segment))
                    ahead = None
                next_index = first + len(values)
                if values and next_index <= upper:
                    ahead = read_ahead(next_index)
                metrics.READ_ENTRIES.labels("read_packed").inc(len(values))
                yield segment_store_pb2.ReadReply(
                    acked_index=meta.acked_index,
                    matched_index=meta.matched_index,
                    last_index=meta.last_index,
                    fence=meta.fence,
                    packed_values=b"".join(values),
                    value_lengths=list(map(len, values)),
                    first_index=first if values else 0,
                )
                # A reply may end early (the byte cap, a gap): only an empty one, or the
                # end of the range, ends the read. A gap gives an empty one next round.
                if not values or next_index > upper:
                    return
        finally:
            if ahead is not None:
                ahead.cancel()

    def read_values(
        self, segment: SegmentKey, first: int, upper: int, limit: int, verify: bool
    ) -> tuple[int, list[bytes]]:
        """Stored values of consecutive indexes from `first` (cut before a gap), each
        verified unless not `verify`; raises CorruptEntry."""
        with self.core.reader.reading(segment):
            values = self.core.reader.read_run(segment, first, upper, limit, PACKED_REPLY_BYTES_MAX)
            bad = first_corrupt_value(first, values) if verify else None
            if bad is not None:
                raise CorruptEntry(f"index {first + bad}: stored copy fails its crc32c")
        return first, values

    async def Digest(
        self,
        request: segment_store_pb2.DigestRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.DigestRequest, segment_store_pb2.DigestReply
        ],
    ) -> segment_store_pb2.DigestReply:
        try:
            segment = segment_key(request.segment)
            self.require_reader(context, "Digest", segment)
            if request.up_to_index > INDEX_MAX:
                raise BadRequest(f"up_to_index {request.up_to_index} is over {INDEX_MAX}")
            if request.certificate:
                return await self._certificate_reply(segment, request.up_to_index)
            info = await self.in_thread(
                functools.partial(self.core.reader.digest, segment, request.up_to_index)
            )
        except (StoreError, CorruptEntry) as error:
            await _abort(context, error)
        return segment_store_pb2.DigestReply(
            digest=info.digest,
            up_to_index=info.up_to_index,
            entries_held=info.entries_held,
            acked_index=info.acked_index,
            fence=info.fence,
        )

    async def _certificate_reply(
        self, segment: SegmentKey, up_to: int
    ) -> segment_store_pb2.DigestReply:
        """The replica's certificate up to `up_to` (0: its acked index); none when it
        lacks an index; a damaged copy raises CorruptEntry (DATA_LOSS)."""
        meta = self.core.catalog.meta(segment)
        if meta is None:
            raise SegmentNotFound(f"segment {segment.stream_id}/{segment.epoch} is not held here")
        final = up_to or meta.acked_index
        if final == 0:
            raise BadRequest("nothing acked to certify: give up_to_index")
        result = await self.in_thread(functools.partial(self.core.reader.certify, segment, final))
        if result.damaged and not result.missing:
            self.core.catalog.mark_damaged(segment)
            raise CorruptEntry(result.detail)
        reply = segment_store_pb2.DigestReply(
            up_to_index=final,
            entries_held=final if result.certificate else result.damaged_index - 1,
            acked_index=meta.acked_index,
            fence=meta.fence,
        )
        if result.certificate is not None:
            reply.certificate.CopyFrom(codec.certificate_to_pb(result.certificate))
        return reply

    # ---- CopySegment ----

    async def CopySegment(
        self,
        request: segment_store_pb2.CopySegmentRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.CopySegmentRequest, segment_store_pb2.CopySegmentReply
        ],
    ) -> segment_store_pb2.CopySegmentReply:
        try:
            self.require(context, "CopySegment")
        except StoreError as error:
            await _abort(context, error, request.segment)
        try:
            certificate = (
                codec.certificate_from_pb(request.certificate)
                if request.HasField("certificate")
                else None
            )
            copy = SegmentCopy(
                self.core,
                self.committer,
                self.in_thread,
                self.members,
                segment_key(request.segment),
                request.source_address,
                request.final_index,
                request.fence,
                request.tenant,
                certificate,
            )
            report = await copy.run()
        except MalformedCertificate as error:
            await _abort(context, BadRequest(f"certificate: {error}"), request.segment)
        except (StoreError, CorruptEntry) as error:
            log.warning(
                "segment copy failed: %s",
                error,
                extra=segment_fields(
                    request.segment.stream, request.segment.epoch, source=request.source_address
                ),
            )
            await _abort(context, error, request.segment)
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

    # ---- Subscribe ----

    async def Subscribe(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[segment_store_pb2.SubscribeRequest],
        context: grpc.aio.ServicerContext[
            segment_store_pb2.SubscribeRequest, segment_store_pb2.SubscribeReply
        ],
    ) -> None:
        requests = aiter(request_iterator)
        try:
            first = await asyncio.wait_for(anext(requests), SUBSCRIBE_START_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            await _abort(context, BadRequest("Subscribe must begin with a start message"))
        try:
            if first.WhichOneof("message") != "start":
                raise BadRequest("Subscribe must begin with a start message")
            segment = segment_key(first.start.segment)
            self.require_reader(context, "Subscribe", segment)
            self.authority.check_not_deleted(segment.stream_id)
        except StoreError as error:
            await _abort(context, error)
        tail = _Tail(self, segment, first.start, requests, context)
        metrics.SUBSCRIBERS.inc()
        try:
            refusal = await tail.run()
        finally:
            metrics.SUBSCRIBERS.dec()
        if refusal is not None:
            await _abort(context, refusal)


# What `_admit` makes of a Write request: the write under way; a batch refused for now
# with its status (REFUSED_BUSY, REFUSED_QUOTA) and what the segment holds; or why the
# stream ends.
_Admitted = asyncio.Future[Outcome] | tuple[int, WriteResult] | Exception


@dataclass(frozen=True, slots=True)
class _Ticket:
    """What a Write reply needs of its request."""

    segment: entry_pb2.SegmentId
    key: SegmentKey
    request_id: int
    first_index: int
    last_index: int
    report_held: bool

    @classmethod
    def of(cls, request: segment_store_pb2.WriteRequest) -> _Ticket:
        segment = entry_pb2.SegmentId()
        segment.CopyFrom(request.segment)
        return cls(
            segment,
            SegmentKey(segment.stream_id, segment.epoch),
            request.request_id,
            request.first_index if request.value_lengths else 0,
            request.first_index + len(request.value_lengths) - 1 if request.value_lengths else 0,
            request.report_held,
        )

    def reply(
        self, status: segment_store_pb2.WriteStatus.ValueType, result: WriteResult
    ) -> segment_store_pb2.WriteReply:
        return segment_store_pb2.WriteReply(
            segment=self.segment,
            request_id=self.request_id,
            status=status,
            matched_index=result.matched_index,
            acked_index=result.acked_index,
            fence=result.fence,
            first_index=self.first_index,
            last_index=self.last_index,
            held_epochs=result.held_epochs if self.report_held else (),
        )


class _Tail:
    """One Subscribe stream: the shell of `segment_store.tail.TailStream`. A pump asks
    the core what to do and fills a buffer, a sender drains it to the wire, a receiver
    notes the client's keepalives. The first of them to end ends the stream."""

    def __init__(
        self,
        service: SegmentStoreService,
        segment: SegmentKey,
        start: segment_store_pb2.SubscribeStart,
        requests: AsyncIterator[segment_store_pb2.SubscribeRequest],
        context: grpc.aio.ServicerContext[
            segment_store_pb2.SubscribeRequest, segment_store_pb2.SubscribeReply
        ],
    ) -> None:
        self.service = service
        self.segment = segment
        self.start = start
        settings = tail.TailSettings.asked(
            start.max_batch_entries,
            start.keepalive_interval_ms,
            WRITE_BATCH_ENTRIES_MAX,
            service.config.subscribe_buffer_batches,
            service.config.subscribe_stall_ms,
        )
        self.stream = tail.TailStream(start.from_index, settings, monotonic_ms())
        self.requests = requests
        self.context = context
        # Bounded by the core, which never asks for more than `buffer_messages`.
        self.buffer: asyncio.Queue[segment_store_pb2.SubscribeReply] = asyncio.Queue()
        self.room = asyncio.Event()

    async def run(self) -> Exception | None:
        tasks = [
            asyncio.create_task(self._pump()),
            asyncio.create_task(self._send()),
            asyncio.create_task(self._receive()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if task.cancelled():
                continue
            error = task.exception()
            if isinstance(error, _Refused):
                return error
            if isinstance(error, CorruptEntry):
                log.error(
                    "DATA_LOSS serving a subscriber: %s",
                    error,
                    extra=segment_fields(self.start.segment.stream, self.segment.epoch),
                )
                return _Refused(grpc.StatusCode.DATA_LOSS, str(error))
            if error is not None and task is tasks[0]:
                log.error("tail of %s failed", self.segment, exc_info=error)
                return _Refused(grpc.StatusCode.INTERNAL, f"tail failed: {error!r}")
            if error is not None:
                # The wire broke (the client went away): nothing left to tell it.
                log.debug("subscriber to %s ended: %r", self.segment, error)
                continue
            result: Exception | None = task.result()
            if result is not None:
                return result
        return None

    async def _pump(self) -> Exception | None:
        watch = self.service.watch
        stream = self.stream
        while True:
            changed = watch.event(self.segment)
            meta = self.service.core.catalog.meta(self.segment) or SegmentMeta()
            position = tail.Position(meta.acked_index, meta.fence, meta.bridge_index)
            action = stream.step(position, self.buffer.qsize(), monotonic_ms())
            if isinstance(action, tail.ReadBatch):
                await self._read(action)
            elif isinstance(action, tail.SendPosition):
                self.buffer.put_nowait(_position_reply(action.position))
            elif isinstance(action, tail.SendKeepalive):
                keepalive = segment_store_pb2.Keepalive(sent_at_ms=wall_ms())
                self.buffer.put_nowait(segment_store_pb2.SubscribeReply(keepalive=keepalive))
            elif isinstance(action, tail.Drop):
                metrics.SUBSCRIBERS_DROPPED.labels(action.reason).inc()
                code = _TAIL_DROP_STATUS[action.reason]
                return _Refused(code, action.detail)
            else:
                await self._wait(changed, action.until_ms)

    async def _read(self, read: tail.ReadBatch) -> None:
        entries = await self.service.in_thread(
            functools.partial(
                self.service.read_entries,
                self.segment,
                read.from_index,
                read.to_index,
                True,
                read.entries_max,
                verify=False,  # followers verify every entry they receive
            )
        )
        if entries:
            metrics.READ_ENTRIES.labels("subscribe").inc(len(entries))
            batch = segment_store_pb2.EntryBatch(entries=entries, token=entries[-1].index)
            self.buffer.put_nowait(segment_store_pb2.SubscribeReply(batch=batch))
        last = entries[-1].index if entries else read.from_index - 1
        self.stream.on_read(read, last, monotonic_ms())

    async def _wait(self, changed: asyncio.Event, until_ms: int) -> None:
        """Until the segment changes, the sender makes room, or `until_ms`."""
        self.room.clear()
        waiters = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(self.room.wait())]
        try:
            timeout_s = max(until_ms - monotonic_ms(), 0) / 1000
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _send(self) -> Exception | None:
        while True:
            reply = await self.buffer.get()
            self.room.set()
            await self.context.write(reply)

    async def _receive(self) -> Exception | None:
        async for _request in self.requests:
            self.stream.on_heard(monotonic_ms())
        return None  # the client closed its side: the stream ends


_TAIL_DROP_STATUS = {
    "silent": grpc.StatusCode.UNAVAILABLE,
    "slow": grpc.StatusCode.RESOURCE_EXHAUSTED,
}



def _position_reply(position: tail.Position) -> segment_store_pb2.SubscribeReply:
    return segment_store_pb2.SubscribeReply(
        position=segment_store_pb2.Position(
            acked_index=position.acked_index,
            fence=position.fence,
            bridge_index=position.bridge_index,
        )
    )
