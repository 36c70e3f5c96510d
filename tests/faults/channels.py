"""How the harness's own calls (and the workload's clients) reach the servers: plaintext,
or over TLS as the cluster's admin when the run's cluster serves TLS (S15). The run
exports the admin's certs dir in `STREAMENGINE_CERTS_DIR` (`scenarios.topology`), so the
workload processes, which inherit the environment, call as the harness does."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

import grpc

from streamengine.client import StreamClient
from streamengine.protocol.transport import CERTS_DIR_ENV, Transport
from streamengine.testing import is_active_master


def certs_dir() -> Path | None:
    """The admin's certs dir of this run's cluster; None when it is plaintext."""
    value = os.environ.get(CERTS_DIR_ENV, "")
    return Path(value) if value else None


def harness_transport() -> Transport:
    return _transport_of(certs_dir())


@functools.cache
def _transport_of(certs: Path | None) -> Transport:
    """Read a certs dir once per process, not at every channel the harness opens."""
    return Transport.for_client(certs)


def open_channel(address: str) -> grpc.Channel:
    """A channel to `address`; given several masters (`a:1,b:2`, a cluster on etcd), to
    the one active now (the first listed when none says so: its calls then fail as a
    lone master's do while it is down)."""
    masters = address.split(",")
    if len(masters) > 1:
        transport = harness_transport()
        active = (m for m in masters if is_active_master(m, transport=transport))
        address = next(active, masters[0])
    return harness_transport().channel(address)


def stream_client(master: str, dial: Mapping[str, str] | None = None) -> StreamClient:
    """An SDK client of the run's cluster, as the harness calls it (`dial`: addresses to
    reach through the fault proxy's links)."""
    return StreamClient(master, certs_dir=certs_dir(), dial=dial)
