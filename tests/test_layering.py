"""The package's layout, and the one way its parts depend on each other.

    streamengine.protocol  <-  client.core  <-  client (the SDK shell)
    streamengine.protocol  <-  master.core  <-  master  ->  streamengine.etcd (metadata)
    streamengine.protocol  <-  segment_store.core  <-  segment_store
    tools (CLI, local cluster), testing, bench, deploy: on top of everything

`streamengine.X.Y` lives at `X/streamengine/X/Y.py`: each part in the top-level folder of
its name, laid out as it is imported (docs/design.md, "Parts and boundaries"). Every
part with decisions to make keeps them in its `core/` folder: those modules are driven by
the asyncio shells and by the deterministic simulator alike, so they never reach for the
network, the event loop, the clock or a random source themselves. Which modules are pure
is a folder, not a list.
"""

from __future__ import annotations

import ast
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.tree import PACKAGE_FOLDERS, ROOT

PARTS = ("protocol", "client", "master", "segment_store", "tools", "testing")
PARTS_WITH_CORES = ("client", "master", "segment_store")

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

# What a core may import besides its own core and the pure protocol modules: the servers'
# cores build and read wire messages (data, no I/O); the client's core knows none.
CORE_EXTRAS = {"client": (), "master": ("streamengine.v1",), "segment_store": ("streamengine.v1",)}

# What each part may import of the package, by prefix.
ALLOWED = {
    "protocol": ("streamengine.protocol", "streamengine.v1"),
    "client": ("streamengine.client", "streamengine.protocol", "streamengine.v1"),
    "master": (
        "streamengine.master",
        "streamengine.protocol",
        "streamengine.v1",
        "streamengine.etcd",
    ),
    "segment_store": ("streamengine.segment_store", "streamengine.protocol", "streamengine.v1"),
}


def package_folder(part: str) -> Path:
    return ROOT / part / "streamengine" / part


def core_folder(part: str) -> Path:
    return package_folder(part) / "core"


def imports_of(path: Path) -> list[str]:
    """Every absolute module a file imports, TYPE_CHECKING blocks included."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            if node.module.startswith("streamengine"):
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def namespace_imports(path: Path) -> list[str]:
    return [name for name in imports_of(path) if name.startswith("streamengine.")]


def does_io(path: Path) -> bool:
    return bool({name.split(".")[0] for name in imports_of(path)} & IO_MODULES)


def pure_protocol_modules() -> set[str]:
    """Protocol modules that import no I/O module, themselves or through the protocol."""
    folder = package_folder("protocol")
    modules = {
        "streamengine.protocol" + ("" if p.stem == "__init__" else f".{p.stem}"): p
        for p in folder.glob("*.py")
    }
    impure = {name for name, path in modules.items() if does_io(path)}
    changed = True
    while changed:
        changed = False
        for name, path in modules.items():
            if name not in impure and any(dep in impure for dep in namespace_imports(path)):
                impure.add(name)
                changed = True
    return set(modules) - impure


def test_the_package_has_no_symbolic_links() -> None:
    listing = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    links = [line.split("\t", 1)[1] for line in listing.splitlines() if line.startswith("120000")]
    assert not links, f"symbolic links in the tree: {links}"


def test_each_part_is_in_the_folder_of_its_name_as_it_is_imported() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    expected = {f"streamengine.{part}": f"{part}/streamengine/{part}" for part in PARTS}
    expected |= {
        "streamengine": "client/streamengine",
        "streamengine.v1": "proto/streamengine/v1",
        "streamengine.etcd": "proto/streamengine/etcd",
    }
    assert package_dir == expected
    for folder in package_dir.values():
        assert (ROOT / folder / "__init__.py").is_file(), folder
    assert config["tool"]["mypy"]["mypy_path"] == list(PACKAGE_FOLDERS)
    assert config["tool"]["pytest"]["ini_options"]["pythonpath"] == [".", *PACKAGE_FOLDERS]
    assert set(PACKAGE_FOLDERS) == {*PARTS, "proto"}


def test_proto_holds_only_proto_files_generated_code_and_its_generators() -> None:
    for path in sorted((ROOT / "proto").rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(ROOT / "proto")
        if relative.parts[0] in {"generate.py", "etcd_protos.py"}:
            continue
        assert relative.parts[:2] in {("streamengine", "v1"), ("streamengine", "etcd")}, relative
        assert path.suffix == ".proto" or path.stem.endswith(("_pb2", "_pb2_grpc", "__init__")), (
            relative
        )


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_part_imports_only_what_is_below_it(part: str) -> None:
    files = sorted(package_folder(part).rglob("*.py"))
    assert files, part
    for path in files:
        for name in namespace_imports(path):
            assert name.startswith(ALLOWED[part]), f"{path.relative_to(ROOT)} imports {name}"


@pytest.mark.parametrize("part", PARTS_WITH_CORES)
def test_every_part_keeps_its_decisions_in_a_core_folder(part: str) -> None:
    modules = [p for p in core_folder(part).glob("*.py") if p.stem != "__init__"]
    assert modules, f"{part} has no core"


CORE_FILES = sorted(
    path
    for part in PARTS_WITH_CORES
    for path in core_folder(part).glob("*.py")
)


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cores_do_no_io(path: Path) -> None:
    io = {name.split(".")[0] for name in imports_of(path)} & IO_MODULES
    assert not io, f"{path.name} imports {sorted(io)}"
    part = path.parent.parent.name
    own_core = f"streamengine.{part}.core"
    pure_protocol = pure_protocol_modules()
    for name in namespace_imports(path):
        if name.startswith((own_core, *CORE_EXTRAS[part])) or name in pure_protocol:
            continue
        # `from streamengine.protocol.entry import X` lists `...entry.X` too.
        assert name.rsplit(".", 1)[0] in pure_protocol, f"{path.name} imports {name}"


def test_the_choice_of_master_and_the_wire_vocabulary_are_pure() -> None:
    pure = pure_protocol_modules()
    vocabulary = ("entry", "certificate", "grants", "tokens", "signing", "policy", "framing")
    for name in ("masters", *vocabulary):
        assert f"streamengine.protocol.{name}" in pure, name


def all_project_files() -> list[Path]:
    folders = [*PARTS, "tests", "bench", "deploy"]
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_nothing_imports_the_folders_as_top_level_packages() -> None:
    top_level = {*PARTS, "proto"}
    for path in all_project_files():
        for name in imports_of(path):
            assert name.split(".")[0] not in top_level, f"{path.relative_to(ROOT)}: {name}"


def test_benchmarks_do_not_import_the_tests() -> None:
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for name in imports_of(path):
            assert name.split(".")[0] != "tests", f"{path.relative_to(ROOT)} imports {name}"


def test_the_package_root_loads_the_sdk_lazily() -> None:
    init = ROOT / "client" / "streamengine" / "__init__.py"
    tree = ast.parse(init.read_text())
    eager = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("streamengine.")
    ]
    assert not eager, "streamengine/__init__.py must not import the SDK at load time"


MODULE_LINES_MAX = 600
CLASS_PUBLIC_METHODS_MAX = 25
LONG_MODULE_REASON = "Why one long module:"


def package_modules() -> list[Path]:
    return [
        path
        for part in PARTS
        for path in sorted(package_folder(part).rglob("*.py"))
    ]


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_long_module_says_at_its_top_why_it_stays_one(path: Path) -> None:
    text = path.read_text()
    if text.count("\n") <= MODULE_LINES_MAX:
        return
    docstring = ast.get_docstring(ast.parse(text)) or ""
    assert LONG_MODULE_REASON in docstring, (
        f"{path.relative_to(ROOT)} has {text.count(chr(10))} lines: split it, or say at its"
        f" top why it stays one ({LONG_MODULE_REASON!r})"
    )


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_class_has_more_than_25_public_methods(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            public = [
                item.name
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                and not item.name.startswith("_")
            ]
            assert len(public) <= CLASS_PUBLIC_METHODS_MAX, (
                f"{path.relative_to(ROOT)}: {node.name} has {len(public)} public methods"
            )
