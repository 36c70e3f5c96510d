"""How the harness's own calls (and the workload's clients) reach the servers: plaintext,
or over TLS as the cluster's admin when the run's cluster serves TLS (S15). The run
exports the admin's certs dir in `STREAMENGINE_CERTS_DIR` (`scenarios.topology`), so the
workload processes, which inherit the environment, call as the harness does."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from streamengine.protocol.transport import CERTS_DIR_ENV, Transport


def certs_dir() -> Path | None:
    """The admin's certs dir of this run's cluster; None when it is plaintext."""
    value = os.environ.get(CERTS_DIR_ENV, "")
    return Path(value) if value else None


def harness_transport() -> Transport:
    return Transport.for_client(certs_dir())


def open_channel(address: str) -> grpc.Channel:
    return harness_transport().channel(address)
