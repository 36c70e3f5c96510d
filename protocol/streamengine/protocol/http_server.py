"""The HTTP ports beside a server's gRPC port: the master's console, a store's metrics.

They follow the gRPC port's rules. A server with `--certs-dir` serves HTTPS with its
node certificate and asks for an optional client certificate, verified in the handshake
against the cluster's CA (`tls_context`); who calls is then its certificate's principal
(`Handler.certified_principal`), held to `auth.authorize_need` by each handler. Without
certificates who calls is INSECURE, as on a plaintext gRPC port, and protected mode
(`transport.check_protected_mode`) keeps the port on loopback.

Each request runs in its own daemon thread, its TLS handshake included, so a slow
client never stalls the accept loop, and one that sends nothing holds its thread no
longer than `REQUEST_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from streamengine.protocol import identity, transport
from streamengine.protocol.auth import INSECURE, Denial, Principal, PrincipalKind

log = logging.getLogger("streamengine.http")

REQUEST_TIMEOUT_S = 10.0
JSON = "application/json"


def json_bytes(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def refusal_code(principal: Principal | Denial) -> int:
    """401 when nobody is proven (no credentials, or a token that is not valid), 403
    when someone is, who may not."""
    unproven = isinstance(principal, Denial) or principal.kind is PrincipalKind.ANONYMOUS
    return 401 if unproven else 403


def tls_context(certs_dir: Path) -> ssl.SSLContext:
    """HTTPS with the node certificate, asking for an optional client certificate
    signed by the cluster's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certs_dir / transport.NODE_CERT, certs_dir / transport.NODE_KEY)
    context.load_verify_locations(certs_dir / transport.CA_CERT)
    context.verify_mode = ssl.CERT_OPTIONAL
    return context


class Handler(BaseHTTPRequestHandler):
    """A request on one of these ports; subclasses answer `do_GET`."""

    timeout = REQUEST_TIMEOUT_S
    # Set by `serve`: the port's TLS, None on plaintext.
    tls: ssl.SSLContext | None = None

    def setup(self) -> None:
        if self.tls is not None:
            self.request.do_handshake()
        super().setup()

    def certified_principal(self) -> Principal:
        """Who the connection proves to be: INSECURE on plaintext; over TLS, the
        principal its client certificate names (ANONYMOUS without one)."""
        if self.tls is None:
            return INSECURE
        assert isinstance(self.connection, ssl.SSLSocket)
        return identity.principal_of_peer_certificate(self.connection.getpeercert(binary_form=True))

    def send_refusal(self, principal: Principal | Denial, denial: Denial) -> None:
        """`refusal_code`, with the reason."""
        self.send_json(refusal_code(principal), {"error": denial.reason})

    def send_json(self, code: int, body: dict[str, Any]) -> None:
        self.send_body(code, JSON, json_bytes(body))

    def send_body(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if code == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="streamengine"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not worth a log line each."""


def serve(
    name: str, host: str, port: int, handler: type[Handler], certs_dir: Path | None
) -> ThreadingHTTPServer:
    """Serve `handler` on `host:port` from a daemon thread named `name` (HTTPS with
    `certs_dir`); returns the server. Raises OSError when the port cannot be bound."""
    tls = tls_context(certs_dir) if certs_dir is not None else None
    bound = type(handler.__name__, (handler,), {"tls": tls})

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def get_request(self) -> tuple[Any, Any]:
            connection, address = super().get_request()
            if tls is None:
                return connection, address
            # The handshake runs in the request's thread (`Handler.setup`), not here.
            connection.settimeout(REQUEST_TIMEOUT_S)
            wrapped = tls.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
            return wrapped, address

        def handle_error(self, request: Any, client_address: Any) -> None:
            log.debug("%s request from %s failed", name, client_address, exc_info=True)

    server = Server((host, port), bound)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server
