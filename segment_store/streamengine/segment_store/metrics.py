"""Prometheus metrics of a store process, served on `--metrics-port` when given
(`serve_metrics`): HTTPS for cluster admins on a store with `--certs-dir`, as the
master's console serves its own (`protocol.http_server`)."""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from streamengine.protocol import http_server
from streamengine.protocol.auth import CONSOLE_NEEDS, authorize_need

METRICS_PATH = "/metrics"

WRITE_MESSAGES = Counter(
    "streamengine_store_write_messages_total", "Write messages read (one or many segments each)"
)
WRITE_PARTS = Counter(
    "streamengine_store_write_parts_total", "Segments' requests read in Write messages"
)
WRITE_BATCHES = Counter("streamengine_store_write_batches_total", "Write batches accepted")
WRITE_ENTRIES = Counter(
    "streamengine_store_write_entries_total", "Entries in accepted write batches"
)
WRITE_BYTES = Counter(
    "streamengine_store_write_bytes_total", "Payload bytes in accepted write batches"
)
BATCH_ENTRIES = Histogram(
    "streamengine_store_write_batch_entries",
    "Entries per accepted write batch",
    buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 4096),
)
GROUP_COMMANDS = Histogram(
    "streamengine_store_group_commit_commands",
    "Commands sharing one KV write and sync",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
SYNC_SECONDS = Histogram(
    "streamengine_store_sync_seconds",
    "Latency of one WAL sync (flush_wal(True))",
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
)
QUEUE_BYTES = Gauge("streamengine_store_queue_bytes", "Payload bytes of write batches queued")
QUEUE_BATCHES = Gauge("streamengine_store_queue_batches", "Write batches queued")
FENCE_REJECTIONS = Counter(
    "streamengine_store_fence_rejections_total", "Writes and seals below the fence"
)
CONFLICTING_COPIES = Counter(
    "streamengine_store_conflicting_copies_total",
    "Write batches refused: an index held at the same epoch sent with other bytes",
)
REFUSED_BUSY = Counter("streamengine_store_refused_busy_total", "Write batches refused: queue full")
BAD_REQUESTS = Counter("streamengine_store_bad_requests_total", "Requests refused as malformed")
REFUSED_QUOTA = Counter(
    "streamengine_store_refused_quota_total",
    "Write batches refused: their tenant over its append quota at this store",
)
DENIED = Counter(
    "streamengine_store_denied_total",
    "Calls refused: no valid grant, or a caller without the permission",
)
REFUSED_CALLERS = Counter(
    "streamengine_store_refused_callers_total",
    "Calls refused for who called: unproven (no valid certificate proof or token, or "
    "anonymous at a stream's open), or over a limit of one caller's share",
    ["reason"],
)
READ_ENTRIES = Counter(
    "streamengine_store_read_entries_total",
    "Entries sent to readers, by RPC (read, read_packed, subscribe)",
    ["rpc"],
)
DATA_CONNECTIONS = Counter(
    "streamengine_store_data_connections_total",
    "Connections to the data port whose hello the store accepted (a client holds one "
    "per store for its reads and tails, one more per 64 requests open)",
)
SUBSCRIBERS = Gauge("streamengine_store_subscribers", "Open Subscribe streams")
TAILS = Gauge("streamengine_store_tails", "Segment tails of multiplexed Subscribe calls")
TAILS_ENDED = Counter(
    "streamengine_store_tails_ended_total",
    "Tails of multiplexed Subscribe calls the store ended, by status",
    ["status"],
)
SUBSCRIBERS_DROPPED = Counter(
    "streamengine_store_subscribers_dropped_total", "Subscribers disconnected", ["reason"]
)
SEGMENTS = Gauge("streamengine_store_segments", "Segments held")
HEARTBEAT_FAILURES = Counter(
    "streamengine_store_master_heartbeat_failures_total", "Failed master calls"
)
WRITE_STREAMS_IDLE_CLOSED = Counter(
    "streamengine_store_write_streams_idle_closed_total",
    "Write streams closed after WRITE_STREAM_IDLE_MS with nothing in flight",
)
SCRUB_BYTES = Counter(
    "streamengine_store_scrub_bytes_total", "Bytes of sealed replicas read back by the scrub"
)
SCRUB_REPLICAS = Counter(
    "streamengine_store_scrub_replicas_total",
    "Sealed replicas the scrub read back, by outcome (read: its certificate went to the "
    "master, which compares it; damaged: a checksum failed or an index is missing)",
    ["outcome"],
)
SCRUB_OLDEST_CHECK_SECONDS = Gauge(
    "streamengine_store_scrub_oldest_check_seconds",
    "Time since the least recently checked sealed replica was read back (since the "
    "store started, for one never read)",
)
SCRUB_UNCHECKED = Gauge(
    "streamengine_store_scrub_unchecked_replicas",
    "Sealed replicas not read back since the store started",
)


class MetricsHandler(http_server.Handler):
    """`/metrics`, to whom the master's console shows its own."""

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != METRICS_PATH:
            self.send_body(404, "text/plain; charset=utf-8", b"not found\n")
            return
        principal = self.certified_principal()
        denial = authorize_need(principal, CONSOLE_NEEDS[METRICS_PATH], f"store {METRICS_PATH}")
        if denial is not None:
            self.send_refusal(principal, denial)
            return
        self.send_body(200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY))


def serve_metrics(host: str, port: int, certs_dir: Path | None) -> ThreadingHTTPServer:
    """Serve this process's metrics on `host:port` (HTTPS with `certs_dir`)."""
    return http_server.serve("metrics", host, port, MetricsHandler, certs_dir)
