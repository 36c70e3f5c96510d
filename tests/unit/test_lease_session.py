"""The lease session hands each writer its own entry's answer, or its own refusal as the
error `WriterHeartbeat` would have raised (`client.leases`)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from streamengine.client.core.writer import STREAM_DELETED, heartbeat_failure_policy
from streamengine.client.errors import NotFound, StreamDeleted, from_rpc_error
from streamengine.client.leases import LeaseSession, refusal
from streamengine.testing.waiting import wait_until
from streamengine.v1 import master_pb2


def test_an_entry_refused_alone_is_the_error_its_writer_would_have_got_alone() -> None:
    deleted = refusal(
        master_pb2.LeaseHeartbeatAnswer(
            code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
            message="stream 't/s' is deleted",
            deleted_until_ms=1234,
        )
    )
    error = from_rpc_error(deleted)
    assert isinstance(error, StreamDeleted) and error.deleted_until_ms == 1234
    assert heartbeat_failure_policy(STREAM_DELETED).ends_leading

    unknown = refusal(
        master_pb2.LeaseHeartbeatAnswer(code=grpc.StatusCode.NOT_FOUND.value[0], message="no")
    )
    assert unknown.code() is grpc.StatusCode.NOT_FOUND and unknown.details() == "no"
    assert isinstance(from_rpc_error(unknown), NotFound)
    assert heartbeat_failure_policy(unknown.code().name).ends_following


class SlowMaster:
    """Answers each LeaseHeartbeat batch when told to: every entry granted."""

    def __init__(self) -> None:
        self.answer_now = asyncio.Event()
        self.batches: list[master_pb2.LeaseHeartbeatRequest] = []

    async def LeaseHeartbeat(self, request, **_):
        self.batches.append(request)
        await self.answer_now.wait()
        granted = master_pb2.WriterHeartbeatReply(
            role=master_pb2.LEADER, epoch=1, lease_secret=b"k" * 32
        )
        return master_pb2.LeaseHeartbeatReply(
            leases=[master_pb2.LeaseHeartbeatAnswer(reply=granted) for _ in request.leases]
        )


async def test_heartbeats_go_in_one_batch_and_a_grant_answered_late_still_reaches_its_writer():
    master: Any = SlowMaster()
    session = LeaseSession(master, lambda: master)

    async def no_hold() -> None:
        session._held.set()  # as if held: batches go at once
        await asyncio.Event().wait()

    session._hold = no_hold  # type: ignore[method-assign]  # no hold call here
    await session.start()
    late: list[master_pb2.WriterHeartbeatReply] = []
    try:
        beats = [
            session.heartbeat(
                master_pb2.WriterHeartbeatRequest(stream=f"t/s{n}", client_id=f"w{n}"),
                0.2,
                late.append,
            )
            for n in range(3)
        ]
        results = await asyncio.gather(*beats, return_exceptions=True)
        assert all(
            isinstance(r, grpc.aio.AioRpcError) and r.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            for r in results
        )
        assert [len(b.leases) for b in master.batches] == [3], "one call for the three"
        master.answer_now.set()
        await wait_until(lambda: len(late) == 3, 5.0)
        assert all(reply.lease_secret == b"k" * 32 for reply in late)
    finally:
        await session.close()


class OrderedMaster(SlowMaster):
    """SlowMaster that also records the order in which calls reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    async def LeaseHeartbeat(self, request, **kwargs):
        reply = await super().LeaseHeartbeat(request, **kwargs)
        self.order.append("heartbeat answered")
        return reply

    async def ReleaseLease(self, request, **_):
        self.order.append(f"release {request.stream}")
        return master_pb2.ReleaseLeaseReply()


async def test_a_release_waits_for_the_heartbeat_of_its_stream_still_in_flight():
    """A writer closing while its last heartbeat is in flight: were the release decided
    first, that heartbeat would find the lease free and win the next epoch for a writer
    that is gone (a clean-clone run's failover test saw epoch 3 where 2 was the last)."""
    master: Any = OrderedMaster()
    session = LeaseSession(master, lambda: master)

    async def no_hold() -> None:
        session._held.set()
        await asyncio.Event().wait()

    session._hold = no_hold  # type: ignore[method-assign]
    await session.start()
    try:
        beat = asyncio.ensure_future(
            session.heartbeat(
                master_pb2.WriterHeartbeatRequest(stream="t/s", client_id="w", epoch=1),
                5.0,
                lambda reply: None,
            )
        )
        await wait_until(lambda: len(master.batches) == 1, 5.0)
        beat.cancel()  # the writer closes: it gives up on the answer, then releases
        session.release(master_pb2.ReleaseLeaseRequest(stream="t/s", client_id="w", epoch=1))
        for _ in range(5):  # turns enough for the release task to call, were it free to
            await asyncio.sleep(0)
        assert master.order == [], "the release waits for the batch carrying t/s"
        master.answer_now.set()
        await wait_until(lambda: len(master.order) == 2, 5.0)
        assert master.order == ["heartbeat answered", "release t/s"]
    finally:
        await session.close()
