"""Nothing a server or command writes is open to other local users: data dirs (RocksDB,
the master's signing key, the store's authority), certificates and keys, metadata
backups, the local cluster's logs are 0600 and their directories 0700; a data dir made
wider beforehand is tightened at start, with a log line."""

from __future__ import annotations

import asyncio
import stat
import subprocess
from pathlib import Path

import pytest

from streamengine.client import StreamClient
from streamengine.protocol.private_files import PRIVATE_UMASK
from streamengine.testing import STREAMENGINE, make_master, make_store, server_env
from streamengine.tools.certs import create_local_certs
from streamengine.tools.local_cluster import Child

pytestmark = pytest.mark.security


def open_to_others(root: Path) -> list[str]:
    """Everything under `root` (itself included) with a group or other bit."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & PRIVATE_UMASK:
            found.append(f"{path} {stat.filemode(mode)}")
    return found


def test_servers_certs_and_backups_are_private(tmp_path: Path) -> None:
    certs = create_local_certs(tmp_path / "certs")
    master = make_master(tmp_path, certs=certs)
    store = make_store(tmp_path, 0, master.address, certs=certs)
    # As an older version (or a umask of 022) left them: open to everyone.
    for data in (tmp_path / "master", tmp_path / "store0"):
        data.chmod(0o755)
        (data / "notes").write_text("left here before")
        (data / "notes").chmod(0o644)
    try:
        master.start()
        store.start()

        async def fill() -> None:
            async with StreamClient(master.address, certs_dir=certs.client_dir) as client:
                await client.create_stream("private/s", replicas=1, write_quorum=1)
                async with client.writer("private/s", leadership_timeout_s=15) as writer:
                    await writer.append_batch([b"secret"] * 10)

        asyncio.run(fill())
        backup = tmp_path / "meta.backup"
        subprocess.run(
            [
                STREAMENGINE,
                "metadata",
                "backup",
                "--data",
                str(tmp_path / "master"),
                "--to",
                str(backup),
            ],
            check=True,
            env=server_env(),
            capture_output=True,
            timeout=60,
        )
        for process in (master, store):
            assert "was open to other users" in process.log(), process.name
        for root in (tmp_path / "master", tmp_path / "store0", certs.root, backup):
            assert open_to_others(root) == [], root
    finally:
        store.kill()
        master.kill()


def test_the_local_clusters_logs_are_private(tmp_path: Path) -> None:
    child = Child("master", "127.0.0.1:1", ["--help"], tmp_path / "master.log")
    child.start()
    assert child.process is not None
    child.process.wait(timeout=30)
    assert open_to_others(tmp_path / "master.log") == []
