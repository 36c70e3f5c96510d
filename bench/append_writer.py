"""A writer process: `python -m bench.append_writer MASTER STREAM PREFIX [BATCHES]`.

Leads STREAM and appends batches of `BATCH` events `PREFIX-NNNNNN`, one batch after
the other, BATCHES of them (0: until killed). Prints one JSON line per change:
`{"leading": epoch, "t": wall seconds}` once it leads, `{"acked": last number, "seq":
its sequence, "t": ...}` per acked batch, `{"done": true}` at the end, or
`{"error": type, "message": ...}` when the writer fails (exit 3). Tests and
`bench/failover.py` SIGKILL or SIGSTOP it to play a crashed or paused leader.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from streamengine.client import StreamClient
from streamengine.client.errors import StreamEngineError

BATCH = 10


def say(**fields: object) -> None:
    print(json.dumps({**fields, "t": time.time()}), flush=True)


def payload(prefix: str, number: int) -> bytes:
    return f"{prefix}-{number:06d}".encode()


async def run(master: str, stream: str, prefix: str, batches: int) -> int:
    async with StreamClient(master) as client:
        say(started=True)
        try:
            async with client.writer(stream) as writer:
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


def main() -> int:
    master, stream, prefix = sys.argv[1:4]
    batches = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    return asyncio.run(run(master, stream, prefix, batches))


if __name__ == "__main__":
    sys.exit(main())
