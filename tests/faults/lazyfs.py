"""A lazy file system (FAULTS.md appendix A): a passthrough FUSE fs that keeps every
write in memory until the file is fsynced, so that a simulated power loss (`drop`)
loses exactly what was never synced.

    python -m tests.faults.lazyfs BACKING MOUNTPOINT CONTROL_FIFO

`write` appends `(offset, data)` to the file's pending list; `read` overlays the list on
the backing file; `fsync`, `truncate` and `rename` apply it to the backing file (and
fsync). Metadata (create, mkdir, unlink, rename) is applied at once: optimistic about
directory fsync. Each line written to CONTROL_FIFO is a command: `drop` forgets every
pending write (the power went out), then the fs appends `dropped` to CONTROL_FIFO.ack;
`ro` makes the fs read-only under its users' feet, as a file system that remounts
itself read-only after a device error does (every write, sync, create, rename, unlink,
and open for writing fails with EROFS; reads go on; what is pending stays pending),
then appends `ro`; `rw` ends that, then appends `rw`.
Python signal handlers do not run while fusepy sits in C, hence the FIFO. Mounted with
`direct_io`, or the kernel's page cache would keep serving dropped data. No attribute
is named `lock`: fusepy would route POSIX locks to it and RocksDB's LOCK file fails.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-untyped]


class LazyFs(Operations):  # type: ignore[misc]
    def __init__(self, backing: str) -> None:
        self.backing = backing
        self.pending: dict[str, list[tuple[int, bytes]]] = {}
        self.guard = threading.RLock()
        self.read_only = False

    def _writable(self) -> None:
        if self.read_only:
            raise FuseOSError(errno.EROFS)

    def _full(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _logical_size(self, path: str, size: int) -> int:
        for offset, data in self.pending.get(path, ()):
            size = max(size, offset + len(data))
        return size

    def _apply(self, path: str, fd: int | None = None) -> None:
        writes = self.pending.pop(path, [])
        if not writes:
            return
        own = fd is None
        handle = os.open(self._full(path), os.O_WRONLY) if own else fd
        assert handle is not None
        try:
            for offset, data in writes:
                os.pwrite(handle, data, offset)
            os.fsync(handle)
        finally:
            if own:
                os.close(handle)

    def drop(self) -> None:
        with self.guard:
            self.pending.clear()

    # ---- metadata, applied at once ----

    def access(self, path: str, mode: int) -> None:
        if not os.access(self._full(path), mode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        st = os.lstat(self._full(path))
        attrs = {key: getattr(st, key) for key in (
            "st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size",
            "st_uid")}
        with self.guard:
            attrs["st_size"] = self._logical_size(path, st.st_size)
        return attrs

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._full(path))]

    def mkdir(self, path: str, mode: int) -> None:
        self._writable()
        os.mkdir(self._full(path), mode)

    def rmdir(self, path: str) -> None:
        self._writable()
        os.rmdir(self._full(path))

    def unlink(self, path: str) -> None:
        self._writable()
        with self.guard:
            self.pending.pop(path, None)
        os.unlink(self._full(path))

    def rename(self, old: str, new: str) -> None:
        self._writable()
        with self.guard:
            self._apply(old)
            self.pending.pop(new, None)
            os.rename(self._full(old), self._full(new))

    def chmod(self, path: str, mode: int) -> None:
        self._writable()
        os.chmod(self._full(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        self._writable()
        os.chown(self._full(path), uid, gid)

    def utimens(self, path: str, times: Any = None) -> None:
        os.utime(self._full(path), times)

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._full(path))
        return {key: getattr(st, key) for key in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
            "f_flag", "f_frsize", "f_namemax")}

    def truncate(self, path: str, length: int, fh: Any = None) -> None:
        self._writable()
        with self.guard:
            self._apply(path)
            os.truncate(self._full(path), length)

    # ---- data, lazy ----

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        self._writable()
        return os.open(self._full(path), os.O_RDWR | os.O_CREAT, mode)

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_CREAT):
            self._writable()
        return os.open(self._full(path), (flags & ~os.O_APPEND) | os.O_RDWR
                       if flags & (os.O_WRONLY | os.O_RDWR) else flags)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self.guard:
            base = bytearray(os.pread(fh, size, offset))
            end = min(offset + size, self._logical_size(path, offset + len(base)))
            if len(base) < end - offset:
                base.extend(bytes(end - offset - len(base)))
            for start, data in self.pending.get(path, ()):
                low, high = max(start, offset), min(start + len(data), end)
                if low < high:
                    base[low - offset:high - offset] = data[low - start:high - start]
            return bytes(base)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._writable()
        with self.guard:
            self.pending.setdefault(path, []).append((offset, bytes(data)))
        return len(data)

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        self._writable()
        with self.guard:
            self._apply(path, fh)

    def flush(self, path: str, fh: int) -> None:
        return None  # closing is not syncing

    def release(self, path: str, fh: int) -> None:
        os.close(fh)


def control(fs: LazyFs, fifo: Path) -> None:
    while True:
        with fifo.open() as commands:
            for line in commands:
                command = line.strip()
                if command == "drop":
                    fs.drop()
                    done = "dropped"
                elif command in ("ro", "rw"):
                    fs.read_only = command == "ro"
                    done = command
                else:
                    continue
                with Path(f"{fifo}.ack").open("a") as ack:
                    ack.write(done + "\n")


def main(backing: str, mountpoint: str, fifo: str) -> None:
    fs = LazyFs(backing)
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    threading.Thread(target=control, args=(fs, Path(fifo)), daemon=True).start()
    FUSE(fs, mountpoint, foreground=True, direct_io=True, nothreads=False,
         allow_other=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
