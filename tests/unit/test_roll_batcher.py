"""The lease session sends the rolls its writers ask at once as one `RollSegments` call,
and hands each writer its own answer, or its own error, as `RollSegment` alone would
have (`client.leases`, `client.call_batches`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from streamengine.client.call_batches import rpc_error
from streamengine.client.leases import LeaseSession
from streamengine.v1 import master_pb2

REFUSED = "t/refused"


def roll(stream: str, epoch: int = 1) -> master_pb2.RollSegmentRequest:
    return master_pb2.RollSegmentRequest(stream=stream, client_id=f"w-{stream}", epoch=epoch)


def rolled(request: master_pb2.RollSegmentRequest) -> master_pb2.WriterHeartbeatReply:
    return master_pb2.WriterHeartbeatReply(
        role=master_pb2.LEADER, epoch=request.epoch + 1, leader_id=request.client_id
    )


class RollingMaster:
    """Rolls every stream but REFUSED (FAILED_PRECONDITION), in batches or alone;
    `batches_known=False` is a master from before RollSegments."""

    def __init__(self, batches_known: bool = True) -> None:
        self.batches_known = batches_known
        self.batches: list[list[str]] = []
        self.alone: list[str] = []
        self.answer_now = asyncio.Event()
        self.answer_now.set()
        self.fail_with: grpc.aio.AioRpcError | None = None

    async def RollSegments(self, request: master_pb2.RollSegmentsRequest, **_: Any):
        if not self.batches_known:
            raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.batches.append([r.stream for r in request.rolls])
        await self.answer_now.wait()
        if self.fail_with is not None:
            raise self.fail_with
        answers = []
        for entry in request.rolls:
            if entry.stream == REFUSED:
                code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
                answers.append(master_pb2.LeaseHeartbeatAnswer(code=code, message="2 unsealed"))
            else:
                answers.append(master_pb2.LeaseHeartbeatAnswer(reply=rolled(entry)))
        return master_pb2.RollSegmentsReply(rolls=answers)

    async def RollSegment(self, request: master_pb2.RollSegmentRequest, **_: Any):
        self.alone.append(request.stream)
        if request.stream == REFUSED:
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "2 unsealed")
        return rolled(request)


@pytest.fixture
async def session_of() -> AsyncIterator[Any]:
    sessions: list[LeaseSession] = []

    async def make(master: Any) -> LeaseSession:
        session = LeaseSession(master, lambda: master)

        async def no_hold() -> None:  # no hold call here: batches go at once
            session._held.set()
            await asyncio.Event().wait()

        session._hold = no_hold  # type: ignore[method-assign]
        await session.start()
        sessions.append(session)
        return session

    yield make
    for session in sessions:
        await session.close()


async def outcomes(session: LeaseSession, requests, timeout_s: float = 5.0) -> list[Any]:
    return await asyncio.gather(
        *(session.roll(request, timeout_s) for request in requests), return_exceptions=True
    )


def check_each_answered_its_own(requests, answers: list[Any]) -> None:
    for request, answer in zip(requests, answers, strict=True):
        if request.stream == REFUSED:
            assert isinstance(answer, grpc.aio.AioRpcError)
            assert answer.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert answer.details() == "2 unsealed"
        else:
            assert answer == rolled(request), request.stream


async def test_rolls_asked_at_once_go_in_one_call_each_answered_its_own(session_of) -> None:
    master = RollingMaster()
    session = await session_of(master)
    requests = [roll(f"t/s{n}") for n in range(5)] + [roll(REFUSED)]
    answers = await outcomes(session, requests)
    check_each_answered_its_own(requests, answers)
    assert master.batches == [[r.stream for r in requests]], "one call for the six"
    assert master.alone == []


async def test_a_master_without_the_batch_call_gets_lone_calls(session_of) -> None:
    master = RollingMaster(batches_known=False)
    session = await session_of(master)
    requests = [roll(f"t/s{n}") for n in range(3)] + [roll(REFUSED)]
    answers = await outcomes(session, requests)
    check_each_answered_its_own(requests, answers)
    assert sorted(master.alone) == sorted(r.stream for r in requests)
    master.alone.clear()
    (again,) = await outcomes(session, [roll("t/later", 4)])
    assert again == rolled(roll("t/later", 4))
    assert master.alone == ["t/later"], "not asked the batch call again at once"


async def test_each_roll_keeps_its_own_timeout_and_a_failed_call_fails_each(session_of) -> None:
    master = RollingMaster()
    master.answer_now.clear()
    session = await session_of(master)
    short = asyncio.ensure_future(session.roll(roll("t/short"), 0.1))
    long = asyncio.ensure_future(session.roll(roll("t/long"), 10.0))
    with pytest.raises(grpc.aio.AioRpcError) as timed_out:
        await short
    assert timed_out.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert not long.done()
    master.answer_now.set()
    assert await long == rolled(roll("t/long"))
    assert master.batches == [["t/short", "t/long"]]

    master.fail_with = rpc_error(grpc.StatusCode.UNAVAILABLE, "the master is starting")
    answers = await outcomes(session, [roll("t/a"), roll("t/b")])
    assert all(
        isinstance(a, grpc.aio.AioRpcError) and a.code() is grpc.StatusCode.UNAVAILABLE
        for a in answers
    )
