"""The `streamengine` CLI against a real local cluster, error paths included."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from streamengine.client import StreamClient, StreamEngineError
from streamengine.protocol import transport
from streamengine.testing import (
    STREAMENGINE,
    Cluster,
    free_port,
    free_port_run,
    is_serving,
    wait_for,
    wait_until,
)
from streamengine.tools.local_cluster import ports_used
from tests.integration.paused_stores import (
    GIVE_UP_AFTER_S,
    READ_RAISES_S_MAX,
    acked_then_paused,
)


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STREAMENGINE, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )


def test_help_works_for_every_command() -> None:
    top = run_cli("--help")
    assert top.returncode == 0
    commands = [
        "master",
        "store",
        "cluster up",
        "stream create",
        "stream list",
        "stream update",
        "stream trim",
        "stream delete",
        "stream undelete",
        "status",
        "drain",
        "rebalance",
        "verify",
        "seal",
        "metadata backup",
        "metadata restore",
    ]
    # Each is a process start (most of the test's time): a few at once.
    with ThreadPoolExecutor(4) as pool:
        results = pool.map(lambda command: run_cli(*command.split(), "--help"), commands)
        for command, result in zip(commands, results, strict=True):
            assert result.returncode == 0, (command, result.stderr)
            assert "usage:" in result.stdout


def test_bad_flags_are_usage_errors_with_exit_code_2() -> None:
    for args in (
        ["no-such-command"],
        ["status", "--bogus"],
        ["stream", "create"],
        ["cluster", "up", "--stores", "x"],
    ):
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr


def test_no_cluster_is_one_clear_line_and_exit_1() -> None:
    address = f"127.0.0.1:{free_port()}"
    for args in (["status"], ["stream", "list"], ["verify", "a/b"]):
        result = run_cli(*args, "--master", address, timeout_s=60)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and address in lines[0], result.stderr


def test_master_address_comes_from_the_environment(cluster: Cluster) -> None:
    result = run_cli("status", "--json", env={"STREAMENGINE_MASTER": cluster.master_address})
    assert result.returncode == 0, result.stderr


def test_stream_lifecycle_and_status(cluster: Cluster) -> None:
    master = ["--master", cluster.master_address]
    created = run_cli(
        "stream", "create", "acme/orders", "--replicas", "3", "--write-quorum", "2", *master
    )
    assert created.returncode == 0, created.stderr
    again = run_cli(
        "stream", "create", "acme/orders", "--replicas", "2", "--write-quorum", "2", *master
    )
    assert again.returncode == 1 and "Traceback" not in again.stderr

    listing = json.loads(run_cli("stream", "list", "--json", *master).stdout)
    assert [s["name"] for s in listing] == ["acme/orders"]
    described = json.loads(run_cli("stream", "describe", "acme/orders", "--json", *master).stdout)
    assert described["replicas"] == 3 and described["write_quorum"] == 2

    status = json.loads(run_cli("status", "--json", *master).stdout)
    assert {s["id"] for s in status["stores"]} == {"store0", "store1", "store2"}
    for store in status["stores"]:
        assert set(store) >= {"id", "address", "zone", "alive", "bytes", "segments"}
        assert store["alive"] is True
    assert [s["name"] for s in status["streams"]] == ["acme/orders"]
    assert set(status["streams"][0]) >= {"name", "leader", "epoch", "acked_index"}
    assert status["under_replicated"] == []
    table = run_cli("status", *master)
    assert table.returncode == 0 and "store0" in table.stdout and "acme/orders" in table.stdout

    deleted = run_cli("stream", "delete", "acme/orders", "--yes", *master)
    assert deleted.returncode == 0, deleted.stderr
    master_log = cluster.master.log()
    assert 'msg="stream created" stream=acme/orders' in master_log
    assert 'msg="stream deleted" stream=acme/orders' in master_log
    # Pending removal for the master's grace (an hour by default): listed, refused.
    (pending,) = json.loads(run_cli("stream", "list", "--json", *master).stdout)
    assert pending["name"] == "acme/orders" and pending["deleted_until_ms"] > 0


def test_unknown_and_invalid_streams_change_nothing(cluster: Cluster) -> None:
    master = ["--master", cluster.master_address]
    for args in (
        ["stream", "describe", "acme/missing"],
        ["verify", "acme/missing"],
        ["stream", "delete", "acme/missing"],
    ):
        result = run_cli(*args, *master)
        assert result.returncode == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    for name, extra in (("no-slash", []), ("a/b", ["--write-quorum", "4"])):
        result = run_cli("stream", "create", name, *extra, *master)
        assert result.returncode == 1, (name, result.stderr)
    assert json.loads(run_cli("stream", "list", "--json", *master).stdout) == []


def test_rebalance_dry_run_on_an_empty_cluster_moves_nothing(cluster: Cluster) -> None:
    result = run_cli("rebalance", "--dry-run", "--master", cluster.master_address)
    assert result.returncode == 0, result.stderr
    assert "nothing to move" in result.stdout


def test_drain_of_an_unknown_store_fails_clearly(cluster: Cluster) -> None:
    result = run_cli("drain", "no-such-store", "--master", cluster.master_address)
    assert result.returncode == 1 and "Traceback" not in result.stderr


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cluster_up_serves_and_leaves_no_orphan_once_stopped(tmp_path: Path, signum: int) -> None:
    port = free_port_run(ports_used(3))
    process = subprocess.Popen(
        [
            STREAMENGINE,
            "cluster",
            "up",
            "--stores",
            "3",
            "--data",
            str(tmp_path / "data"),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # TLS by default: the CLI uses the client certs dir the cluster printed.
        certs = {"STREAMENGINE_CERTS_DIR": str((tmp_path / "data" / "certs" / "client").resolve())}

        def three_stores_alive() -> bool:
            result = run_cli(
                "status", "--json", "--master", f"127.0.0.1:{port}", env=certs, timeout_s=10
            )
            if result.returncode != 0:
                return False
            return sum(s["alive"] for s in json.loads(result.stdout)["stores"]) == 3

        wait_for(three_stores_alive, timeout_s=60, interval_s=0.3, message="cluster up")
        # The web console, by default on the port after the last store's, shows the
        # cluster to its admin (HTTPS, client.root's certificate).
        client_dir = Path(certs["STREAMENGINE_CERTS_DIR"])
        tls = ssl.create_default_context(cafile=client_dir / transport.CA_CERT)
        tls.load_cert_chain(*transport.client_cert_paths(client_dir, "root"))
        console = f"https://127.0.0.1:{port + 4}/"

        def console_shows_three_stores() -> bool:
            with urllib.request.urlopen(console + "api/status", timeout=10, context=tls) as reply:
                return len(json.loads(reply.read())["stores"]) == 3

        # The master publishes the console's view once a second.
        wait_for(console_shows_three_stores, timeout_s=10, interval_s=0.2, message="console")
        children = _children(process.pid)
        assert len(children) >= 4
        assert stop_within_a_second(process, signum) == 0
        # Its servers were stopped (or killed) before it exited.
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
        assert process.stdout is not None
        output = process.stdout.read()
        assert f"127.0.0.1:{port}" in output
        assert f"stopping ({signal.Signals(signum).name})" in output
        assert f"export STREAMENGINE_CERTS_DIR={certs['STREAMENGINE_CERTS_DIR']}" in output
        assert f"export STREAMENGINE_MASTER=127.0.0.1:{port}" in output
        assert f"web console: {console}" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("source", "expected_lease_ms"), [("env", 900), ("config", 1500), ("config+flag", 1200)]
)
def test_servers_take_settings_from_config_files_and_env_flags_winning(
    tmp_path: Path, source: str, expected_lease_ms: int
) -> None:
    port = free_port()
    data = tmp_path / "master"
    env = {}
    args = ["master"]
    if source == "env":
        env = {
            "STREAMENGINE_LISTEN": f"127.0.0.1:{port}",
            "STREAMENGINE_DATA": str(data),
            "STREAMENGINE_LEASE_MS": "900",
        }
    else:
        config = tmp_path / "master.toml"
        config.write_text(f'listen = "127.0.0.1:{port}"\ndata = "{data}"\nlease-ms = 1500\n')
        args += ["--config", str(config)]
        if source == "config+flag":
            args += ["--lease-ms", "1200"]
            env = {"STREAMENGINE_LEASE_MS": "900"}
    log_path = tmp_path / "master.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [STREAMENGINE, *args], env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_for(
            lambda: (
                run_cli("status", "--master", f"127.0.0.1:{port}", timeout_s=10).returncode == 0
            ),
            timeout_s=30,
            interval_s=0.2,
            message="master serving at the configured address",
        )
        assert f"lease {expected_lease_ms} ms" in log_path.read_text()
    finally:
        process.terminate()
        assert process.wait(timeout=20) == 0


def test_append_and_tail(cluster: Cluster) -> None:
    master = ["--master", cluster.master_address]
    assert run_cli("stream", "create", "cli/events", *master).returncode == 0
    lines = [json.dumps({"kind": f"k{i % 3}", "n": i}) for i in range(300)]
    appended = subprocess.run(
        [STREAMENGINE, "append", "cli/events", "--batch", "50", *master],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert appended.returncode == 0, appended.stderr
    assert "appended 300 events" in appended.stdout

    text = run_cli("tail", "cli/events", *master)
    assert text.returncode == 0, text.stderr
    rows = [line.split("\t", 1) for line in text.stdout.splitlines()]
    assert [payload for _, payload in rows] == lines
    sequences = [int(sequence) for sequence, _ in rows]
    assert sequences == sorted(sequences)

    from_middle = run_cli(
        "tail", "cli/events", "--format", "json", "--from", str(sequences[250]), *master
    )
    events = [json.loads(line) for line in from_middle.stdout.splitlines()]
    assert [e["sequence"] for e in events] == sequences[250:]
    assert [e["payload"] for e in events] == lines[250:]

    missing = run_cli("tail", "cli/missing", *master)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr


async def test_tail_of_paused_stores_fails_naming_them(cluster: Cluster) -> None:
    """Issue #36 (0): `tail` without --follow of acked events no store can serve exits
    non-zero with the stores on stderr, never zero with nothing printed."""
    async with (
        StreamClient(cluster.master_address) as client,
        acked_then_paused(cluster, client, "cli/paused") as paused,
    ):
        tail = await asyncio.to_thread(
            run_cli, "tail", paused.name, "--master", cluster.master_address,
            "--give-up-after", str(GIVE_UP_AFTER_S),
            timeout_s=READ_RAISES_S_MAX,
        )  # fmt: skip
    assert tail.returncode == 1, (tail.stdout, tail.stderr)
    assert tail.stdout == ""
    assert tail.stderr.startswith("streamengine: error: "), tail.stderr
    assert "Traceback" not in tail.stderr
    assert all(store in tail.stderr for store in paused.stores), tail.stderr


async def test_status_and_describe_show_the_open_segment_move(cluster: Cluster) -> None:
    """The leader reports its acked index with each lease renewal: an operator sees the
    open segment's acked index, and still sees it once that writer has gone."""
    master = ["--master", cluster.master_address]
    events = 2000

    async def shown() -> tuple[int, int, list[dict[str, Any]]]:
        status = await asyncio.to_thread(run_cli, "status", "--json", *master)
        described = await asyncio.to_thread(
            run_cli, "stream", "describe", "cli/progress", "--json", *master
        )
        assert status.returncode == 0 and described.returncode == 0, status.stderr
        stream = json.loads(status.stdout)["streams"][0]
        info = json.loads(described.stdout)
        open_segments = [s for s in info["segments"] if s["state"] == "open"]
        return stream["acked_index"], info["acked_index"], open_segments

    async def all_acked_shown() -> bool:
        in_status, in_describe, open_segments = await shown()
        return (
            in_status >= events
            and in_describe >= events
            and len(open_segments) == 1
            and open_segments[0]["acked_index"] >= events
        )

    async with StreamClient(cluster.master_address) as client:
        await client.create_stream("cli/progress", replicas=3, write_quorum=2)
        async with client.writer("cli/progress") as writer:
            for first in range(0, events, 500):
                await writer.append_batch([b"event %d" % i for i in range(first, first + 500)])
            await wait_until(all_acked_shown, timeout_s=30, message="acked events shown")
        await wait_until(all_acked_shown, timeout_s=30, message="shown after the writer left")
    table = await asyncio.to_thread(run_cli, "stream", "describe", "cli/progress", *master)
    assert "ACKED" in table.stdout and str(events) in table.stdout


def test_tail_follow_prints_events_appended_later(cluster: Cluster, tmp_path: Path) -> None:
    master = ["--master", cluster.master_address]
    assert run_cli("stream", "create", "cli/follow", *master).returncode == 0
    output = tmp_path / "tail.out"
    with output.open("w") as sink:
        follower = subprocess.Popen(
            [STREAMENGINE, "tail", "cli/follow", "--follow", *master],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        appended = subprocess.run(
            [STREAMENGINE, "append", "cli/follow", *master],
            input="later-a\nlater-b\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert appended.returncode == 0, appended.stderr
        wait_for(
            lambda: output.read_text().count("\n") >= 2, timeout_s=30, message="follower output"
        )
        payloads = [line.split("\t", 1)[1] for line in output.read_text().splitlines()]
        assert payloads == ["later-a", "later-b"]
        assert stop_within_a_second(follower, signal.SIGINT) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()


# A command that runs until stopped ends this soon after Ctrl-C or SIGTERM, on a loaded
# host too (issue: a stopped `tail --follow` once took over 20 s to exit).
STOP_S_MAX = 1.0


def stop_within_a_second(process: subprocess.Popen[Any], signum: int) -> int:
    """Send `signum`; the process's exit code, which must come within STOP_S_MAX."""
    sent = time.monotonic()
    process.send_signal(signum)
    try:
        code = process.wait(timeout=STOP_S_MAX)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(
            f"{signal.Signals(signum).name}: still running after {STOP_S_MAX} s"
        ) from None
    assert time.monotonic() - sent <= STOP_S_MAX + 0.1  # the wait's own slack
    return code


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_tail_follow_stops_within_a_second_while_another_process_appends(
    cluster: Cluster, tmp_path: Path, signum: int
) -> None:
    master = ["--master", cluster.master_address]
    assert run_cli("stream", "create", "cli/busy", *master).returncode == 0
    output = tmp_path / "tail.out"
    appender = subprocess.Popen(
        [STREAMENGINE, "append", "cli/busy", "--batch", "20", *master],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert appender.stdin is not None
    with output.open("w") as sink:
        follower = subprocess.Popen(
            [STREAMENGINE, "tail", "cli/busy", "--follow", *master],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        # Appending on while the follower prints, for at most 60 s and 200,000 events.
        deadline = time.monotonic() + 60
        for _ in range(2_000):
            appender.stdin.write(b"busy-event\n" * 100)
            appender.stdin.flush()
            if output.stat().st_size > 20_000 or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        assert output.stat().st_size > 20_000, "the follower printed too little"
        assert stop_within_a_second(follower, signum) == 0
    finally:
        for process in (follower, appender):
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_servers_and_an_append_waiting_for_input_stop_within_a_second(
    tmp_path: Path, signum: int
) -> None:
    master_address, store_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    # Its own data port: the default, the gRPC port + 1, may be another server's.
    data_address = f"127.0.0.1:{free_port()}"
    started: dict[str, subprocess.Popen[bytes]] = {}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, *args: str) -> None:
        with (logs / name).open("wb") as log:
            started[name] = subprocess.Popen(
                [STREAMENGINE, *args], stdin=subprocess.PIPE, stdout=log, stderr=log
            )

    def serving(name: str, address: str) -> bool:
        exited = started[name].poll()
        assert exited is None, (name, exited, (logs / name).read_text())
        return is_serving(address)

    try:
        start("master", "master", "--listen", master_address, "--data", str(tmp_path / "m"))
        wait_for(lambda: serving("master", master_address), timeout_s=30, message="master")
        start(
            "store",
            *("store", "--listen", store_address, "--data-listen", data_address),
            *("--data", str(tmp_path / "s"), "--master", master_address, "--id", "s0"),
        )
        wait_for(lambda: serving("store", store_address), timeout_s=30, message="store")
        master = ["--master", master_address]
        created = run_cli(
            "stream", "create", "cli/typed", "--replicas", "1", "--write-quorum", "1", *master
        )
        assert created.returncode == 0, created.stderr
        # As from a terminal: a line typed, then nothing, the input left open.
        start("append", "append", "cli/typed", "--batch", "1", *master)
        append_input = started["append"].stdin
        assert append_input is not None
        append_input.write(b"typed\n")
        append_input.flush()

        def typed_line_acked() -> bool:
            described = run_cli("stream", "describe", "cli/typed", "--json", *master)
            return described.returncode == 0 and any(
                segment["acked_index"] >= 1 for segment in json.loads(described.stdout)["segments"]
            )

        wait_for(typed_line_acked, timeout_s=30, interval_s=0.2, message="the typed line acked")
        # Interrupted, `append` says so in its exit code; the servers stop cleanly.
        for name, code in (("append", 130), ("store", 0), ("master", 0)):
            assert stop_within_a_second(started[name], signum) == code, (
                name,
                (logs / name).read_text(),
            )
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


async def test_closing_a_client_ends_its_busy_writer_and_reader_at_once(
    cluster: Cluster,
) -> None:
    """What a stopped command's close relies on: closing a `StreamClient` is bounded in
    time whatever its writers and readers are doing, and they end with its error (not
    appending on into closed channels until the append timeout, nor their tasks
    looking cancelled)."""
    client = StreamClient(cluster.master_address)
    await client.__aenter__()
    await client.create_stream("cli/closing", replicas=3, write_quorum=2)
    appended = 0

    async def write() -> None:
        nonlocal appended
        async with client.writer("cli/closing") as writer:
            for _ in range(100_000):  # ended by the close long before
                await writer.append_batch([b"x" * 100] * 100)
                appended += 100

    async def read() -> None:
        async for _ in client.subscribe_batches("cli/closing"):
            pass

    tasks = [asyncio.create_task(write()), asyncio.create_task(read())]
    await wait_until(lambda: appended >= 2_000, timeout_s=30, message="appending")
    closed = time.monotonic()
    await asyncio.wait_for(client.close(), timeout=STOP_S_MAX)
    done, _ = await asyncio.wait(tasks, timeout=STOP_S_MAX)
    assert time.monotonic() - closed < STOP_S_MAX + 0.1
    assert done == set(tasks), "a writer or reader went on after its client closed"
    for task in tasks:
        assert not task.cancelled()
        error = task.exception()
        while isinstance(error, BaseExceptionGroup):  # the writer's background tasks
            error = error.exceptions[0]
        assert isinstance(error, StreamEngineError) and "closed" in str(error), error


def test_a_second_server_on_a_taken_port_fails_with_one_line(
    cluster: Cluster, tmp_path: Path
) -> None:
    for args in (
        ["master", "--listen", cluster.master_address, "--data", str(tmp_path / "m2")],
        [
            "store",
            "--listen",
            cluster.stores[0].address,
            "--data",
            str(tmp_path / "s2"),
            "--master",
            cluster.master_address,
        ],
    ):
        result = run_cli(*args, timeout_s=30)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout


def test_bench_runs_a_benchmark_against_the_cluster(cluster: Cluster) -> None:
    master = ["--master", cluster.master_address]
    result = run_cli(
        "bench",
        "--only",
        "subscribe",
        *master,
        "--",
        "--events",
        "3000",
        "--seconds",
        "1",
        timeout_s=180,
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "catch-up:" in result.stdout and "live tail:" in result.stdout
    assert run_cli("bench", "--only", "nope", *master).returncode == 2
    assert run_cli("bench", "--master", f"127.0.0.1:{free_port()}").returncode == 1


def test_seal_seals_the_open_segment_and_an_unknown_stream_is_one_line(cluster: Cluster) -> None:
    master = ["--master", cluster.master_address]
    unknown = run_cli("seal", "nobody/here", *master)
    assert unknown.returncode == 1, (unknown.stdout, unknown.stderr)
    lines = [line for line in unknown.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nobody/here" in lines[0], unknown.stderr
    assert run_cli("stream", "create", "acme/sealed", *master).returncode == 0
    appended = subprocess.run(
        [STREAMENGINE, "append", "acme/sealed", *master],
        input="one\ntwo\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert appended.returncode == 0, appended.stderr
    sealed = run_cli("seal", "acme/sealed", *master)
    assert sealed.returncode == 0, sealed.stderr
    assert sealed.stdout.startswith("sealed acme/sealed: segment "), sealed.stdout
    epoch = int(sealed.stdout.split()[-1])
    described = json.loads(run_cli("stream", "describe", "acme/sealed", "--json", *master).stdout)
    states = {s["epoch"]: s["state"] for s in described["segments"]}
    assert states[epoch] == "sealed", described


def segments_on(master: list[str], store_id: str) -> int:
    """Segments the master places on `store_id` (-1 while it is unknown)."""
    status = json.loads(run_cli("status", "--json", *master).stdout)
    return next((s["segments"] for s in status["stores"] if s["id"] == store_id), -1)


def test_drain_and_verify_with_data(tmp_path: Path) -> None:
    from bench.segment_driver import Driver
    from streamengine.testing import running_cluster

    with running_cluster(tmp_path, stores=4, master_args=["--lease-ms", "1000"]) as cluster:
        master = ["--master", cluster.master_address]
        assert run_cli("stream", "create", "ops/data", *master).returncode == 0
        driver = Driver(cluster.master_address, "ops/data")
        for _ in range(3):
            driver.fill_and_roll(200, 50)

        verified = run_cli("verify", "ops/data", *master)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "3 sealed segments checked, OK" in verified.stdout

        stores = ("store0", "store1", "store2", "store3")
        busiest = max(stores, key=lambda store_id: segments_on(master, store_id))
        assert segments_on(master, busiest) > 0
        drained = run_cli("drain", busiest, *master, timeout_s=180)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert "drain [" in drained.stderr  # the progress bar
        assert driver.segment is not None
        if busiest in {replica.store_id for replica in driver.segment.copy_set}:
            # A drain moves sealed replicas; a writer whose open segment has a draining
            # store rolls away from it (its heartbeat reply says why). The driver is no
            # writer: it rolls by hand, and the drain moves the segment it sealed.
            driver.fill_and_roll(200, 50)
        # A segment sealed just before the drain may be planned only once its replicas
        # have reported it (the repairer keeps draining the store): wait for it.
        wait_for(lambda: segments_on(master, busiest) == 0, timeout_s=90, message="store drained")
        assert run_cli("verify", "ops/data", *master).returncode == 0

        victim = next(s for s in stores if s != busiest)
        cluster.stores[int(victim[-1])].kill()
        broken = run_cli("verify", "ops/data", *master)
        assert broken.returncode == 1
        assert f"replica {victim} missing" in broken.stdout


def test_rebalance_with_data_fills_a_new_store_and_keeps_every_replica_identical(
    tmp_path: Path,
) -> None:
    from bench.segment_driver import Driver
    from streamengine.testing import running_cluster

    with running_cluster(tmp_path, stores=3, master_args=["--lease-ms", "1000"]) as cluster:
        master = ["--master", cluster.master_address]
        assert run_cli("stream", "create", "ops/spread", *master).returncode == 0
        driver = Driver(cluster.master_address, "ops/spread")
        for _ in range(4):
            driver.fill_and_roll(200, 50)

        listed: list[object] = []

        def replicated() -> bool:
            status = json.loads(run_cli("status", "--json", *master).stdout)
            listed[:] = status["under_replicated"] + status["verifying"]
            return listed == []

        # Only replicas read back equal to their certificate count as good, and only
        # segments whose replicas are all good move.
        try:
            wait_for(replicated, timeout_s=60, message="every sealed replica matched")
        except TimeoutError as error:
            raise AssertionError(f"still under-replicated: {listed}") from error
        cluster.add_store()
        wait_for(lambda: segments_on(master, "store3") == 0, timeout_s=30, message="store3 known")
        planned = run_cli("rebalance", "--dry-run", *master)
        assert planned.returncode == 0, planned.stdout + planned.stderr
        assert "plan: " in planned.stdout and "store3" in planned.stdout
        assert segments_on(master, "store3") == 0  # a dry run moves nothing

        moved = run_cli("rebalance", *master, timeout_s=180)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        counts = [segments_on(master, f"store{n}") for n in range(4)]
        assert counts[3] > 0 and max(counts) - min(counts) <= 1, counts
        verified = run_cli("verify", "ops/spread", *master)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "4 sealed segments checked, OK" in verified.stdout
        again = run_cli("rebalance", "--dry-run", *master)
        assert "nothing to move" in again.stdout, again.stdout


def test_drain_refuses_to_break_a_stream_plans_and_is_cancelled(tmp_path: Path) -> None:
    from streamengine.testing import running_cluster

    def draining(master: list[str]) -> dict[str, bool]:
        status = json.loads(run_cli("status", "--json", *master).stdout)
        return {s["id"]: s["draining"] for s in status["stores"]}

    with running_cluster(tmp_path, stores=3) as cluster:
        master = ["--master", cluster.master_address]
        assert run_cli("stream", "create", "ops/three", "--replicas", "3", *master).returncode == 0
        refused = run_cli("drain", "store0", *master)
        assert refused.returncode != 0
        assert "refused" in refused.stderr and "ops/three" in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr
        planned = run_cli("drain", "store0", "--dry-run", *master)
        assert planned.returncode != 0 and "ops/three" in planned.stderr
        assert draining(master) == {"store0": False, "store1": False, "store2": False}

        cluster.add_store()
        wait_for(lambda: "store3" in draining(master), timeout_s=30, message="store3 known")
        planned = run_cli("drain", "store0", "--dry-run", *master)
        assert planned.returncode == 0, planned.stderr
        assert "plan to drain store0" in planned.stdout
        assert not draining(master)["store0"]  # a plan changes nothing
        started = run_cli("drain", "store0", *master, timeout_s=60)
        assert started.returncode == 0, started.stderr
        assert draining(master)["store0"]
        # With store0 draining, store1 may not go too: two stores would be left.
        assert run_cli("drain", "store1", *master).returncode != 0
        cancelled = run_cli("undrain", "store0", *master)
        assert cancelled.returncode == 0, cancelled.stderr
        assert "takes new replicas again" in cancelled.stdout
        assert not draining(master)["store0"]
