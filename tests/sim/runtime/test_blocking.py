"""Synchronous code on the simulated loop (`blocking.py`): blocking gRPC calls, reads of
the data plane and `time.sleep`, each in virtual time and under the network's faults,
taking turns with the loop (the SDK's synchronous client: `tests/sim/test_runtime.py`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from streamengine.protocol import framed_read, loop_thread, transport
from streamengine.protocol.transport import PLAINTEXT
from streamengine.v1 import master_pb2, master_pb2_grpc, segment_store_pb2
from tests.integration.store_helpers import seg
from tests.sim.runtime.blocking import Abandoned, BlockingThread
from tests.sim.runtime.loop import SimLoop
from tests.sim.runtime.master import SimMaster
from tests.sim.runtime.store import SimStore
from tests.sim.runtime.test_transport import HARSH, simulate, write
from tests.sim.runtime.transport import SimNetwork


def test_a_blocking_call_and_a_sleep_take_virtual_time_only() -> None:
    def synchronous(master: str) -> tuple[float, Any]:
        started = time.monotonic()
        time.sleep(30)
        with PLAINTEXT.channel(master) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            reply = stub.GetClusterStatus(master_pb2.GetClusterStatusRequest(), timeout=5)
        return time.monotonic() - started, reply

    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> Any:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, SimLoop)
        real = time.perf_counter()
        took, reply = await BlockingThread("job").run(synchronous, master.address)
        assert time.perf_counter() - real < 10
        return took >= 30, type(reply).__name__

    assert simulate(1, scenario) == (True, "ClusterStatus")


def test_a_call_failing_on_the_network_raises_grpcs_error_in_the_thread() -> None:
    def synchronous() -> grpc.StatusCode:
        with PLAINTEXT.channel("nowhere:1") as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            try:
                stub.GetClusterStatus(master_pb2.GetClusterStatusRequest(), timeout=1)
            except grpc.RpcError as error:
                return error.code()
        raise AssertionError("a call to nowhere answered")

    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> Any:
        return await BlockingThread("job").run(synchronous)

    assert simulate(1, scenario) in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )


def test_a_synchronous_read_of_the_data_plane_under_faults() -> None:
    def synchronous(data_address: str) -> list[int]:
        request = segment_store_pb2.ReadRequest(
            segment=seg(7, 3), from_index=1, to_index=9, max_entries_per_reply=4
        )
        replies = framed_read.read_sync(data_address, PLAINTEXT, request, timeout_s=30)
        return [entry.index for reply in replies for entry in reply.entries]

    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> Any:
        await write(stores[0], seg(7, 3), 1, 9, 9)
        return await BlockingThread("job").run(synchronous, stores[0].data_address)

    for seed in range(4):
        assert simulate(seed, scenario, HARSH) == list(range(1, 10))


def test_cancelling_the_task_abandons_the_synchronous_code_through_its_finally() -> None:
    unwound: list[str] = []

    def synchronous() -> None:
        try:
            time.sleep(3600)
        finally:
            unwound.append("finally")
            with pytest.raises(Abandoned):
                time.sleep(1)  # a blocking call once abandoned raises at once

    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> Any:
        task = asyncio.get_running_loop().create_task(BlockingThread("job").run(synchronous))
        await asyncio.sleep(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return unwound

    assert simulate(1, scenario) == ["finally"]


def test_the_seams_are_set_only_while_a_network_is_installed() -> None:
    async def scenario(network: SimNetwork, stores: list[SimStore], master: SimMaster) -> Any:
        return transport.channel_factory is not None and loop_thread.factory is not None

    assert simulate(1, scenario)
    assert transport.channel_factory is None and loop_thread.factory is None
    assert time.sleep.__module__ == "time"
