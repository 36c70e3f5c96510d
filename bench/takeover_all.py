"""How long a process takes to take over every stream another left open (issue #38).

    .venv/bin/python -m bench.takeover_all                 # 500 streams
    .venv/bin/python -m bench.takeover_all --lone-seals    # as before batched seals

A fresh local cluster (a master, 3 stores, plaintext, stores with fsync never; the
master's metadata commits are synced as always). One `StreamClient` creates `--streams`
streams (N=3, W=2), leads a writer on each, appends one event to each and closes: each
stream's open segment is left for its next leader to seal, as a process that stopped
leaves it. A second client then leads every stream at once and appends one event to
each: an append is acked only once the writer recovered and sealed the segment before
its own (the gate), so the last ack is when the takeover is done. Printed: the seconds
from the first lead until every stream appended, the p50 / p99 of that per stream, and
how the seals at the master went (`SealSegments` calls and the seals they carried,
lone `SealSegment` calls). `--lone-seals` sends each seal as its own `SealSegment`, as
the SDK did before it batched them (the lease session's batcher is told the master lacks
the batch call).

Every phase is bounded in time (`--phase-timeout-s`). A figure measured on a machine
shared with other work is inflated: say so with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from pathlib import Path

from bench.scale import (
    EVENT_BYTES,
    bounded,
    lead_all_and_append_once,
    on_a_local_cluster,
    percentile,
)
from streamengine.client import StreamClient

STREAMS_DEFAULT = 500


async def leave_open(address: str, names: list[str], timeout_s: float) -> None:
    """Create the streams, lead each, append one event to each, and let go."""
    async with StreamClient(address) as client:
        await bounded("create", timeout_s, client.create_streams(names, replicas=3, write_quorum=2))
        async with contextlib.AsyncExitStack() as exits:
            await lead_all_and_append_once(client, names, exits, timeout_s)


async def take_over(address: str, names: list[str], args: argparse.Namespace) -> str:
    async with StreamClient(address) as client, contextlib.AsyncExitStack() as exits:
        session = client._leases
        assert session is not None
        if args.lone_seals:
            session.seals._lone_until = math.inf
        started = time.monotonic()
        done: list[float] = []

        async def lead_and_append(name: str) -> None:
            writer = await exits.enter_async_context(
                client.writer(name, leadership_timeout_s=args.phase_timeout_s)
            )
            await writer.append(bytes(EVENT_BYTES))
            done.append(time.monotonic() - started)

        await bounded(
            "take over",
            args.phase_timeout_s,
            asyncio.gather(*(lead_and_append(name) for name in names)),
        )
        seals = session.seals
        return (
            f"every stream appending after {max(done):.2f} s (per stream p50 "
            f"{percentile(done, 0.5):.2f} s, p99 {percentile(done, 0.99):.2f} s); seals at "
            f"the master: {seals.batches_sent} SealSegments calls carrying "
            f"{seals.entries_sent}, {seals.lone_sent} lone SealSegment calls"
        )


async def measure(address: str, args: argparse.Namespace) -> None:
    names = [f"takeover/s{n}" for n in range(args.streams)]
    await leave_open(address, names, args.phase_timeout_s)
    line = await take_over(address, names, args)
    how = "lone seals" if args.lone_seals else "batched seals"
    print(f"{args.streams} streams taken over, {how}: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=STREAMS_DEFAULT)
    parser.add_argument("--lone-seals", action="store_true")
    parser.add_argument("--phase-timeout-s", type=float, default=300.0)
    parser.add_argument("--keep", type=Path, help="keep the cluster's data and logs here")
    args = parser.parse_args(argv)
    on_a_local_cluster("se-takeover-", args.keep, lambda address: measure(address, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
