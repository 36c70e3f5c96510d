"""The design document cannot drift silently from the code.

Every numbered invariant of `docs/design.md` names at least one guard, every guard it
names exists (a test function, or a checker method or function), the simulator's
invariant numbers are all documented, and the README links the document. The commit
rule of CONTRIBUTING.md is checked on the history since it was made.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.sim.checkers import INVARIANTS
from tests.tree import PACKAGE_FOLDERS, ROOT

DESIGN = ROOT / "docs" / "design.md"
# The first commit made under CONTRIBUTING.md's rule for commit subjects.
FIRST_COMMIT_UNDER_THE_RULE = "16b7844"
SUBJECT_CHARS_MAX = 72
GUARD = re.compile(r"`(tests/[\w/]+\.py)::([\w.]+)`")
INVARIANT_START = re.compile(r"^(\d+)\. \*\*", re.MULTILINE)
MODULE_NAME = re.compile(r"`(streamengine(?:\.[a-z0-9_]+)*)`")
MODULE_PATH = re.compile(rf"`((?:{'|'.join(PACKAGE_FOLDERS)})/streamengine/[\w/]+\.py)`")


def section(title: str) -> str:
    """The text of the design document's `## title` section, up to the next one."""
    text = DESIGN.read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def invariants() -> dict[int, str]:
    text = section("Invariants")
    starts = list(INVARIANT_START.finditer(text))
    assert starts, "the Invariants section lists no numbered invariant"
    bodies: dict[int, str] = {}
    for here, following in zip(starts, [*starts[1:], None], strict=True):
        end = following.start() if following else len(text)
        bodies[int(here.group(1))] = text[here.start() : end]
    return bodies


def defined_names(path: Path) -> set[str]:
    """Top-level functions and classes, and `Class.method` for their methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}.{item.name}")
    return names


def module_file(name: str) -> Path | None:
    """The file of module `streamengine.X.Y` (`X/streamengine/X/Y.py`, a package's
    `__init__.py`; the generated `streamengine.v1` and `.etcd` under `proto/`)."""
    parts = name.split(".")
    if len(parts) == 1:
        return ROOT / "client" / "streamengine" / "__init__.py"
    folder = parts[1] if parts[1] in PACKAGE_FOLDERS else "proto"
    path = ROOT / folder / Path(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def core_modules_on_disk() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts[1:]): path
        for path in sorted(ROOT.glob("*/streamengine/*/core/*.py"))
        if path.stem != "__init__"
    }


def test_parts_and_boundaries_names_every_core_module_on_disk() -> None:
    text = section("Parts and boundaries")
    named = set(MODULE_NAME.findall(text))
    cores = core_modules_on_disk()
    assert cores, "no core module found on disk"
    missing = [
        name
        for name, path in cores.items()
        if name not in named and f"`{path.relative_to(ROOT)}`" not in text
    ]
    assert not missing, f'"Parts and boundaries" does not name {missing}'


def test_every_module_parts_and_boundaries_names_exists() -> None:
    text = section("Parts and boundaries")
    names = MODULE_NAME.findall(text)
    assert names, '"Parts and boundaries" names no module'
    absent = [name for name in names if module_file(name) is None]
    absent += [path for path in MODULE_PATH.findall(text) if not (ROOT / path).is_file()]
    assert not absent, f'"Parts and boundaries" names modules that do not exist: {absent}'


def test_the_invariants_are_numbered_one_to_n() -> None:
    numbers = list(invariants())
    assert numbers == list(range(1, len(numbers) + 1))


@pytest.mark.parametrize("number", sorted(invariants()))
def test_every_invariant_names_guards_that_exist(number: int) -> None:
    guards = GUARD.findall(invariants()[number])
    assert guards, f"invariant {number} of docs/design.md names no test or checker"
    for file, name in guards:
        path = ROOT / file
        assert path.is_file(), f"invariant {number}: {file} does not exist"
        assert name in defined_names(path), f"invariant {number}: {file}::{name} does not exist"


def test_every_invariant_the_simulator_checks_is_documented() -> None:
    documented = set(invariants())
    checked = {number for number in INVARIANTS if number != 0}  # 0: liveness
    assert checked <= documented, f"checked but not documented: {sorted(checked - documented)}"


def test_every_guard_named_anywhere_in_the_document_exists() -> None:
    for file, name in GUARD.findall(DESIGN.read_text()):
        assert name in defined_names(ROOT / file), f"{file}::{name}"


def test_the_readme_links_the_design_document() -> None:
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_the_readme_links_the_contributing_rules_and_the_performance_document() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "CONTRIBUTING.md" in readme
    assert "docs/performance.md" in readme
    assert (ROOT / "docs" / "performance.md").is_file()


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def test_commit_subjects_are_short_and_single() -> None:
    """CONTRIBUTING.md: a subject of at most 72 characters, one change (no `;`)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if git("cat-file", "-e", f"{FIRST_COMMIT_UNDER_THE_RULE}^{{commit}}").returncode != 0:
        pytest.skip(f"no history back to {FIRST_COMMIT_UNDER_THE_RULE} (not a git clone)")
    log = git("log", "--format=%h %s", f"{FIRST_COMMIT_UNDER_THE_RULE}..HEAD")
    assert log.returncode == 0, log.stderr
    broken = []
    for line in log.stdout.splitlines():
        commit, _, subject = line.partition(" ")
        if len(subject) > SUBJECT_CHARS_MAX or ";" in subject:
            broken.append(f"{commit} ({len(subject)} characters): {subject}")
    assert not broken, "subjects against CONTRIBUTING.md:\n" + "\n".join(broken)
