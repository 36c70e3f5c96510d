"""Hosts as network namespaces, through `deploy/netns-cluster.sh` (its `hosts`, `cut`,
`partition`, `oneway`, `lossy` and `heal` commands): one namespace per process on a private
bridge, the harness in this namespace on the same bridge. Needs root and iptables;
`unavailable()` says why not, for a clear skip."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.tree import ROOT

SCRIPT = ROOT / "deploy" / "netns-cluster.sh"
MASTER_PORT, STORE_PORT = 7070, 7071
STORE_DATA_PORT = STORE_PORT + 1  # the store's default --data-listen


def unavailable() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("iptables") is None or shutil.which("ip") is None:
        return "needs iproute2 and iptables (deploy/install-system-deps.sh)"
    check = subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True, text=True)
    return (check.stdout or check.stderr).strip() if check.returncode else ""


class Hosts:
    """The namespaces of one run; `close()` deletes every one (and its processes)."""

    def __init__(self, prefix: str, subnet: str, data: Path) -> None:
        self.env = {**os.environ, "SE_NETNS_PREFIX": prefix, "SE_NETNS_SUBNET": subnet}
        self.prefix_name = prefix
        self.data = data
        self.hosts: list[str] = []

    def _run(self, *args: str) -> str:
        result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                                env=self.env, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"netns-cluster.sh {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout.strip()

    def up(self, hosts: list[str]) -> None:
        self.hosts = list(hosts)
        self._run("hosts", *hosts)

    def close(self) -> None:
        self._run("down", str(self.data))

    def addr(self, host: str) -> str:
        return self._run("addr", host)

    def prefix(self, host: str) -> list[str]:
        """Run a command on `host`."""
        return ["ip", "netns", "exec", f"{self.prefix_name}-{host}"]

    def cut(self, host: str) -> None:
        self._run("cut", host)

    def partition(self, host: str, *peers: str) -> None:
        self._run("partition", host, *peers)

    def oneway(self, host: str, *peers: str) -> None:
        self._run("oneway", host, *peers)

    def lossy(self, host: str, percent: float, *peers: str) -> None:
        """`host` drops `percent` % of its packets to and from each peer, at random."""
        self._run("lossy", host, f"{percent:g}", *peers)

    def heal_host(self, host: str) -> None:
        self._run("heal", host)

    def heal(self) -> None:
        for host in self.hosts:
            self.heal_host(host)
