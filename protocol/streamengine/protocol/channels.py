"""gRPC channel and server options, the same for the SDK, the servers and the tools.

Keepalive settings follow what was measured on grpc-core 1.85: without
`grpc.http2.ping_timeout_ms` a hung peer is detected only after about a minute, and the
servers must permit the clients' ping rate (see `SERVER_OPTIONS`).
"""

from __future__ import annotations

from streamengine.protocol.limits import GRPC_MESSAGE_BYTES_MAX

KEEPALIVE_TIME_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 3_000

CLIENT_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
    ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
]

# The receive window of each stream a server reads (see SERVER_OPTIONS).
SERVER_STREAM_WINDOW_BYTES = 1 << 20

SERVER_OPTIONS: list[tuple[str, int | str]] = [
    # grpc sets SO_REUSEPORT by default: a second server on a taken port would silently
    # share it instead of failing to start.
    ("grpc.so_reuseport", 0),
    # What a client may push ahead of the server's reading, per stream: a fixed window.
    # With BDP probing grpc grows it without a bound we set, and a store flooded by
    # writers it refuses grew by hundreds of MiB of buffered requests.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", SERVER_STREAM_WINDOW_BYTES),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
    ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
]
