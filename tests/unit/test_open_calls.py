"""The one counter of calls each principal holds open (`protocol.open_calls`)."""

from __future__ import annotations

import pytest

from streamengine.protocol.auth import ANONYMOUS, INSECURE, Principal, PrincipalKind, Role
from streamengine.protocol.open_calls import OpenCalls

READER = Principal(PrincipalKind.TENANT, "r", "acme", Role.READ, "t-read")
STORE = Principal(PrincipalKind.STORE, "s1")


def test_each_principal_holds_at_most_its_calls_and_gets_them_back_as_they_close() -> None:
    calls = OpenCalls(2)
    assert calls.open(READER) and calls.open(READER)
    assert not calls.open(READER)
    assert calls.held(READER) == 2, "a refused call is not counted"
    assert calls.open(STORE)
    calls.close(READER)
    assert calls.open(READER)
    for _ in range(2):
        calls.close(READER)
    calls.close(STORE)
    assert (calls.held(READER), calls.held(STORE)) == (0, 0)


def test_callers_of_a_server_without_certificates_are_not_counted() -> None:
    calls = OpenCalls(1)
    assert all(calls.open(INSECURE) for _ in range(5))
    calls.close(INSECURE)
    assert calls.held(INSECURE) == 0


def test_an_anonymous_caller_is_refused_before_it_is_counted() -> None:
    with pytest.raises(AssertionError):
        OpenCalls(1).open(ANONYMOUS)
