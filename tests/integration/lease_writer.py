"""A writer that only heartbeats: `python -m tests.integration.lease_writer MASTER STREAM ID`.

Prints one JSON line per change of role or epoch (`{"t": wall seconds when the heartbeat
was sent, "rt": when its reply came, "role", "epoch"}`),
heartbeats every lease/3, and on SIGTERM releases its lease and exits 0. Integration
tests kill it with SIGKILL to play a crashed leader.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import grpc

from streamengine.protocol.limits import HEARTBEATS_PER_LEASE
from streamengine.v1 import master_pb2, master_pb2_grpc


def main(master: str, stream: str, client_id: str) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    channel = grpc.insecure_channel(master)
    stub = master_pb2_grpc.MasterStub(channel)
    epoch = 0
    grant = b""  # the master's signed grant of `epoch`
    secret = b""  # the lease secret handed with it
    last: tuple[int, int] | None = None
    interval_s = 0.1
    while not stop.is_set():
        sent = time.time()
        try:
            reply = stub.WriterHeartbeat(
                master_pb2.WriterHeartbeatRequest(
                    stream=stream, client_id=client_id, epoch=epoch, lease_secret=secret
                ),
                timeout=1.0,
            )
        except grpc.RpcError as error:
            print(json.dumps({"t": time.time(), "error": error.code().name}), flush=True)
            stop.wait(interval_s)
            continue
        epoch = reply.epoch if reply.role == master_pb2.LEADER else 0
        grant = reply.grant
        secret = reply.lease_secret or (secret if epoch else b"")
        interval_s = reply.lease_ms / HEARTBEATS_PER_LEASE / 1000
        if (reply.role, epoch) != last:
            last = (reply.role, epoch)
            role = master_pb2.WriterRole.Name(reply.role)
            event = {"t": sent, "rt": time.time(), "role": role, "epoch": reply.epoch}
            print(json.dumps(event), flush=True)
        stop.wait(interval_s)
    if epoch:
        stub.ReleaseLease(
            master_pb2.ReleaseLeaseRequest(
                stream=stream, client_id=client_id, epoch=epoch, grant=grant, lease_secret=secret
            ),
            timeout=2.0,
        )
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
