"""The harness's `wait_for`: an error of the condition is polled through until the
deadline, except `Hopeless`, which ends the wait at once (a server that exited while a
fault run's heal waited for it held the run 20 s: S12's store with a damaged disk)."""

from __future__ import annotations

import time

import pytest

from streamengine.testing.waiting import Hopeless, wait_for


def test_a_passing_error_is_polled_through_until_the_condition_holds() -> None:
    calls = []

    def condition() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return True

    assert wait_for(condition, timeout_s=5, interval_s=0.001)
    assert len(calls) == 3


def test_a_hopeless_condition_ends_the_wait_at_once() -> None:
    calls = []

    def condition() -> bool:
        calls.append(1)
        raise Hopeless("store1 exited with 1")

    started = time.monotonic()
    with pytest.raises(Hopeless, match="store1 exited"):
        wait_for(condition, timeout_s=30, interval_s=0.001)
    assert calls == [1]
    assert time.monotonic() - started < 5


def test_an_error_until_the_deadline_is_named_in_the_timeout() -> None:
    def condition() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(TimeoutError, match="refused"):
        wait_for(condition, timeout_s=0.05, interval_s=0.001)
