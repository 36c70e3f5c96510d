"""Servers a test makes are given distinct ports, even when the kernel names the same
free port twice (two stores once shared one: the second could not listen, and the first
answering there passed for it)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from streamengine.testing import ports as harness


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
    monkeypatch.delenv(harness.PORT_SHARD_ENV, raising=False)
    _ScriptedSocket.script = [41000, 41000, 41000, 41001, 41000, 41002]
    assert [harness.free_port() for _ in range(3)] == [41000, 41001, 41002]
    assert _ScriptedSocket.script == []


def test_a_port_shard_takes_only_its_residue_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "_handed_out", set())
    monkeypatch.setattr(socket, "socket", _ScriptedSocket)
    monkeypatch.setenv(harness.PORT_SHARD_ENV, "1/2")
    ours = [port for port in range(41001, 41101, 2) if harness.port_share(port, 2) == 1]
    theirs = [port for port in range(41001, 41101, 2) if harness.port_share(port, 2) == 0]
    # bind(0) names ports of one parity: a share by parity would take all or none.
    assert len(ours) > 10 and len(theirs) > 10
    _ScriptedSocket.script = [theirs[0], ours[0], theirs[1], ours[0], ours[1]]
    assert [harness.free_port() for _ in range(2)] == [ours[0], ours[1]]
    assert _ScriptedSocket.script == []


@pytest.mark.parametrize("raw", ["2/2", "x/2", "1", "-1/2"])
def test_a_malformed_port_shard_is_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(harness.PORT_SHARD_ENV, raw)
    with pytest.raises(ValueError, match="want K/N"):
        harness.free_port()


def test_a_run_of_ports_skips_a_base_whose_next_ports_are_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run's ports past the base are bound to be checked: one already listening
    (a server of another test) makes the next base be tried, and a run handed out is
    never handed out again, in whole or in part."""
    monkeypatch.setattr(harness, "_handed_out", set())
    monkeypatch.delenv(harness.PORT_SHARD_ENV, raising=False)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        taken = listening.getsockname()[1]
        # A base just below a listening port: its run is refused, another is found.
        harness._handed_out.discard(taken - 1)
        bases = [taken - 1, *range(taken + 20, taken + 420, 20)]
        monkeypatch.setattr(harness, "free_port", iter(bases).__next__)
        base = harness.free_port_run(4)
        assert base > taken, "the run over the listening port was skipped"
    assert set(range(base, base + 4)) <= harness._handed_out
