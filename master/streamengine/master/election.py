"""Several masters on one etcd, one of them active: an election on etcd leases.

Theory of operation. Each master process holds one etcd lease (`ttl_s`, 1 s by
default), kept alive `KEEPALIVES_PER_TTL` times per TTL, and one key bound to it,
`PREFIX/master/<lease id in hex>`, whose value is the master's address (`join`: a
transaction that creates the key unless it exists). The master whose key is the oldest
(lowest creation revision) is the active one (`members`, polled every `POLL_S`). So:

- the active master dies or hangs → its keepalives stop → etcd expires its lease (TTL,
  checked every 500 ms) and deletes its key → the next standby's key is the oldest, and
  that standby sees it at its next poll;
- every commit of the active master compares its key (`etcd_metadata.ActiveGuard`), so
  once the key is gone nothing the old master sends is written;
- each master counts its own lease from the send time of the keepalives etcd confirms
  (`leadership.master_active_until`, applied by `role.MasterRole`): it stops serving
  before etcd can expire the lease and let a standby win;
- standbys read the active master's address from the oldest key.

Every call is unary or a short exchange, each with a deadline, and a member that does
not answer is left for the next (`EtcdClient`): a member cut off the network costs one
deadline, never a connection attempt that waits for TCP to give up. (etcd's own
`v3election.Campaign` blocks server-side on one member, which is why it is not used.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc

from streamengine.etcd import rpc_pb2
from streamengine.master.core.leadership import master_active_until
from streamengine.master.etcd import EtcdClient
from streamengine.master.metadata import prefix_end
from streamengine.protocol.backoff import ETCD_CALL

log = logging.getLogger("streamengine.master.election")

T = TypeVar("T")
KeepAliveCall = grpc.aio.StreamStreamCall[
    rpc_pb2.LeaseKeepAliveRequest, rpc_pb2.LeaseKeepAliveResponse
]

ELECTION_TTL_S_DEFAULT = 1
# Keepalives per TTL: one lost or late keepalive still leaves the lease alive.
KEEPALIVES_PER_TTL = 3
# How often a master reads who is active: bounds how late a standby notices that it is
# now the oldest (after the old lease's TTL) and how late an active master notices that
# it is not (its key deleted by hand).
POLL_S = 0.1
# One etcd call; a member slower than this is left for the next.
CALL_TIMEOUT_S = 0.5


class LeaseLost(Exception):
    """etcd no longer knows this master's election lease."""


@dataclass(frozen=True, slots=True)
class Term:
    """This master's place in the election: its key and the key's creation revision."""

    key: bytes
    revision: int
    lease_id: int


@dataclass(frozen=True, slots=True)
class Member:
    """A master in the election, as its key says."""

    address: str
    key: bytes
    revision: int


class Election:
    def __init__(
        self, client: EtcdClient, address: str, ttl_s: int, clock_ms: Callable[[], int]
    ) -> None:
        self.client = client
        self.address = address
        self.ttl_s = ttl_s
        self.clock_ms = clock_ms
        self.prefix = client.config.election_name + b"/"
        self.lease_id = 0
        self.ttl_ms = ttl_s * 1000

    async def grant(self) -> int:
        """A new election lease (retried until etcd answers); returns its id."""
        request = rpc_pb2.LeaseGrantRequest(TTL=self.ttl_s)
        reply = await self._call(
            "lease grant",
            lambda member: self.client.aio_lease(member).LeaseGrant(
                request, timeout=CALL_TIMEOUT_S
            ),
        )
        granted_s = reply.TTL
        if granted_s > self.ttl_s:
            log.warning(
                "etcd raised the election lease from %d s to its minimum of %d s: failovers "
                "take that long (etcd --heartbeat-interval=50 --election-timeout=500 gives 1 s)",
                self.ttl_s,
                granted_s,
            )
        self.lease_id, self.ttl_ms = reply.ID, granted_s * 1000
        return reply.ID

    async def keep_alive(self, lease_id: int, confirmed: Callable[[int], None]) -> NoReturn:
        """Renew the lease `KEEPALIVES_PER_TTL` times per TTL, telling `confirmed` until
        when it now surely runs; raises LeaseLost when etcd says it is gone."""
        interval_s = self.ttl_ms / KEEPALIVES_PER_TTL / 1000
        request = rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)
        failures = 0
        while True:
            member = self.client.member
            call = self.client.aio_lease(member).LeaseKeepAlive()
            try:
                while True:
                    sent_ms = self.clock_ms()
                    # Unanswered within an interval (even unsent: a member cut off the
                    # network never completes the connection): try the next member. Not
                    # `asyncio.wait_for`: cancelled as the renewal failed, Python 3.11's
                    # hands back the failure and the cancellation is lost.
                    async with asyncio.timeout(interval_s):
                        reply = await self._renew(call, request)
                    if reply.TTL <= 0:
                        raise LeaseLost(f"etcd no longer knows lease {lease_id:x}")
                    confirmed(master_active_until(sent_ms, reply.TTL * 1000))
                    failures = 0
                    spent_s = (self.clock_ms() - sent_ms) / 1000
                    await asyncio.sleep(max(0.0, interval_s - spent_s))
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
            # Never longer than an interval: the lease is only as alive as its keepalives.
            failures += 1
            await asyncio.sleep(min(ETCD_CALL.delay_ms(failures) / 1000, interval_s))

    @staticmethod
    async def _renew(
        call: KeepAliveCall, request: rpc_pb2.LeaseKeepAliveRequest
    ) -> rpc_pb2.LeaseKeepAliveResponse:
        await call.write(request)
        reply = await call.read()
        if not isinstance(reply, rpc_pb2.LeaseKeepAliveResponse):
            raise ConnectionError("etcd closed the keepalive stream")
        return reply

    async def join(self, lease_id: int) -> Term:
        """This master's key in the election, created unless it exists (a retry after
        an answer that got lost finds it)."""
        key = self.prefix + f"{lease_id:x}".encode()
        request = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    result=rpc_pb2.Compare.EQUAL,
                    target=rpc_pb2.Compare.CREATE,
                    key=key,
                    create_revision=0,
                )
            ],
            success=[
                rpc_pb2.RequestOp(
                    request_put=rpc_pb2.PutRequest(
                        key=key, value=self.address.encode(), lease=lease_id
                    )
                )
            ],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))],
        )
        reply = await self._call(
            "election join",
            lambda member: self.client.aio_kv(member).Txn(request, timeout=CALL_TIMEOUT_S),
        )
        if reply.succeeded:
            return Term(key, reply.header.revision, lease_id)
        return Term(key, reply.responses[0].response_range.kvs[0].create_revision, lease_id)

    async def members(self) -> list[Member]:
        """Every master in the election, oldest (the active one) first."""
        request = rpc_pb2.RangeRequest(
            key=self.prefix,
            range_end=prefix_end(self.prefix),
            sort_order=rpc_pb2.RangeRequest.ASCEND,
            sort_target=rpc_pb2.RangeRequest.CREATE,
        )
        reply = await self._call(
            "election read",
            lambda member: self.client.aio_kv(member).Range(request, timeout=CALL_TIMEOUT_S),
        )
        return [Member(kv.value.decode(), kv.key, kv.create_revision) for kv in reply.kvs]

    async def revoke(self) -> None:
        """Give the lease back (a clean stop): the key goes at once, a standby wins."""
        if not self.lease_id:
            return
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await self.client.aio_lease(self.client.member).LeaseRevoke(
                rpc_pb2.LeaseRevokeRequest(ID=self.lease_id), timeout=CALL_TIMEOUT_S
            )
        self.lease_id = 0

    async def _call(self, what: str, attempt: Callable[[str], Awaitable[T]]) -> T:
        """`attempt(member)` until a member answers, moving on after each failure."""
        failures = 0
        while True:
            member = self.client.member
            try:
                return await attempt(member)
            except grpc.aio.AioRpcError as error:
                self._failed(member, what, error)
            failures += 1
            await asyncio.sleep(ETCD_CALL.delay_ms(failures) / 1000)

    def _failed(self, member: str, what: str, error: BaseException) -> None:
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        if code in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.client.member_failed(member)
        log.info("etcd %s at %s failed: %s", what, member, code or repr(error))
