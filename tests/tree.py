"""This working tree, for the processes tests start."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The folders that hold the `streamengine` package, each laid out as it is imported
# (`X/streamengine/X/...`); pyproject.toml's package-dir, mypy_path and pytest's
# pythonpath name the same folders (tests/test_layering.py checks it).
PACKAGE_FOLDERS = ("client", "master", "segment_store", "protocol", "tools", "testing", "proto")


def child_env() -> dict[str, str]:
    """The environment of a child process that imports this working tree's code, wherever
    the installed copy points."""
    paths = [
        *(str(ROOT / folder) for folder in PACKAGE_FOLDERS),
        str(ROOT),
        os.environ.get("PYTHONPATH", ""),
    ]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
