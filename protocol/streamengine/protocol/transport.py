"""How every process reaches every other: plaintext, or TLS from a certs directory.

The one place that turns a certs directory (CockroachDB's layout: `ca.crt`, `node.crt` +
`node.key`, `client.NAME.crt` + `client.NAME.key`) into gRPC credentials, for servers
and for every channel the SDK, the tools and the servers open.

- Servers serve TLS with their node certificate: tenants connect with `ca.crt` and a
  token; members and admins also prove a certificate signed by the same CA on each call
  (`identity.py` says why not in the handshake).
- Members (master and stores) call each other with their node certificate.
- Clients trust `ca.crt`, present `client.root` when given no token and it is there,
  and send a token as `authorization: Bearer <token>` on every call, streams included.
  A token is sent over TLS only: it is a bearer secret.
- The data plane (`framed.py`) uses Python's `ssl` with the same files: servers present
  `node.crt` and ask for a client certificate of the cluster's CA without requiring one
  (`CERT_OPTIONAL`: members and admins are known by it, tenants by the token of their
  hello); clients verify the server by `ca.crt` and present their certificate in the
  handshake.

A `Transport` holds the PEM bytes, not paths, so it pickles (Spark ships it to the
executors) and a certificate replaced on disk takes effect at the next process start.
"""

from __future__ import annotations

import argparse
import ipaddress
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.protocol.identity import CertificateProof, ServerIdentity

CA_CERT = "ca.crt"
NODE_CERT = "node.crt"
NODE_KEY = "node.key"
ROOT_CLIENT = "root"
# The operator's certificate for etcd's `root` user (`metadata secure`): it names no
# Stream Engine identity, so it grants nothing on the cluster's own servers.
ETCD_ROOT_CERT = "etcd-root.crt"
ETCD_ROOT_KEY = "etcd-root.key"
CERTS_DIR_ENV = "STREAMENGINE_CERTS_DIR"
MASTER_ENV = "STREAMENGINE_MASTER"
TOKEN_ENV = "STREAMENGINE_TOKEN"

Options = list[tuple[str, int | str]]


class TransportError(Exception):
    """A certs directory that cannot serve as asked (a file missing or unreadable)."""


def client_cert_paths(certs_dir: Path, name: str) -> tuple[Path, Path]:
    return certs_dir / f"client.{name}.crt", certs_dir / f"client.{name}.key"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise TransportError(f"cannot read {path}: {error.strerror or error}") from None


@dataclass(frozen=True)
class Transport:
    """Credentials for the channels one process opens; `PLAINTEXT` when it has none."""

    ca_pem: bytes = b""  # empty: plaintext
    cert_pem: bytes = b""  # presented to servers (members, admins); may be empty
    key_pem: bytes = field(default=b"", repr=False)
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        assert bool(self.cert_pem) == bool(self.key_pem), "a certificate needs its key"
        assert self.ca_pem or not self.cert_pem, "a certificate is presented over TLS only"

    @property
    def tls(self) -> bool:
        return bool(self.ca_pem)

    @classmethod
    def for_node(cls, certs_dir: Path) -> Transport:
        """A member calling members: its node certificate."""
        return cls(
            _read(certs_dir / CA_CERT),
            _read(certs_dir / NODE_CERT),
            _read(certs_dir / NODE_KEY),
        )

    @classmethod
    def for_client(cls, certs_dir: Path | None, token: str = "") -> Transport:
        """A client: plaintext without a certs dir; else the CA, and without a token
        `client.root` when the dir has it (a cluster admin's command)."""
        if certs_dir is None:
            if token:
                raise TransportError(
                    "a token is sent over TLS only: give the certs dir holding ca.crt"
                )
            return cls()
        ca = _read(certs_dir / CA_CERT)
        cert_path, key_path = client_cert_paths(certs_dir, ROOT_CLIENT)
        if not token and cert_path.exists():
            return cls(ca, _read(cert_path), _read(key_path))
        return cls(ca, token=token)

    def _credentials(self) -> grpc.ChannelCredentials:
        credentials = grpc.ssl_channel_credentials(self.ca_pem)
        per_call: list[grpc.CallCredentials] = []
        if self.cert_pem:
            # grpcio cannot ask for a client certificate without requiring one of
            # everyone: the certificate is proven inside the connection (identity.py).
            per_call.append(
                grpc.metadata_call_credentials(CertificateProof(self.cert_pem, self.key_pem))
            )
        if self.token:
            # Sent as `authorization: Bearer <token>` on every call (auth.py's key).
            per_call.append(grpc.access_token_call_credentials(self.token))
        if per_call:
            credentials = grpc.composite_channel_credentials(credentials, *per_call)
        return credentials

    def ssl_context(self) -> ssl.SSLContext | None:
        """The data plane's client side: None for plaintext; else verifying the server
        by the CA, presenting this transport's certificate when it holds one."""
        if not self.tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.ca_pem.decode())
        if self.cert_pem:
            _load_chain(context, self.cert_pem, self.key_pem)
        return context

    def aio_channel(self, address: str, options: Options | None = None) -> grpc.aio.Channel:
        chosen = CLIENT_OPTIONS if options is None else options
        if aio_channel_factory is not None:
            return aio_channel_factory(self, address, chosen)
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=chosen)
        return grpc.aio.secure_channel(address, self._credentials(), options=chosen)

    def channel(self, address: str, options: Options | None = None) -> grpc.Channel:
        chosen = CLIENT_OPTIONS if options is None else options
        if channel_factory is not None:
            return channel_factory(self, address, chosen)
        if not self.tls:
            return grpc.insecure_channel(address, options=chosen)
        return grpc.secure_channel(address, self._credentials(), options=chosen)


PLAINTEXT = Transport()

# Where `Transport.aio_channel` gets its channels when set: the deterministic simulator
# (tests/sim/runtime) puts its in-process network here. None, as shipped: grpc's own.
aio_channel_factory: Callable[[Transport, str, Options], grpc.aio.Channel] | None = None
# The same for `Transport.channel`, the blocking channels of synchronous callers (Spark's
# driver and executors, tools).
channel_factory: Callable[[Transport, str, Options], grpc.Channel] | None = None

# What grpc-core says when a handshake fails (the client's side of it).
_HANDSHAKE_FAILURES = ("Tls handshake failed", "CERTIFICATE_VERIFY_FAILED", "SSL_ERROR")
_PEER_NAME_MISMATCH = "is not in peer certificate"


def tls_problem(details: str, tls: bool) -> str:
    """What went wrong, in words naming TLS, when a call failed UNAVAILABLE for a TLS
    reason; "" when the failure says nothing of TLS (a server down, a restart)."""
    if _PEER_NAME_MISMATCH in details:
        return (
            "TLS: the server's certificate does not name the host dialed "
            "(connect by a host or IP its node certificate lists)"
        )
    if any(failure in details for failure in _HANDSHAKE_FAILURES):
        if not tls:
            return "TLS handshake failed"
        return (
            "TLS handshake failed: the server's certificate is not signed by this "
            "cluster's CA (ca.crt of the certs dir), or the server does not serve TLS"
        )
    if not tls and "Socket closed" in details:
        # A TLS server drops a plaintext client's first bytes without a word.
        return (
            "the server closed the connection at once: it serves TLS; give the certs "
            f"dir with the cluster's ca.crt (--certs-dir or ${CERTS_DIR_ENV})"
        )
    return ""


def server_credentials(certs_dir: Path) -> grpc.ServerCredentials:
    """TLS with the node certificate; no client certificate in the handshake (tenants
    have none): members and admins prove theirs per call (identity.py)."""
    ca = _read(certs_dir / CA_CERT)
    pair = (_read(certs_dir / NODE_KEY), _read(certs_dir / NODE_CERT))
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=False)


def server_ssl_context(certs_dir: Path) -> ssl.SSLContext:
    """The data plane's server side: TLS with the node certificate, a client certificate
    asked for and verified against the CA when given, never required (tenants have
    none: their token in the hello says who they are)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, _read(certs_dir / NODE_CERT), _read(certs_dir / NODE_KEY))
    context.load_verify_locations(cadata=_read(certs_dir / CA_CERT).decode())
    context.verify_mode = ssl.CERT_OPTIONAL
    return context


def _load_chain(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """`ssl` loads a certificate and key from files only: they pass through a private
    directory (mode 0700, removed at once) rather than the PEM bytes a Transport holds
    being kept on disk."""
    with tempfile.TemporaryDirectory(prefix="streamengine-tls-") as folder:
        cert_path, key_path = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert_path.write_bytes(cert_pem)
        key_path.touch(mode=0o600)
        key_path.write_bytes(key_pem)
        context.load_cert_chain(cert_path, key_path)


LOOPBACK_HOSTS = frozenset({"localhost", "::1"})


class ProtectedMode(TransportError):
    """A server without certificates asked to listen beyond loopback (exit 2)."""


def is_loopback(listen: str) -> bool:
    """Whether `host:port` binds loopback addresses only (`0.0.0.0`, `[::]` and empty
    hosts bind every interface)."""
    host = listen.rpartition(":")[0].strip("[]").lower()
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name may resolve anywhere


def check_protected_mode(listen: str, certs_dir: Path | None, insecure: bool) -> None:
    """As Redis does: without certificates a server serves loopback only, unless told
    `--insecure`; anyone who reaches its port could otherwise delete data."""
    if certs_dir is None and not insecure and not is_loopback(listen):
        raise ProtectedMode(
            f"refusing to listen on {listen} without TLS: give --certs-dir, "
            "or --insecure to serve plaintext beyond loopback"
        )


def add_server_port(
    server: grpc.aio.Server, listen: str, certs_dir: Path | None
) -> ServerIdentity | None:
    """Serve on `listen`, with TLS from `certs_dir` when given; returns the identity
    that verifies callers' certificates (None for plaintext). Raises TransportError
    when the certs dir is unusable, RuntimeError when the address is taken."""
    if certs_dir is None:
        if server.add_insecure_port(listen) == 0:
            raise RuntimeError(f"cannot listen on {listen}")
        return None
    credentials = server_credentials(certs_dir)
    port = server.add_secure_port(listen, credentials)
    if port == 0:
        raise RuntimeError(f"cannot listen on {listen}")
    # The port bound (`:0` picks one): the audience callers' proofs must name.
    return ServerIdentity(_read(certs_dir / CA_CERT), _read(certs_dir / NODE_CERT), port)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--certs-dir",
        type=Path,
        help="serve TLS with ca.crt, node.crt and node.key of this directory, and call "
        "the other members with them",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve plaintext beyond loopback without --certs-dir (anyone reaching the "
        "port may read, write and delete)",
    )
