"""The SDK knows an event too large by the bound a store attaches to its INVALID_ARGUMENT
(`TOO_LARGE_METADATA_KEY`), never by the words of the status."""

from __future__ import annotations

from typing import Any

import grpc

from streamengine.client.errors import EventTooLarge, InvalidArgument, from_rpc_error
from streamengine.protocol.status import TOO_LARGE_METADATA_KEY


class _Refusal(grpc.RpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._trailing = trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:  # (key, value) pairs, as grpc.aio answers them
        return self._trailing


def test_an_invalid_argument_naming_its_bound_is_event_too_large() -> None:
    bound = ((TOO_LARGE_METADATA_KEY, "1048576"),)
    error = from_rpc_error(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, "entry 3 refused", bound))
    assert isinstance(error, EventTooLarge) and str(error) == "entry 3 refused"


def test_the_words_too_large_alone_are_a_plain_invalid_argument() -> None:
    error = from_rpc_error(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, "batch too large"))
    assert type(error) is InvalidArgument


def test_the_bound_under_another_status_is_not_event_too_large() -> None:
    bound = ((TOO_LARGE_METADATA_KEY, "1048576"),)
    error = from_rpc_error(_Refusal(grpc.StatusCode.UNAVAILABLE, "later", bound))
    assert not isinstance(error, EventTooLarge)
