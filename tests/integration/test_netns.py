"""The demo workload across a cluster whose hosts are network namespaces, with one
store cut off the network (iptables) halfway through."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamengine.testing import etcd_binary, wait_for

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


@pytest.fixture
def netns_ha_cluster(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be used here: {reason}")
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (deploy/install-system-deps.sh installs it)")
    env = {
        **os.environ,
        "SE_NETNS_PREFIX": f"sh{os.getpid() % 10000}",
        "SE_NETNS_SUBNET": "10.213.8",
        "STREAMENGINE": STREAMENGINE,
        "ETCD": str(etcd_binary()),
    }
    data = tmp_path / "netns"
    try:
        up = netns("up-ha", "3", str(data), env=env)
        assert up.returncode == 0, up.stderr
        yield env, data
    finally:
        netns("down", str(data), env=env)


def active_master_host(data: Path) -> str | None:
    """The master host whose log says it became the active master last."""
    latest: tuple[str, str] | None = None
    for number in range(3):
        log = (data / f"master{number}.log").read_text(errors="replace")
        for line in log.splitlines():
            if 'msg="active master' in line and (latest is None or line > latest[1]):
                latest = (f"master{number}", line)
    return latest[0] if latest else None


def test_ha_workload_survives_the_active_master_host_cut_off_the_network(
    netns_ha_cluster: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """Three hosts each run an etcd member and a master (`netns-cluster.sh up-ha`: TLS
    everywhere, etcd's auth on); the active master's host, etcd member included, drops
    off the network halfway."""
    env, data = netns_ha_cluster
    masters = netns("masters", str(data), env=env).stdout.strip()
    assert masters.count(",") == 2, masters
    admin = ["--certs-dir", str(data / "certs" / "client")]  # everything speaks TLS

    def stores_alive() -> int:
        status = netns(
            "exec", "client", STREAMENGINE, "status", "--json", "--master", masters, *admin,
            env=env,
        )
        if status.returncode != 0:
            return 0
        return sum(store["alive"] for store in json.loads(status.stdout)["stores"])

    wait_for(lambda: stores_alive() == 3, timeout_s=60, interval_s=0.5, message="3 stores up")
    first = active_master_host(data)
    assert first is not None

    pause_file = tmp_path / "resume"
    command = [sys.executable, "-m", "deploy.workload", "--master", masters, *admin]
    command += ["--stream", "netns/ha", "--events", "6000", "--pause-file", str(pause_file)]
    workload = subprocess.Popen(
        ["bash", str(SCRIPT), "exec", "client", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert workload.stdout is not None
        assert workload.stdout.readline().strip() == "HALFWAY"
        cut = netns("cut", first, env=env)
        assert cut.returncode == 0, cut.stderr
        pause_file.touch()
        wait_for(
            lambda: active_master_host(data) not in (None, first),
            timeout_s=30,
            interval_s=0.2,
            message="a standby on another host active",
        )
        out, err = workload.communicate(timeout=240)
        (tmp_path / "workload.err").write_text(err)
        assert workload.returncode == 0, (out, err)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["appended"] == 6000
        assert result["followed"] == 6000 and result["follower_matches"] is True
        assert stores_alive() == 3, "the stores follow the new active master"
    finally:
        if workload.poll() is None:
            workload.kill()
        netns("heal", first, env=env)


ECHO_SERVER = """
import socket, sys
echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
echo.bind((sys.argv[1], 9999))
print("ready", flush=True)
while True:
    data, peer = echo.recvfrom(100)
    try:
        echo.sendto(data, peer)
    except PermissionError:  # dropped on the way out by the lossy rule
        pass
"""


def test_a_lossy_host_drops_its_share_of_packets_each_way(tmp_path: Path) -> None:
    """S10's 10 % loss: `lossy` drops packets to and from the peer at random, so about
    0.9 x 0.9 of the round trips of a UDP echo come back."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be used here: {reason}")
    env = {**os.environ, "SE_NETNS_PREFIX": f"sl{os.getpid() % 10000}",
           "SE_NETNS_SUBNET": "10.213.41"}
    try:
        assert netns("hosts", "store0", env=env).returncode == 0
        assert netns("lossy", "store0", "10", "harness", env=env).returncode == 0
        address = netns("addr", "store0", env=env).stdout.strip()
        server = subprocess.Popen(
            ["bash", str(SCRIPT), "exec", "store0", sys.executable, "-c", ECHO_SERVER, address],
            env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            client.settimeout(0.02)
            back = 0
            for _ in range(1000):
                client.sendto(b"x", (address, 9999))
                try:
                    client.recvfrom(100)
                    back += 1
                except TimeoutError:
                    pass
        finally:
            server.kill()
        assert 700 <= back <= 900, f"{back} of 1000 round trips came back, expected about 810"
    finally:
        netns("down", str(tmp_path), env=env)
