"""The demo workload: one writer appends JSON events while a follower tails them.

    python -m deploy.workload --master HOST:PORT --stream demo/orders --events 100000 \
        [--pause-file PATH]

Halfway through, a hook runs (the demo kills and restarts a store there; with
`--pause-file` the process prints `HALFWAY` and waits for that file to appear, so a test
can cut a store off the network meanwhile). At the end it checks that the follower saw
exactly what was acknowledged, in order, and prints a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from streamengine import StreamClient

BATCH = 500
KINDS = ("order", "refund", "signup", "login", "logout")
FOLLOWER_DRAIN_S = 60.0


def payload(number: int) -> bytes:
    kind = KINDS[(number * 7) % len(KINDS)]
    return json.dumps({"kind": kind, "n": number, "amount": number % 997}).encode()


@dataclass(frozen=True)
class WorkloadResult:
    appended: int
    seconds: float
    followed: int
    follower_matches: bool
    first_sequence: int
    last_sequence: int

    @property
    def events_per_s(self) -> float:
        return self.appended / self.seconds if self.seconds else 0.0


Progress = Callable[[int, int], None]


async def run_workload(
    client: StreamClient,
    stream: str,
    events: int,
    on_halfway: Callable[[], Awaitable[None]] | None = None,
    progress: Progress | None = None,
) -> WorkloadResult:
    """Append `events` events in batches while a follower tails the stream from the
    first appended sequence; returns what both saw."""
    acked: list[tuple[int, bytes]] = []
    seen: list[tuple[int, bytes]] = []
    started_at = asyncio.Event()
    first_sequence = 0

    async def follow() -> None:
        await started_at.wait()
        async for event in client.subscribe(stream, start=first_sequence):
            seen.append((event.sequence, event.payload))
            if len(seen) >= events:
                return

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        follower = group.create_task(follow())
        async with client.writer(stream) as writer:
            halfway_done = on_halfway is None
            for first in range(0, events, BATCH):
                batch = [payload(n) for n in range(first, min(events, first + BATCH))]
                sequences = await writer.append_batch(batch)
                acked.extend(zip(sequences, batch, strict=True))
                if not started_at.is_set():
                    first_sequence = sequences[0]
                    started_at.set()
                if progress is not None:
                    progress(len(acked), events)
                if not halfway_done and len(acked) >= events // 2:
                    halfway_done = True
                    assert on_halfway is not None
                    await on_halfway()
        seconds = time.perf_counter() - started
        try:
            await asyncio.wait_for(asyncio.shield(follower), FOLLOWER_DRAIN_S)
        except TimeoutError:
            follower.cancel()
    return WorkloadResult(
        appended=len(acked),
        seconds=seconds,
        followed=len(seen),
        follower_matches=seen == acked,
        first_sequence=acked[0][0] if acked else 0,
        last_sequence=acked[-1][0] if acked else 0,
    )


async def _wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(path.exists):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s}s")
        await asyncio.sleep(0.05)


async def _main(args: argparse.Namespace) -> WorkloadResult:
    async def pause() -> None:
        print("HALFWAY", flush=True)
        await _wait_for_file(args.pause_file, args.pause_timeout)

    async with StreamClient(args.master, certs_dir=args.certs_dir) as client:
        await client.create_stream(args.stream)
        return await run_workload(
            client, args.stream, args.events, pause if args.pause_file else None
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", required=True)
    parser.add_argument(
        "--certs-dir", type=Path, help="TLS: a certs dir with ca.crt (and client.root)"
    )
    parser.add_argument("--stream", default="demo/orders")
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--pause-file", type=Path)
    parser.add_argument("--pause-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    result = asyncio.run(_main(args))
    print(json.dumps(asdict(result) | {"events_per_s": round(result.events_per_s)}), flush=True)
    return 0 if result.follower_matches and result.followed == result.appended else 1


if __name__ == "__main__":
    sys.exit(main())
