"""Ports for test servers: free on 127.0.0.1, never handed out twice, one share per
worker of a parallel test run."""

from __future__ import annotations

import os
import socket
import zlib

# Ports `free_port` handed out; forgotten past this many (the ephemeral range is far
# larger), so that a long test session still finds ports.
_HANDED_OUT_MAX = 8192
_handed_out: set[int] = set()


# Processes that pick ports side by side (the test runner's workers) each take one
# share of them: "K/N" takes the ports whose `port_share` is K. Within a process
# `_handed_out` keeps ports distinct; across processes only this does.
PORT_SHARD_ENV = "STREAMENGINE_PORT_SHARD"


def port_share(port: int, count: int) -> int:
    """Which of `count` shares `port` falls in. A hash, not `port % count`: Linux hands
    out ports of one parity to bind(0) and of the other to connect()."""
    return zlib.crc32(port.to_bytes(2, "big")) % count


def port_shard() -> tuple[int, int]:
    """(K, N) from `PORT_SHARD_ENV`; (0, 1), every port, when it is unset."""
    raw = os.environ.get(PORT_SHARD_ENV, "")
    if not raw:
        return 0, 1
    shard, _, count = raw.partition("/")
    if not (shard.isdigit() and count.isdigit() and int(shard) < int(count)):
        raise ValueError(f"{PORT_SHARD_ENV}={raw!r}: want K/N with 0 <= K < N")
    return int(shard), int(count)


def free_port() -> int:
    """A port free on 127.0.0.1 now, and not handed out before by this process. Servers
    are given their ports before any of them binds, and the kernel may name the same free
    port twice: once two stores got the same one, the second could not listen, and the
    first answering at that address passed for it (a CI run hung for 300 s)."""
    if len(_handed_out) >= _HANDED_OUT_MAX:
        _handed_out.clear()
    shard, count = port_shard()
    for _ in range(100 * count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port_share(port, count) == shard and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no port free on 127.0.0.1 that was not handed out already")


def free_port_run(count: int) -> int:
    """A port p with p .. p + count - 1 all free on 127.0.0.1 now and none handed out
    before, for a server set that takes consecutive ports from one base (a
    `LocalCluster`: `local_cluster.ports_used`). `free_port` alone checks the base only:
    a store of such a cluster once found its port taken and exited."""
    _, shards = port_shard()
    for _ in range(100 * shards):
        base = free_port()
        run = range(base, base + count)
        if run.stop > 65535 or any(p in _handed_out for p in run[1:]):
            continue
        sockets: list[socket.socket] = []
        try:
            for port in run[1:]:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        _handed_out.update(run)
        return base
    raise RuntimeError(f"no run of {count} free ports on 127.0.0.1")
