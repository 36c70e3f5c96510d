"""Packages depend one way, and the decision cores do no I/O.

    streamengine.protocol  <-  client.core  <-  client (the SDK shell)
    streamengine.protocol  <-  master  ->  streamengine.etcd (etcd's API, for metadata)
    streamengine.protocol  <-  segment_store
    tools (CLI, local cluster), bench, deploy: on top of everything

The cores (`client/core`, the master's leadership/placement/repair, the store's core and
live tail) are driven by the asyncio shells and by the deterministic simulator alike, so
they never reach for the network, the event loop, the clock or a random source themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "proto" / "streamengine" / "protocol"

IO_MODULES = {
    "asyncio",
    "grpc",
    "time",
    "random",
    "socket",
    "threading",
    "subprocess",
    "os",
    "rocksdict",
    "uuid",
}

# What each part may import of the namespace, by prefix.
ALLOWED = {
    "protocol": ("streamengine.protocol", "streamengine.v1"),
    "client/core": ("streamengine.client.core", "streamengine.protocol"),
    "client": ("streamengine.client", "streamengine.protocol", "streamengine.v1"),
    "master": (
        "streamengine.master",
        "streamengine.protocol",
        "streamengine.v1",
        "streamengine.etcd",
    ),
    "segment_store": ("streamengine.segment_store", "streamengine.protocol", "streamengine.v1"),
}
PURE_PROTOCOL = [
    "certificate.py",
    "entry.py",
    "limits.py",
    "masters.py",
    "policy.py",
    "sequence.py",
    "signing.py",
    "grants.py",
    "tokens.py",
    "auth.py",
    "retention.py",
    "segment_records.py",
]
PURE_MASTER = [
    "leadership.py",
    "placement.py",
    "repair.py",
    "integrity.py",
    "model.py",
    "errors.py",
    "authority.py",
    "retention.py",
    "rebuild.py",
]
# The store's decisions: applying a batch over the narrow KV interface, the copy steps,
# the live tail, the scrub, the grants and callers it takes.
PURE_STORE = ["store.py", "keys.py", "copy_rules.py", "tail.py", "scrub.py", "authority.py"]
OLD_TOP_LEVEL = {"client", "master", "segment_store", "tools"}


def imports_of(path: Path) -> list[str]:
    """Every absolute module a file imports, TYPE_CHECKING blocks included."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            if node.module == "streamengine":
                found.extend(f"streamengine.{alias.name}" for alias in node.names)
    return found


def part_files(part: str) -> list[Path]:
    folder = PROTOCOL if part == "protocol" else ROOT / part
    files = sorted(folder.rglob("*.py"))
    if part == "client":
        files = [path for path in files if "core" not in path.relative_to(folder).parts]
    return files


def namespace_imports(path: Path) -> list[str]:
    return [name for name in imports_of(path) if name.startswith("streamengine.")]


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_part_imports_only_what_is_below_it(part: str) -> None:
    files = part_files(part)
    assert files, part
    for path in files:
        for name in namespace_imports(path):
            assert name.startswith(ALLOWED[part]), f"{path.relative_to(ROOT)} imports {name}"


CORE_FILES = (
    sorted((ROOT / "client" / "core").glob("*.py"))
    + [PROTOCOL / name for name in PURE_PROTOCOL]
    + [ROOT / "master" / name for name in PURE_MASTER]
    + [ROOT / "segment_store" / name for name in PURE_STORE]
)


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cores_do_no_io(path: Path) -> None:
    top_level = {name.split(".")[0] for name in imports_of(path)}
    assert not top_level & IO_MODULES, f"{path.name} imports {sorted(top_level & IO_MODULES)}"
    if path.parent == ROOT / "master":
        shells = [
            name
            for name in namespace_imports(path)
            if name.startswith("streamengine.master.")
            and f"{name.split('.')[2]}.py" not in PURE_MASTER
        ]
        assert not shells, f"{path.name} depends on the master's shell: {shells}"
    if path.parent == ROOT / "client" / "core":
        for name in namespace_imports(path):
            if name.startswith("streamengine.protocol."):
                assert f"{name.split('.')[2]}.py" in PURE_PROTOCOL, f"{path.name} imports {name}"


def all_project_files() -> list[Path]:
    folders = ["client", "master", "segment_store", "tools", "tests", "bench", "deploy"]
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))] + sorted(
        PROTOCOL.glob("*.py")
    )


def test_nothing_imports_the_folders_as_top_level_packages() -> None:
    for path in all_project_files():
        for name in imports_of(path):
            assert name.split(".")[0] not in OLD_TOP_LEVEL, f"{path.relative_to(ROOT)}: {name}"


def test_benchmarks_do_not_import_the_tests() -> None:
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for name in imports_of(path):
            assert name.split(".")[0] != "tests", f"{path.relative_to(ROOT)} imports {name}"


def test_the_namespace_root_loads_the_sdk_lazily() -> None:
    init = ROOT / "proto" / "streamengine" / "__init__.py"
    tree = ast.parse(init.read_text())
    eager = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("streamengine.")
    ]
    assert not eager, "streamengine/__init__.py must not import the SDK at load time"
