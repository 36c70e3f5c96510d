"""Files only their owner reads: everything a server or a command writes.

A master's data dir holds its signing key and every tenant's metadata; a store's, the
events themselves and the master's authority; a metadata backup, all of the metadata;
a certs dir, private keys; logs name tenants and streams. Any local user who reads one
of them reads a secret, so every file is 0600 and every directory 0700.

Two halves. `keep_private()` sets the process's umask at start, so that whatever it
creates from then on (RocksDB's own files included, which this code never opens) has
no group or other bits. And what exists already (a data dir an older version made, a
directory made by hand or by a tool run under another umask) is tightened where a
server or command takes it over (`private_dir`), with one line saying so. Files
written by a process whose umask is not ours (the test harness, an embedding program)
are private from their first byte all the same (`write_private`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# What no group or other user may do with anything we write.
PRIVATE_UMASK = 0o077
FILE_MODE = 0o600
DIR_MODE = 0o700


def keep_private() -> None:
    """From now on, everything this process (and what it starts) creates is private."""
    os.umask(PRIVATE_UMASK)


def tighten(root: Path) -> list[Path]:
    """Take group and other bits off `root` and everything under it; returns what
    changed. Symbolic links are neither changed nor followed: their own mode means
    nothing, and what they point to is not ours to change."""
    changed = []
    for directory, subdirectories, files in os.walk(root):
        here = Path(directory)
        entries = [here] if here == root else []
        entries += [here / name for name in sorted(subdirectories) + sorted(files)]
        for path in entries:
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode) or not mode & PRIVATE_UMASK:
                continue
            path.chmod(stat.S_IMODE(mode) & ~PRIVATE_UMASK)
            changed.append(path)
    return changed


def private_dir(path: Path) -> list[Path]:
    """Make `path` (and its missing parents) 0700, or tighten it and what it holds if
    it exists with wider modes; returns what was tightened, for the caller to say."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return tighten(path)


def tightened_message(what: str, path: Path, changed: list[Path]) -> str:
    """The one line a server logs (or a command prints) when `private_dir` tightened."""
    return (
        f"{what} {path} was open to other users: took group and other access off "
        f"{len(changed)} files and directories"
    )


def write_private(path: Path, data: bytes) -> None:
    """Write `path` whole (through a temporary file, renamed when complete), readable by
    its owner only from its first byte on, whatever the umask."""
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".partial")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with os.fdopen(descriptor, "wb") as file:
            os.fchmod(file.fileno(), FILE_MODE)  # O_CREAT's mode is masked by the umask
            file.write(data)
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
