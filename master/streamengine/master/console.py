"""The master's web console and metrics, on its `--metrics-port`.

- `/` a read-only page that polls `/api/status` every second and draws it: stores,
  streams, each stream's segments with copy sets and seal state, under-replicated
  segments, repairs and drains. Plain HTML and a little script, no build chain. The
  page holds no data: anyone reaching the port gets it.
- `/api/status` the cluster's state in the shape of `streamengine status --json`
  (`streamengine.protocol.status_view`), each stream with its segments, as GetClusterStatus
  would answer the caller (`authority.visible_status`).
- `/metrics` Prometheus: cluster-wide figures, for cluster admins.

Access follows the gRPC API's rules (`auth.CONSOLE_NEEDS`, `auth.authorize_need`). A
master with `--certs-dir` serves HTTPS with its node certificate and asks for an
optional client certificate: an admin's (or a member's) proves who calls, verified by
the handshake against the cluster's CA; a tenant sends its token as
`Authorization: Bearer`, the same token its SDK holds, and sees its own streams only.
A caller with neither gets 401. A plaintext master serves loopback only (or beyond
with `--insecure`), and shows everything to a caller without a token, as its gRPC port
does; a token is held to what it allows either way.

The HTTP server (`protocol.http_server`, as a store's metrics port) runs in its own
thread and never touches the master's state: the master's loop publishes a
`ConsoleView` (`ConsoleSnapshot.publish`) and the server filters the latest one per
caller. What a request is answered is `console_reply`, apart from the socket, so that
the simulator asks the console what a browser or a dashboard would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from streamengine.master.core.authority import stream_tenant, visible_status
from streamengine.protocol import http_server
from streamengine.protocol.auth import (
    CONSOLE_NEEDS,
    Denial,
    Principal,
    authorize_need,
    visible_tenant,
)
from streamengine.protocol.callers import token_of_authorization
from streamengine.protocol.clock import wall_ms
from streamengine.protocol.signing import NoVerifyingKey, Verifier
from streamengine.protocol.status_view import status_dict
from streamengine.protocol.tokens import Revocations, resolve_caller
from streamengine.v1 import master_pb2

PAGE = Path(__file__).with_name("console.html")


@dataclass(frozen=True)
class ConsoleView:
    """What the active master's loop publishes: everything, filtered per caller."""

    status: master_pb2.ClusterStatus
    segments: dict[str, list[dict[str, Any]]]  # stream name -> its segments
    verifier: Verifier
    revocations: Revocations


class ConsoleSnapshot:
    """The latest view the master's loop published, for the HTTP thread; a standby
    publishes only that it stands by, and which master is active."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._view: ConsoleView | None = None
        self._standby: dict[str, Any] = {"starting": True}

    def publish(self, view: ConsoleView) -> None:
        with self._lock:
            self._view = view

    def publish_standby(self, active_master: str) -> None:
        with self._lock:
            self._view = None
            self._standby = {"starting": True, "standby": True, "active_master": active_master}

    def latest(self) -> ConsoleView | dict[str, Any]:
        with self._lock:
            return self._view if self._view is not None else self._standby


def status_for(view: ConsoleView, principal: Principal) -> dict[str, Any]:
    """`/api/status` as `principal` may see it."""
    status = status_dict(visible_status(view.status, principal))
    status["segments"] = {
        name: segments
        for name, segments in view.segments.items()
        if visible_tenant(principal, stream_tenant(name))
    }
    return status


@dataclass(frozen=True, slots=True)
class ConsoleReply:
    """What the console answers a GET: its status code, content type and body."""

    code: int
    content_type: str
    body: bytes


def console_reply(
    path: str,
    latest: ConsoleView | dict[str, Any],
    registry: CollectorRegistry,
    certified: Principal,
    authorization: str | None,
    now_ms: int,
) -> ConsoleReply:
    """The answer to `GET path` (not the page itself) from a caller its connection
    proves to be `certified`, sending the `Authorization` header `authorization`, given
    the snapshot's `latest` view."""
    need = CONSOLE_NEEDS.get(path)
    if need is None:
        return ConsoleReply(404, "text/plain; charset=utf-8", b"not found\n")
    if not isinstance(latest, ConsoleView):
        # Starting, or a standby: only which master is active, as its gRPC port
        # answers anyone.
        return ConsoleReply(200, http_server.JSON, http_server.json_bytes(latest))
    principal = _principal(latest, certified, authorization, now_ms)
    denial = (
        principal
        if isinstance(principal, Denial)
        else authorize_need(principal, need, f"console {path}")
    )
    if denial is not None:
        body = http_server.json_bytes({"error": denial.reason})
        return ConsoleReply(http_server.refusal_code(principal), http_server.JSON, body)
    assert isinstance(principal, Principal)
    if path == "/metrics":
        return ConsoleReply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
    status = status_for(latest, principal)
    return ConsoleReply(200, http_server.JSON, http_server.json_bytes(status))


def _principal(
    view: ConsoleView, certified: Principal, authorization: str | None, now_ms: int
) -> Principal | Denial:
    try:
        return resolve_caller(
            certified,
            None if authorization is None else token_of_authorization(authorization),
            view.verifier,
            view.revocations,
            now_ms,
        )
    except NoVerifyingKey:
        return Denial("the master cannot check tokens yet")


def serve_console(
    port: int,
    snapshot: ConsoleSnapshot,
    registry: CollectorRegistry,
    host: str = "127.0.0.1",
    certs_dir: Path | None = None,
) -> ThreadingHTTPServer:
    """Serve the console on `host:port` from a daemon thread (HTTPS with `certs_dir`);
    returns the server."""
    page = PAGE.read_bytes()

    class Handler(http_server.Handler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self.send_body(200, "text/html; charset=utf-8", page)
                return
            reply = console_reply(
                path,
                snapshot.latest(),
                registry,
                self.certified_principal(),
                self.headers.get("Authorization"),
                wall_ms(),
            )
            self.send_body(reply.code, reply.content_type, reply.body)

    return http_server.serve("console", host, port, Handler, certs_dir)
