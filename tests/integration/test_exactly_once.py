"""Exactly once with a producer id (issue #40) against real processes: a writer process
SIGKILLed in the middle of its batches, then a new process with the same producer id
that resends everything from its own start (`bench.append_writer` with a producer),
with a store of the unsealed segment lost in between too; and a producer resuming from
the positions a seal recorded at the master."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from bench.append_writer import PRODUCER_WINDOW
from streamengine.client import InvalidArgument, StreamClient
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
