"""The SDK's public edge is what README.md documents, no more and no less.

The README's "## SDK" section lists the SDK's names in its `text` block, the errors as a
tree under `StreamEngineError`; both `streamengine` and `streamengine.client` export
exactly those names, and each error's documented parent is its base class.
"""

from __future__ import annotations

import importlib
import re

import pytest

import streamengine
import streamengine.client
from streamengine.client import StreamEngineError
from tests.tree import ROOT

# A name line of the block: tree branches (`│   `, `├── `, `└── `), then the name.
NAME_LINE = re.compile(r"^(?P<indent>(?:[│ ]   )*)(?P<branch>[├└]── )?(?P<name>[A-Z]\w*)(?:\s|$)")


def documented_names() -> dict[str, str | None]:
    """Each name the README's SDK section lists, with its parent in the tree (None at
    the top)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## SDK\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```text\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "the SDK section lists its names in one text block"
    names: dict[str, str | None] = {}
    parents: list[str] = []  # the last name seen at each depth
    for line in blocks[0].splitlines():
        match = NAME_LINE.match(line)
        if match is None:
            continue  # a description carried over from the line above
        depth = len(match["indent"]) // 4 + 1 if match["branch"] else 0
        del parents[depth:]
        assert match["name"] not in names, f"{match['name']} listed twice"
        names[match["name"]] = parents[depth - 1] if depth else None
        parents.append(match["name"])
    return names


@pytest.mark.parametrize("module", ["streamengine", "streamengine.client"])
def test_exported_names_are_exactly_the_documented_ones(module: str) -> None:
    exported = importlib.import_module(module).__all__
    assert len(exported) == len(set(exported))
    documented = documented_names()
    assert sorted(set(exported) - set(documented)) == [], "exported, not in the README"
    assert sorted(set(documented) - set(exported)) == [], "in the README, not exported"


def test_the_root_hands_out_the_sdks_own_objects() -> None:
    for name in streamengine.client.__all__:
        assert getattr(streamengine, name) is getattr(streamengine.client, name)


def test_every_error_sits_under_its_base_class_in_the_documented_tree() -> None:
    documented = documented_names()
    errors = [
        name
        for name in documented
        if isinstance(getattr(streamengine.client, name), type)
        and issubclass(getattr(streamengine.client, name), BaseException)
    ]
    assert "StreamEngineError" in errors and documented["StreamEngineError"] is None
    for name in errors:
        if name != "StreamEngineError":
            error = getattr(streamengine.client, name)
            assert documented[name] == error.__base__.__name__, name
            assert issubclass(error, StreamEngineError)
