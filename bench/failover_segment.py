"""Failover with a large unsealed segment: SIGKILL of a writer that filled its segment
to the standby's first ack, on a plain stream and on a stream with producers.

    .venv/bin/python -m bench.failover_segment                  # starts a local cluster
    .venv/bin/python -m bench.failover_segment --segment-mib 128 --runs 3

Per run and kind, on a fresh stream: a writer process (`--fill`, never rolling) appends
`--segment-mib` MiB in events of `EVENT_BYTES` (with a producer id on the stream with
producers) and says so; it is SIGKILLed; a plain writer here then takes the lease,
seals and recovers that segment and gets one append acked. The figure is the wall time
from the kill to that ack. Recovery reads a segment whole only on a stream with
producers (the marks it folds into the seal's positions may be anywhere in it); a plain
stream's recovery reads its tail, whatever the segment's size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.failover import create_stream

REPO = Path(__file__).resolve().parents[1]
EVENT_BYTES = 64 << 10
BATCH_EVENTS = 64  # 4 MiB a batch, half of WRITE_BATCH_BYTES_MAX
FILL_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 120.0
KINDS = ("plain", "producers")


async def fill(master: str, stream: str, mib: int, producer: str | None) -> None:
    """Lead `stream` and append `mib` MiB into one segment, then wait to be killed."""
    from streamengine.client import StreamClient

    events = (mib << 20) // EVENT_BYTES
    async with (
        StreamClient(master) as client,
        client.writer(stream, rolling=False, producer_id=producer) as writer,
    ):
        sent = 0
        while sent < events:
            count = min(BATCH_EVENTS, events - sent)
            payloads = [os.urandom(EVENT_BYTES) for _ in range(count)]
            sequence = sent if producer is not None else None
            await writer.append_batch(payloads, producer_sequence=sequence)
            sent += count
        print("filled", flush=True)
        await asyncio.Event().wait()


async def take_over(master: str, stream: str) -> float:
    """Lead `stream` as a plain writer; the monotonic time of the first ack."""
    from streamengine.client import StreamClient

    async with StreamClient(master) as client, client.writer(stream) as writer:
        await writer.append_batch([b"after the failover"])
        return time.monotonic()


async def one_run(master: str, kind: str, number: int, mib: int) -> float:
    stream = f"bench/segment-{kind}-{number}-{os.getpid()}"
    create_stream(master, stream)
    command = ["-m", "bench.failover_segment", "--fill", master, stream]
    command += ["--segment-mib", str(mib)] + (["--producer", "p"] if kind == "producers" else [])
    filler = await asyncio.create_subprocess_exec(
        sys.executable, *command, cwd=REPO, stdout=subprocess.PIPE
    )
    try:
        assert filler.stdout is not None
        line = await asyncio.wait_for(filler.stdout.readline(), FILL_TIMEOUT_S)
        if line.strip() != b"filled":
            raise RuntimeError(f"the filling writer did not fill its segment: {line!r}")
        killed_at = time.monotonic()
        filler.send_signal(signal.SIGKILL)
        acked_at = await asyncio.wait_for(take_over(master, stream), RUN_TIMEOUT_S)
        return acked_at - killed_at
    finally:
        if filler.returncode is None:
            filler.kill()
        await filler.wait()


async def measure(master: str, runs: int, mib: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for number in range(runs):
        for kind in KINDS:
            took = await one_run(master, kind, number, mib)
            results[kind].append(took)
            print(f"run {number + 1} {kind}: kill -> first ack {took:.3f} s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--segment-mib", type=int, default=64)
    parser.add_argument("--fill", nargs=2, metavar=("MASTER", "STREAM"), help=argparse.SUPPRESS)
    parser.add_argument("--producer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fill:
        master, stream = args.fill
        asyncio.run(fill(master, stream, args.segment_mib, args.producer))
        return 0
    from streamengine.testing import running_cluster

    with (
        tempfile.TemporaryDirectory(prefix="se-failover-segment-") as root,
        running_cluster(Path(root), stores=3) as cluster,
    ):
        results = asyncio.run(measure(cluster.master_address, args.runs, args.segment_mib))
    for kind in KINDS:
        print(
            f"{kind}: segment of {args.segment_mib} MiB, kill -> first ack median "
            f"{statistics.median(results[kind]):.3f} s, max {max(results[kind]):.3f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
