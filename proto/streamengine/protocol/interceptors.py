"""Server interceptors shared by the master and the stores.

`MalformedRequests`: a request whose bytes do not parse as its message is answered
INVALID_ARGUMENT, saying so, like any other bad input. Left to grpc-core, the failed
parse escapes as an unhandled error: UNKNOWN to the caller and a traceback in the log
per request, which any stranger could fill the log with.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    """What a request that did not parse becomes, for the handler to refuse."""

    def __init__(self, error: DecodeError) -> None:
        self.reason = f"malformed request: {error}"


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as error:
            return _Malformed(error)

    return parse


async def _checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        yield request


class MalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        parse = _lenient(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _one_request(handler.unary_unary), parse, serialize
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _one_request(handler.unary_stream), parse, serialize
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _request_stream(handler.stream_stream), parse, serialize
            )
        assert handler.stream_unary is not None
        return grpc.stream_unary_rpc_method_handler(
            _request_stream(handler.stream_unary), parse, serialize
        )


# A handler either yields its replies (an async generator) or returns (a coroutine
# that answers, or writes its replies with `context.write`): grpc.aio tells them apart by
# their kind, so each wrapper keeps the kind of what it wraps.


def _one_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def replies(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async for reply in behavior(request, context):
                yield reply

        return replies

    async def answer(request: Any, context: Any) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await behavior(request, context)

    return answer


def _request_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def replies(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for reply in behavior(_checked(requests, context), context):
                yield reply

        return replies

    async def answer(requests: AsyncIterator[Any], context: Any) -> Any:
        return await behavior(_checked(requests, context), context)

    return answer
