"""Where a lone write's time and CPU go, on one store, beside a bare framed echo.

    .venv/bin/python -m bench.write_path [--requests 600] [--gap-ms 5]

Three servers are measured the same way: one Write stream, one request at a time,
each sent `--gap-ms` after the last reply (0: back to back), round trips timed by the
client:
- echo: a data-plane server (`framed_server`) that answers each Write request with an
  empty reply at once: what the transport and the event loop cost, nothing of ours;
- store, fsync never: a real `streamengine store`, one 100-byte entry per request;
- store, fsync always: the same with every write synced.
For the store, the CPU of each of its threads per request (from /proc): the event
loop's (the request read, admission, the committer's hand-off, the reply), the
commit thread's (the plan, RocksDB, the fsync), gRPC's own threads (idle: Write goes
on the data plane).

The gap matters on this kind of machine: an idle process's threads sleep, and waking
them (the poller, the loop, the commit thread) costs time and CPU at every hop.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.append import percentile
from bench.store_write import BENCH_KEY, STORE_IDS
from streamengine.protocol import codec, framed, framing
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.framed_server import DataServer, ServerCall
from streamengine.protocol.framing import Kind
from streamengine.protocol.grants import Grant, GrantSegment, GrantSigner
from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing import free_port, make_store
from streamengine.v1 import entry_pb2, segment_store_pb2

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread id and name."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        role = "event loop" if int(tid) == pid else name
        found[f"{role} ({tid})"] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return found


async def _echo(call: ServerCall) -> None:
    async for request in call:
        assert isinstance(request, segment_store_pb2.WriteRequest)
        await call.send(segment_store_pb2.WriteReply(request_id=request.request_id))


def _serve_echo(address: str) -> None:
    async def serve() -> None:
        server = DataServer({Kind.WRITE_REQUEST: _echo}, lambda identity, _token: identity)
        await server.start(address, None)
        await asyncio.Event().wait()

    asyncio.run(serve())


def _requests(count: int) -> list[segment_store_pb2.WriteRequest]:
    grant = Grant(7, 1, "bench", "bench-writer", (GrantSegment(1, STORE_IDS),), 1 << 62)
    signed = GrantSigner(BENCH_KEY).sign(grant)
    return [
        codec.write_request(
            [StoredEntry.make(index, EntryKind.EVENT, 1, b"l" * 100)],
            segment=entry_pb2.SegmentId(stream_id=7, epoch=1, stream="bench/lone"),
            writer_epoch=1,
            acked_index=index - 1,
            request_id=index,
            grant=signed if index == 1 else b"",
        )
        for index in range(1, count + 1)
    ]


async def _round_trips(
    address: str, requests: list[segment_store_pb2.WriteRequest], gap_s: float, pid: int
) -> tuple[list[float], dict[str, float]]:
    """Round trips (s) of all but the first request, and each thread's CPU over them."""
    async with framed.connect(address, PLAINTEXT) as connection:
        call = await connection.call(framing.WRITE)
        await call.send(requests[0])
        await call.receive()
        before = thread_cpu_s(pid)
        times = []
        for request in requests[1:]:
            started = time.perf_counter()
            await call.send(request)
            await call.receive()
            times.append(time.perf_counter() - started)
            await asyncio.sleep(gap_s)
        after = thread_cpu_s(pid)
        await call.end()
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    return times, spent


def _line(label: str, times: list[float], cpu: dict[str, float], count: int) -> list[str]:
    lines = [
        f"{label:<24} p50 {percentile(times, 0.5) * 1e3:6.3f} ms  p99 "
        f"{percentile(times, 0.99) * 1e3:6.3f} ms  mean {statistics.mean(times) * 1e3:6.3f} ms"
        f"  CPU {sum(cpu.values()) / count * 1e6:5.0f} us/request"
    ]
    for name, seconds in sorted(cpu.items(), key=lambda item: -item[1]):
        if seconds > 0:
            lines.append(f"    {name:<30} {seconds / count * 1e6:5.0f} us/request")
    return lines


def measure(count: int, gap_s: float) -> list[str]:
    requests = _requests(count + 1)
    lines = []
    echo_address = f"127.0.0.1:{free_port()}"
    echo = multiprocessing.Process(target=_serve_echo, args=(echo_address,), daemon=True)
    echo.start()
    try:
        time.sleep(1.0)
        assert echo.pid is not None
        times, cpu = asyncio.run(_round_trips(echo_address, requests, gap_s, echo.pid))
        lines += _line("framed echo", times, cpu, count)
    finally:
        echo.kill()
    with tempfile.TemporaryDirectory(prefix="write-path-") as data:
        root = Path(data)
        key_file = root / "bench-signing-key.pub"
        key_file.write_text(BENCH_KEY.public_key.hex())
        for number, fsync in enumerate(("never", "always")):
            store = make_store(root, number, "127.0.0.1:1")
            store.args += ["--fsync", fsync, "--trust-signing-key", str(key_file)]
            store.start()
            try:
                times, cpu = asyncio.run(
                    _round_trips(store.data_address, requests, gap_s, store.pid)
                )
                lines += _line(f"store, fsync {fsync}", times, cpu, count)
            finally:
                store.kill()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--gap-ms", type=float, default=5.0, help="pause after each reply")
    args = parser.parse_args()
    print(f"one 100-byte entry per request, {args.requests} requests, {args.gap_ms:g} ms apart")
    for line in measure(args.requests, args.gap_ms / 1000):
        print(line)


if __name__ == "__main__":
    main()
