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
from tests.tree import ROOT

DESIGN = ROOT / "docs" / "design.md"
# The first commit made under CONTRIBUTING.md's rule for commit subjects.
FIRST_COMMIT_UNDER_THE_RULE = "16b7844"
SUBJECT_CHARS_MAX = 72
GUARD = re.compile(r"`(tests/[\w/]+\.py)::([\w.]+)`")
INVARIANT_START = re.compile(r"^(\d+)\. \*\*", re.MULTILINE)


def invariants() -> dict[int, str]:
    text = DESIGN.read_text()
    section = text.split("\n## Invariants\n", 1)[1].split("\n## ", 1)[0]
    starts = list(INVARIANT_START.finditer(section))
    assert starts, "the Invariants section lists no numbered invariant"
    bodies: dict[int, str] = {}
    for here, following in zip(starts, [*starts[1:], None], strict=True):
        end = following.start() if following else len(section)
        bodies[int(here.group(1))] = section[here.start() : end]
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


def test_the_readme_links_the_contributing_rules() -> None:
    assert "CONTRIBUTING.md" in (ROOT / "README.md").read_text()


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
