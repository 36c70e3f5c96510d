"""`streamengine metadata backup|restore` against real processes: a backup of a running
master's embedded metadata, restored into etcd, is what a master on etcd then serves
(a cluster moved from one master to several)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamengine.client import StreamClient
from streamengine.master.catalog import decode_records
from streamengine.testing import (
    ServerProcess,
    etcd_binary,
    running_cluster,
    running_etcd,
)
from streamengine.tools.metadata_backup import read_backup
from tests.integration.test_cli import run_cli
from tests.integration.writer_process import read_all

pytestmark = pytest.mark.skipif(
    etcd_binary() is None,
    reason="etcd is not installed (deploy/install-system-deps.sh installs Debian's etcd-server)",
)


async def test_a_running_masters_metadata_moves_to_etcd_through_a_backup(tmp_path: Path) -> None:
    backup = tmp_path / "metadata.backup"
    with running_cluster(tmp_path / "cluster", stores=3) as cluster:
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream("move/orders", replicas=3, write_quorum=2)
            async with client.writer("move/orders") as writer:
                await writer.append_batch([b"e-%03d" % n for n in range(20)])
                epoch = writer.epoch

        # The master keeps running while its metadata is read.
        data = str(cluster.root / "master")
        saved = run_cli("metadata", "backup", "--data", data, "--to", str(backup))
        assert saved.returncode == 0, saved.stderr
        assert cluster.master.alive()

        with running_etcd(tmp_path / "etcd") as etcd:
            url = etcd.url("moved")
            restored = run_cli("metadata", "restore", "--from", str(backup), "--metadata", url)
            assert restored.returncode == 0, restored.stderr
            again = run_cli("metadata", "restore", "--from", str(backup), "--metadata", url)
            assert again.returncode == 1 and "not empty" in again.stderr

            # A backup older than the last grant comes back with its epochs raised.
            raised_url, copy = etcd.url("raised"), tmp_path / "raised.backup"
            raised = run_cli(
                "metadata",
                "restore",
                "--from",
                str(backup),
                "--metadata",
                raised_url,
                "--raise-epochs",
                "100",
            )
            assert raised.returncode == 0, raised.stderr
            saved = run_cli("metadata", "backup", "--metadata", raised_url, "--to", str(copy))
            assert saved.returncode == 0, saved.stderr
            streams = decode_records(read_backup(copy)).streams
            assert streams["move/orders"].epoch == epoch + 100

            # The same address, now a master on etcd: stores and clients need no change.
            cluster.master.kill()
            address = cluster.master.address
            moved = ServerProcess(
                "moved",
                ["master", "--listen", address, "--metadata", url],
                address,
                tmp_path / "moved.log",
            )
            cluster.master = moved
            moved.start()
            async with StreamClient(address) as client:
                info = await client.describe_stream("move/orders")
                assert info.epoch == epoch
                events = await read_all(client, "move/orders")
                assert [payload for _, payload in events] == [b"e-%03d" % n for n in range(20)]
