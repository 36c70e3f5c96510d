"""Certificates, certificate proofs and protected mode, without a network."""

from __future__ import annotations

import datetime
import ipaddress
import stat
import time
from pathlib import Path

import pytest
from cryptography import x509

from streamengine.protocol import auth, transport
from streamengine.protocol.identity import (
    PROOF_WINDOW_MS,
    CertificateProof,
    ProofRefused,
    ServerIdentity,
    reply_audience,
)
from streamengine.tools import certs

# Certificates are made with the real clock; proofs are checked against this moment.
NOW_MS = time.time_ns() // 1_000_000
PORT = 7070


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> certs.LocalCerts:
    local = certs.create_local_certs(tmp_path_factory.mktemp("certs"))
    local.add_node("master", master=True)
    local.add_node("store1", store_id="s1")
    return local


def server(cluster: certs.LocalCerts) -> ServerIdentity:
    directory = cluster.node_dir("master")
    return ServerIdentity(
        (directory / "ca.crt").read_bytes(), (directory / "node.crt").read_bytes(), PORT
    )


def proof_of(directory: Path, cert: str = "node") -> CertificateProof:
    return CertificateProof(
        (directory / f"{cert}.crt").read_bytes(), (directory / f"{cert}.key").read_bytes()
    )


def principal(
    cluster: certs.LocalCerts,
    prover: CertificateProof,
    audience: str = f"127.0.0.1:{PORT}",
    issued_ms: int = NOW_MS,
) -> auth.Principal:
    return server(cluster).principal(dict(prover.metadata(audience, issued_ms)), NOW_MS)


def test_members_and_admins_are_who_their_certificates_name(cluster: certs.LocalCerts) -> None:
    store = principal(cluster, proof_of(cluster.node_dir("store1")))
    assert store == auth.Principal(auth.PrincipalKind.STORE, "s1")
    master = principal(cluster, proof_of(cluster.node_dir("master")), f"localhost:{PORT}")
    assert master.kind is auth.PrincipalKind.MASTER
    admin = principal(cluster, proof_of(cluster.client_dir, "client.root"))
    assert admin == auth.Principal(auth.PrincipalKind.CLUSTER_ADMIN, "client root")


def test_a_client_certificate_without_admin_proves_nothing(
    cluster: certs.LocalCerts, tmp_path: Path
) -> None:
    (tmp_path / "ca.crt").write_bytes((cluster.ca_dir / "ca.crt").read_bytes())
    certs.create_client(tmp_path, "alice", ca_key_path=cluster.ca_dir / "ca.key")
    assert principal(cluster, proof_of(tmp_path, "client.alice")) == auth.ANONYMOUS


def test_no_proof_is_anonymous(cluster: certs.LocalCerts) -> None:
    assert server(cluster).principal({}, NOW_MS) == auth.ANONYMOUS


@pytest.mark.parametrize(
    ("audience", "issued_ms", "reason"),
    [
        (f"127.0.0.1:{PORT + 1}", NOW_MS, "not this server"),  # another server's proof
        ("10.0.0.9:7070", NOW_MS, "not this server"),
        (f"127.0.0.1:{PORT}", NOW_MS - PROOF_WINDOW_MS - 1, "clock"),
        (f"127.0.0.1:{PORT}", NOW_MS + PROOF_WINDOW_MS + 1, "clock"),
    ],
    # Named without the time: every worker of a parallel run must collect the same ids.
    ids=["another port", "another host", "too old", "too new"],
)
def test_a_proof_for_another_server_or_time_is_refused(
    cluster: certs.LocalCerts, audience: str, issued_ms: int, reason: str
) -> None:
    with pytest.raises(ProofRefused, match=reason):
        principal(cluster, proof_of(cluster.node_dir("store1")), audience, issued_ms)


def test_a_signature_by_another_key_is_refused(cluster: certs.LocalCerts, tmp_path: Path) -> None:
    honest = dict(proof_of(cluster.node_dir("store1")).metadata(f"127.0.0.1:{PORT}", NOW_MS))
    forged = dict(proof_of(cluster.node_dir("master")).metadata(f"127.0.0.1:{PORT}", NOW_MS))
    # The store's certificate with the master's signature: the key does not match.
    mixed = {
        "x-streamengine-cert": honest["x-streamengine-cert"],
        "x-streamengine-proof": forged["x-streamengine-proof"],
    }
    with pytest.raises(ProofRefused, match="signature"):
        server(cluster).principal(mixed, NOW_MS)


def test_a_certificate_of_another_ca_is_refused(cluster: certs.LocalCerts, tmp_path: Path) -> None:
    other = certs.create_local_certs(tmp_path)
    with pytest.raises(ProofRefused, match="not the cluster's"):
        principal(cluster, proof_of(other.add_node("master", master=True)))


def test_an_expired_certificate_is_refused(cluster: certs.LocalCerts, tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_bytes((cluster.ca_dir / "ca.crt").read_bytes())
    certs.create_node(tmp_path, ["127.0.0.1"], store_id="s2", ca_key_path=cluster.ca_dir / "ca.key")
    later_ms = NOW_MS + 10 * 365 * 86_400_000
    prover = proof_of(tmp_path)
    remembering = server(cluster)
    now_proof = dict(prover.metadata(f"127.0.0.1:{PORT}", NOW_MS))
    assert remembering.principal(now_proof, NOW_MS).kind is auth.PrincipalKind.STORE
    later_proof = dict(prover.metadata(f"127.0.0.1:{PORT}", later_ms))
    with pytest.raises(ProofRefused, match="expired"):  # verified before, remembered
        remembering.principal(later_proof, later_ms)
    with pytest.raises(ProofRefused, match="not the cluster's"):  # never seen before
        server(cluster).principal(later_proof, later_ms)


def test_certificates_name_hosts_identity_and_lifetime(
    cluster: certs.LocalCerts, tmp_path: Path
) -> None:
    (tmp_path / "ca.crt").write_bytes((cluster.ca_dir / "ca.crt").read_bytes())
    certs.create_node(
        tmp_path,
        ["10.1.2.3", "store-7.example"],
        store_id="s7",
        ca_key_path=cluster.ca_dir / "ca.key",
        lifetime_days=365,
    )
    node = x509.load_pem_x509_certificate((tmp_path / "node.crt").read_bytes())
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3")]
    assert names.get_values_for_type(x509.DNSName) == ["store-7.example"]
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [auth.store_uri("s7")]
    lifetime = node.not_valid_after_utc - node.not_valid_before_utc
    assert datetime.timedelta(days=365) <= lifetime <= datetime.timedelta(days=366)
    ca = x509.load_pem_x509_certificate((cluster.ca_dir / "ca.crt").read_bytes())
    assert ca.not_valid_after_utc - ca.not_valid_before_utc >= datetime.timedelta(days=3650)
    for key in (
        tmp_path / "node.key",
        cluster.ca_dir / "ca.key",
        cluster.client_dir / "client.root.key",
    ):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_cert_commands_refuse_what_makes_no_sense(
    cluster: certs.LocalCerts, tmp_path: Path
) -> None:
    key = cluster.ca_dir / "ca.key"
    (tmp_path / "ca.crt").write_bytes((cluster.ca_dir / "ca.crt").read_bytes())
    with pytest.raises(certs.CertError):
        certs.create_node(tmp_path, ["127.0.0.1"], ca_key_path=key)  # neither role
    with pytest.raises(certs.CertError):
        certs.create_node(tmp_path, ["urn:streamengine:admin"], master=True, ca_key_path=key)
    with pytest.raises(certs.CertError):
        certs.create_ca(cluster.ca_dir)  # never overwrites a CA unasked
    with pytest.raises(certs.CertError, match="cannot load the CA"):
        certs.create_client(tmp_path, "bob")  # the key lives apart: --ca-key


def test_a_rotation_bundle_signs_with_the_ca_matching_the_key(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    certs.create_ca(old)
    certs.create_ca(new)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "ca.crt").write_bytes((new / "ca.crt").read_bytes() + (old / "ca.crt").read_bytes())
    certs.create_node(bundle, ["127.0.0.1"], master=True, ca_key_path=old / "ca.key")
    node = x509.load_pem_x509_certificate((bundle / "node.crt").read_bytes())
    old_ca = x509.load_pem_x509_certificate((old / "ca.crt").read_bytes())
    assert node.issuer == old_ca.subject
    node.verify_directly_issued_by(old_ca)


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:7070", True),
        ("127.3.2.1:7070", True),
        ("localhost:7070", True),
        ("[::1]:7070", True),
        ("0.0.0.0:7070", False),
        ("[::]:7070", False),
        (":7070", False),
        ("10.0.0.5:7070", False),
        ("db.example:7070", False),
    ],
)
def test_protected_mode_serves_loopback_only_without_certificates(
    listen: str, loopback: bool
) -> None:
    assert transport.is_loopback(listen) is loopback
    if loopback:
        transport.check_protected_mode(listen, None, insecure=False)
    else:
        with pytest.raises(transport.ProtectedMode):
            transport.check_protected_mode(listen, None, insecure=False)
    transport.check_protected_mode(listen, None, insecure=True)
    transport.check_protected_mode(listen, Path("certs"), insecure=False)


def test_a_token_is_never_sent_in_plaintext() -> None:
    with pytest.raises(transport.TransportError, match="TLS"):
        transport.Transport.for_client(None, "secret")


def test_a_client_uses_client_root_only_without_a_token(cluster: certs.LocalCerts) -> None:
    admin = transport.Transport.for_client(cluster.client_dir)
    assert admin.cert_pem and not admin.token
    tenant = transport.Transport.for_client(cluster.client_dir, "tok")
    assert not tenant.cert_pem and tenant.token == "tok"
    assert not transport.Transport.for_client(cluster.tenant_dir).cert_pem


def test_a_reply_to_a_store_counts_only_as_the_master_signed_it_for_this_store(
    cluster: certs.LocalCerts,
) -> None:
    from streamengine.v1 import entry_pb2, master_pb2

    deletes = [entry_pb2.SegmentId(stream_id=7, epoch=3), entry_pb2.SegmentId(stream_id=7, epoch=4)]
    reply = master_pb2.StoreHeartbeatReply(delete_segments=deletes, signing_public_keys=[b"k"])
    audience = reply_audience("heartbeat", "s1", reply)
    master = proof_of(cluster.node_dir("master"))
    store_side = server(cluster)

    def signer(prover: CertificateProof, signed_for: str) -> auth.PrincipalKind:
        metadata = dict(prover.metadata(signed_for, NOW_MS))
        return store_side.principal(metadata, NOW_MS, audience).kind

    assert signer(master, audience) is auth.PrincipalKind.MASTER
    # Another store's certificate signs nothing that counts.
    assert signer(proof_of(cluster.node_dir("store1")), audience) is auth.PrincipalKind.STORE
    with pytest.raises(ProofRefused, match="made for"):  # signed for another store
        signer(master, reply_audience("heartbeat", "s2", reply))
    with pytest.raises(ProofRefused, match="made for"):  # a list with one segment less
        fewer = master_pb2.StoreHeartbeatReply(
            delete_segments=deletes[:1], signing_public_keys=[b"k"]
        )
        signer(master, reply_audience("heartbeat", "s1", fewer))
    with pytest.raises(ProofRefused, match="made for"):  # another signing key
        other = master_pb2.StoreHeartbeatReply(delete_segments=deletes, signing_public_keys=[b"x"])
        signer(master, reply_audience("heartbeat", "s1", other))
    with pytest.raises(ProofRefused, match="made for"):  # another kind of reply
        signer(master, reply_audience("register", "s1", reply))
    assert store_side.principal({}, NOW_MS, audience) == auth.ANONYMOUS
