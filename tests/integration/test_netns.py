"""The demo workload across a cluster whose hosts are network namespaces, with one
store cut off the network (iptables) halfway through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamengine.tools.harness import wait_for

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "netns-cluster.sh"
STREAMENGINE = str(Path(sys.executable).with_name("streamengine"))


def netns(
    *args: str, env: dict[str, str], timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout_s
    )


def namespaces_unavailable() -> str:
    check = subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True, text=True)
    return check.stdout.strip() or check.stderr.strip() if check.returncode else ""


@pytest.fixture
def netns_cluster(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be used here: {reason}")
    env = {
        **os.environ,
        "SE_NETNS_PREFIX": f"se{os.getpid() % 10000}",
        "STREAMENGINE": STREAMENGINE,
    }
    data = tmp_path / "netns"
    try:
        up = netns("up", "3", str(data), env=env)
        assert up.returncode == 0, up.stderr
        yield env, data
    finally:
        netns("down", str(data), env=env)


def test_demo_workload_survives_a_store_cut_off_the_network(
    netns_cluster: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    env, data = netns_cluster
    master = netns("addr", "master", env=env).stdout.strip() + ":7070"

    def alive_stores() -> int:
        status = netns(
            "exec", "client", STREAMENGINE, "status", "--json", "--master", master, env=env
        )
        if status.returncode != 0:
            return 0
        return sum(store["alive"] for store in json.loads(status.stdout)["stores"])

    wait_for(lambda: alive_stores() == 3, timeout_s=60, interval_s=0.5, message="3 stores up")

    pause_file = tmp_path / "resume"
    workload = subprocess.Popen(
        [
            "bash",
            str(SCRIPT),
            "exec",
            "client",
            sys.executable,
            "-m",
            "deploy.workload",
            "--master",
            master,
            "--stream",
            "netns/orders",
            "--events",
            "20000",
            "--pause-file",
            str(pause_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert workload.stdout is not None
        assert workload.stdout.readline().strip() == "HALFWAY"
        cut = netns("cut", "store0", env=env)
        assert cut.returncode == 0, cut.stderr
        pause_file.touch()
        out, err = workload.communicate(timeout=240)
        (tmp_path / "workload.err").write_text(err)
        assert workload.returncode == 0, (out, err)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["appended"] == 20000
        assert result["followed"] == 20000 and result["follower_matches"] is True
        # store0 is unreachable from the master too: it is declared dead.
        wait_for(lambda: alive_stores() == 2, timeout_s=60, interval_s=0.5, message="store0 dead")
    finally:
        if workload.poll() is None:
            workload.kill()
        netns("heal", "store0", env=env)
    log = (data / "master.log").read_text(errors="replace")
    assert "10.213.7.1:7070" in log
