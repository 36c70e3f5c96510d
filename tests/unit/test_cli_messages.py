"""What the CLI tells a user on stderr while it appends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamengine.tools.ops import MASTER_SILENCE_TOLD_S, _tell_master_silence


def test_append_says_once_that_the_master_is_silent_and_when_it_answers_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def stats(silent_s: float | None) -> SimpleNamespace:
        return SimpleNamespace(master_silent_s=silent_s)

    told = _tell_master_silence(stats(0.3), False)
    assert not told and capsys.readouterr().err == ""
    told = _tell_master_silence(stats(MASTER_SILENCE_TOLD_S + 1), told)
    assert told and "no master has answered for 6 s" in capsys.readouterr().err
    told = _tell_master_silence(stats(MASTER_SILENCE_TOLD_S + 9), told)
    assert told and capsys.readouterr().err == ""  # once
    told = _tell_master_silence(stats(0.1), told)
    assert not told and "answers again" in capsys.readouterr().err
