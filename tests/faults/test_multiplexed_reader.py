"""The multiplexed reader (`workload.ReaderWorkload` with `--multiplexed`) records what
the per-stream reader records, so the checker reads it unchanged: a scripted
`subscribe_many` stands in for the cluster (no servers)."""

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
    """A started client whose `subscribe_many` plays one script per subscription: events
    to hand out, then an error to raise, `HANG`, or the end (the reader then stops)."""

    def __init__(self, scripts: list[list[Any]], stopping: asyncio.Event) -> None:
        self.scripts = scripts
        self.stopping = stopping
        self.positions: list[dict[str, int]] = []
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


def reader_args(history: Path) -> argparse.Namespace:
    args = workload.parse_args([
        "reader", "--master", "127.0.0.1:1", "--streams", f"{A},{B}", "--name", "r1",
        "--inc", "2", "--history", str(history), "--seed", "1", "--churn-s", "0.1",
        "--multiplexed",
    ])
    assert args.multiplexed
    return args


def test_a_multiplexed_reader_records_per_stream_what_the_checker_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workload, "SUBSCRIBE_RETRY_S", 0.0)
    path = tmp_path / "r1.jsonl"
    # An earlier incarnation recorded A up to index 3: this one resumes after it.
    before = Recorder(path, "r1", inc=1)
    before.record("subscribe", stream=A, **{"from": 0})
    before.record("deliver", stream=A, events=[
        [e.sequence, 1, e.index, payload.parse(e.payload).pid,
         payload.fingerprint(e.payload), True] for e in map(lambda i: event(A, i), (1, 2, 3))])
    before.close()
    args = reader_args(tmp_path)
    recorder = Recorder(path, "r1", inc=2)
    scripts: list[list[Any]] = [
        # B's indexes 3..5 are unreadable everywhere: the whole subscription ends.
        [event(A, 4), event(B, 1), event(A, 5), event(B, 2), DataLossError(B, 1, 3, 5)],
        [event(B, 6), event(A, 6), HANG],  # dropped by churn
        [Unavailable("no master answers")],  # ends every stream's reading
        [event(A, 7)],
    ]

    async def follow() -> ScriptedClient:
        reader = workload.ReaderWorkload(
            args, recorder, path, lambda _args: cast(StreamClient, client))
        client = ScriptedClient(scripts, reader.stopping)
        await asyncio.wait_for(reader.run(), 5.0)
        return client

    client = asyncio.run(follow())
    recorder.close()

    assert client.closed and not scripts
    after_three, past_loss = pack_sequence(1, 4), pack_sequence(1, 6)
    assert client.positions == [
        {A: after_three, B: 0},
        {A: pack_sequence(1, 6), B: past_loss},
        {A: pack_sequence(1, 7), B: pack_sequence(1, 7)},
        {A: pack_sequence(1, 7), B: pack_sequence(1, 7)},
    ]
    mine = [r for r in read_file(path) if r["inc"] == 2]
    subscribes = [(r["stream"], r["from"], r.get("after_loss")) for r in mine
                  if r["type"] == "subscribe"]
    assert subscribes[:4] == [(A, after_three, None), (B, 0, None),
                              (A, pack_sequence(1, 6), None), (B, past_loss, [1, 3, 5])]
    errors = [(r["stream"], r.get("data_loss")) for r in mine if r["type"] == "error"]
    assert errors == [(B, [1, 3, 5]), (A, None), (B, None)]
    delivered = {stream: [e[2] for r in mine if r["type"] == "deliver" and r["stream"] == stream
                          for e in r["events"]] for stream in (A, B)}
    assert delivered == {A: [4, 5, 6, 7], B: [1, 2, 6]}

    # C6 over both incarnations: no repeat, no skip but the loss it was told of.
    verdict = Verdict()
    reads = deliveries(read_file(path))
    for stream in (A, B):
        canonical = {"positions": [pack_sequence(1, index) for index in range(1, 8)]}
        check_reader_order(verdict, stream, canonical, reads)
    assert verdict.valid, verdict.anomalies
