"""The console obeys the gRPC API's access rules: on a secured cluster it serves HTTPS,
an admin's client certificate sees everything, a tenant's token only its own streams,
and a caller with neither nothing but the (data-free) page. A store's metrics port
follows the same rules, and neither listens in plaintext beyond loopback."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamengine.client.sync import SyncStreamClient
from streamengine.protocol import transport
from streamengine.testing import (
    STREAMENGINE,
    Cluster,
    free_port,
    running_cluster,
    server_env,
    wait_for,
)
from streamengine.tools import certs
from streamengine.v1 import master_pb2, master_pb2_grpc

pytestmark = pytest.mark.security

STREAMS = ["acme/orders", "globex/invoices"]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, int]]:
    port = free_port()
    root = tmp_path_factory.mktemp("console-tls")
    with running_cluster(root, stores=3, master_args=["--metrics-port", str(port)], tls=True) as (
        cluster
    ):
        with SyncStreamClient(cluster.master_address, certs_dir=cluster.admin_certs_dir) as client:
            for name in STREAMS:
                client.create_stream(name, replicas=3, write_quorum=2)
        yield cluster, port


def admin_call(cluster: Cluster, method: str, request: Any) -> Any:
    with cluster.client_transport.channel(cluster.master.address) as channel:
        return getattr(master_pb2_grpc.MasterStub(channel), method)(request, timeout=10)


def context(cluster: Cluster, client_cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    assert cluster.admin_certs_dir is not None
    made = ssl.create_default_context(cafile=cluster.admin_certs_dir / transport.CA_CERT)
    if client_cert is not None:
        made.load_cert_chain(*client_cert)
    return made


def get(port: int, path: str, tls: ssl.SSLContext, token: str = "") -> tuple[int, bytes]:
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls) as response:
            body: bytes = response.read()
            return response.status, body
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def streams_seen(port: int, tls: ssl.SSLContext, token: str = "") -> set[str]:
    code, body = get(port, "/api/status", tls, token)
    assert code == 200, body
    status = json.loads(body)
    assert set(status["segments"]) <= {s["name"] for s in status["streams"]}
    return {s["name"] for s in status["streams"]}


def test_without_a_certificate_or_token_only_the_page_is_served(
    secured: tuple[Cluster, int],
) -> None:
    cluster, port = secured
    anonymous = context(cluster)
    code, page = get(port, "/", anonymous)
    assert code == 200 and b"<title>Stream Engine</title>" in page
    for path in ("/api/status", "/metrics"):
        code, body = get(port, path, anonymous)
        assert code == 401, (path, body)
        assert "no certificate or token" in json.loads(body)["error"]


def test_an_admin_certificate_sees_every_tenant_and_the_metrics(
    secured: tuple[Cluster, int],
) -> None:
    cluster, port = secured
    assert cluster.admin_certs_dir is not None
    admin = context(cluster, transport.client_cert_paths(cluster.admin_certs_dir, "root"))
    wait_for(lambda: set(STREAMS) <= streams_seen(port, admin), 10, 0.1, "both streams")
    code, metrics = get(port, "/metrics", admin)
    assert code == 200 and b"streamengine_master_streams" in metrics


def test_a_tenant_token_sees_its_own_streams_and_no_metrics(
    secured: tuple[Cluster, int],
) -> None:
    cluster, port = secured
    token = admin_call(
        cluster,
        "CreateToken",
        master_pb2.CreateTokenRequest(tenant="acme", role=master_pb2.TOKEN_ROLE_READ),
    )
    tenant = context(cluster)  # a tenant holds ca.crt and its token
    wait_for(lambda: bool(streams_seen(port, tenant, token.token)), 10, 0.1, "a stream")
    assert streams_seen(port, tenant, token.token) == {"acme/orders"}
    code, body = get(port, "/api/status", tenant, token.token)
    status = json.loads(body)
    assert (status["durability"]["bytes_below_n"], status["durability"]["bytes_below_w"]) == (0, 0)
    code, body = get(port, "/metrics", tenant, token.token)
    assert code == 403 and "cluster admin" in json.loads(body)["error"]
    # A revoked token proves nobody (401) once the revocation is published (each second).
    admin_call(cluster, "RevokeToken", master_pb2.RevokeTokenRequest(token_id=token.token_id))
    wait_for(lambda: get(port, "/api/status", tenant, token.token)[0] == 401, 10, 0.1, "revoked")
    assert get(port, "/api/status", tenant, "not-a-token")[0] == 401


def test_a_certificate_of_another_ca_is_refused_in_the_handshake(
    secured: tuple[Cluster, int], tmp_path: Path
) -> None:
    cluster, port = secured
    other = certs.create_local_certs(tmp_path / "other-ca")
    impostor = context(cluster, transport.client_cert_paths(other.client_dir, "root"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        get(port, "/api/status", impostor)


def test_a_plaintext_console_beyond_loopback_is_refused(tmp_path: Path) -> None:
    refused = subprocess.run(
        [
            STREAMENGINE,
            "master",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--data",
            str(tmp_path / "d"),
            "--metrics-port",
            str(free_port()),
            "--metrics-host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
    )
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "0.0.0.0" in refused.stderr and "--certs-dir" in refused.stderr


# ---- a store's metrics port: the same rules ----


@pytest.fixture(scope="module")
def store_metrics(secured: tuple[Cluster, int]) -> int:
    """The port of a store of the secured cluster serving its metrics."""
    cluster, _ = secured
    port = free_port()
    cluster.add_store(extra_args=["--metrics-port", str(port)])
    return port


def test_a_secured_stores_metrics_are_https_for_cluster_admins_only(
    secured: tuple[Cluster, int], store_metrics: int
) -> None:
    cluster, _ = secured
    assert cluster.admin_certs_dir is not None and cluster.certs is not None
    admin = context(cluster, transport.client_cert_paths(cluster.admin_certs_dir, "root"))
    code, metrics = get(store_metrics, "/metrics", admin)
    assert code == 200 and b"streamengine_store_" in metrics
    code, body = get(store_metrics, "/metrics", context(cluster))
    assert code == 401 and "no certificate or token" in json.loads(body)["error"]
    # A member of the cluster, not an admin.
    node = cluster.certs.node_dir("store0")
    member = context(cluster, (node / transport.NODE_CERT, node / transport.NODE_KEY))
    code, body = get(store_metrics, "/metrics", member)
    assert code == 403 and "cluster admin" in json.loads(body)["error"]
    # A certificate of the cluster's CA that names no role proves nobody.
    certs.create_client(cluster.certs.ca_dir, "viewer")
    viewer = context(cluster, transport.client_cert_paths(cluster.certs.ca_dir, "viewer"))
    assert get(store_metrics, "/metrics", viewer)[0] == 401
    # Plaintext gets no metrics: the connection ends in the failed handshake (whether
    # the client reads a TLS alert as a bad status line or sees the close first).
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{store_metrics}/metrics", timeout=10)


def test_a_plaintext_stores_metrics_beyond_loopback_are_refused(tmp_path: Path) -> None:
    refused = subprocess.run(
        [
            STREAMENGINE,
            "store",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--data",
            str(tmp_path / "d"),
            "--master",
            "127.0.0.1:1",
            "--metrics-port",
            str(free_port()),
            "--metrics-host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
    )
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "0.0.0.0" in refused.stderr and "--certs-dir" in refused.stderr
