"""`protocol.private_files`: what exists is tightened, what is written is private from
its first byte, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamengine.protocol.private_files import private_dir, write_private


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The widest umask: nothing but our own modes keeps a file private."""
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_dir_open_to_others_is_tightened_and_reported(tmp_path: Path, open_umask: None) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True, mode=0o777)
    (data / "sub" / "file").write_text("x")
    (data / "sub" / "file").chmod(0o664)
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    (outside / "theirs").write_text("x")
    (outside / "theirs").chmod(0o644)
    (data / "link").symlink_to(outside)
    data.chmod(0o755)
    changed = private_dir(data)
    assert changed == [data, data / "sub", data / "sub" / "file"]
    assert (mode(data), mode(data / "sub"), mode(data / "sub" / "file")) == (0o700, 0o700, 0o600)
    assert (mode(outside), mode(outside / "theirs")) == (0o755, 0o644), "links not followed"
    assert private_dir(data) == [], "nothing left to tighten"


def test_a_new_dir_is_private(tmp_path: Path, open_umask: None) -> None:
    assert private_dir(tmp_path / "new") == []
    assert mode(tmp_path / "new") == 0o700


def test_a_written_file_is_private_even_over_a_wider_one(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "keys" / "node.key"
    path.parent.mkdir(mode=0o700)
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, b"new")
    assert (path.read_bytes(), mode(path)) == (b"new", 0o600)
    assert sorted(p.name for p in path.parent.iterdir()) == ["node.key"]
