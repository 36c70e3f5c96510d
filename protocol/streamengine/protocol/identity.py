"""Who is calling: the certificate a member or an admin proves on each call.

Why not the TLS handshake alone: grpcio's `ssl_server_credentials` either requires a
client certificate of everyone or never asks for one (there is no "ask, verify if
given"), and tenants connect with only `ca.crt` and a token. So servers ask for none,
and a caller holding a certificate of the cluster's CA proves it inside the TLS
connection, on every call (streams included), with two metadata entries:

- `x-streamengine-cert`: its certificate (DER, base64);
- `x-streamengine-proof`: `<issued_ms>.<audience>.<signature>`, the signature by the
  certificate's key over the audience and the time. The audience is the `host:port` the
  caller dialed (grpc's `service_url`), so a server that receives a proof cannot use it
  at another server: a server accepts only an audience naming one of the hosts of its
  own certificate and its own port. A proof is valid for `PROOF_WINDOW_MS` either side
  of the server's clock (hosts' clocks differ), which bounds what a leaked one is worth.

The server verifies the chain to its `ca.crt` (cached per certificate), that the
certificate is not revoked (`cert_revocations`: the list the master keeps, which this
server holds, `take_revocations`) and the signature (per call), then maps the
certificate's URI SANs to a `Principal` with `auth.identity_from_auth_context`. A call
without a proof is ANONYMOUS over TLS (a token may say more: tenants), INSECURE over
plaintext. A proof that fails is refused outright (`ProofRefused`, UNAUTHENTICATED with
the reason), never read as anonymous: a member with a wrong clock, an expired or a
revoked certificate must hear why.

Replies use the same proof where a store must know the master said it: the master's
registration and heartbeat replies (a delete list, the master's grant-signing keys, its
token revocations) carry its proof in their trailing metadata, whose audience names the
kind of reply, the store and the exact reply (`reply_audience`).

Cost: a proof is signed per call by the caller (ECDSA P-256, in grpc's plugin thread)
and verified per call by a server that asks who called (docs/performance.md,
"Signatures"); a stream pays once, whatever it carries.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import datetime
import hashlib
import ipaddress
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from streamengine.protocol import auth
from streamengine.protocol.cert_revocations import CertRevocations
from streamengine.protocol.clock import wall_ms

log = logging.getLogger("streamengine.identity")

CERT_METADATA_KEY = "x-streamengine-cert"
PROOF_METADATA_KEY = "x-streamengine-proof"
PROOF_CONTEXT = b"streamengine-call-proof-v1\n"
# Clock difference tolerated between caller and server, each way.
PROOF_WINDOW_MS = 5 * 60 * 1000
# Verified certificates remembered per server (members and admins: a handful).
VERIFIED_CERTS_MAX = 1024
# A proof is one line of metadata; a longer one is not read at all.
PROOF_CHARS_MAX = 1024
CERT_CHARS_MAX = 8192


class ProofRefused(Exception):
    """The caller sent a certificate proof that does not hold."""


def _signed_bytes(audience: str, issued_ms: int) -> bytes:
    return PROOF_CONTEXT + f"{audience}\n{issued_ms}".encode()


def audience_of(service_url: str) -> str:
    """`host:port` of grpc's `https://host:port/package.Service`."""
    return urlsplit(service_url).netloc


class CertificateProof(grpc.AuthMetadataPlugin):
    """Client side: adds the certificate and a fresh proof to every call."""

    def __init__(self, cert_pem: bytes, key_pem: bytes) -> None:
        certificate = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the certificate's key is not an EC key")
        self._cert_b64 = base64.b64encode(certificate.public_bytes(serialization.Encoding.DER))
        self._key = key

    def metadata(self, audience: str, issued_ms: int) -> tuple[tuple[str, str], ...]:
        signature = self._key.sign(_signed_bytes(audience, issued_ms), ec.ECDSA(hashes.SHA256()))
        proof = f"{issued_ms}.{audience}.{base64.b64encode(signature).decode()}"
        return ((CERT_METADATA_KEY, self._cert_b64.decode()), (PROOF_METADATA_KEY, proof))

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        try:
            callback(self.metadata(audience_of(context.service_url), wall_ms()), None)
        except Exception as error:  # grpc fails the call with it
            callback((), error)


@dataclass(frozen=True)
class _Verified:
    uris: tuple[str, ...]  # URI SANs only: a DNS name spelled like a URI proves nothing
    common_name: str
    not_after_ms: int
    public_key: ec.EllipticCurvePublicKey
    serial: int


class ServerIdentity:
    """Server side: verifies proofs against the cluster's CA, for one listening port."""

    def __init__(self, ca_pem: bytes, node_cert_pem: bytes, listen_port: int) -> None:
        self._store = Store(x509.load_pem_x509_certificates(ca_pem))
        node = x509.load_pem_x509_certificate(node_cert_pem)
        names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
        hosts += [name.lower() for name in names.get_values_for_type(x509.DNSName)]
        self._hosts = frozenset(hosts)
        self._port = listen_port
        self._verified: OrderedDict[bytes, _Verified] = OrderedDict()
        self._lock = threading.Lock()  # sync servers call from a pool of threads
        # Replaced whole (one reference, read without the lock) as the master says.
        self.revocations = CertRevocations()

    def principal(
        self, metadata: Mapping[str, str], now_ms: int, audience: str | None = None
    ) -> auth.Principal:
        """Who proved a certificate in `metadata`: a call's caller (`audience` None: the
        proof must name this server's host and port), or the author of a reply (the
        proof must name exactly `audience`)."""
        cert_b64 = metadata.get(CERT_METADATA_KEY, "")
        proof = metadata.get(PROOF_METADATA_KEY, "")
        if not cert_b64 and not proof:
            return auth.ANONYMOUS
        if len(cert_b64) > CERT_CHARS_MAX or len(proof) > PROOF_CHARS_MAX:
            raise ProofRefused("certificate proof too long")
        verified = self._verified_cert(cert_b64, now_ms)
        refusal = self.revocations.refusal(verified.serial)
        if refusal is not None:
            raise ProofRefused(refusal)
        self._check_proof(verified, proof, now_ms, audience)
        return auth.identity_from_auth_context(_auth_context(verified.uris, verified.common_name))

    def _check_proof(
        self, verified: _Verified, proof: str, now_ms: int, expected: str | None
    ) -> None:
        issued, _, rest = proof.partition(".")
        audience, _, signature_b64 = rest.rpartition(".")
        try:
            issued_ms = int(issued)
            signature = base64.b64decode(signature_b64, validate=True)
        except ValueError:
            raise ProofRefused("malformed certificate proof") from None
        if abs(now_ms - issued_ms) > PROOF_WINDOW_MS:
            raise ProofRefused(
                f"certificate proof issued {(now_ms - issued_ms) / 1000:+.0f} s from this "
                "server's clock (are the hosts' clocks in sync?)"
            )
        if expected is None and not self._audience_is_me(audience):
            raise ProofRefused(f"certificate proof made for {audience!r}, not this server")
        if expected is not None and audience != expected:
            raise ProofRefused(f"certificate proof made for {audience!r}, not {expected!r}")
        try:
            verified.public_key.verify(
                signature, _signed_bytes(audience, issued_ms), ec.ECDSA(hashes.SHA256())
            )
        except InvalidSignature:
            raise ProofRefused("certificate proof signature does not verify") from None

    def _audience_is_me(self, audience: str) -> bool:
        host, _, port = audience.rpartition(":")
        host = host.strip("[]").lower()
        with contextlib.suppress(ValueError):
            host = str(ipaddress.ip_address(host))
        return port == str(self._port) and host in self._hosts

    def _verified_cert(self, cert_b64: str, now_ms: int) -> _Verified:
        try:
            der = base64.b64decode(cert_b64, validate=True)
        except ValueError:
            raise ProofRefused("malformed certificate") from None
        with self._lock:
            verified = self._verified.get(der)
            if verified is not None:
                self._verified.move_to_end(der)
        if verified is None:
            verified = self._verify_chain(der, now_ms)
            with self._lock:
                self._verified[der] = verified
                while len(self._verified) > VERIFIED_CERTS_MAX:
                    self._verified.popitem(last=False)
        if now_ms > verified.not_after_ms:
            raise ProofRefused("the caller's certificate has expired")
        return verified

    def _verify_chain(self, der: bytes, now_ms: int) -> _Verified:
        try:
            certificate = x509.load_der_x509_certificate(der)
            moment = datetime.datetime.fromtimestamp(now_ms / 1000, datetime.UTC)
            verifier = PolicyBuilder().store(self._store).time(moment).build_client_verifier()
            verifier.verify(certificate, [])
        except (ValueError, VerificationError) as error:
            raise ProofRefused(f"the caller's certificate is not the cluster's: {error}") from None
        key = certificate.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise ProofRefused("the caller's certificate does not hold an EC key")
        uris, common_name = _names(certificate)
        return _Verified(
            uris,
            common_name,
            int(certificate.not_valid_after_utc.timestamp() * 1000),
            key,
            certificate.serial_number,
        )


def _names(certificate: x509.Certificate) -> tuple[tuple[str, ...], str]:
    """A certificate's URI SANs (where identities live) and common name."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        uris = tuple(names.value.get_values_for_type(x509.UniformResourceIdentifier))
    except x509.ExtensionNotFound:
        uris = ()
    common = certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return uris, str(common[0].value) if common else ""


def _auth_context(uris: Sequence[str], common_name: str) -> dict[str, list[bytes]]:
    """What grpc's auth context says of a TLS peer with these names."""
    return {
        "transport_security_type": [b"ssl"],
        "x509_common_name": [common_name.encode()],
        "peer_uri": [uri.encode() for uri in uris],
    }


def principal_of_peer_certificate(der: bytes | None) -> auth.Principal:
    """The caller of a TLS connection whose handshake verified its certificate chain
    against the cluster's CA (an HTTPS server asking for an optional client
    certificate): ANONYMOUS without one, or with a revoked one."""
    if not der:
        return auth.ANONYMOUS
    certificate = x509.load_der_x509_certificate(der)
    server = _current()
    if server is not None and server.revocations.refusal(certificate.serial_number):
        return auth.ANONYMOUS
    uris, common_name = _names(certificate)
    return auth.identity_from_auth_context(_auth_context(uris, common_name))


def reply_audience(kind: str, store_id: str, reply: Any) -> str:
    """What the master's proof on a reply to a store names: the kind of reply
    ("register", "heartbeat"), the store it answers and the exact reply (a protobuf
    message), so that none of them can be swapped."""
    digest = hashlib.sha256(reply.SerializeToString(deterministic=True)).hexdigest()
    return f"{kind}:{store_id}:{digest}"


def metadata_dict(metadata: Iterable[Any] | None) -> dict[str, str]:
    """The proof's entries of gRPC metadata (pairs or `Metadatum`s); a key sent twice
    is refused."""
    entries: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if key in (CERT_METADATA_KEY, PROOF_METADATA_KEY):
            if key in entries:
                raise ProofRefused(f"{key} sent twice")
            entries[key] = value if isinstance(value, str) else value.decode("ascii", "replace")
    return entries


# The identity of this server, set once at start by a TLS server (None: plaintext):
# held for the tasks started from then on (those of the server's `start`, whose
# handlers run in them), and as the process's, for threads, which start from an empty
# context (an HTTPS server's). One server per process, as shipped, the two agree; the
# simulator runs many servers in one process, each its tasks with its own identity.
_installed: contextvars.ContextVar[ServerIdentity | None] = contextvars.ContextVar(
    "streamengine_server_identity"
)
_process_identity: ServerIdentity | None = None


def install(server_identity: ServerIdentity | None) -> None:
    global _process_identity
    _process_identity = server_identity
    _installed.set(server_identity)


def _current() -> ServerIdentity | None:
    return _installed.get(_process_identity)


def caller_identity(context: Any) -> auth.Principal:
    """The caller of a gRPC call (`grpc.aio.ServicerContext`) as its transport and
    certificate prove it. Raises ProofRefused for a proof that does not hold."""
    security = context.auth_context().get("transport_security_type", [b""])
    if not security or security[0] != b"ssl":
        return auth.INSECURE
    return principal_of_metadata(context.invocation_metadata() or ())


def principal_of_metadata(metadata: Sequence[Any]) -> auth.Principal:
    server = _current()
    assert server is not None, "a TLS server installs its identity at start"
    return server.principal(metadata_dict(metadata), wall_ms())


def take_revocations(revocations: CertRevocations) -> None:
    """The certificates this server refuses from now on, as the master keeps them
    (nothing to do on a plaintext server: it proves nobody)."""
    server = _current()
    if server is not None:
        server.revocations = revocations


def server_identity() -> ServerIdentity | None:
    """This TLS server's identity (None: plaintext)."""
    return _current()
