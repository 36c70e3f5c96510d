"""etcd's own auth, as `metadata secure` sets it up: of the certificates of the cluster's
CA, the masters' alone reach the cluster's keys; a store's, a client's that grants
nothing, a cluster admin's and a TLS client without one get nothing. (The masters
electing, failing over and serving on such an etcd: test_master_failover.)"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from streamengine.etcd import rpc_pb2, rpc_pb2_grpc
from streamengine.master.etcd import EtcdTLS
from streamengine.protocol import transport
from streamengine.testing import EtcdCluster, etcd_binary, running_etcd
from streamengine.tools import metadata_secure
from streamengine.tools.certs import LocalCerts, create_client, create_local_certs
from tests.conftest import ETCD_MISSING
from tests.integration.test_cli import run_cli

SIGNING_KEY = b"/streamengine/meta/m/signing_key"
PREFIX_KEY = b"/streamengine/writer"
OUTSIDE_KEY = b"/streamengineX/meta/m/signing_key"


@dataclass
class SecuredEtcd:
    etcd: EtcdCluster
    certs: LocalCerts


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredEtcd]:
    if etcd_binary() is None:
        pytest.skip(ETCD_MISSING)
    root = tmp_path_factory.mktemp("etcd-auth")
    certs = create_local_certs(root / "certs")
    with running_etcd(root / "etcd", certs=certs) as etcd:
        yield SecuredEtcd(etcd, certs)


def _client_tls(certs: LocalCerts, directory: Path, name: str) -> EtcdTLS:
    cert, key = transport.client_cert_paths(directory, name)
    ca = (certs.ca_dir / transport.CA_CERT).read_bytes()
    return EtcdTLS(ca, cert.read_bytes(), key.read_bytes())


def _outcomes(endpoint: str, credentials: grpc.ChannelCredentials) -> dict[str, grpc.StatusCode]:
    """The status of a Put and a Range on the signing key, a key of the prefix, and a
    key of a neighbouring prefix."""
    outcomes = {}
    with grpc.secure_channel(endpoint, credentials) as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        for key in (SIGNING_KEY, PREFIX_KEY, OUTSIDE_KEY):
            for verb, call in (
                ("put", lambda k=key: kv.Put(rpc_pb2.PutRequest(key=k, value=b"x"), timeout=3)),
                ("range", lambda k=key: kv.Range(rpc_pb2.RangeRequest(key=k), timeout=3)),
            ):
                try:
                    call()
                    outcomes[f"{verb} {key.decode()}"] = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    outcomes[f"{verb} {key.decode()}"] = error.code()
    return outcomes


def test_only_master_certificates_reach_the_clusters_keys(secured: SecuredEtcd) -> None:
    certs, endpoint = secured.certs, secured.etcd.endpoints[0]
    master = EtcdTLS.from_certs_dir(certs.add_node("master-a", master=True))
    store = EtcdTLS.from_certs_dir(certs.add_node("store-a", store_id="a"))
    create_client(certs.ca_dir, "nobody", ca_key_path=certs.ca_dir / "ca.key")
    nobody = _client_tls(certs, certs.ca_dir, "nobody")
    admin = _client_tls(certs, certs.client_dir, transport.ROOT_CLIENT)

    allowed = _outcomes(endpoint, master.credentials())
    assert allowed == {
        **{what: grpc.StatusCode.OK for what in allowed},
        f"put {OUTSIDE_KEY.decode()}": grpc.StatusCode.PERMISSION_DENIED,
        f"range {OUTSIDE_KEY.decode()}": grpc.StatusCode.PERMISSION_DENIED,
    }
    for name, tls in (("store", store), ("nobody", nobody), ("cluster admin", admin)):
        outcomes = _outcomes(endpoint, tls.credentials())
        assert set(outcomes.values()) == {grpc.StatusCode.PERMISSION_DENIED}, (name, outcomes)
    # No client certificate at all: etcd's --client-cert-auth refuses the handshake.
    anonymous = _outcomes(endpoint, grpc.ssl_channel_credentials(master.ca_pem))
    assert set(anonymous.values()) == {grpc.StatusCode.UNAVAILABLE}, anonymous
    # etcd's root, the operator's key to it, reaches everything.
    assert set(_outcomes(endpoint, secured.etcd.tls.credentials()).values()) == {  # type: ignore[union-attr]
        grpc.StatusCode.OK
    }


def test_secure_again_changes_nothing_and_bad_input_is_one_line(
    secured: SecuredEtcd, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run on an etcd the helper secured already (idempotent), then with what cannot
    work: a one-line error, nothing changed."""
    url = secured.etcd.url("/streamengine")
    again = argparse.Namespace(
        metadata=url, certs_dir=secured.certs.client_dir, ca_key=None, master_name=None
    )
    assert metadata_secure.cmd_secure(again) == 0
    assert "etcd auth enabled" in capsys.readouterr().out
    # A certs dir without the CA cannot make etcd's root certificate.
    empty = secured.certs.root / "empty"
    empty.mkdir()
    no_ca = run_cli("metadata", "secure", "--metadata", url, "--certs-dir", str(empty))
    assert no_ca.returncode == 1 and "cannot load the CA" in no_ca.stderr, no_ca.stderr
    assert "Traceback" not in no_ca.stderr
    assert not (empty / transport.ETCD_ROOT_CERT).exists()
    master = EtcdTLS.from_certs_dir(secured.certs.add_node("master-b", master=True))
    assert set(_outcomes(secured.etcd.endpoints[0], master.credentials()).values()) == {
        grpc.StatusCode.OK,
        grpc.StatusCode.PERMISSION_DENIED,
    }
