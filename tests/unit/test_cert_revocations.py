"""Revoked certificates: the list, the one decision over it, what `cert revoke` takes,
and where the master keeps the list, without a network."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from streamengine.master.catalog import Batch, decode_records
from streamengine.master.core.errors import InvalidArgument
from streamengine.master.role import MasterRole
from streamengine.protocol import auth, codec, identity
from streamengine.protocol.cert_revocations import (
    REVOKED_CERTS_MAX,
    CertRevocations,
    RevokedCert,
    parse_serial,
    serial_text,
)
from streamengine.protocol.identity import CertificateProof, ProofRefused, ServerIdentity
from streamengine.segment_store.master_link import (
    RevokedCertsDamaged,
    read_revoked_certs,
    write_revoked_certs,
)
from streamengine.tools import certs
from tests.metadata_backends import MetadataPlace
from tests.unit.test_master_state import Master

NOW_MS = time.time_ns() // 1_000_000
PORT = 7070
DAY_MS = 24 * 3600 * 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> certs.LocalCerts:
    local = certs.create_local_certs(tmp_path_factory.mktemp("certs"))
    local.add_node("master", master=True)
    certs.create_client(local.ca_dir, "ops", admin=True)
    return local


def _serial_of(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


@pytest.mark.parametrize(
    ("text", "serial"),
    [("1f", 0x1F), ("0x1F", 0x1F), ("01:af:3c", 0x01AF3C), (" abc ", 0xABC)],
)
def test_a_serial_is_hex_as_openssl_and_browsers_show_it(text: str, serial: int) -> None:
    assert parse_serial(text) == serial
    assert parse_serial(serial_text(serial)) == serial


@pytest.mark.parametrize("text", ["", "0", "xyz", "12-34", "f" * 41, "ca.crt"])
def test_what_is_no_serial_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a serial number"):
        parse_serial(text)


def test_the_decision_refuses_exactly_the_serials_listed() -> None:
    revocations = CertRevocations.of([RevokedCert(7, NOW_MS + DAY_MS, "client ops")])
    assert revocations.refusal(8) is None
    refusal = revocations.refusal(7)
    assert refusal is not None and "serial 7" in refusal and "revoked" in refusal
    assert CertRevocations().refusal(7) is None


def test_the_version_is_zero_for_none_and_follows_the_list() -> None:
    one = CertRevocations.of([RevokedCert(7, NOW_MS + DAY_MS)])
    two = one.with_revoked(RevokedCert(3, NOW_MS + 2 * DAY_MS))
    assert CertRevocations().version == 0
    assert len({0, one.version, two.version}) == 3
    # The same list in any order: the same version (a store compares it with the master's).
    assert CertRevocations.of(list(reversed(two.revoked))).version == two.version
    assert [r.serial for r in two.revoked] == [3, 7]


def test_a_revocation_is_kept_until_the_certificate_expires() -> None:
    revocations = CertRevocations.of(
        [RevokedCert(1, NOW_MS + 1), RevokedCert(2, NOW_MS + DAY_MS)]
    )
    assert [r.serial for r in revocations.current(NOW_MS).revoked] == [1, 2]
    assert [r.serial for r in revocations.current(NOW_MS + 1).revoked] == [2]


def test_the_list_is_bounded() -> None:
    full = CertRevocations.of(
        [RevokedCert(n, NOW_MS + DAY_MS) for n in range(1, 1 + REVOKED_CERTS_MAX)]
    )
    with pytest.raises(ValueError, match="replace the CA"):
        full.with_revoked(RevokedCert(REVOKED_CERTS_MAX + 1, NOW_MS + DAY_MS))


def test_a_server_refuses_a_revoked_certificate_and_no_other(cluster: certs.LocalCerts) -> None:
    directory = cluster.node_dir("master")
    server = ServerIdentity(
        (directory / "ca.crt").read_bytes(), (directory / "node.crt").read_bytes(), PORT
    )
    ops_cert = cluster.ca_dir / "client.ops.crt"
    ops = CertificateProof(ops_cert.read_bytes(), (cluster.ca_dir / "client.ops.key").read_bytes())
    root = CertificateProof(
        (cluster.client_dir / "client.root.crt").read_bytes(),
        (cluster.client_dir / "client.root.key").read_bytes(),
    )
    audience = f"127.0.0.1:{PORT}"
    assert server.principal(dict(ops.metadata(audience, NOW_MS)), NOW_MS).name == "client ops"
    server.revocations = CertRevocations.of([RevokedCert(_serial_of(ops_cert), NOW_MS + DAY_MS)])
    with pytest.raises(ProofRefused, match="revoked"):
        server.principal(dict(ops.metadata(audience, NOW_MS)), NOW_MS)
    assert server.principal(dict(root.metadata(audience, NOW_MS)), NOW_MS).name == "client root"
    # HTTPS (metrics, console): the handshake's certificate, revoked, proves nobody.
    der = x509.load_pem_x509_certificate(ops_cert.read_bytes()).public_bytes(Encoding.DER)
    identity.install(server)
    try:
        assert identity.principal_of_peer_certificate(der) == auth.ANONYMOUS
    finally:
        identity.install(None)
    assert identity.principal_of_peer_certificate(der).kind is auth.PrincipalKind.CLUSTER_ADMIN


def test_the_ca_lists_what_it_issued_privately(cluster: certs.LocalCerts) -> None:
    issued = certs.issued_path(cluster.ca_dir)
    assert stat.S_IMODE(issued.stat().st_mode) == 0o600
    lines = [json.loads(line) for line in issued.read_text().splitlines()]
    ops = serial_text(_serial_of(cluster.ca_dir / "client.ops.crt"))
    assert {"serial": ops, "common_name": "client ops"}.items() <= next(
        line for line in lines if line["serial"] == ops
    ).items()


def test_revoke_takes_a_file_or_a_serial_the_ca_issued(
    cluster: certs.LocalCerts, tmp_path: Path
) -> None:
    ops_cert = cluster.ca_dir / "client.ops.crt"
    by_file = certs.revocation_target(str(ops_cert), cluster.client_dir, None)
    assert (by_file.serial, by_file.common_name) == (_serial_of(ops_cert), "client ops")
    by_serial = certs.revocation_target(
        serial_text(by_file.serial), cluster.client_dir, cluster.ca_dir / "ca.key"
    )
    assert by_serial == by_file

    unknown = serial_text(by_file.serial + 1)
    with pytest.raises(certs.CertError, match="never issued serial"):
        certs.revocation_target(unknown, cluster.client_dir, cluster.ca_dir / "ca.key")
    with pytest.raises(certs.CertError, match="neither a certificate file nor a serial"):
        certs.revocation_target("no-such-file.crt", cluster.client_dir, None)
    junk = tmp_path / "junk.crt"
    junk.write_text("hello")
    with pytest.raises(certs.CertError, match="is not a certificate"):
        certs.revocation_target(str(junk), cluster.client_dir, None)
    other = certs.create_local_certs(tmp_path / "other")
    stranger = other.client_dir / "client.root.crt"
    with pytest.raises(certs.CertError, match="not signed by the cluster's CA"):
        certs.revocation_target(str(stranger), cluster.client_dir, None)


def test_the_master_keeps_revocations_as_records_and_sends_them_whole() -> None:
    entry = RevokedCert(0xABC, NOW_MS + DAY_MS, "client ops", NOW_MS)
    loaded = decode_records(Batch().revoked_cert(entry).puts)
    assert loaded.revoked_certs == [entry]
    assert codec.revoked_cert_from_pb(codec.revoked_cert_to_pb(entry)) == entry


def test_revocations_survive_a_restart_and_the_active_master_refuses_them(
    metadata_place: MetadataPlace, cluster: certs.LocalCerts
) -> None:
    """A restarted master, or a standby taking over, loads the list from the metadata
    and its identity refuses what it lists from its activation on."""
    master = Master(metadata_place)
    entry = RevokedCert(0xABC, master.now + DAY_MS, "client ops")
    assert master.state.revoker.revoke(entry, master.now)
    assert not master.state.revoker.revoke(entry, master.now)  # revoked already
    with pytest.raises(InvalidArgument, match="expired already"):
        master.state.revoker.revoke(RevokedCert(0xDEF, master.now), master.now)

    restarted = master.restart()
    assert [r.serial for r in restarted.cert_revocations.revoked] == [0xABC]
    assert restarted.cert_revocations.revoked[0].revoked_at_ms == master.now
    directory = cluster.node_dir("master")
    server = ServerIdentity(
        (directory / "ca.crt").read_bytes(), (directory / "node.crt").read_bytes(), PORT
    )
    identity.install(server)
    try:
        MasterRole("127.0.0.1:7070").activate(restarted, None)  # type: ignore[arg-type]
        assert server.revocations.refusal(0xABC) is not None
    finally:
        identity.install(None)


def test_a_store_keeps_the_list_privately_and_refuses_to_start_on_a_damaged_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "revoked-certs.json"
    assert read_revoked_certs(path) == CertRevocations()
    kept = CertRevocations.of([RevokedCert(0xABC, NOW_MS + DAY_MS, "client ops", NOW_MS)])
    write_revoked_certs(path, kept)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_revoked_certs(path) == kept
    path.write_text('[{"serial": "not hex"}]')
    with pytest.raises(RevokedCertsDamaged, match="remove it"):
        read_revoked_certs(path)
