"""A reader of the workload (`workload.ReaderWorkload`), per stream or multiplexed
(`--multiplexed`), records what the checker reads: subscriptions resumed from the
recorded tokens (an earlier incarnation's too), deliveries, a loss gone past and other
errors, per stream. A scripted client stands in for the cluster (no servers)."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from streamengine.client import StreamClient, StreamEvent
from streamengine.client.errors import DataLossError, Unavailable
from streamengine.protocol.sequence import pack_sequence
from tests.faults import payload, workload
from tests.faults.checker import Verdict, check_reader_order, deliveries
from tests.faults.history import Recorder, read_file

A, B = "t1/a", "t1/b"
HANG = "hang"  # the subscription waits for events that never come (until its churn)


def event(stream: str, index: int) -> StreamEvent:
    value = payload.make("w1.1", index, 0, 64, random.Random(index))
    return StreamEvent(pack_sequence(1, index), 1, index, value, stream)


class ScriptedClient:
    """A started client whose `subscribe` and `subscribe_many` play one script per
    subscription: events to hand out, then an error to raise, `HANG`, or the end (the
    reader then stops)."""

    def __init__(self, scripts: list[list[Any]], stopping: asyncio.Event) -> None:
        self.scripts = scripts
        self.stopping = stopping
        self.positions: list[dict[str, int]] = []
        self.starts: list[int] = []
        self.closed = False

    async def __aenter__(self) -> ScriptedClient:
        return self

    async def close(self) -> None:
        self.closed = True

    def subscribe_many(
        self, streams: Sequence[str], *, positions: Mapping[str, int]
    ) -> AsyncGenerator[StreamEvent, None]:
        assert list(streams) == [A, B]
        self.positions.append(dict(positions))
        return self.play(self.scripts.pop(0))

    def subscribe(self, stream: str, start: int) -> AsyncGenerator[StreamEvent, None]:
        assert stream == A
        self.starts.append(start)
        return self.play(self.scripts.pop(0))

    async def play(self, script: list[Any]) -> AsyncGenerator[StreamEvent, None]:
        for step in script:
            if isinstance(step, StreamEvent):
                yield step
            elif isinstance(step, BaseException):
                raise step
            else:
                await asyncio.Event().wait()
        if not self.scripts:
            self.stopping.set()


def reader_args(history: Path, streams: list[str], *options: str) -> argparse.Namespace:
    return workload.parse_args([
        "reader", "--master", "127.0.0.1:1", "--streams", ",".join(streams), "--name", "r1",
        "--inc", "2", "--history", str(history), "--seed", "1", "--churn-s", "0.1", *options,
    ])


def earlier_incarnation(path: Path) -> None:
    """r1's first incarnation, which recorded A up to index 3."""
    before = Recorder(path, "r1", inc=1)
    before.record("subscribe", stream=A, **{"from": 0})
    before.record("deliver", stream=A, events=[
        [e.sequence, 1, e.index, payload.parse(e.payload).pid,
         payload.fingerprint(e.payload), True] for e in (event(A, i) for i in (1, 2, 3))])
    before.close()


def follow(args: argparse.Namespace, path: Path, scripts: list[list[Any]]) -> ScriptedClient:
    """Run the second incarnation until its scripts are played."""
    recorder = Recorder(path, "r1", inc=2)

    async def run() -> ScriptedClient:
        reader = workload.ReaderWorkload(
            args, recorder, path, lambda _args: cast(StreamClient, client))
        client = ScriptedClient(scripts, reader.stopping)
        await asyncio.wait_for(reader.run(), 5.0)
        return client

    try:
        return asyncio.run(run())
    finally:
        recorder.close()


def reader_order_holds(path: Path, streams: list[str], last_index: int) -> None:
    """C6 over both incarnations: no repeat, no skip but a loss the reader was told of."""
    verdict = Verdict()
    reads = deliveries(read_file(path))
    for stream in streams:
        canonical = {"positions": [pack_sequence(1, i) for i in range(1, last_index + 1)]}
        check_reader_order(verdict, stream, canonical, reads)
    assert verdict.valid, verdict.anomalies


def records_of_this_incarnation(path: Path) -> dict[str, list[Any]]:
    mine = [r for r in read_file(path) if r["inc"] == 2]
    return {
        "subscribes": [(r["stream"], r["from"], r.get("after_loss")) for r in mine
                       if r["type"] == "subscribe"],
        "errors": [(r["stream"], r.get("data_loss")) for r in mine if r["type"] == "error"],
        "delivered": [(r["stream"], e[2]) for r in mine if r["type"] == "deliver"
                      for e in r["events"]],
    }


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The reader's history, an earlier incarnation's records in it; no pause between
    subscriptions."""
    monkeypatch.setattr(workload, "SUBSCRIBE_RETRY_S", 0.0)
    history = tmp_path / "r1.jsonl"
    earlier_incarnation(history)
    return history


def test_a_multiplexed_reader_records_per_stream_what_the_checker_reads(
    tmp_path: Path, path: Path
) -> None:
    scripts: list[list[Any]] = [
        # B's indexes 3..5 are unreadable everywhere: the whole subscription ends.
        [event(A, 4), event(B, 1), event(A, 5), event(B, 2), DataLossError(B, 1, 3, 5)],
        [event(B, 6), event(A, 6), HANG],  # dropped by churn
        [Unavailable("no master answers")],  # ends every stream's reading
        [event(A, 7)],
    ]
    client = follow(reader_args(tmp_path, [A, B], "--multiplexed"), path, scripts)

    assert client.closed and not scripts
    after_three, past_loss, seven = pack_sequence(1, 4), pack_sequence(1, 6), pack_sequence(1, 7)
    assert client.positions == [
        {A: after_three, B: 0},
        {A: pack_sequence(1, 6), B: past_loss},
        {A: seven, B: seven},
        {A: seven, B: seven},
    ]
    records = records_of_this_incarnation(path)
    assert records["subscribes"][:4] == [(A, after_three, None), (B, 0, None),
                                         (A, pack_sequence(1, 6), None), (B, past_loss, [1, 3, 5])]
    assert records["errors"] == [(B, [1, 3, 5]), (A, None), (B, None)]
    assert sorted(records["delivered"]) == [(A, 4), (A, 5), (A, 6), (A, 7),
                                            (B, 1), (B, 2), (B, 6)]
    reader_order_holds(path, [A, B], 7)


def test_a_reader_per_stream_records_the_same(tmp_path: Path, path: Path) -> None:
    scripts: list[list[Any]] = [
        [event(A, 4), event(A, 5), DataLossError(A, 1, 6, 7)],
        [event(A, 8), HANG],
        [Unavailable("no master answers")],
        [event(A, 9)],
    ]
    client = follow(reader_args(tmp_path, [A]), path, scripts)

    assert client.closed and not scripts
    nine = pack_sequence(1, 9)
    assert client.starts == [pack_sequence(1, 4), pack_sequence(1, 8), nine, nine]
    records = records_of_this_incarnation(path)
    assert records["subscribes"] == [(A, pack_sequence(1, 4), None),
                                     (A, pack_sequence(1, 8), [1, 6, 7]),
                                     (A, nine, None), (A, nine, None)]
    assert records["errors"] == [(A, [1, 6, 7]), (A, None)]
    assert records["delivered"] == [(A, 4), (A, 5), (A, 8), (A, 9)]
    reader_order_holds(path, [A], 9)
