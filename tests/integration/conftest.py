"""Fixtures of the real-process tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.writer_process import WriterProcess


@pytest.fixture
def writers() -> Iterator[list[WriterProcess]]:
    started: list[WriterProcess] = []
    yield started
    for writer in started:
        writer.kill()
