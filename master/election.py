"""Several masters on one etcd, one of them active: etcd's election service on a lease.

Theory of operation. Each master process holds one etcd lease (`ttl_s`, 1 s by
default) and keeps it alive `KEEPALIVES_PER_TTL` times per TTL. With it, it campaigns
(`v3election.Campaign`): etcd puts a key `PREFIX/master/<lease>` bound to the lease,
whose value is the master's address, and answers once every older key is gone. The
oldest key is the active master. So:

- the active master dies or hangs → its keepalives stop → etcd expires its lease (TTL,
  checked every 500 ms) and deletes its key → the next standby's Campaign returns;
- every commit of the active master compares its key (`etcd_metadata.ActiveGuard`), so
  once the key is gone nothing the old master sends is written;
- each master counts its own lease from the send time of the keepalives etcd confirms
  (`leadership.master_active_until`, applied by `role.MasterRole`): it stops serving
  before etcd can elect another;
- standbys watch the election (`Observe`) to name the active master in their answers.

A master that loses its lease (etcd answers a keepalive with TTL 0) takes a new one and
campaigns again as a standby; one whose key is gone while its lease lives (deleted by
hand, or a commit found it missing) campaigns again with the same lease. It never exits
for this: a deposed master is simply a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import grpc

from streamengine.etcd import rpc_pb2, v3election_pb2
from streamengine.master.etcd import EtcdClient
from streamengine.master.leadership import master_active_until

log = logging.getLogger("streamengine.master.election")

ELECTION_TTL_S_DEFAULT = 1
# Keepalives per TTL: one lost or late keepalive still leaves the lease alive.
KEEPALIVES_PER_TTL = 3
# Pause before an etcd call that failed is tried again (on the next member).
RETRY_S = 0.1
REVOKE_TIMEOUT_S = 1.0


class LeaseLost(Exception):
    """etcd no longer knows this master's election lease."""


@dataclass(frozen=True, slots=True)
class Term:
    """One win of the election: the key etcd created for it, and its revision."""

    key: bytes
    revision: int
    lease_id: int


@dataclass(frozen=True, slots=True)
class Leader:
    """The active master as the election reports it."""

    address: str
    key: bytes
    revision: int

    def succeeds(self, term: Term) -> bool:
        """Whether this leader won after `term` (so that term is over)."""
        return self.key != term.key and self.revision > term.revision


class Election:
    def __init__(
        self,
        client: EtcdClient,
        address: str,
        ttl_s: int,
        clock_ms: Callable[[], int],
    ) -> None:
        self.client = client
        self.address = address
        self.ttl_s = ttl_s
        self.clock_ms = clock_ms
        self.name = client.config.election_name
        self.lease_id = 0
        self.ttl_ms = ttl_s * 1000

    async def grant(self) -> int:
        """A new election lease (retried until etcd answers); returns its id."""
        while True:
            member = self.client.member
            try:
                reply = await self.client.aio_lease(member).LeaseGrant(
                    rpc_pb2.LeaseGrantRequest(TTL=self.ttl_s), timeout=2.0
                )
            except grpc.aio.AioRpcError as error:
                self._failed(member, "lease grant", error)
                await asyncio.sleep(RETRY_S)
                continue
            if self.ttl_s < reply.TTL:
                log.warning(
                    "etcd raised the election lease from %d s to its minimum of %d s: "
                    "failovers take that long (run etcd with --heartbeat-interval=50 "
                    "--election-timeout=500 for 1 s)",
                    self.ttl_s,
                    reply.TTL,
                )
            self.lease_id, self.ttl_ms = reply.ID, reply.TTL * 1000
            return reply.ID

    async def keep_alive(self, lease_id: int, confirmed: Callable[[int], None]) -> NoReturn:
        """Renew the lease `KEEPALIVES_PER_TTL` times per TTL, telling `confirmed` until
        when it now surely runs; raises LeaseLost when etcd says it is gone."""
        interval_s = self.ttl_ms / KEEPALIVES_PER_TTL / 1000
        request = rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)
        while True:
            member = self.client.member
            call = self.client.aio_lease(member).LeaseKeepAlive()
            try:
                while True:
                    sent_ms = self.clock_ms()
                    await call.write(request)
                    # Unanswered for a whole interval: try the next member.
                    reply = await asyncio.wait_for(call.read(), interval_s)
                    if not isinstance(reply, rpc_pb2.LeaseKeepAliveResponse):
                        raise ConnectionError("etcd closed the keepalive stream")
                    if reply.TTL <= 0:
                        raise LeaseLost(f"etcd no longer knows lease {lease_id:x}")
                    confirmed(master_active_until(sent_ms, reply.TTL * 1000))
                    await asyncio.sleep(max(0.0, interval_s - (self.clock_ms() - sent_ms) / 1000))
            except (
                grpc.aio.AioRpcError,
                TimeoutError,
                ConnectionError,
                # write() on a stream etcd already ended
                asyncio.InvalidStateError,
            ) as error:
                self._failed(member, "keepalive", error)
            finally:
                call.cancel()
            await asyncio.sleep(RETRY_S)

    async def campaign(self, lease_id: int) -> Term:
        """Wait until this master is the active one; returns its term."""
        request = v3election_pb2.CampaignRequest(
            name=self.name, lease=lease_id, value=self.address.encode()
        )
        while True:
            member = self.client.member
            try:
                reply = await self.client.aio_election(member).Campaign(request)
            except grpc.aio.AioRpcError as error:
                self._failed(member, "campaign", error)
                await asyncio.sleep(RETRY_S)
                continue
            term = Term(reply.leader.key, reply.leader.rev, lease_id)
            # Campaign also returns when this master's own key was deleted while it
            # waited (its lease expired meanwhile): only a key still there is a win.
            if await self.holds(term):
                return term
            await asyncio.sleep(RETRY_S)

    async def holds(self, term: Term) -> bool:
        """Whether the term's key still exists, as created when it was won."""
        while True:
            member = self.client.member
            try:
                reply = await self.client.aio_kv(member).Range(
                    rpc_pb2.RangeRequest(key=term.key), timeout=2.0
                )
            except grpc.aio.AioRpcError as error:
                self._failed(member, "election read", error)
                await asyncio.sleep(RETRY_S)
                continue
            return bool(reply.kvs) and reply.kvs[0].create_revision == term.revision

    async def observe(self, leader: Callable[[Leader], None]) -> NoReturn:
        """Tell `leader` who the active master is each time it changes."""
        request = v3election_pb2.LeaderRequest(name=self.name)
        while True:
            member = self.client.member
            try:
                async for reply in self.client.aio_election(member).Observe(request):
                    kv = reply.kv
                    leader(Leader(kv.value.decode(), kv.key, kv.create_revision))
            except grpc.aio.AioRpcError as error:
                self._failed(member, "observe", error)
            await asyncio.sleep(RETRY_S)

    async def revoke(self) -> None:
        """Give the lease back (a clean stop): the key goes at once, a standby wins."""
        if not self.lease_id:
            return
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await self.client.aio_lease(self.client.member).LeaseRevoke(
                rpc_pb2.LeaseRevokeRequest(ID=self.lease_id), timeout=REVOKE_TIMEOUT_S
            )
        self.lease_id = 0

    def _failed(self, member: str, what: str, error: BaseException) -> None:
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        if code in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.client.member_failed(member)
        log.info("etcd %s at %s failed: %s", what, member, code or repr(error))
