"""The history of a run: JSON lines, one file per process, merged by time.

Every process (writers, readers, the nemesis, the metadata sampler) appends to its own
`history/<process>.jsonl`, flushing each record before it acts on it, so a `kill -9`
loses at most a torn last line (dropped on load). Times are the machine's monotonic clock
(`now()`), one clock for every process, true even in processes on fake clocks. Records (`type`):

- `invoke` / `ok` / `fail` / `info`: an append of events `ids` (payload ids) by writer
  `process` (incarnation `inc`, writer session `session`) to `stream`, operation `op`;
  `ok` carries the returned sequences `seqs`; `fail` (definitely not written) and
  `info` (in doubt) carry `error`. An `invoke` without a completion is `info`.
- `grant`: `process` leads `stream` at `epoch` as `client`.
- `subscribe`: reader `process` (re)subscribes to `stream` from sequence `from`
  (inclusive; the token of its last delivery + 1, or just past a range it was told is
  lost, `after_loss` = [epoch, first, last]); `deliver`: the events it then got,
  each `[sequence, epoch, index, payload id, fingerprint, intact]`; `error`: its
  subscription failed (`data_loss` names the range when it is an explicit loss).
- `nemesis`: a fault `fault` on `target`, `phase` start / stop; `nemesis_skip`: a
  round of the schedule that found nothing to fault (`why`); `nemesis_error`: the
  nemesis failed.
- `phase`: the run's phases (`name` faults, heal, final); the faults phase names the
  scenario's `nemesis` (None for the baseline).
- `meta`: the master's segment list for `stream`, `[[epoch, state], ...]`.
- `rss`: resident memory of every running process, `mib` = {process name: MiB}, and
  the machine's 1-minute `load` average.
- `lost` (S16): every copy of segment `epoch` of `stream` destroyed on purpose; its
  `final_index` and the indexes of its `events`.
- `bad`, `digest`, `serving` (S15): a bad request and its status; the workload's
  metadata and sealed replicas before and after; the servers' health after.
- `client_error`: a workload process's client did not start (its first call to the
  master failed); it is started again.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import time
from pathlib import Path
from typing import IO, Any

Record = dict[str, Any]

# clock_gettime by system call number: libfaketime intercepts the libc function, not the
# system call, so processes on fake clocks (S4) still record true times.
_CLOCK_GETTIME = {"x86_64": 228, "aarch64": 113}.get(platform.machine())
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def now() -> float:
    """The machine's monotonic clock, true even under libfaketime."""
    if _LIBC is not None and _CLOCK_GETTIME is not None:
        spec = _Timespec()
        if _LIBC.syscall(_CLOCK_GETTIME, _CLOCK_MONOTONIC, ctypes.byref(spec)) == 0:
            return spec.seconds + spec.nanoseconds / 1e9
    return time.monotonic()


class Recorder:
    """Appends records of one process to its file; every record is flushed at once."""

    def __init__(self, path: Path, process: str, **fields: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.process = process
        self.fields = fields
        self._file: IO[str] = path.open("a", buffering=1)

    def record(self, type_: str, **fields: Any) -> Record:
        record = {"t": now(), "type": type_, "process": self.process}
        record.update(self.fields)
        record.update(fields)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()


def read_file(path: Path) -> list[Record]:
    """Records of one file; a torn line (a process killed mid-write) is dropped."""
    records = []
    with path.open() as lines:
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def load(directory: Path) -> list[Record]:
    """Every record of a run, ordered by time (stable within one process's file)."""
    records: list[Record] = []
    for path in sorted(directory.glob("*.jsonl")):
        records.extend(read_file(path))
    records.sort(key=lambda record: record["t"])
    return records


def write_merged(records: list[Record], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as out:
        for record in records:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
