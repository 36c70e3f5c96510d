"""`streamengine cert`: the cluster's CA and the certificates it signs.

CockroachDB's layout in one certs directory: `ca.crt` (+ `ca.key`, unless `--ca-key`
puts it elsewhere), `node.crt` + `node.key` for a server, `client.NAME.crt` +
`client.NAME.key` for a client. Every certificate the CA signs names what it is in one
URI SAN (`protocol.auth`): `urn:streamengine:master`, `urn:streamengine:store:<id>` or
`urn:streamengine:admin`; a client certificate without `--admin` names
`urn:streamengine:client:<name>`, which grants nothing (a name for logs).

etcd (with `--client-cert-auth` and its auth enabled by `metadata secure`) takes a
certificate's common name as its user, so common names are kept apart: a master's is
`master` (`MASTER_COMMON_NAME`, etcd's user for the masters), a store's `store <id>`,
an etcd member's `etcd`, a client's `client <name>`, and `etcd-root.crt` alone is `root`
(etcd's root user). No client certificate can thus pass for a master or for root in
etcd, whatever its name.

Every certificate signed is listed in `ca.issued` beside the CA's key (JSON lines:
serial, common name, expiry), OpenSSL's `index.txt` in spirit: `cert revoke SERIAL`
finds there what it revokes, and refuses a serial the CA never issued. Keys are ECDSA
P-256 (small, fast handshakes); every file is written 0600 in 0700 directories
(`protocol.private_files`).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from streamengine.protocol import auth, transport
from streamengine.protocol.cert_revocations import (
    COMMON_NAME_CHARS_MAX,
    RevokedCert,
    parse_serial,
    serial_text,
)
from streamengine.protocol.private_files import private_dir, tightened_message, write_private

CA_KEY = "ca.key"
ISSUED = "ca.issued"
ROOT_CLIENT = transport.ROOT_CLIENT
# Long enough that a CA outlives many node rotations; nodes and clients expire sooner,
# so a leaked key stops working on its own.
CA_LIFETIME_DAYS = 10 * 365
NODE_LIFETIME_DAYS_DEFAULT = 5 * 365
CLIENT_LIFETIME_DAYS_DEFAULT = 5 * 365
LIFETIME_DAYS_MIN = 1
# A certificate is valid from a little before it is made: clocks of hosts differ.
BACKDATE = datetime.timedelta(hours=1)
ORGANIZATION = "Stream Engine"
MASTER_COMMON_NAME = "master"
ETCD_ROOT_USER = "root"


class CertError(Exception):
    """A certificate cannot be made as asked: one line, exit 1."""


@dataclass(frozen=True)
class Authority:
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    issued: Path  # the list of what it signed, beside its key


def issued_path(certs_dir: Path, ca_key_path: Path | None = None) -> Path:
    return (ca_key_path or certs_dir / CA_KEY).with_name(ISSUED)


def _ms(moment: datetime.datetime) -> int:
    return int(moment.timestamp() * 1000)


def _record_issued(authority: Authority, certificate: x509.Certificate) -> None:
    line = json.dumps(
        {
            "serial": serial_text(certificate.serial_number),
            "common_name": _common_name(certificate),
            "not_after_ms": _ms(certificate.not_valid_after_utc),
        }
    )
    try:
        kept = authority.issued.read_bytes() if authority.issued.exists() else b""
        write_private(authority.issued, kept + line.encode() + b"\n")
    except OSError as error:
        # Before the certificate is written: one the list misses could not be revoked
        # by serial.
        raise CertError(
            f"cannot list the certificate in {authority.issued}: {error.strerror or error}"
        ) from None


def _common_name(certificate: x509.Certificate) -> str:
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_private(path, pem)


def _write_cert(path: Path, certificate: x509.Certificate) -> None:
    write_private(path, certificate.public_bytes(serialization.Encoding.PEM))


def create_ca(certs_dir: Path, ca_key_path: Path | None = None, overwrite: bool = False) -> Path:
    """A new self-signed CA: `ca.crt` in `certs_dir`, its key at `ca_key_path`."""
    key_path = ca_key_path or certs_dir / CA_KEY
    cert_path = certs_dir / transport.CA_CERT
    if not overwrite and (cert_path.exists() or key_path.exists()):
        raise CertError(f"{cert_path} or {key_path} exists; remove it first to make a new CA")
    key = _new_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, "Stream Engine CA"),
        ]
    )
    now = _now()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=CA_LIFETIME_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_cert(cert_path, certificate)
    return cert_path


def load_authority(certs_dir: Path, ca_key_path: Path | None = None) -> Authority:
    """The CA that signs: the newest certificate of `ca.crt` (a rotation bundle lists the
    new CA first) whose public key matches the key."""
    key_path = ca_key_path or certs_dir / CA_KEY
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        bundle = x509.load_pem_x509_certificates((certs_dir / transport.CA_CERT).read_bytes())
    except (OSError, ValueError) as error:
        raise CertError(f"cannot load the CA from {certs_dir} (key {key_path}): {error}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{key_path} is not an EC key")
    wanted = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for certificate in bundle:
        held = certificate.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if held == wanted:
            return Authority(certificate, key, key_path.with_name(ISSUED))
    raise CertError(f"no certificate in {certs_dir / transport.CA_CERT} matches {key_path}")


def _san_entries(hosts: Sequence[str], identity_uri: str) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    if identity_uri:
        entries.append(x509.UniformResourceIdentifier(identity_uri))
    return entries


def _sign(
    authority: Authority,
    common_name: str,
    sans: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    lifetime_days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if lifetime_days < LIFETIME_DAYS_MIN:
        raise CertError(f"a lifetime is at least {LIFETIME_DAYS_MIN} day")
    key = _new_key()
    now = _now()
    # Never past the CA: a chain is only as valid as its shortest link.
    not_after = min(
        now + datetime.timedelta(days=lifetime_days),
        authority.certificate.not_valid_after_utc,
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                    x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                ]
            )
        )
        .issuer_name(authority.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    certificate = builder.sign(authority.key, hashes.SHA256())
    _record_issued(authority, certificate)
    return certificate, key


def create_node(
    certs_dir: Path,
    hosts: Sequence[str],
    *,
    master: bool = False,
    store_id: str = "",
    etcd: bool = False,
    ca_key_path: Path | None = None,
    lifetime_days: int = NODE_LIFETIME_DAYS_DEFAULT,
) -> Path:
    """`node.crt` + `node.key`: a server's certificate for `hosts` (DNS names or IPs),
    naming it the master or store `store_id`. Members use it both to serve and to call
    each other, so it is good for server and client authentication. An etcd member's
    (`etcd`) names no identity: it proves nothing to the masters and stores, and etcd
    uses it to serve the masters and to reach its peers."""
    if [master, bool(store_id), etcd].count(True) != 1:
        raise CertError(
            "a node is the master (--master), a store (--store-id ID) or an etcd member (--etcd)"
        )
    if not hosts:
        raise CertError("name at least one host or IP the node is reached by")
    if any(host.startswith(auth.URI_PREFIX) or not host for host in hosts):
        raise CertError("a host is a DNS name or an IP address")
    identity = auth.MEMBER_URI_MASTER if master else "" if etcd else auth.store_uri(store_id)
    authority = load_authority(certs_dir, ca_key_path)
    certificate, key = _sign(
        authority,
        MASTER_COMMON_NAME if master else "etcd" if etcd else f"store {store_id}",
        _san_entries(hosts, identity),
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        lifetime_days,
    )
    _write_key(certs_dir / transport.NODE_KEY, key)
    _write_cert(certs_dir / transport.NODE_CERT, certificate)
    return certs_dir / transport.NODE_CERT


def create_client(
    certs_dir: Path,
    name: str,
    *,
    admin: bool = False,
    ca_key_path: Path | None = None,
    lifetime_days: int = CLIENT_LIFETIME_DAYS_DEFAULT,
) -> Path:
    """`client.NAME.crt` + `.key`; `root` is always a cluster admin."""
    if not name or "/" in name or name.startswith("."):
        raise CertError(f"bad client name {name!r}")
    authority = load_authority(certs_dir, ca_key_path)
    is_admin = admin or name == ROOT_CLIENT
    certificate, key = _sign(
        authority,
        client_common_name(name),
        # A name for logs either way; only the admin URI grants anything.
        _san_entries([], auth.ADMIN_URI if is_admin else auth.URI_PREFIX + "client:" + name),
        [ExtendedKeyUsageOID.CLIENT_AUTH],
        lifetime_days,
    )
    cert_path, key_path = transport.client_cert_paths(certs_dir, name)
    _write_key(key_path, key)
    _write_cert(cert_path, certificate)
    return cert_path


def client_common_name(name: str) -> str:
    """A client certificate's common name: never an etcd user's (module doc)."""
    return f"client {name}"


def create_etcd_root(certs_dir: Path, ca_key_path: Path | None = None) -> Path:
    """`etcd-root.crt` + `.key`, etcd's `root` user (`metadata secure`), kept when there.
    No URI SAN: on the cluster's own servers it is nobody."""
    cert_path = certs_dir / transport.ETCD_ROOT_CERT
    if cert_path.exists() and (certs_dir / transport.ETCD_ROOT_KEY).exists():
        return cert_path
    certificate, key = _sign(
        load_authority(certs_dir, ca_key_path),
        ETCD_ROOT_USER,
        [],
        [ExtendedKeyUsageOID.CLIENT_AUTH],
        CLIENT_LIFETIME_DAYS_DEFAULT,
    )
    _write_key(certs_dir / transport.ETCD_ROOT_KEY, key)
    _write_cert(cert_path, certificate)
    return cert_path


def revocation_target(what: str, certs_dir: Path, ca_key_path: Path | None) -> RevokedCert:
    """What `cert revoke WHAT` revokes: a certificate file (PEM or DER) the cluster's CA
    (`ca.crt` of `certs_dir`) signed, or a serial the CA's `ca.issued` lists. Raises
    CertError saying which it is not."""
    path = Path(what)
    if not path.is_file():
        try:
            serial = parse_serial(what)
        except ValueError:
            raise CertError(f"{what!r} is neither a certificate file nor a serial number") from None
        return _issued_serial(serial, issued_path(certs_dir, ca_key_path))
    data = path.read_bytes()
    try:
        certificate = (
            x509.load_pem_x509_certificate(data)
            if data.lstrip().startswith(b"-----BEGIN")
            else x509.load_der_x509_certificate(data)
        )
    except ValueError:
        raise CertError(f"{path} is not a certificate (PEM or DER)") from None
    try:
        authorities = x509.load_pem_x509_certificates((certs_dir / transport.CA_CERT).read_bytes())
    except (OSError, ValueError) as error:
        raise CertError(f"cannot read the CA of {certs_dir}: {error}") from None
    for authority in authorities:
        try:
            certificate.verify_directly_issued_by(authority)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return RevokedCert(
            certificate.serial_number,
            _ms(certificate.not_valid_after_utc),
            _common_name(certificate)[:COMMON_NAME_CHARS_MAX],
        )
    raise CertError(f"{path} was not signed by the cluster's CA ({certs_dir / transport.CA_CERT})")


def _issued_serial(serial: int, issued: Path) -> RevokedCert:
    try:
        lines = issued.read_text().splitlines()
    except OSError as error:
        raise CertError(
            f"cannot read the CA's list of what it issued ({issued}): {error.strerror}; "
            "revoke by the certificate's file, or give --ca-key"
        ) from None
    for line in lines:
        entry = json.loads(line)
        if entry["serial"] == serial_text(serial):
            return RevokedCert(serial, entry["not_after_ms"], entry["common_name"])
    raise CertError(
        f"the CA never issued serial {serial_text(serial)} (not in {issued}); "
        "revoke a certificate made elsewhere by its file"
    )


def add_arguments(cert: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The `cert` command's actions and their flags; returns those of the actions that
    call the masters (they take the client's options)."""
    actions = cert.add_subparsers(dest="action", required=True, metavar="ACTION")
    ca = actions.add_parser("create-ca", help="a new CA: ca.crt (+ ca.key), valid 10 years")
    ca.add_argument("--overwrite", action="store_true", help="replace an existing CA")
    node = actions.add_parser(
        "create-node", help="node.crt + node.key for a master, a store or an etcd member"
    )
    node.add_argument("hosts", nargs="+", metavar="HOST", help="DNS names and IPs it serves on")
    role = node.add_mutually_exclusive_group(required=True)
    role.add_argument("--master", action="store_true", help="the master's certificate")
    role.add_argument("--store-id", default="", help="a store's certificate, for this store id")
    role.add_argument(
        "--etcd",
        action="store_true",
        help="an etcd member's certificate (server and peer): no Stream Engine identity",
    )
    client = actions.add_parser("create-client", help="client.NAME.crt + client.NAME.key")
    client.add_argument("name", help="client name (root is always a cluster admin)")
    client.add_argument("--admin", action="store_true", help="a cluster admin's certificate")
    for parser in (ca, node, client):
        parser.add_argument(
            "--certs-dir", type=Path, required=True, help="ca.crt, node.*, client.* live here"
        )
        parser.add_argument(
            "--ca-key", type=Path, help="the CA's key, kept apart (default: CERTS_DIR/ca.key)"
        )
    for parser in (node, client):
        parser.add_argument(
            "--lifetime-days",
            type=int,
            default=NODE_LIFETIME_DAYS_DEFAULT,
            help="days the certificate is valid (default %(default)s; never past the CA's)",
        )
    revoke = actions.add_parser(
        "revoke", help="refuse a certificate on every server from the next heartbeat on"
    )
    revoke.add_argument(
        "certificate", metavar="SERIAL|FILE", help="its serial (hex) or its .crt file"
    )
    revoke.add_argument(
        "--ca-key",
        type=Path,
        help="where the CA's key is kept: ca.issued beside it lists the serials "
        "(default: CERTS_DIR/ca.key)",
    )
    revoke.add_argument("--yes", action="store_true", help="revoke (without it: say what, exit 1)")
    revoke.set_defaults(run=_lazy_run("cmd_revoke"))
    listing = actions.add_parser("list-revoked", help="the certificates revoked")
    listing.set_defaults(run=_lazy_run("cmd_list_revoked"))
    return [revoke, listing]


def _lazy_run(function: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from streamengine.tools import revocations

        result: int = getattr(revocations, function)(args)
        return result

    return run


def run(args: argparse.Namespace) -> int:
    tightened = private_dir(args.certs_dir)
    if tightened:
        print(
            f"streamengine: {tightened_message('certs dir', args.certs_dir, tightened)}",
            file=sys.stderr,
        )
    try:
        if args.action == "create-ca":
            path = create_ca(args.certs_dir, args.ca_key, args.overwrite)
        elif args.action == "create-node":
            path = create_node(
                args.certs_dir,
                args.hosts,
                master=args.master,
                store_id=args.store_id,
                etcd=args.etcd,
                ca_key_path=args.ca_key,
                lifetime_days=args.lifetime_days,
            )
        else:
            path = create_client(
                args.certs_dir,
                args.name,
                admin=args.admin,
                ca_key_path=args.ca_key,
                lifetime_days=args.lifetime_days,
            )
    except CertError as error:
        print(f"streamengine: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class LocalCerts:
    """Certs dirs for a cluster on one host (`cluster up`, tests): the CA apart, one dir
    per process holding `ca.crt` + its `node.*`, and a client dir with `client.root`
    (and `etcd-root.*` once `add_etcd_root` made them)."""

    root: Path

    @property
    def ca_dir(self) -> Path:
        return self.root / "ca"

    @property
    def client_dir(self) -> Path:
        """What a cluster admin exports as $STREAMENGINE_CERTS_DIR."""
        return self.root / "client"

    @property
    def tenant_dir(self) -> Path:
        """`ca.crt` alone: what a tenant holds beside its token."""
        return self.root / "tenant"

    def node_dir(self, name: str) -> Path:
        return self.root / name

    def _copy_ca(self, directory: Path) -> None:
        write_private(directory / transport.CA_CERT, (self.ca_dir / transport.CA_CERT).read_bytes())

    def add_node(
        self, name: str, *, master: bool = False, store_id: str = "", etcd: bool = False
    ) -> Path:
        """`node_dir(name)`, made on first use; kept when it holds a certificate."""
        directory = self.node_dir(name)
        if not (directory / transport.NODE_CERT).exists():
            self._copy_ca(directory)
            create_node(
                directory,
                LOCAL_HOSTS,
                master=master,
                store_id=store_id,
                etcd=etcd,
                ca_key_path=self.ca_dir / CA_KEY,
            )
        return directory

    def add_etcd_root(self) -> Path:
        """The operator's etcd root certificate, in the client dir."""
        return create_etcd_root(self.client_dir, self.ca_dir / CA_KEY)


def create_local_certs(root: Path) -> LocalCerts:
    """A CA (kept if `root` has one), the client dir with `client.root`, and the tenant
    dir; node dirs come with `LocalCerts.add_node`."""
    local = LocalCerts(root)
    private_dir(root)
    if not (local.ca_dir / transport.CA_CERT).exists():
        create_ca(local.ca_dir)
    for directory in (local.client_dir, local.tenant_dir):
        local._copy_ca(directory)
    if not transport.client_cert_paths(local.client_dir, ROOT_CLIENT)[0].exists():
        create_client(local.client_dir, ROOT_CLIENT, ca_key_path=local.ca_dir / CA_KEY)
    return local
