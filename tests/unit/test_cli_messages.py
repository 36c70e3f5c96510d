"""What the CLI tells a user on stderr: while it appends, and of where its token came
from."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from streamengine.protocol.transport import TOKEN_ENV
from streamengine.tools.cli import parse
from streamengine.tools.events import MASTER_SILENCE_TOLD_S, _tell_master_silence


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


# ---- where a command's token comes from ----


def test_a_token_on_the_command_line_works_but_warns_that_ps_shows_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert parse(["stream", "list", "--token", "se1.typed"]).token == "se1.typed"
    assert "visible to other users" in capsys.readouterr().err


def test_a_token_from_a_file_or_the_environment_is_taken_silently(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "se1.from-env")
    assert parse(["stream", "list"]).token == "se1.from-env"
    token_file = tmp_path / "token"
    token_file.write_text("se1.from-file\n")
    assert parse(["stream", "list", "--token-file", str(token_file)]).token == "se1.from-file"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("contents", "told"), [(None, "cannot read"), ("", "is empty"), ("\n", "is empty")]
)
def test_a_token_file_that_holds_no_token_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, contents: str | None, told: str
) -> None:
    token_file = tmp_path / "token"
    if contents is not None:
        token_file.write_text(contents)
    with pytest.raises(SystemExit) as exited:
        parse(["stream", "list", "--token-file", str(token_file)])
    assert exited.value.code == 2
    assert told in capsys.readouterr().err


def test_a_token_and_a_token_file_together_are_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["stream", "list", "--token", "a", "--token-file", str(tmp_path / "t")])
    assert exited.value.code == 2


# ---- a bounded tail's give-up time ----


def test_tail_takes_its_give_up_time_and_refuses_one_within_a_replicas_silence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse(["tail", "t/s", "--give-up-after", "5"]).give_up_after == 5.0
    assert parse(["tail", "t/s"]).give_up_after is None
    for bad in ("4", "x", "inf"):
        with pytest.raises(SystemExit):
            parse(["tail", "t/s", "--give-up-after", bad])
        err = capsys.readouterr().err
        assert "argument --give-up-after" in err and "Traceback" not in err, err
