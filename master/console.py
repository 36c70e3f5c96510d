"""The master's web console and metrics, on its `--metrics-port` (loopback only).

- `/` a read-only page that polls `/api/status` every second and draws it: stores,
  streams, each stream's segments with copy sets and seal state, under-replicated
  segments, repairs and drains. Plain HTML and a little script, no build chain.
- `/api/status` the cluster's state in the shape of `streamengine status --json`
  (`protocol/status_view.py`), each stream with its segments.
- `/metrics` Prometheus.

The HTTP server runs in its own thread and never touches the master's state: the
master's loop publishes a snapshot (`ConsoleSnapshot.publish`) and the server hands out
the latest one.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

PAGE = Path(__file__).with_name("console.html")


class ConsoleSnapshot:
    """The latest status the master's loop published, for the HTTP thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._body = json.dumps({"starting": True}).encode()

    def publish(self, status: dict[str, Any]) -> None:
        body = json.dumps(status, separators=(",", ":")).encode()
        with self._lock:
            self._body = body

    def body(self) -> bytes:
        with self._lock:
            return self._body


def serve_console(
    port: int, snapshot: ConsoleSnapshot, registry: CollectorRegistry, host: str = "127.0.0.1"
) -> ThreadingHTTPServer:
    """Serve the console on `host:port` from a daemon thread; returns the server."""
    page = PAGE.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/status":
                self._send(200, "application/json", snapshot.body())
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Requests are not worth a log line each."""

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="console", daemon=True).start()
    return server
