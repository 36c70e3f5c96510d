"""What every call of the SegmentStore service shares (`StoreContext`): the core and its
committer, the segment watch, the settings, what the store trusts of its master and who
calls, the tenants' append quota, how the store reaches its peers, and the threads that
read the KV. Also the store's own mutations that no call makes (the master link's:
keeping its authority, joining, keeping segment records) and Delete's.

Every call first resolves its caller (`protocol.callers`) and is authorized
(`protocol.auth.authorize`) with the tenant of the stream it touches: for Write and
Seal the tenant of their grant, which must also list the segment and this store
(`core.authority`); for reads the tenant this store keeps for the stream. A streaming
call (the data port's) has its caller resolved once, at the connection's hello: an
anonymous one is refused before anything of it is read, and each principal holds a
bounded share of the store while its requests run (`admit_stream`,
`core.authority.CallerShares`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from streamengine.protocol import identity, transport
from streamengine.protocol.auth import Denial, Principal, authorize
from streamengine.protocol.callers import Callers
from streamengine.protocol.signing import NoVerifyingKey
from streamengine.segment_store.core import tail
from streamengine.segment_store.core.authority import (
    AppendQuota,
    CallerRefused,
    CallerShares,
    CallerUnproven,
    NoSigningKeyYet,
    StoreAuthority,
)
from streamengine.segment_store.core.commands import (
    AckedRaised,
    AuthorityKept,
    ClusterViewKept,
    DeleteCommand,
    DeleteResult,
    JoinCommand,
    Joined,
    KeepAuthorityCommand,
    KeepClusterViewCommand,
    KeepRecordsCommand,
    RaiseAckedCommand,
    RecordsKept,
    SegmentKey,
    check_segment,
)
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.group_commit import GroupCommitter, SegmentWatch
from streamengine.v1 import entry_pb2

T = TypeVar("T")

# The live tail's own limits and decisions are in `core.tail`.
SUBSCRIBE_BUFFER_BATCHES_DEFAULT = tail.BUFFER_MESSAGES_DEFAULT
SUBSCRIBE_STALL_MS_DEFAULT = tail.STALL_MS_DEFAULT

# A Write stream with no request answered-but-unread and none arriving for this long is
# closed: an abandoned stream holds no server resources. A leader that appends sends far
# more often; one that idles reconnects in one pause (`client.store_session`), well within
# the time after which it would count the store as lost.
WRITE_STREAM_IDLE_MS_DEFAULT = 60_000


@dataclass(frozen=True)
class ServiceConfig:
    subscribe_buffer_batches: int = SUBSCRIBE_BUFFER_BATCHES_DEFAULT
    subscribe_stall_ms: int = SUBSCRIBE_STALL_MS_DEFAULT
    write_stream_idle_ms: int = WRITE_STREAM_IDLE_MS_DEFAULT


def segment_key(segment: entry_pb2.SegmentId) -> SegmentKey:
    key = SegmentKey(segment.stream_id, segment.epoch)
    check_segment(key)
    return key


def segment_pb(segment: SegmentKey) -> entry_pb2.SegmentId:
    return entry_pb2.SegmentId(stream_id=segment.stream_id, epoch=segment.epoch)


class StoreContext:
    """What the service's calls share; see the module doc."""

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
        self.shares = CallerShares(committer.queue_bytes_max)
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

    def admit_stream(self, principal: Principal) -> Principal:
        """A streaming call (a data-port request, its caller known at the hello), counted
        against its caller's share until `close_stream`; raises OverCallerLimit for one
        holding all it may."""
        self.shares.open_stream(principal)
        return principal

    def close_stream(self, principal: Principal) -> None:
        self.shares.close_stream(principal)

    def require(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, tenant: str = ""
    ) -> Principal:
        """The caller, when it may call `method` on `tenant`'s data; else raises
        CallerRefused."""
        principal = self.caller(context)
        self.check_allowed(principal, method, tenant)
        return principal

    def check_allowed(
        self, principal: Principal, method: str, tenant: str = "", stream_id: int = 0
    ) -> None:
        denial = authorize(principal, f"SegmentStore/{method}", tenant, stream_id)
        if denial is not None:
            raise CallerRefused(denial.reason)

    def check_reader(self, principal: Principal, method: str, segment: SegmentKey) -> None:
        """Raises CallerRefused unless `principal` may read `segment`'s stream."""
        tenant = self.core.catalog.tenant_of(segment.stream_id)
        self.check_allowed(principal, method, tenant, segment.stream_id)

    def require_reader(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, segment: SegmentKey
    ) -> None:
        self.check_reader(self.caller(context), method, segment)

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)

    async def in_thread(self, function: Callable[[], T]) -> T:
        """Run a read of the KV off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, function)

    # ---- the store's own mutations ----

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

    async def raise_acked(self, raised: Sequence[tuple[SegmentKey, int]]) -> int:
        """Take the acked indexes the master passes on from leaders that let go
        (`RaiseAckedCommand`), durably; returns how many segments it raised."""
        outcome = await self.committer.submit(RaiseAckedCommand(tuple(raised)))
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, AckedRaised)
        return len(outcome.raised)

    async def keep_cluster_view(self, view: bytes) -> None:
        """Keep the master's cluster view (a serialized `v1.ClusterView`) durably."""
        outcome = await self.committer.submit(KeepClusterViewCommand(view))
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, ClusterViewKept)

    async def delete(self, segment: SegmentKey) -> bool:
        """Delete the segment durably (Delete, and the master link's cleanup); whether
        the store held it."""
        outcome = await self.committer.submit(DeleteCommand(segment))
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, DeleteResult)
        return outcome.existed
