"""A writer in its own process (`bench.append_writer`), so that a test can SIGKILL or
SIGSTOP it; what it acked is what it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from streamengine.client import StreamClient

REPO = Path(__file__).resolve().parents[2]


class WriterProcess:
    """One `append_writer` process and the JSON lines it printed so far."""

    def __init__(
        self, master: str, stream: str, prefix: str, batches: int = 0, producer: str = ""
    ) -> None:
        self.prefix = prefix
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.append_writer",
                master,
                stream,
                prefix,
                str(batches),
                *([producer] if producer else []),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(json.loads(line))

    def acked(self) -> list[dict[str, Any]]:
        return [line for line in list(self.lines) if "acked" in line]

    def last_acked(self) -> int:
        acked = self.acked()
        return acked[-1]["acked"] if acked else -1

    def leading_epoch(self) -> int:
        """The epoch it led first (it printed `leading`)."""
        line = self.first("leading")
        assert line is not None, f"{self.prefix} never led: {self.lines}"
        epoch: int = line["leading"]
        return epoch

    def first(self, key: str) -> dict[str, Any] | None:
        return next((line for line in list(self.lines) if key in line), None)

    def signal(self, number: int) -> None:
        os.kill(self.process.pid, number)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._reader.join(5)


async def read_all(client: StreamClient, name: str) -> list[tuple[int, bytes]]:
    return [(event.sequence, event.payload) async for event in client.read(name)]


def numbers_of(events: list[tuple[int, bytes]], prefix: str) -> list[int]:
    return [int(p.split(b"-")[-1]) for _, p in events if p.startswith(prefix.encode() + b"-")]
