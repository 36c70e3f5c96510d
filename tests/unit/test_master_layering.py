"""The master's decision cores (leases, placement, repair) stay pure: no I/O, no clock,
no randomness, no storage, no gRPC. The shells (catalog, state, service, repairer,
server) carry those out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = ["leadership.py", "placement.py", "repair.py", "model.py", "errors.py"]
FORBIDDEN = {
    "asyncio",
    "grpc",
    "time",
    "random",
    "socket",
    "threading",
    "os",
    "rocksdict",
    "streamengine",
}


def imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
            if node.module.startswith("master."):
                found.add(node.module)
    return found


@pytest.mark.parametrize("name", PURE)
def test_master_cores_do_no_io(name: str) -> None:
    modules = imported(ROOT / "master" / name)
    assert not modules & FORBIDDEN, f"{name} imports {sorted(modules & FORBIDDEN)}"
    shells = {m for m in modules if m.startswith("master.") and f"{m.split('.')[1]}.py" not in PURE}
    assert not shells, f"{name} depends on the shell: {sorted(shells)}"
