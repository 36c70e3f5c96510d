"""The lazy fs loses exactly what was not fsynced: RocksDB with 200 synced and 200
unsynced puts, a crash without close, a drop, a reopen -> the 200 synced keys."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults import disk
from tests.tree import child_env

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

PUTS = """
import os, sys
from rocksdict import Options, Rdict, WriteOptions
db = Rdict(sys.argv[1], options=Options(raw_mode=True))
synced = WriteOptions()
synced.sync = True
for i in range(200):
    db.put(b"synced-%03d" % i, b"v", write_opt=synced)
for i in range(200):
    db.put(b"unsynced-%03d" % i, b"v", write_opt=WriteOptions())
print(len(list(db.keys())), flush=True)
os._exit(0)  # a crash: nothing closed, nothing flushed
"""

COUNT = """
import sys
from rocksdict import Options, Rdict
db = Rdict(sys.argv[1], options=Options(raw_mode=True))
keys = list(db.keys())
print(len(keys), sum(key.startswith(b"synced-") for key in keys))
db.close()
"""


@pytest.fixture
def lazy(tmp_path: Path) -> Iterator[disk.LazyMount]:
    reason = disk.lazy_unavailable()
    if reason:
        pytest.skip(reason)
    mount = disk.LazyMount(tmp_path / "mnt", tmp_path / "backing")
    try:
        mount.mount(child_env(), tmp_path / "lazyfs.log")
        yield mount
    finally:
        mount.close()


def python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, env=child_env())
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_crash_alone_loses_nothing(lazy: disk.LazyMount) -> None:
    db = str(lazy.mountpoint / "db")
    assert python(PUTS, db) == "400"
    assert python(COUNT, db) == "400 200"  # the process died, the machine did not


def test_a_drop_loses_exactly_the_unsynced_writes(lazy: disk.LazyMount) -> None:
    db = str(lazy.mountpoint / "db")
    assert python(PUTS, db) == "400"
    lazy.drop()
    assert python(COUNT, db) == "200 200"


def test_read_only_refuses_every_write_and_keeps_reads(lazy: disk.LazyMount) -> None:
    import errno

    kept = lazy.mountpoint / "kept"
    kept.write_bytes(b"before")
    with kept.open("r+b") as open_for_writing:
        lazy.read_only(True)
        for attempt in (
            lambda: (lazy.mountpoint / "new").write_bytes(b"x"),
            lambda: kept.open("r+b"),
            lambda: kept.unlink(),
            lambda: _write_through(open_for_writing, b"y"),
            lambda: os.fsync(open_for_writing.fileno()),
        ):
            with pytest.raises(OSError) as refused:
                attempt()
            assert refused.value.errno == errno.EROFS
        assert kept.read_bytes() == b"before"
        lazy.read_only(False)
    kept.write_bytes(b"after")
    assert kept.read_bytes() == b"after"


def _write_through(file: Any, data: bytes) -> None:
    file.write(data)
    file.flush()
