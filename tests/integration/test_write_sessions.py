"""One Write stream per (client, store), shared by every writer of the client (issue
#38): a client leads more streams than a store serves calls, its writers' appends
travel together in few Write messages, and a refusal of one segment leaves the
others' traffic alone. A master and three stores (W=2)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from streamengine.client import AppendInDoubt, Fenced, LeadershipLost, StreamClient
from streamengine.client.core.replicator import StoreConnected, StoreDisconnected
from streamengine.client.writer import Writer
from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.segment_store.server import CONCURRENT_RPCS_MAX
from streamengine.testing import Cluster, free_port, metric_value, running_cluster
from streamengine.v1 import entry_pb2, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.integration.authority_helpers import signed_grant

# More streams than a store serves calls at once: with a Write stream per writer and
# store, the ones past it were refused (RESOURCE_EXHAUSTED).
STREAMS = 608
assert STREAMS > CONCURRENT_RPCS_MAX
# A deadline, not a wait: leadership of every stream comes within a second or two.
LEADERSHIP_TIMEOUT_S = 30
# Calls to the master at once while the streams are made.
CREATES_AT_ONCE = 100
# Segments' requests per Write message at least, when every writer appends at once:
# each store is sent all of them in a few messages, not one message per writer.
PARTS_PER_MESSAGE_MIN = 10


async def _create_streams(client: StreamClient, names: list[str]) -> None:
    gate = asyncio.Semaphore(CREATES_AT_ONCE)

    async def create(name: str) -> None:
        async with gate:
            await client.create_stream(name, replicas=3, write_quorum=2)

    await asyncio.gather(*(create(name) for name in names))


def _store_events(writer: Writer, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every store event the writer's core is given from now on."""
    seen: list[object] = []
    core = writer._core
    step = core.step

    def recorded(now: int, event: Any) -> None:
        if isinstance(event, StoreConnected | StoreDisconnected):
            seen.append(event)
        step(now, event)

    monkeypatch.setattr(core, "step", recorded)
    return seen


@pytest.fixture
def store_metrics_ports() -> list[int]:
    return [free_port() for _ in range(3)]


@pytest.fixture
def lasting_cluster(tmp_path: Path, store_metrics_ports: list[int]) -> Iterator[Cluster]:
    """A master with its default lease (the `cluster` fixture's 1 s lease would run out
    on a loaded machine while hundreds of writers are granted) and three stores, each
    with its metrics port."""
    with running_cluster(
        tmp_path,
        stores=3,
        store_args_for=lambda number: ["--metrics-port", str(store_metrics_ports[number])],
    ) as running:
        yield running


def _write_traffic(ports: list[int]) -> tuple[float, float]:
    """Write messages and the segments' requests they carried, over every store."""
    messages = sum(metric_value(p, "streamengine_store_write_messages_total") for p in ports)
    parts = sum(metric_value(p, "streamengine_store_write_parts_total") for p in ports)
    return messages, parts


async def test_one_client_leads_and_appends_to_more_streams_than_a_store_serves_calls(
    lasting_cluster: Cluster, store_metrics_ports: list[int]
) -> None:
    cluster = lasting_cluster
    names = [f"acme/many-{n:04d}" for n in range(STREAMS)]
    async with StreamClient(cluster.master_address) as client:
        await _create_streams(client, names)
        async with contextlib.AsyncExitStack() as stack:
            writers = await asyncio.gather(
                *(
                    stack.enter_async_context(
                        client.writer(name, leadership_timeout_s=LEADERSHIP_TIMEOUT_S)
                    )
                    for name in names
                )
            )
            messages_before, parts_before = _write_traffic(store_metrics_ports)
            sequences = await asyncio.gather(
                *(writer.append_batch([b"first", b"second"]) for writer in writers)
            )
            assert all(len(pair) == 2 for pair in sequences)
            messages, parts = _write_traffic(store_metrics_ports)
            messages, parts = messages - messages_before, parts - parts_before
            # Each writer's batch went to every store; in few messages, not one apiece.
            assert parts >= STREAMS * len(cluster.stores), (messages, parts)
            assert messages * PARTS_PER_MESSAGE_MIN <= parts, (messages, parts)
            assert [w.statistics().role for w in writers] == ["leading"] * STREAMS
            assert all(w.statistics().acked_index == 2 for w in writers)
            # One Write stream per store carries them all.
            assert len(client._sessions) == len(cluster.stores)


async def test_a_fence_on_one_segment_leaves_another_on_the_same_stores_alone(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with StreamClient(cluster.master_address) as client:
        fenced_info = await client.create_stream("acme/fenced", replicas=3, write_quorum=2)
        await client.create_stream("acme/bystander", replicas=3, write_quorum=2)
        async with (
            client.writer("acme/fenced", leadership_timeout_s=10) as fenced,
            client.writer("acme/bystander", leadership_timeout_s=10) as bystander,
        ):
            await asyncio.gather(fenced.append(b"a"), bystander.append(b"a"))
            assert set(bystander.statistics().connected.values()) == {True}
            events = _store_events(bystander, monkeypatch)
            # A later leader's seal of the fenced writer's segment on every store, under
            # the grant the master would give it.
            stores = [store.name for store in cluster.stores]
            later = signed_grant(
                cluster, fenced_info.stream_id, fenced.epoch + 1, {fenced.epoch: stores}, "acme"
            )
            for store in cluster.stores:
                async with grpc.aio.insecure_channel(store.address, options=CLIENT_OPTIONS) as ch:
                    await store_grpc.SegmentStoreStub(ch).Seal(
                        segment_store_pb2.SealRequest(
                            segment=entry_pb2.SegmentId(
                                stream_id=fenced_info.stream_id, epoch=fenced.epoch
                            ),
                            new_epoch=fenced.epoch + 1,
                            grant=later,
                        ),
                        timeout=5,
                    )
            with pytest.raises(LeadershipLost) as caught:
                for _ in range(100):  # bounded: the first refused write ends it
                    await fenced.append(b"b")
            # Fenced, or `b` went out and was refused: no store holds it past the fence.
            assert isinstance(caught.value, Fenced | AppendInDoubt), caught.value
            assert fenced.statistics().role == "finished"
            # The bystander's segment shares each store's stream: it went on untouched.
            sequences = await bystander.append_batch([b"b", b"c"])
            assert len(sequences) == 2
            assert events == [], "the bystander lost no store"
            stats = bystander.statistics()
            assert stats.role == "leading" and stats.acked_index == 3
            assert set(stats.connected.values()) == {True}
