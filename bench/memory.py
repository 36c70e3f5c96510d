"""Memory of the writer and the stores while a peer stalls: a store, then a reader.

    .venv/bin/python -m bench.memory                       # starts a local cluster
    .venv/bin/python -m bench.memory --seconds 20 --size 100

Two phases, each on a fresh stream of a local cluster (3 stores, N=3 W=2, fsync always),
with one writer in this process appending batches of `--size`-byte events as fast as it
can for `--seconds`:

- a stalled store: after a second, one store of the writer's copy set is SIGSTOPped
  (its sockets stay open, it answers nothing) until the phase ends. W = 2 stores still
  ack, and the writer keeps what the stalled store lacks for resending, up to
  `RETAINED_BYTES_MAX` (then it detaches that store). Printed: the writer's RSS growth
  beside that named limit, and each store's;
- a stalled reader: a subscriber process reads from the start, is SIGSTOPped after its
  first events, and stays stopped while the writer appends. The store tailing to it
  buffers at most `--subscribe-buffer-batches` messages of the subscriber's batch size
  for it, then drops it as slow. Printed: each store's RSS growth beside that bound.

RSS is sampled every 50 ms; growth is the peak over the phase minus the RSS at its start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import psutil

from bench.append import local_cluster, peak_batched
from streamengine.client import StreamClient
from streamengine.client.core.replicator import (
    ENTRY_OVERHEAD_BYTES,
    RETAINED_BYTES_MAX,
    UNACKED_BYTES_MAX,
)
from streamengine.client.core.subscription import SUBSCRIBE_BATCH_ENTRIES
from streamengine.segment_store.group_commit import STORE_QUEUE_BYTES_MAX
from streamengine.segment_store.kv import MEMTABLE_BYTES, MEMTABLES_MAX
from streamengine.segment_store.store_context import SUBSCRIBE_BUFFER_BATCHES_DEFAULT

BATCH = 1000
BATCHES_IN_FLIGHT = 4
SAMPLE_S = 0.05
MIB = 1 << 20


@dataclass
class Peaks:
    """Peak RSS growth per process over a phase."""

    baseline: dict[str, int]
    peak: dict[str, int] = field(default_factory=dict)

    def growth_mib(self, name: str) -> float:
        return (self.peak.get(name, 0) - self.baseline[name]) / MIB


async def sample(processes: dict[str, psutil.Process], peaks: Peaks, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for name, process in processes.items():
            try:
                rss = process.memory_info().rss
            except psutil.Error:
                continue
            peaks.peak[name] = max(peaks.peak.get(name, 0), rss)
        await asyncio.sleep(SAMPLE_S)


async def append_for(client: StreamClient, stream: str, seconds: float, size: int) -> int:
    """Append as fast as the writer goes for `seconds` once it leads; the events acked."""
    async with client.writer(stream, leadership_timeout_s=15) as writer:
        rate = await peak_batched(writer, size, BATCH, BATCHES_IN_FLIGHT, seconds)
    return rate.events


def print_stores(processes: dict[str, psutil.Process], peaks: Peaks) -> None:
    print(
        f"  stores' named bounds: write queue {STORE_QUEUE_BYTES_MAX / MIB:.0f} MiB, RocksDB "
        f"memtables {MEMTABLES_MAX} x {MEMTABLE_BYTES / MIB:.0f} MiB (any store that takes writes)"
    )
    for name in sorted(n for n in processes if n.startswith("store")):
        print(f"  {name} RSS +{peaks.growth_mib(name):.0f} MiB")


def processes_of(pids: tuple[int, ...]) -> dict[str, psutil.Process]:
    """The writer (this process) and the stores (the cluster's pids after the master)."""
    named = {"writer": psutil.Process(os.getpid())}
    for number, pid in enumerate(pids[1:]):
        named[f"store{number}"] = psutil.Process(pid)
    return named


async def stalled_store(master: str, pids: tuple[int, ...], seconds: float, size: int) -> None:
    processes = processes_of(pids)
    peaks = Peaks({name: p.memory_info().rss for name, p in processes.items()})
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(processes, peaks, stop))
    async with StreamClient(master) as client:
        stream = "bench/stalled-store"
        await client.create_stream(stream, replicas=3, write_quorum=2)
        victim = processes["store2"]

        async def stall_later() -> None:
            await asyncio.sleep(1.0)
            victim.send_signal(signal.SIGSTOP)

        staller = asyncio.create_task(stall_later())
        try:
            acked = await append_for(client, stream, seconds, size)
        finally:
            await staller
            victim.send_signal(signal.SIGCONT)
    stop.set()
    await sampler
    print(f"stalled store (store2 stopped after 1 s, {seconds:.0f} s of {size} B events):")
    print(f"  acked {acked:,} events ({acked / seconds:,.0f}/s)")
    print(
        f"  writer RSS +{peaks.growth_mib('writer'):.0f} MiB; its named limits: retained "
        f"{RETAINED_BYTES_MAX / MIB:.0f} MiB, unacked {UNACKED_BYTES_MAX / MIB:.0f} MiB "
        "(payload and per-entry overhead as counted)"
    )
    print_stores(processes, peaks)


READER = [sys.executable, "-m", "bench.memory", "--reader"]


async def read_forever(master: str, stream: str) -> None:
    async with StreamClient(master) as client:
        async for event in client.subscribe(stream, 0):
            if event.index == 1:
                print("reading", flush=True)


async def stalled_reader(master: str, pids: tuple[int, ...], seconds: float, size: int) -> None:
    processes = processes_of(pids)
    async with StreamClient(master) as client:
        stream = "bench/stalled-reader"
        await client.create_stream(stream, replicas=3, write_quorum=2)
        await append_for(client, stream, 0.5, size)
        reader = await asyncio.to_thread(
            subprocess.Popen,
            [*READER, master, stream],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        try:
            assert reader.stdout is not None
            line = await asyncio.to_thread(reader.stdout.readline)
            if line.strip() != "reading":
                raise SystemExit(f"the reader did not start: {line!r}")
            reader.send_signal(signal.SIGSTOP)
            peaks = Peaks({name: p.memory_info().rss for name, p in processes.items()})
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample(processes, peaks, stop))
            acked = await append_for(client, stream, seconds, size)
            stop.set()
            await sampler
        finally:
            reader.send_signal(signal.SIGCONT)
            reader.kill()
            reader.wait()
    message_bytes = SUBSCRIBE_BATCH_ENTRIES * (size + ENTRY_OVERHEAD_BYTES)
    bound = SUBSCRIBE_BUFFER_BATCHES_DEFAULT * message_bytes / MIB
    print(f"stalled reader (a subscriber stopped after its first events, {seconds:.0f} s):")
    print(f"  acked {acked:,} events ({acked / seconds:,.0f}/s)")
    print(
        f"  store buffer bound per subscriber: {SUBSCRIBE_BUFFER_BATCHES_DEFAULT} messages of "
        f"{SUBSCRIBE_BATCH_ENTRIES} entries of {size} B = {bound:.1f} MiB"
    )
    print_stores(processes, peaks)
    print(f"  writer RSS +{peaks.growth_mib('writer'):.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--size", type=int, default=100, help="event payload bytes")
    parser.add_argument("--reader", nargs=2, metavar=("MASTER", "STREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reader:
        asyncio.run(read_forever(*args.reader))
        return
    with local_cluster("always", tls=False) as target:
        asyncio.run(stalled_store(target.master, target.pids, args.seconds, args.size))
    with local_cluster("always", tls=False) as target:
        asyncio.run(stalled_reader(target.master, target.pids, args.seconds, args.size))


if __name__ == "__main__":
    main()
