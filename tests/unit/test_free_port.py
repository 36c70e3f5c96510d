"""Servers a test makes are given distinct ports, even when the kernel names the same
free port twice (two stores once shared one: the second could not listen, and the first
answering there passed for it)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from streamengine.tools import harness


class _ScriptedSocket:
    """Binds to the next port of a script, as the kernel might choose them."""

    script: list[int] = []

    def __init__(self, *args: Any) -> None:
        self.port = 0

    def __enter__(self) -> _ScriptedSocket:
        return self

    def __exit__(self, *args: Any) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.script.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_names_twice_is_handed_out_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness, "_handed_out", set())
    monkeypatch.setattr(socket, "socket", _ScriptedSocket)
    _ScriptedSocket.script = [41000, 41000, 41000, 41001, 41000, 41002]
    assert [harness.free_port() for _ in range(3)] == [41000, 41001, 41002]
    assert _ScriptedSocket.script == []
