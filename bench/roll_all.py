"""How long appends wait when every stream a client leads rolls at once (issue #38).

    .venv/bin/python -m bench.roll_all                  # 500 streams
    .venv/bin/python -m bench.roll_all --streams 200 --rounds 3

A fresh local cluster (a master, 3 stores, plaintext, stores with fsync never; the
master's metadata commits are synced as always) and one `StreamClient` in this process,
which creates `--streams` streams (N=3, W=2), leads a writer on each and appends one
event to each. Then, each round, an operator's `RequestRoll` for every stream (as
`streamengine seal` asks it, all at once): each leader hears of it with its lease
session's next renewal and rolls, as the writers of a process do together once a store
of their copy sets is lost (S18 of the fault suite). Meanwhile every writer appends one
event at a time; the round ends when every stream has appended in its new epoch (a
leader a busy master found without a running lease, and so did not ask, is asked again
each second). Printed per round: the seconds from the first request until every stream
appended again, the p50 / p99 of that per stream, the longest any one append waited,
and the appends answered without an ack (in doubt, failed, timed out).

Later rounds measure the same thing again: they stalled on earlier trees (a writer
that rolled heard the next request only with its own heartbeat, every
`SESSION_BOUND_HEARTBEAT_MS`) and no longer do on a machine that is not starved
(docs/performance.md, "Rolling many streams at once").

Every phase is bounded in time (`--phase-timeout-s`). A figure measured on a machine
shared with other work is inflated: say so with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from bench.scale import (
    EVENT_BYTES,
    PhaseTimedOut,
    bounded,
    lead_all_and_append_once,
    on_a_local_cluster,
    percentile,
)
from streamengine.client import AppendFailed, AppendInDoubt, AppendTimedOut, StreamClient
from streamengine.client.writer import Writer
from streamengine.v1 import master_pb2

STREAMS_DEFAULT = 500
# An append not acked in this long fails the round (the figure is far below it).
APPEND_WAIT_S_MAX = 60.0
# A leader not rolled yet is asked again this often.
ASK_AGAIN_S = 1.0
# Appends answered but not acked during a round (a roll that could not drain them).
ENDED_NOT_ACKED: dict[str, int] = {}


async def append_through_roll(
    writer: Writer, epoch_before: int, started: float
) -> tuple[float, float]:
    """Append one event at a time until one is acked in an epoch past `epoch_before`:
    (seconds from `started` until then, the longest append's wait)."""
    payload = bytes(EVENT_BYTES)
    longest = 0.0
    while True:
        rolled = writer.epoch > epoch_before
        sent = time.monotonic()
        try:
            async with asyncio.timeout(APPEND_WAIT_S_MAX):
                await writer.append(payload)
        except (AppendInDoubt, AppendFailed, AppendTimedOut) as error:
            # Answered, though not acked: counted, and the next append goes on.
            ENDED_NOT_ACKED[type(error).__name__] = ENDED_NOT_ACKED.get(type(error).__name__, 0) + 1
            rolled = False
        acked = time.monotonic()
        longest = max(longest, acked - sent)
        if rolled:
            return acked - started, longest
        await asyncio.sleep(0.01)  # one append per stream at a time, not a busy loop


async def ask_until_rolled(client: StreamClient, writers: list[Writer], epochs: list[int]) -> None:
    """Ask every leader to roll, all at once; again each `ASK_AGAIN_S` for those that
    have not rolled yet: a master too busy to renew a lease in time finds it ended and
    asks nobody (`RequestRoll` answers no leader)."""
    while True:
        waiting = [w for w, epoch in zip(writers, epochs, strict=True) if w.epoch <= epoch]
        asks = [
            client.master.RequestRoll(master_pb2.RequestRollRequest(stream=w.stream), timeout=5.0)
            for w in waiting
        ]
        await asyncio.gather(*asks, return_exceptions=True)
        await asyncio.sleep(ASK_AGAIN_S)


async def roll_round(client: StreamClient, writers: list[Writer], timeout_s: float) -> str:
    epochs = [writer.epoch for writer in writers]
    started = time.monotonic()
    appending = [
        asyncio.ensure_future(append_through_roll(writer, epoch, started))
        for writer, epoch in zip(writers, epochs, strict=True)
    ]
    asking = asyncio.ensure_future(ask_until_rolled(client, writers, epochs))
    try:
        try:
            async with asyncio.timeout(timeout_s):
                results = await asyncio.gather(*appending)
        except TimeoutError:
            rolled = sum(w.epoch > e for w, e in zip(writers, epochs, strict=True))
            raise PhaseTimedOut(f"after {timeout_s} s: {rolled} of {len(writers)} rolled") from None
    finally:
        for task in [asking, *appending]:
            task.cancel()
    done = [seconds for seconds, _ in results]
    waits = [longest for _, longest in results]
    stepped_down = sum(not w.leading for w in writers)
    not_acked = dict(ENDED_NOT_ACKED)
    ENDED_NOT_ACKED.clear()
    return (
        f"every stream appending again after {max(done):.2f} s (per stream p50 "
        f"{percentile(done, 0.5):.2f} s, p99 {percentile(done, 0.99):.2f} s); longest "
        f"append wait {max(waits):.2f} s; {stepped_down} stepped down; "
        f"ended not acked: {not_acked or 'none'}"
    )


async def measure(address: str, args: argparse.Namespace) -> None:
    names = [f"rolls/s{n}" for n in range(args.streams)]
    async with StreamClient(address) as client:
        await bounded(
            "create", args.phase_timeout_s, client.create_streams(names, replicas=3, write_quorum=2)
        )
        async with contextlib.AsyncExitStack() as exits:
            writers = await lead_all_and_append_once(client, names, exits, args.phase_timeout_s)
            for number in range(args.rounds):
                line = await roll_round(client, writers, args.phase_timeout_s)
                print(f"round {number + 1}, {args.streams} streams: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=STREAMS_DEFAULT)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--phase-timeout-s", type=float, default=300.0)
    parser.add_argument("--keep", type=Path, help="keep the cluster's data and logs here")
    args = parser.parse_args(argv)
    on_a_local_cluster("se-rolls-", args.keep, lambda address: measure(address, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
