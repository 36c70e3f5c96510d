"""Exactly once with a producer id (issue #40) against real processes: a writer process
SIGKILLed in the middle of its batches, then a new process with the same producer id
that resends everything from its own start (`bench.append_writer` with a producer),
with a store of the unsealed segment lost in between too; and a producer resuming from
the positions a seal recorded at the master."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from bench.append_writer import PRODUCER_WINDOW
from streamengine.client import AppendFailed, InvalidArgument, StreamClient
from streamengine.client.core.replicator import ENTRY_MEMORY_BYTES, ReplicatorLimits
from streamengine.protocol.limits import EVENT_BYTES_MAX
from streamengine.testing import Cluster, running_cluster, wait_until
from tests.integration.writer_process import WriterProcess, numbers_of, read_all

PRODUCER = "orders-ingest-7"


async def test_a_producer_killed_mid_batch_and_resent_from_its_start_has_every_event_once(
    cluster: Cluster, writers: list[WriterProcess]
) -> None:
    name = "exactly/kill"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        first = WriterProcess(cluster.master_address, name, "a", producer=PRODUCER)
        writers.append(first)
        await wait_until(lambda: first.last_acked() >= 100, 30, "100 acked appends")
        first.signal(signal.SIGKILL)
        first.kill()
        acked_before_kill = first.last_acked()

        # Everything again from sequence 0, past what the first may have had in flight.
        batches = (acked_before_kill + 1) // 10 + PRODUCER_WINDOW + 1
        second = WriterProcess(cluster.master_address, name, "a", batches, PRODUCER)
        writers.append(second)
        await wait_until(lambda: second.process.poll() is not None, 30, "the resend")
        assert second.first("done"), second.lines
        leading = second.first("leading")
        assert leading is not None
        # It knew, as it led, at least what the first one had acked.
        assert leading["last_producer_sequence"] >= acked_before_kill

        events = await read_all(client, name)
        assert numbers_of(events, "a") == list(range(batches * 10)), "not every event once"
        # A resent event is answered with the sequence it has in the stream.
        where = {int(p.split(b"-")[-1]): s for s, p in events}
        for line in second.acked():
            assert line["seq"] == where[line["acked"]], line


def batch(prefix: str, first: int, count: int = 10) -> list[bytes]:
    return [f"{prefix}-{n:06d}".encode() for n in range(first, first + count)]


async def test_a_producer_resumes_from_the_positions_the_masters_seal_recorded(
    cluster: Cluster,
) -> None:
    name = "exactly/sealed"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        async with client.writer(name, producer_id=PRODUCER) as first:
            assert first.last_producer_sequence is None
            for number in range(0, 50, 10):
                await first.append_batch(batch("a", number), producer_sequence=number)
            assert first.last_producer_sequence == 49
            # The writer rolls: its seal of the segment records where P stands.
            await client.seal(name)
        async with client.writer(name, producer_id=PRODUCER) as second:
            # Its grant carried the seal's positions; the segment it recovered is empty.
            assert second.last_producer_sequence == 49
            answered = await second.append_batch(batch("a", 40, 20), producer_sequence=40)
            with pytest.raises(InvalidArgument, match="gap"):
                await second.append_batch(batch("a", 70), producer_sequence=70)
        events = await read_all(client, name)
        assert numbers_of(events, "a") == list(range(60))
        where = {int(p.split(b"-")[-1]): s for s, p in events}
        # 40..48: durable, older than what the seal keeps (0); 49 and up: where they are.
        assert answered == [0] * 9 + [where[n] for n in range(49, 60)]


async def test_a_leader_failover_and_a_store_lost_before_the_retry_change_nothing(
    tmp_path: Path, writers: list[WriterProcess]
) -> None:
    name = "exactly/lost"
    with running_cluster(tmp_path, stores=4, master_args=["--lease-ms", "1000"]) as c:
        async with StreamClient(c.master_address) as client:
            await client.create_stream(name, replicas=3, write_quorum=2)
            first = WriterProcess(c.master_address, name, "a", producer=PRODUCER)
            writers.append(first)
            await wait_until(lambda: first.last_acked() >= 50, 30, "50 acked appends")
            first.signal(signal.SIGKILL)
            first.kill()
            # A store of the copy set the killed writer left unsealed goes too.
            [segment] = [s for s in await client.list_segments(name)]
            c.store_by_address(segment.copy_set[0].address).kill()

            # Past what the first may have had in flight (`PRODUCER_WINDOW` batches).
            batches = (first.last_acked() + 1) // 10 + PRODUCER_WINDOW + 1
            second = WriterProcess(c.master_address, name, "a", batches, PRODUCER)
            writers.append(second)
            await wait_until(lambda: second.process.poll() is not None, 30, "the resend")
            assert second.first("done"), second.lines
            events = await read_all(client, name)
            assert numbers_of(events, "a") == list(range(batches * 10)), "not every event once"


async def test_a_producer_that_opted_in_jumps_ahead_and_is_still_deduplicated(
    cluster: Cluster,
) -> None:
    name = "exactly/jumps"
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        async with client.writer(name, producer_id=PRODUCER) as plain:
            await plain.append_batch(batch("a", 0), producer_sequence=0)
            with pytest.raises(InvalidArgument, match="gap"):
                await plain.append_batch(batch("a", 100), producer_sequence=100)
        async with client.writer(name, producer_id=PRODUCER, sequence_jumps=True) as jumping:
            assert jumping.last_producer_sequence == 9
            await jumping.append_batch(batch("a", 100), producer_sequence=100)
            # Both batches resent: nothing at or below the mark (109) goes again.
            for first in (0, 100):
                again = await jumping.append_batch(batch("a", first), producer_sequence=first)
                assert len(again) == 10
            assert jumping.last_producer_sequence == 109
        events = await read_all(client, name)
        assert numbers_of(events, "a") == [*range(10), *range(100, 110)]


async def test_a_held_producer_batch_cancelled_fails_the_batches_held_behind_it(
    cluster: Cluster,
) -> None:
    """A producer's batches wait for room in turn, each decided behind the one before.
    One cancelled by its caller while it waits is never written, so the batch behind it
    must not be either: written, it would leave the cancelled sequences out of the
    stream under a mark past them, and their retry would be answered as written."""
    name = "exactly/held"
    # One big event fills the window: the next batches are held back behind it.
    limits = ReplicatorLimits(unacked_bytes_max=EVENT_BYTES_MAX + ENTRY_MEMORY_BYTES)
    big = 700_000

    def one(number: int) -> list[bytes]:
        return [f"a-{number:06d}".encode().ljust(big, b".")]

    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(name, replicas=3, write_quorum=2)
        async with client.writer(name, producer_id=PRODUCER, limits=limits) as writer:
            calls = [
                asyncio.create_task(writer.append_batch(one(n), producer_sequence=n))
                for n in range(3)
            ]
            await asyncio.sleep(0)  # each call decides and is given or held at once
            assert writer.statistics().waiting_appends == 2
            calls[1].cancel()
            with pytest.raises(AppendFailed, match="earlier batch of this producer"):
                await calls[2]
            assert len(await calls[0]) == 1
            assert writer.last_producer_sequence == 0
            # The caller retries from the cancelled batch: each event lands once.
            for number in (1, 2):
                await writer.append_batch(one(number), producer_sequence=number)
        events = await read_all(client, name)
        assert [int(p[2:8]) for _, p in events] == [0, 1, 2]
