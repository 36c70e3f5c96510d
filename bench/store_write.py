"""Store write throughput against a raw rocksdict WriteBatch loop, measured in one run.

100-byte entries in batches of 100; 1 and 4 concurrent writers; fsync always and never.
A writer is one Write stream to a real `streamengine store` process, with a window of
batches in flight (as a leader pipelines); the raw loop writes the same keys and values
into a RocksDB of its own, one WriteBatch per batch (`sync` per batch for "always"), one
thread per writer. Requests and raw batches are built before the clock starts.

    .venv/bin/python -m bench.store_write [--seconds 3] [--window 8] [--fsync both]

With a window above 1, batches of one writer share syncs too (group commit), which the
raw loop, one synced WriteBatch per batch, cannot; `--window 1` compares batch for batch.

The store runs without a master and trusts a key of this benchmark's
(`--trust-signing-key`): each Write stream shows a grant it signed once, as a leader's.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.peers.common import proc_cpu_seconds
from streamengine.protocol import codec, framed, framing
from streamengine.protocol.entry import EntryKind, StoredEntry, encode_value
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.signing import SigningKey
from streamengine.protocol.transport import PLAINTEXT
from streamengine.segment_store.core.keys import entry_key
from streamengine.testing import make_store
from streamengine.v1 import entry_pb2, segment_store_pb2

ENTRY_BYTES = 100
BATCH_ENTRIES = 100
# Signs the grants of the benchmark's store (`--trust-signing-key`).
BENCH_KEY = SigningKey.generate()
STORE_IDS = ("store0", "store1")


@dataclass(frozen=True)
class Figure:
    fsync: str
    writers: int
    store_rate: float
    raw_rate: float
    # CPU time of the store process (user + system) per entry written.
    store_cpu_us: float

    @property
    def ratio(self) -> float:
        return self.store_rate / self.raw_rate if self.raw_rate else 0.0


def _payload(index: int) -> bytes:
    return (b"%010d" % index).ljust(ENTRY_BYTES, b".")


def _stored(index: int) -> StoredEntry:
    return StoredEntry.make(index, EntryKind.EVENT, 1, _payload(index))


def raw_rate(root: Path, fsync: bool, writers: int, batches: int) -> float:
    """Entries/s of `writers` threads each writing `batches` WriteBatches."""
    from rocksdict import Options, Rdict, WriteBatch, WriteOptions

    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(str(root / f"raw-{fsync}-{writers}"), options)
    write_options = WriteOptions()
    write_options.sync = fsync
    prepared = []
    for writer in range(writers):
        rows = []
        for number in range(batches):
            first = number * BATCH_ENTRIES + 1
            rows.append(
                [
                    (
                        entry_key(writer + 1, 1, e.index),
                        encode_value(e.kind, e.epoch, e.crc32c, e.payload),
                    )
                    for e in (_stored(i) for i in range(first, first + BATCH_ENTRIES))
                ]
            )
        prepared.append(rows)

    def loop(rows: list[list[tuple[bytes, bytes]]]) -> None:
        for row in rows:
            batch = WriteBatch(raw_mode=True)
            for key, value in row:
                batch.put(key, value)
            db.write(batch, write_options)

    threads = [threading.Thread(target=loop, args=(rows,)) for rows in prepared]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    db.close()
    return writers * batches * BATCH_ENTRIES / elapsed


def _requests(stream_id: int, batches: int) -> list[segment_store_pb2.WriteRequest]:
    segment = entry_pb2.SegmentId(stream_id=stream_id, epoch=1)
    grant = Grant(stream_id, 1, "bench", "bench-writer", (GrantSegment(1, STORE_IDS),), 1 << 62)
    signed = GrantSigner(BENCH_KEY).sign(grant)
    requests = []
    for number in range(batches):
        first = number * BATCH_ENTRIES + 1
        stored = [_stored(i) for i in range(first, first + BATCH_ENTRIES)]
        requests.append(
            codec.write_request(
                stored,
                segment=segment,
                writer_epoch=1,
                acked_index=max(first - 1, 0),
                request_id=number,
                grant=signed if number == 0 else b"",
            )
        )
    return requests


async def _writer(address: str, requests: list[segment_store_pb2.WriteRequest], window: int) -> int:
    """One leader's stream (on the store's data plane) with `window` batches in flight;
    returns entries accepted."""
    slots = asyncio.Semaphore(window)
    accepted = 0
    async with framed.connect(address, PLAINTEXT) as connection:
        call = await connection.call(framing.WRITE)

        async def produce() -> None:
            for request in requests:
                await slots.acquire()
                await call.send(request)
            await call.end()

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(produce())
            while (reply := await call.receive()) is not None:
                assert isinstance(reply, segment_store_pb2.WriteReply)
                if reply.status == segment_store_pb2.ACCEPTED:
                    accepted += reply.last_index - reply.first_index + 1
                slots.release()
    return accepted


async def store_rate(
    address: str, pid: int, writers: int, batches: int, window: int, base: int
) -> tuple[float, float]:
    """(entries/s, the store's CPU microseconds per entry)."""
    prepared = [_requests(base + w, batches) for w in range(writers)]
    cpu_before = proc_cpu_seconds(pid)
    started = time.perf_counter()
    done = await asyncio.gather(*(_writer(address, r, window) for r in prepared))
    elapsed = time.perf_counter() - started
    cpu = proc_cpu_seconds(pid) - cpu_before
    return sum(done) / elapsed, cpu * 1e6 / max(1, sum(done))


def measure(seconds: float, window: int, fsyncs: tuple[str, ...]) -> list[Figure]:
    root = Path(tempfile.mkdtemp(prefix="store-bench-"))
    figures = []
    try:
        for fsync in fsyncs:
            # Size each run from a short raw probe so it lasts about `seconds`.
            probe = raw_rate(root, fsync == "always", 1, 20)
            batches = max(20, int(probe * seconds / BATCH_ENTRIES))
            key_file = root / "bench-signing-key.pub"
            key_file.write_text(BENCH_KEY.public_key.hex())
            store = make_store(root, 0 if fsync == "always" else 1, "127.0.0.1:1")
            store.args += ["--fsync", fsync, "--trust-signing-key", str(key_file)]
            store.start()
            try:
                for number, writers in enumerate((1, 4)):
                    per_writer = max(20, batches // writers)
                    rate, cpu_us = asyncio.run(
                        store_rate(
                            store.data_address,
                            store.pid,
                            writers,
                            per_writer,
                            window,
                            100 * (number + 1),
                        )
                    )
                    raw = raw_rate(root, fsync == "always", writers, per_writer)
                    figures.append(Figure(fsync, writers, rate, raw, cpu_us))
            finally:
                store.kill()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="rough length of each run")
    parser.add_argument("--window", type=int, default=8, help="batches in flight per writer")
    parser.add_argument("--fsync", choices=["always", "never", "both"], default="both")
    args = parser.parse_args()
    fsyncs = ("always", "never") if args.fsync == "both" else (args.fsync,)
    figures = measure(args.seconds, args.window, fsyncs)
    print(f"{ENTRY_BYTES}-byte entries, batches of {BATCH_ENTRIES}, window {args.window}")
    print(
        f"{'fsync':<8}{'writers':>8}{'store entries/s':>18}{'raw entries/s':>16}{'ratio':>8}"
        f"{'store CPU us/entry':>20}"
    )
    for f in figures:
        print(
            f"{f.fsync:<8}{f.writers:>8}{f.store_rate:>18,.0f}{f.raw_rate:>16,.0f}{f.ratio:>8.0%}"
            f"{f.store_cpu_us:>20.2f}"
        )


if __name__ == "__main__":
    main()
