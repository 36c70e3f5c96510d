"""The master's web console in a real headless browser (Debian's chromium through its
chromedriver): the page shows a stream the test created, and a store going down after
it is SIGKILLed. The last screenshot is kept in `test-artifacts/console.png`."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from streamengine.client.sync import SyncStreamClient
from streamengine.testing import free_port, running_cluster, wait_for
from tests.integration.test_cli import run_cli
from tests.tree import ROOT

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (deploy/install-system-deps.sh)",
)


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body


def test_the_console_shows_a_stream_and_a_store_going_down(tmp_path: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    master_args = ["--metrics-port", str(port), "--store-timeout-ms", "1500"]
    with running_cluster(tmp_path, stores=3, master_args=master_args) as cluster:
        with SyncStreamClient(cluster.master_address) as client:
            client.create_stream(
                "console/orders", replicas=3, write_quorum=2, retention_age_ms=3_600_000
            )
            with client.writer("console/orders", leadership_timeout_s=10) as writer:
                writer.append_batch([b"event-%d" % n for n in range(100)])
        sealed = run_cli("seal", "console/orders", "--master", cluster.master_address)
        assert sealed.returncode == 0, sealed.stderr
        base = f"http://127.0.0.1:{port}"

        def status() -> dict[str, Any]:
            published: dict[str, Any] = json.loads(fetch(base + "/api/status"))
            return published

        # The snapshot is published each second: wait for one taken after the writes.
        wait_for(lambda: "console/orders" in status().get("segments", {}), 10, 0.1, "stream")
        assert {s["id"] for s in status()["stores"]} == {"store0", "store1", "store2"}
        assert b"streamengine_master_streams" in fetch(base + "/metrics")

        def sealed_published() -> bool:
            segments = status()["segments"]["console/orders"]
            return any(s["state"] == "sealed" for s in segments)

        # Sealed a moment ago on three live stores: being verified (or verified
        # already), never under-replicated.
        wait_for(sealed_published, 10, 0.1, "the sealed segment published")
        assert status()["under_replicated"] == [], status()

        options = Options()
        options.binary_location = CHROMIUM or ""
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        ARTIFACTS.mkdir(exist_ok=True)
        try:
            driver.set_window_size(1280, 1000)
            driver.get(base + "/")

            def table(name: str) -> str:
                text: str = driver.find_element(By.ID, name).text
                return text

            def shows(condition: str, check: object) -> None:
                WebDriverWait(driver, 30, poll_frequency=0.2).until(
                    lambda _: check(), message=condition  # type: ignore[operator]
                )

            shows("the stream", lambda: "console/orders" in table("streams"))
            assert "1 h" in table("streams"), table("streams")  # its retention
            shows("three stores up", lambda: table("stores").count(" up") == 3)
            assert "console/orders" not in table("under"), table("under")
            assert "Being verified" in driver.page_source
            cluster.stores[1].kill()

            def store1_down(_: WebDriver | None = None) -> bool:
                rows = [r for r in table("stores").splitlines() if r.startswith("store1 ")]
                return bool(rows) and " down" in rows[0]

            shows("store1 down", store1_down)
            # Three replicas asked for and two stores left: nothing can refill it.
            shows("the segment under-replicated", lambda: "console/orders" in table("under"))
            import grpc

            from streamengine.v1 import master_pb2, master_pb2_grpc

            with grpc.insecure_channel(cluster.master_address) as channel:
                master_pb2_grpc.MasterStub(channel).DeleteStream(
                    master_pb2.DeleteStreamRequest(name="console/orders"), timeout=5
                )
            shows(
                "the deleted stream pending",
                lambda: "console/orders the whole stream" in table("pending"),
            )
            driver.save_screenshot(str(ARTIFACTS / "console.png"))
        finally:
            driver.quit()
