"""`streamengine append` and `streamengine tail`: events in from standard input, out to
standard output."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from streamengine.tools.ops import stream_client

APPEND_BATCH_DEFAULT = 500


def _read_lines(path: str | None) -> Iterator[bytes]:
    source = sys.stdin.buffer if path in (None, "-") else open(path, "rb")  # noqa: SIM115
    try:
        for line in source:
            yield line.rstrip(b"\r\n")
    finally:
        if source is not sys.stdin.buffer:
            source.close()


# Batches read ahead of the writer: the reading thread waits beyond this many.
INPUT_BATCHES_AHEAD = 2


async def _input_batches(path: str | None, size: int) -> AsyncIterator[list[bytes]]:
    """The input's lines (`_read_lines`) in batches of `size`, read in a thread of their
    own: a terminal's input blocks, and blocking the loop would stop the writer's
    heartbeats and leave Ctrl-C unanswered (asyncio's SIGINT handler cancels the main
    task, which a blocked loop never runs). A daemon thread: the process may end while
    it waits for input."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[bytes] | BaseException | None] = asyncio.Queue(INPUT_BATCHES_AHEAD)

    def hand_over(item: list[bytes] | BaseException | None) -> None:
        asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

    def read() -> None:
        try:
            batch: list[bytes] = []
            for line in _read_lines(path):
                batch.append(line)
                if len(batch) >= size:
                    hand_over(batch)
                    batch = []
            if batch:
                hand_over(batch)
            hand_over(None)
        except Exception as error:
            hand_over(error)

    threading.Thread(target=read, name="append-input", daemon=True).start()
    while (item := await queue.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


def cmd_append(args: argparse.Namespace) -> int:
    """Append one event per input line, `--batch` lines per append."""
    import asyncio

    async def append() -> tuple[int, int]:
        count, last = 0, 0
        silent_told = False
        async with stream_client(args) as client, client.writer(args.name) as writer:
            async for batch in _input_batches(args.file, args.batch):
                last = (await writer.append_batch(batch))[-1]
                count += len(batch)
                silent_told = _tell_master_silence(writer.statistics(), silent_told)
        return count, last

    if args.batch < 1:
        raise SystemExit("streamengine: error: --batch must be at least 1")
    count, last = asyncio.run(append())
    print(f"appended {count} events to {args.name}" + (f", last sequence {last}" if count else ""))
    return 0


# A writer appends on while no master answers (it cannot roll meanwhile); `append`
# says so on stderr once the silence lasts this long, and again when it ends.
MASTER_SILENCE_TOLD_S = 5.0


def _tell_master_silence(statistics: Any, told: bool) -> bool:
    """Whether the user now knows the master is silent."""
    silent_s = statistics.master_silent_s
    if silent_s is not None and silent_s >= MASTER_SILENCE_TOLD_S and not told:
        print(
            f"streamengine: no master has answered for {silent_s:.0f} s; appending on to "
            "the open segment (no roll until one answers)",
            file=sys.stderr,
        )
        return True
    if told and silent_s is not None and silent_s < MASTER_SILENCE_TOLD_S:
        print("streamengine: the master answers again", file=sys.stderr)
        return False
    return told


def cmd_tail(args: argparse.Namespace) -> int:
    """Print acked events from `--from` on; with `--follow`, keep waiting for new ones.
    Events come as record batches, printed a batch at a time."""
    import asyncio
    import base64

    def render(sequence: int, epoch: int, index: int, payload: bytes) -> str:
        if args.format == "json":
            try:
                text: dict[str, str] = {"payload": payload.decode()}
            except UnicodeDecodeError:
                text = {"payload_base64": base64.b64encode(payload).decode()}
            return json.dumps({"sequence": sequence, "epoch": epoch, "index": index} | text)
        return f"{sequence}\t{payload.decode(errors='backslashreplace')}"

    async def tail() -> None:
        async with stream_client(args) as client:
            if args.follow:
                batches = client.subscribe_batches(args.name, start=args.start)
            elif args.start == "end":
                return  # nothing is acked past the end yet
            else:
                batches = client.read_batches(
                    args.name, start=args.start, give_up_after_s=args.give_up_after
                )
            async for batch in batches:
                columns = [
                    batch.column(name).to_pylist()
                    for name in ("sequence", "epoch", "index", "payload")
                ]
                lines = "\n".join(itertools.starmap(render, zip(*columns, strict=True)))
                print(lines, flush=args.follow)

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return 0
    return 0


# ---- bench ----
