"""The protocol core stays free of I/O, clocks and randomness; packages depend one way.

client/core is driven by the asyncio shell and by the deterministic simulator alike, so
it must not reach for the network, the event loop, the clock or a random source itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_CORE = {"asyncio", "grpc", "time", "random", "socket", "threading", "subprocess", "os"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


CORE_FILES = sorted((ROOT / "client" / "core").glob("*.py"))


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_modules_do_no_io(path: Path) -> None:
    forbidden = imported_modules(path) & FORBIDDEN_IN_CORE
    assert not forbidden, f"{path.name} imports {sorted(forbidden)}"


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_depends_on_no_server_or_shell(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith(("master", "segment_store", "streamengine")), (
                node.module
            )
            if node.module.startswith("client"):
                assert node.module.startswith("client.core"), f"{path.name} imports {node.module}"


# The CLI is the one place that starts every kind of server.
ENTRY_POINTS = {ROOT / "client" / "cli.py"}


@pytest.mark.parametrize("package", ["client", "segment_store"])
def test_sdk_and_store_never_import_the_master(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        if path not in ENTRY_POINTS:
            assert "master" not in imported_modules(path), path
