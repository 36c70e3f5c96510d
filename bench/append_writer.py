"""A writer process: `python -m bench.append_writer MASTER STREAM PREFIX [BATCHES [PRODUCER]]`.

Leads STREAM and appends batches of `BATCH` events `PREFIX-NNNNNN`, one batch after
the other, BATCHES of them (0: until killed). Prints one JSON line per change:
`{"leading": epoch, "t": wall seconds}` once it leads, `{"acked": last number, "seq":
its sequence, "t": ...}` per acked batch, `{"done": true}` at the end, or
`{"error": type, "message": ...}` when the writer fails (exit 3). Tests and
`bench/failover.py` SIGKILL or SIGSTOP it to play a crashed or paused leader.

With PRODUCER, the writer has that producer id and event N is the producer's sequence
N: a process started again resends everything from 0, as an application that does not
know what the last one got in would, and keeps `PRODUCER_WINDOW` batches in flight, so
that a kill lands in the middle of batches. `leading` then also says
`last_producer_sequence`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque

from streamengine.client import StreamClient, Writer
from streamengine.client.errors import StreamEngineError

BATCH = 10
# Producer batches in flight at once.
PRODUCER_WINDOW = 4


def say(**fields: object) -> None:
    print(json.dumps({**fields, "t": time.time()}), flush=True)


def payload(prefix: str, number: int) -> bytes:
    return f"{prefix}-{number:06d}".encode()


async def run(master: str, stream: str, prefix: str, batches: int, producer: str | None) -> int:
    async with StreamClient(master) as client:
        say(started=True)
        try:
            async with client.writer(stream, producer_id=producer) as writer:
                if producer is not None:
                    say(leading=writer.epoch, last_producer_sequence=writer.last_producer_sequence)
                    await produce(writer, prefix, batches)
                    say(done=True)
                    return 0
                say(leading=writer.epoch)
                number = 0
                while batches == 0 or number < batches * BATCH:
                    payloads = [payload(prefix, number + i) for i in range(BATCH)]
                    sequences = await writer.append_batch(payloads)
                    number += BATCH
                    say(acked=number - 1, seq=sequences[-1])
        except StreamEngineError as error:
            say(error=type(error).__name__, message=str(error))
            return 3
        except ExceptionGroup as group:  # a background loop's failure
            first = group.exceptions[0]
            say(error=type(first).__name__, message=str(first))
            return 3
    say(done=True)
    return 0


async def produce(writer: Writer, prefix: str, batches: int) -> None:
    """Batches from producer sequence 0, `PRODUCER_WINDOW` in flight, each said in order
    once acked (with the stream sequence of its last event)."""
    in_flight: deque[tuple[int, asyncio.Task[list[int]]]] = deque()
    number = 0
    while batches == 0 or number < batches * BATCH or in_flight:
        if in_flight and (
            len(in_flight) >= PRODUCER_WINDOW or not (batches == 0 or number < batches * BATCH)
        ):
            last, task = in_flight.popleft()
            sequences = await task
            say(acked=last, seq=sequences[-1])
            continue
        payloads = [payload(prefix, number + i) for i in range(BATCH)]
        task = asyncio.create_task(writer.append_batch(payloads, producer_sequence=number))
        in_flight.append((number + BATCH - 1, task))
        number += BATCH
        await asyncio.sleep(0)  # let it take its turn, in order


def main() -> int:
    master, stream, prefix = sys.argv[1:4]
    batches = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    producer = sys.argv[5] if len(sys.argv) > 5 else None
    return asyncio.run(run(master, stream, prefix, batches, producer))


if __name__ == "__main__":
    sys.exit(main())
