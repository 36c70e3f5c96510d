"""What a batch of writers' calls at the master must answer: for each entry, what its
lone call, made after the entries before it, answers (tests/unit/test_roll_batches.py,
tests/unit/test_seal_batches.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from streamengine.master.core.errors import MasterError

Answer = TypeVar("Answer")


def assert_answered_as_alone(answer: Answer | MasterError, alone: Callable[[], Answer]) -> None:
    """`answer` (a batch's, for one entry) is what `alone` (its lone call) returns, or
    the same refusal it raises."""
    try:
        expected: Answer | MasterError = alone()
    except MasterError as error:
        expected = error
    if isinstance(expected, MasterError):
        assert type(answer) is type(expected) and str(answer) == str(expected)
    else:
        assert answer == expected
