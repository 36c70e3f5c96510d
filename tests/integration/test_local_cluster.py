"""`LocalCluster` (behind `cluster up` and `make demo`): children never outlive it, and a
killed server restarts while the parent is busy with gRPC."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from streamengine.client import StreamClient
from streamengine.testing import free_port_run, wait_for
from streamengine.tools.local_cluster import LocalCluster, ports_used, serving

pytestmark = pytest.mark.timeout(180)


def test_servers_die_with_a_sigkilled_cluster_process(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from streamengine.tools.local_cluster import LocalCluster, serving
        cluster = LocalCluster(Path({str(tmp_path / "data")!r}), 2, {free_port_run(ports_used(2))})
        cluster.start()
        print("serving", flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "serving"
        children = psutil.Process(parent.pid).children(recursive=True)
        assert len(children) == 3
        parent.kill()
        parent.wait(timeout=10)

        def all_gone() -> bool:
            return not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)

        wait_for(
            all_gone,
            timeout_s=20,
            message="servers gone after their cluster process was SIGKILLed",
        )
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


async def test_a_killed_store_restarts_while_other_threads_are_inside_grpc(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(tmp_path / "data", 3, free_port_run(ports_used(3)))
    cluster.start()
    polling = threading.Event()

    def poll_the_master() -> None:  # a thread inside gRPC calls when the child forks
        while not polling.is_set():
            serving(cluster.master_address, cluster.health_transport)

    pollers = [threading.Thread(target=poll_the_master) for _ in range(2)]
    for poller in pollers:
        poller.start()
    try:
        async with StreamClient(
            cluster.master_address, certs_dir=cluster.admin_certs_dir
        ) as client:
            await client.create_stream("lc/restart", replicas=3, write_quorum=2)
            async with client.writer("lc/restart") as writer:
                for round_ in range(5):
                    appends = asyncio.ensure_future(writer.append_batch([b"x" * 100] * 5_000))
                    cluster.kill("store1")
                    # From the loop's thread: it outlives the child (see restart()).
                    cluster.restart("store1", wait=False)
                    await asyncio.to_thread(cluster.wait_serving, "store1")
                    assert len(await appends) == 5_000, round_
    finally:
        polling.set()
        for poller in pollers:
            poller.join()
        cluster.stop()
