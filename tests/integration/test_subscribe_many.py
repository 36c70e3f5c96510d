"""One subscription following a few hundred streams (`StreamClient.subscribe_many`):
every stream's events exactly once and in order, through a stream that rolls into new
segments and one created under the prefix after the start; and a consumer that stalls,
whose stores drop it and whose streams resume where they were."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import pytest

from streamengine.client import InvalidArgument, StreamClient, StreamEvent, multiplex
from streamengine.protocol.sequence import unpack_sequence
from streamengine.testing import Cluster, running_cluster

pytestmark = pytest.mark.timeout(60)

STREAMS = 200
EVENTS = 3  # per stream, in each of two rounds
# The stream that rolls: small segments, and enough bytes each round to fill a few.
ROLLING_SEGMENT_BYTES = 8 * 1024
ROLLING_EVENTS = 100
ROLLING_PAD = b"." * 100
# What a stalled subscriber's streams hold: beyond the data plane's credit per call
# (one largest frame, 10 MiB) and the stores' buffers of 4 batches.
STALLING_EVENTS = 1000
STALLING_EVENT_BYTES = 16 * 1024


# The stores drop a subscriber whose buffer stays full this long (it resumes): short, so
# that a stalled consumer is dropped within the test.
STALL_MS = 500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module. Leases of 10 s: two hundred writers of one process
    heartbeat together, and on a loaded machine a 1 s lease ran out under some of them
    (the writers here never fail over, so nothing waits on a lease running out)."""
    root = tmp_path_factory.mktemp("many")
    stores = ["--subscribe-buffer-batches", "4", "--subscribe-stall-ms", str(STALL_MS)]
    with running_cluster(
        root, stores=3, master_args=["--lease-ms", "10000"], store_args=stores
    ) as running:
        yield running


def payloads_of(name: str, first: int, count: int, pad: bytes = b"") -> list[bytes]:
    return [f"{name}#{n}".encode() + pad for n in range(first, first + count)]


async def collect(
    events: AsyncIterator[StreamEvent], wanted: dict[str, int], timeout_s: float
) -> dict[str, list[StreamEvent]]:
    """Events by stream until each stream of `wanted` has that many."""
    seen: dict[str, list[StreamEvent]] = {}

    async def consume() -> None:
        async for event in events:
            seen.setdefault(event.stream, []).append(event)
            if all(len(seen.get(name, ())) >= count for name, count in wanted.items()):
                return

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except TimeoutError:
        short = {n: len(seen.get(n, ())) for n, c in wanted.items() if len(seen.get(n, ())) < c}
        raise AssertionError(f"streams short of events after {timeout_s} s: {short}") from None
    return seen


async def test_one_subscription_follows_hundreds_of_streams_exactly_once(
    cluster: Cluster,
) -> None:
    started = time.monotonic()
    names = [f"many/s{n:03d}" for n in range(STREAMS)]
    rolling, late = names[0], "many/late"
    expected: dict[str, list[bytes]] = {name: [] for name in names}

    def wanted_of(streams: list[str]) -> dict[str, int]:
        """The events of one round, by stream."""
        return {name: ROLLING_EVENTS if name == rolling else EVENTS for name in streams}
    async with StreamClient(cluster.master_address) as client, AsyncExitStack() as stack:
        await client.create_stream(rolling, segment_bytes=ROLLING_SEGMENT_BYTES)
        await asyncio.gather(*(client.create_stream(name) for name in names[1:]))
        subscription = client.subscribe_many(prefix="many/", start=0)
        opened = await asyncio.gather(
            client.writer(rolling).__aenter__(),  # closed by hand after the first round
            *(stack.enter_async_context(client.writer(name)) for name in names[1:]),
        )
        writers = dict(zip(names, opened, strict=True))

        async def write_round(streams: list[str]) -> None:
            batches = {name: payloads_of(name, len(expected[name]), EVENTS) for name in streams}
            batches[rolling] = payloads_of(
                rolling, len(expected[rolling]), ROLLING_EVENTS, ROLLING_PAD
            )
            for name, batch in batches.items():
                expected[name] += batch
            await asyncio.gather(
                *(writers[name].append_batch(batch) for name, batch in batches.items())
            )

        reading = asyncio.ensure_future(collect(subscription, wanted_of(names), 30))
        await write_round(names)
        seen = await reading
        # The rolling stream's next writer goes on in a new segment (whether or not its
        # size rolled it already); and a stream is created under the prefix.
        await writers[rolling].__aexit__(None, None, None)
        writers[rolling] = await stack.enter_async_context(client.writer(rolling))
        await client.create_stream(late)
        writers[late] = await stack.enter_async_context(client.writer(late))
        expected[late] = []
        reading = asyncio.ensure_future(collect(subscription, wanted_of([*names, late]), 30))
        await write_round([*names, late])
        more = await reading
        await subscription.aclose()
    for name, payloads in expected.items():
        events = seen.get(name, []) + more.get(name, [])
        assert [e.payload for e in events] == payloads, name
        sequences = [e.sequence for e in events]
        assert sequences == sorted(set(sequences)), f"{name}: a sequence twice or out of order"
        assert all(unpack_sequence(e.sequence) == (e.epoch, e.index) for e in events)
    rolled = {e.epoch for e in seen[rolling] + more[rolling]}
    assert len(rolled) >= 2, "the rolling stream went on in a new segment"
    print(f"{STREAMS} streams followed in {time.monotonic() - started:.1f} s")


async def test_subscribe_many_refuses_both_names_and_a_prefix(cluster: Cluster) -> None:
    async with StreamClient(cluster.master_address) as client:
        with pytest.raises(InvalidArgument):
            client.subscribe_many(["a/b"], prefix="a/")
        with pytest.raises(InvalidArgument):
            client.subscribe_many()


async def test_a_stalled_consumer_is_dropped_and_resumes_exactly_once(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small batches and a small inbox, so that a few MiB overflow every buffer between
    # the consumer and the stores (the defaults hold tens of MiB).
    monkeypatch.setattr(multiplex, "SUBSCRIBE_BATCH_ENTRIES", 16)
    monkeypatch.setattr(multiplex, "INBOX_ITEMS_MAX", 2)
    caplog.set_level(logging.INFO, logger="streamengine.client.multiplex")
    names = [f"slow/s{n}" for n in range(2)]
    payloads = [bytes([n % 256]) * STALLING_EVENT_BYTES for n in range(STALLING_EVENTS)]
    async with StreamClient(cluster.master_address) as client:
        for name in names:
            await client.create_stream(name)
            async with client.writer(name) as writer:
                for first in range(0, STALLING_EVENTS, 100):
                    await writer.append_batch(payloads[first : first + 100])
        subscription = client.subscribe_many(names, start=0)
        seen: dict[str, list[StreamEvent]] = {}
        taken = await subscription.__anext__()
        seen[taken.stream] = [taken]
        # Nothing taken for a while: the stores' buffers stay full past their limit.
        await asyncio.sleep(4 * STALL_MS / 1000)
        rest = await collect(
            subscription,
            {name: STALLING_EVENTS - len(seen.get(name, [])) for name in names},
            30,
        )
        await subscription.aclose()
    for name in names:
        events = seen.get(name, []) + rest.get(name, [])
        assert [e.payload for e in events] == payloads, name
        assert [e.index for e in events] == list(range(1, STALLING_EVENTS + 1)), name
    dropped = [r for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage()]
    assert dropped, "the stores never dropped the stalled subscriber"
