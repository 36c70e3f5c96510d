"""TLS between real processes: who is refused, who gets through, and that a secured
cluster does everything a plaintext one does (append, read, seal, repair by a
store-to-store copy, the CLI).

Clusters here are `running_cluster(tls=True)`: certificates under `root/certs`, every
process with its own node certificate, `client/` holding `client.root`.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from streamengine.client.errors import Unavailable
from streamengine.client.stream_client import StreamClient
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.testing import (
    STREAMENGINE,
    Cluster,
    free_port,
    free_port_run,
    running_cluster,
    server_env,
    wait_for,
)
from streamengine.tools import certs
from streamengine.tools.local_cluster import ports_used
from streamengine.tools.verify import verify_stream
from streamengine.v1 import (
    entry_pb2,
    master_pb2,
    master_pb2_grpc,
    segment_store_pb2,
    segment_store_pb2_grpc,
)

pytestmark = pytest.mark.security

STREAM = "acme/orders"
STORE_TIMEOUT_MS = 1500
MASTER_ARGS = ["--lease-ms", "1000", "--store-timeout-ms", str(STORE_TIMEOUT_MS)]
# A refusal at first contact: a handshake is milliseconds, so seconds mean waiting.
FAIL_FAST_S = 3.0


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("tls")
    with running_cluster(root, stores=3, master_args=MASTER_ARGS, tls=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> certs.LocalCerts:
    """A second CA with its own client.root: signed, but not by the cluster's CA."""
    return certs.create_local_certs(tmp_path_factory.mktemp("other-ca"))


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [STREAMENGINE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**server_env(), **(env or {})},
    )


async def make_stream(cluster: Cluster, events: int) -> list[bytes]:
    payloads = [f"event {n}".encode() for n in range(events)]
    async with StreamClient(cluster.master_address, certs_dir=cluster.admin_certs_dir) as client:
        await client.create_stream(STREAM, replicas=3, write_quorum=2)
        async with client.writer(STREAM) as writer:
            await writer.append_batch(payloads)
    return payloads


def sealed_segment(cluster: Cluster) -> entry_pb2.Segment:
    with cluster.client_transport.channel(cluster.master_address) as channel:
        listing = master_pb2_grpc.MasterStub(channel).ListSegments(
            master_pb2.ListSegmentsRequest(stream=STREAM), timeout=5
        )
    sealed = [s for s in listing.segments if s.state == entry_pb2.SEALED]
    assert sealed, listing
    segment = sealed[0]
    segment.id.stream_id = listing.stream_id
    return segment


def digest(transport: Transport, address: str, segment: entry_pb2.Segment) -> bytes:
    with transport.channel(address) as channel:
        reply = segment_store_pb2_grpc.SegmentStoreStub(channel).Digest(
            segment_store_pb2.DigestRequest(segment=segment.id, up_to_index=segment.final_index),
            timeout=5,
        )
    return bytes(reply.digest)


def segment_state(
    transport: Transport, address: str, segment: entry_pb2.Segment
) -> segment_store_pb2.SegmentStateReply:
    with transport.channel(address) as channel:
        return segment_store_pb2_grpc.SegmentStoreStub(channel).GetSegmentState(
            segment_store_pb2.GetSegmentStateRequest(segment=segment.id), timeout=5
        )


# ---- who is refused ----


async def test_a_plaintext_client_is_refused_at_once_naming_tls(secured: Cluster) -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable, match="TLS"):
        async with StreamClient(secured.master_address) as client:
            await client.describe_stream(STREAM)
    assert time.monotonic() - started < FAIL_FAST_S


async def test_a_client_trusting_another_ca_is_refused_at_once_naming_tls(
    secured: Cluster, other_ca: certs.LocalCerts
) -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable, match="TLS handshake failed"):
        async with StreamClient(secured.master_address, certs_dir=other_ca.client_dir) as client:
            await client.describe_stream(STREAM)
    assert time.monotonic() - started < FAIL_FAST_S


def test_the_cli_says_in_one_line_why_it_cannot_connect(
    secured: Cluster, other_ca: certs.LocalCerts
) -> None:
    plaintext = run_cli("status", "--master", secured.master_address)
    assert plaintext.returncode == 1
    assert plaintext.stderr.count("\n") == 1 and "TLS" in plaintext.stderr, plaintext.stderr
    wrong_ca = run_cli(
        "status", "--master", secured.master_address, "--certs-dir", str(other_ca.client_dir)
    )
    assert wrong_ca.returncode == 1
    assert wrong_ca.stderr.count("\n") == 1 and "TLS handshake" in wrong_ca.stderr, wrong_ca.stderr


def test_a_certificate_of_another_ca_proves_nothing(
    secured: Cluster, other_ca: certs.LocalCerts
) -> None:
    """A client that trusts the cluster's CA but proves a certificate another CA signed
    (naming itself the master) is refused before anything is done."""
    forged_dir = other_ca.add_node("forged-master", master=True)
    forged = Transport(
        (secured.admin_certs_dir or Path()).joinpath("ca.crt").read_bytes(),
        (forged_dir / "node.crt").read_bytes(),
        (forged_dir / "node.key").read_bytes(),
    )
    segment_id = entry_pb2.SegmentId(stream_id=1, epoch=1)
    with (
        forged.channel(secured.stores[0].address) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        segment_store_pb2_grpc.SegmentStoreStub(channel).Delete(
            segment_store_pb2.DeleteRequest(segment=segment_id), timeout=5
        )
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not the cluster's" in (refused.value.details() or "")


async def test_delete_and_copy_only_from_the_masters_certificate(secured: Cluster) -> None:
    await make_stream(secured, 50)
    async with StreamClient(secured.master_address, certs_dir=secured.admin_certs_dir) as client:
        await client.seal(STREAM)
    segment = sealed_segment(secured)
    admin = secured.client_transport
    target = secured.store_by_address(segment.copy_set[0].address)
    before = (digest(admin, target.address, segment), segment_state(admin, target.address, segment))
    assert secured.certs is not None
    callers = {
        "a store": Transport.for_node(secured.certs.node_dir("store1")),
        "a cluster admin": admin,
        "a tenant's CA alone": Transport.for_client(secured.certs.tenant_dir),
    }
    for who, transport in callers.items():
        with transport.channel(target.address) as channel:
            stub = segment_store_pb2_grpc.SegmentStoreStub(channel)
            with pytest.raises(grpc.RpcError) as deleted:
                stub.Delete(segment_store_pb2.DeleteRequest(segment=segment.id), timeout=5)
            with pytest.raises(grpc.RpcError) as copied:
                stub.CopySegment(
                    segment_store_pb2.CopySegmentRequest(
                        segment=segment.id,
                        source_address=segment.copy_set[1].address,
                        source_data_address=segment.copy_set[1].data_address,
                        final_index=segment.final_index,
                        fence=before[1].fence + 1,
                    ),
                    timeout=5,
                )
        for refused in (deleted.value, copied.value):
            assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, (who, refused)
            assert "master" in (refused.details() or ""), who
    after = (digest(admin, target.address, segment), segment_state(admin, target.address, segment))
    assert after == before


def test_a_store_registers_and_heartbeats_only_as_itself(secured: Cluster) -> None:
    assert secured.certs is not None
    impostor = Transport.for_node(secured.certs.node_dir("store1"))
    victim = secured.stores[0]
    with impostor.channel(secured.master_address) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        with pytest.raises(grpc.RpcError) as registered:
            stub.RegisterStore(
                master_pb2.RegisterStoreRequest(
                    store_id="store0", address="127.0.0.1:1", zone="", free_bytes=1 << 30
                ),
                timeout=5,
            )
        with pytest.raises(grpc.RpcError) as heartbeat:
            stub.StoreHeartbeat(
                master_pb2.StoreHeartbeatRequest(store_id="store0", address="127.0.0.1:1"),
                timeout=5,
            )
        # As itself it is welcome (the real store1 does this every second).
        stub.StoreHeartbeat(
            master_pb2.StoreHeartbeatRequest(store_id="store1", address=secured.stores[1].address),
            timeout=5,
        )
    for refused in (registered.value, heartbeat.value):
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "store1" in (refused.details() or "")
    with secured.client_transport.channel(secured.master_address) as channel:
        status = master_pb2_grpc.MasterStub(channel).GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=5
        )
    addresses = {s.store_id: s.address for s in status.stores}
    assert addresses["store0"] == victim.address


def test_a_store_whose_certificate_names_another_id_is_never_registered(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path, stores=1, tls=True) as cluster:
        assert cluster.certs is not None
        impostor_certs = cluster.certs.add_node("impostor", store_id="store0")
        port = free_port()
        impostor = subprocess.Popen(
            [
                STREAMENGINE,
                "store",
                "--listen",
                f"127.0.0.1:{port}",
                # Its own port: by default the data port is the next one, which nobody
                # checked was free (taken, the store exits before it ever registers).
                "--data-listen",
                f"127.0.0.1:{free_port()}",
                "--data",
                str(tmp_path / "impostor"),
                "--master",
                cluster.master_address,
                "--id",
                "store9",
                "--certs-dir",
                str(impostor_certs),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=server_env(),
        )
        try:

            def refusals() -> float:
                log = (tmp_path / "master.log").read_text(errors="replace")
                return log.count("RegisterStore as store 'store9'")

            wait_for(refusals, 20, 0.1, "the master refusing store9's registration")
            with cluster.client_transport.channel(cluster.master_address) as channel:
                status = master_pb2_grpc.MasterStub(channel).GetClusterStatus(
                    master_pb2.GetClusterStatusRequest(), timeout=5
                )
            assert {s.store_id for s in status.stores} == {"store0"}
        finally:
            impostor.kill()
            impostor.wait()


@pytest.mark.parametrize("server", ["master", "store"])
def test_protected_mode_refuses_plaintext_beyond_loopback(tmp_path: Path, server: str) -> None:
    args = [server, "--listen", f"0.0.0.0:{free_port()}", "--data", str(tmp_path / "d")]
    if server == "store":
        args += ["--master", "127.0.0.1:1"]
    refused = run_cli(*args)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "--certs-dir" in refused.stderr and "--insecure" in refused.stderr
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


# ---- a secured cluster does its work ----


async def test_append_read_seal_and_repair_by_a_store_to_store_copy(tmp_path: Path) -> None:
    with running_cluster(tmp_path, stores=4, master_args=MASTER_ARGS, tls=True) as cluster:
        payloads = await make_stream(cluster, 200)
        async with StreamClient(
            cluster.master_address, certs_dir=cluster.admin_certs_dir
        ) as client:
            assert [e.payload async for e in client.read(STREAM)] == payloads
            await client.seal(STREAM)
        segment = sealed_segment(cluster)
        lost = cluster.store_by_address(segment.copy_set[0].address)
        lost.kill()

        def repaired() -> bool:
            current = sealed_segment(cluster)
            members = {r.store_id for r in current.copy_set}
            return lost.name not in members and len(members) == 3

        wait_for(repaired, 40, 0.2, "the lost replica re-created on the fourth store")

        # The seal raised W replicas to the bridge; the third reaches it a little later
        # (a late store's bridging, or the master's repair), so every replica is judged
        # once they all could have, not at the instant the copy set changed.
        def verified() -> bool:
            report = verify_stream(cluster.master_address, STREAM, cluster.client_transport)
            return report.ok and report.sealed_segments >= 1

        wait_for(verified, 30, 0.5, "every replica of the sealed segment at its bridge")
        async with StreamClient(
            cluster.master_address, certs_dir=cluster.admin_certs_dir
        ) as client:
            assert [e.payload async for e in client.read(STREAM)] == payloads
        copied = (tmp_path / "master.log").read_text(errors="replace")
        assert "replica repaired" in copied
        # Back, the replaced store hears from the master (a delete list its certificate
        # signed) that its copy is no longer one, and deletes it.
        lost.start()

        def replaced_copy_deleted() -> bool:
            try:
                segment_state(cluster.client_transport, lost.address, segment)
            except grpc.RpcError as error:
                return error.code() == grpc.StatusCode.NOT_FOUND
            return False

        wait_for(replaced_copy_deleted, 30, 0.2, "the replaced copy deleted by the master's list")
        assert "deleted segment" in lost.log()
        assert "not from the master's certificate" not in lost.log()


def test_the_cli_with_a_certs_dir(secured: Cluster, tmp_path: Path) -> None:
    env = {"STREAMENGINE_CERTS_DIR": str(secured.admin_certs_dir)}
    master = ["--master", secured.master_address]
    created = run_cli("stream", "create", "cli/events", *master, env=env)
    assert created.returncode == 0, created.stderr
    lines = tmp_path / "lines"
    lines.write_text("one\ntwo\nthree\n")
    appended = run_cli("append", "cli/events", "--file", str(lines), *master, env=env)
    assert appended.returncode == 0, appended.stderr
    tailed = run_cli("tail", "cli/events", *master, "--format", "json", env=env)
    assert [json.loads(line)["payload"] for line in tailed.stdout.splitlines()] == [
        "one",
        "two",
        "three",
    ]
    status = run_cli("status", "--json", *master, "--certs-dir", str(secured.admin_certs_dir))
    assert status.returncode == 0, status.stderr
    assert len(json.loads(status.stdout)["stores"]) == 3
    explained = run_cli("stream", "explain", "cli/events", *master, env=env)
    assert explained.returncode == 0, explained.stderr
    assert run_cli("seal", "cli/events", *master, env=env).returncode == 0
    verified = run_cli("verify", "cli/events", *master, env=env)
    assert verified.returncode == 0 and "OK" in verified.stdout, verified.stdout


def test_health_checks_need_no_certificate(secured: Cluster) -> None:
    """Load balancers and `is_serving` probe with the CA alone."""
    assert secured.certs is not None
    from streamengine.testing import is_serving

    tenant = Transport.for_client(secured.certs.tenant_dir)
    assert all(is_serving(p.address, transport=tenant) for p in [secured.master, *secured.stores])
    assert not is_serving(secured.master.address, transport=PLAINTEXT)


def test_cluster_up_insecure_serves_plaintext_and_makes_no_certificates(tmp_path: Path) -> None:
    port = free_port_run(ports_used(1))
    command = [STREAMENGINE, "cluster", "up", "--insecure", "--stores", "1"]
    command += ["--data", str(tmp_path / "data"), "--port", str(port)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=server_env(),
    )
    try:

        def plaintext_status() -> bool:
            return run_cli("status", "--master", f"127.0.0.1:{port}").returncode == 0

        wait_for(plaintext_status, 60, 0.2, "the insecure cluster answering plaintext")
        assert not (tmp_path / "data" / "certs").exists()
        process.terminate()
        exited = process.wait(timeout=30)
        assert process.stdout is not None
        printed = process.stdout.read()
        assert exited == 0, printed
        assert "STREAMENGINE_CERTS_DIR" not in printed
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_cert_commands_make_the_layout(tmp_path: Path) -> None:
    certs_dir, ca_key = tmp_path / "certs", tmp_path / "offline" / "ca.key"
    made = [
        run_cli("cert", "create-ca", "--certs-dir", str(certs_dir), "--ca-key", str(ca_key)),
        run_cli(
            "cert",
            "create-node",
            "127.0.0.1",
            "db1.example",
            "--store-id",
            "s1",
            "--certs-dir",
            str(certs_dir),
            "--ca-key",
            str(ca_key),
        ),
        run_cli(
            "cert",
            "create-client",
            "alice",
            "--admin",
            "--lifetime-days",
            "30",
            "--certs-dir",
            str(certs_dir),
            "--ca-key",
            str(ca_key),
        ),
    ]
    assert [m.returncode for m in made] == [0, 0, 0], [m.stderr for m in made]
    assert sorted(p.name for p in certs_dir.iterdir()) == [
        "ca.crt",
        "client.alice.crt",
        "client.alice.key",
        "node.crt",
        "node.key",
    ]
    for key in (ca_key, certs_dir / "node.key", certs_dir / "client.alice.key"):
        assert key.stat().st_mode & 0o777 == 0o600, key
    alice = Transport.for_client(certs_dir)  # no client.root here: the CA alone
    assert alice.tls and not alice.cert_pem
    no_role = run_cli("cert", "create-node", "h", "--certs-dir", str(certs_dir))
    assert no_role.returncode == 2
    again = run_cli("cert", "create-ca", "--certs-dir", str(certs_dir), "--ca-key", str(ca_key))
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
