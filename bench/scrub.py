"""The scrub's cost on appends, and its speed: 3 stores, W=2, fsync always.

    .venv/bin/python -m bench.scrub                      # rates 0 (off), 4 (default), 20
    .venv/bin/python -m bench.scrub --rates 0 4 --sealed-mb 60

A stream is filled with `--sealed-mb` of sealed segments, then, for each scrub rate in
turn, the stores restart with `--scrub-mb-per-s` at that rate (a restarted store has
checked nothing: its scrub reads every sealed replica from the start) and, while they
scrub, single appends of `--event-bytes` go in one at a time at `--light-rate` per
second on another stream: their latency p50/p99/max is printed beside the bytes the
stores scrubbed meanwhile (their metrics). Rate 0 is the scrub off: the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.append import latency_line, light_load
from streamengine.client import StreamClient
from streamengine.testing import Cluster, free_port, metric_value, running_cluster

FILL_STREAM = "bench/sealed"
PROBE_STREAM = "bench/probe"


async def fill(cluster: Cluster, sealed_mb: int, event_bytes: int) -> None:
    payload = b"s" * event_bytes
    events = sealed_mb * 1_000_000 // event_bytes
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(FILL_STREAM, segment_bytes=16 << 20)
        async with client.writer(FILL_STREAM) as writer:
            for _ in range(0, events, 1000):
                await writer.append_batch([payload] * 1000)
            await client.seal(FILL_STREAM)


def scrubbed_bytes(ports: list[int]) -> float:
    return sum(metric_value(p, "streamengine_store_scrub_bytes_total") for p in ports)


async def probe(cluster: Cluster, args: argparse.Namespace) -> list[float]:
    async with StreamClient(cluster.master_address) as client:
        await client.create_stream(PROBE_STREAM)
        async with client.writer(PROBE_STREAM) as writer:
            await writer.append(b"warm up")
            return await light_load(writer, args.event_bytes, args.light_rate, args.light_count)


def restart_stores(cluster: Cluster, rate: float) -> None:
    for store in cluster.stores:
        at = store.args.index("--scrub-mb-per-s")
        store.args[at + 1] = str(rate)
        store.terminate()
        store.start(wait=False)
    for store in cluster.stores:
        store.wait_serving()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0, 4, 20])
    parser.add_argument("--sealed-mb", type=int, default=60)
    parser.add_argument("--event-bytes", type=int, default=1000)
    parser.add_argument("--light-rate", type=float, default=100.0)
    parser.add_argument("--light-count", type=int, default=500)
    args = parser.parse_args()
    ports = [free_port() for _ in range(3)]
    with tempfile.TemporaryDirectory() as root, running_cluster(
        Path(root),
        stores=3,
        store_args=["--scrub-mb-per-s", "0"],
        store_args_for=lambda n: ["--metrics-port", str(ports[n])],
    ) as cluster:
        started = time.monotonic()
        asyncio.run(fill(cluster, args.sealed_mb, args.event_bytes))
        print(f"filled {args.sealed_mb} MB sealed in {time.monotonic() - started:.1f} s")
        for rate in args.rates:
            restart_stores(cluster, rate)
            before, started = scrubbed_bytes(ports), time.monotonic()
            latencies = asyncio.run(probe(cluster, args))
            seconds = time.monotonic() - started
            mb_per_s = (scrubbed_bytes(ports) - before) / seconds / 1e6
            label = f"scrub {rate:g} MB/s per store ({mb_per_s:.1f} MB/s scrubbed, 3 stores)"
            print(latency_line(label, latencies))


if __name__ == "__main__":
    main()
