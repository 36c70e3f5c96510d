"""Store data dirs on their own small tmpfs, filled with ballast (disk full; FAULTS.md §2:
tmpfs `size=`). Needs root. `read_only` works only on a mount nobody writes to: with a
store running it fails with "mount point is busy" (read-only disks need the FUSE layer)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

DISK_MB = 128
# Left free by the ballast: the store's next writes fill it within moments.
ROOM_MB = 1
BALLAST = "ballast"


def unavailable(probe_dir: Path) -> str:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    probe = probe_dir / "tmpfs-probe"
    probe.mkdir(parents=True, exist_ok=True)
    try:
        mount(probe, 1)
    except RuntimeError as error:
        return str(error)
    finally:
        umount(probe)
        probe.rmdir()
    return ""


def _run(*command: str) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")


def mount(path: Path, size_mb: int = DISK_MB) -> None:
    path.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path))


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(path: Path, room_mb: int = ROOM_MB) -> None:
    """Ballast until only `room_mb` are free."""
    stats = os.statvfs(path)
    free_mb = stats.f_bavail * stats.f_frsize >> 20
    with (path / BALLAST).open("ab") as out:
        for _ in range(max(0, free_mb - room_mb)):
            out.write(bytes(1 << 20))


def free(path: Path) -> None:
    (path / BALLAST).unlink(missing_ok=True)


def read_only(path: Path, on: bool) -> None:
    _run("mount", "-o", f"remount,{'ro' if on else 'rw'}", str(path))


class LazyMount:
    """A store's data dir on the lazy FUSE fs (`tests.faults.lazyfs`): `drop()` loses
    every write not yet fsynced, as a power loss would."""

    def __init__(self, mountpoint: Path, backing: Path) -> None:
        self.mountpoint = mountpoint
        self.backing = backing
        self.fifo = backing.with_name(backing.name + ".ctl")
        self.process: subprocess.Popen[bytes] | None = None

    def mount(self, env: dict[str, str], log: Path) -> None:
        import sys
        import time

        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.faults.lazyfs", str(self.backing),
                 str(self.mountpoint), str(self.fifo)],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mountpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lazy fs did not mount on {self.mountpoint}")
            time.sleep(0.05)

    def drop(self) -> None:
        """Forget unsynced writes; returns once the fs confirmed."""
        self._command("drop", "dropped")

    def read_only(self, on: bool) -> None:
        """The fs refuses every write with EROFS (on), or takes writes again (off)."""
        self._command("ro" if on else "rw", "ro" if on else "rw")

    def _command(self, command: str, done: str) -> None:
        import time

        ack = Path(f"{self.fifo}.ack")

        def confirmed() -> int:
            return ack.read_text().splitlines().count(done) if ack.exists() else 0

        before = confirmed()
        with self.fifo.open("w") as commands:
            commands.write(command + "\n")
        deadline = time.monotonic() + 10
        while confirmed() <= before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"lazy fs on {self.mountpoint} did not confirm {command}")
            time.sleep(0.02)

    def close(self) -> None:
        umount(self.mountpoint)
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def lazy_unavailable() -> str:
    if os.geteuid() != 0:
        return "a FUSE mount needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    try:
        import fuse  # type: ignore[import-untyped]  # noqa: F401
    except (ImportError, OSError) as error:
        return f"needs fusepy and libfuse2 ({error})"
    return ""
