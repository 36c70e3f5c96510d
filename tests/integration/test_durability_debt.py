"""Durability debt with real processes: a store holding a sealed segment dies where no
spare store can take its replica; the master charges the segment time below N good
replicas, shows it in status, the console's JSON and its metrics, and keeps it once the
store is back."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from streamengine.client import StreamClient
from streamengine.testing import free_port, running_cluster, wait_until
from streamengine.v1 import master_pb2
from tests.integration.test_cli import run_cli


def console_status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10) as reply:
        status: dict[str, Any] = json.loads(reply.read())
        return status


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def test_a_segment_below_n_is_charged_shown_and_remembered(tmp_path: Path) -> None:
    port = free_port()
    args = ["--store-timeout-ms", "1000", "--metrics-port", str(port)]
    with running_cluster(tmp_path, stores=3, master_args=args) as cluster:
        name = "debt/orders"
        async with StreamClient(cluster.master_address) as client:
            await client.create_stream(name, replicas=3, write_quorum=2)
            async with client.writer(name, leadership_timeout_s=10) as writer:
                await writer.append_batch([b"x" * 1000] * 200)
            await client.seal(name)

            async def every_replica_matched() -> bool:
                status = await client.master.GetClusterStatus(
                    master_pb2.GetClusterStatusRequest(), timeout=5
                )
                checked = status.replica_verification
                return checked.matched >= 3 and checked.unmatched == 0

            # A replica counts as good once its store read it back (the scrubs, first
            # thing after a seal).
            await wait_until(every_replica_matched, 30, "the scrubs matched every replica")

        def worst() -> list[dict[str, Any]]:
            debts: list[dict[str, Any]] = (
                console_status(port).get("durability", {}).get("worst", [])
            )
            return [d for d in debts if d["stream"] == name]

        await wait_until(
            lambda: not any(d["exposed"] for d in worst()), 30, "nothing exposed once matched"
        )
        cluster.stores[2].kill()
        await wait_until(
            lambda: any(d["exposed"] and d["below_n_s"] >= 1.0 for d in worst()),
            30,
            "a sealed segment charged a second below N",
        )
        [exposed] = [d for d in worst() if d["exposed"]]
        # Two of three good now; a moment below W is possible while the survivors'
        # reports catch up after the kill, never more than the time below N.
        assert (exposed["good_replicas"], exposed["replicas"]) == (2, 3)
        assert exposed["below_w_s"] <= exposed["below_n_s"]
        status = console_status(port)["durability"]
        assert status["bytes_below_n"] > 0 and status["bytes_below_w"] == 0
        assert metric(port, "streamengine_master_durability_debt_seconds_total") >= 1.0
        text = run_cli("status", "--master", cluster.master_address)
        assert text.returncode == 0 and "DURABILITY DEBT" in text.stdout, text

        cluster.stores[2].restart()
        await wait_until(lambda: worst() and not worst()[0]["exposed"], 30, "the segment healed")
        [healed] = worst()
        assert healed["below_n_s"] >= exposed["below_n_s"]
        assert console_status(port)["durability"]["bytes_below_n"] == 0
