"""Fixtures of the real-process tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from streamengine.testing import log_faults, servers_started
from tests.integration.writer_process import WriterProcess


@pytest.fixture
def writers() -> Iterator[list[WriterProcess]]:
    started: list[WriterProcess] = []
    yield started
    for writer in started:
        writer.kill()


@pytest.fixture(autouse=True, scope="module")
def servers_never_fail_a_call(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a module marked `security`, no server the module started answered UNKNOWN or
    logged a traceback: an exception escaping a handler does both (grpcio logs it and
    the caller gets UNKNOWN), and every bad credential or value must get a precise
    status instead. Checked once the module's servers are gone, over their whole logs."""
    if request.node.get_closest_marker("security") is None:
        yield
        return
    before = {id(server) for server in servers_started()}
    yield
    started = [server for server in servers_started() if id(server) not in before]
    faults = [f"{server.name}: {line}" for server in started for line in log_faults(server)[:5]]
    assert not faults, "\n".join(faults)
