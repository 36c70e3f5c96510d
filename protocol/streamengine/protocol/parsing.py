"""Requests that do not parse get INVALID_ARGUMENT, on every RPC of every server.

grpcio parses a request before the handler runs; bytes that are not the method's
message make it answer UNKNOWN ("Unexpected DecodeError") and log a traceback at error
level, once per request: no clear status for the sender, and a log anyone can flood
(found by the fault suite's bad-input scenario, S15). `RequestParsing`, a server
interceptor, takes the parsing over: each handler receives raw bytes and parses them
itself, so a request that does not parse ends its call with INVALID_ARGUMENT naming the
method, and one line at info level.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger("streamengine.requests")

Parse = Callable[[bytes], Any]
if TYPE_CHECKING:
    # grpcio's stubs make it generic; the runtime class is not subscriptable.
    Handler = grpc.RpcMethodHandler[Any, Any]


async def _parsed(raw: bytes, parse: Parse, context: grpc.aio.ServicerContext[Any, Any],
                  method: str) -> Any:
    try:
        return parse(raw)
    except DecodeError as error:
        log.info("%s: a request that does not parse (%d bytes): %s", method, len(raw), error)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse: {error}"
        )


async def _each_parsed(raws: AsyncIterator[bytes], parse: Parse,
                       context: grpc.aio.ServicerContext[Any, Any],
                       method: str) -> AsyncIterator[Any]:
    async for raw in raws:
        yield await _parsed(raw, parse, context, method)


def _wrap(handler: Handler, method: str) -> Handler:
    parse = handler.request_deserializer
    serialize = handler.response_serializer
    assert parse is not None
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def behaviour_uu(raw: bytes, context: Any) -> Any:
            return await unary_unary(await _parsed(raw, parse, context, method), context)

        return grpc.unary_unary_rpc_method_handler(behaviour_uu, None, serialize)
    if handler.stream_unary is not None:
        stream_unary: Any = handler.stream_unary

        async def behaviour_su(raws: AsyncIterator[bytes], context: Any) -> Any:
            return await stream_unary(_each_parsed(raws, parse, context, method), context)

        return grpc.stream_unary_rpc_method_handler(behaviour_su, None, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _streaming(handler.unary_stream, lambda raw, context: _parsed(
                raw, parse, context, method)),
            None, serialize)
    assert handler.stream_stream is not None

    async def requests(raws: Any, context: Any) -> Any:
        return _each_parsed(raws, parse, context, method)

    return grpc.stream_stream_rpc_method_handler(
        _streaming(handler.stream_stream, requests), None, serialize)


def _streaming(behaviour: Callable[..., Any],
               request: Callable[[Any, Any], Awaitable[Any]]) -> Callable[..., Any]:
    """A reply-streaming handler fed parsed requests, of the same kind as `behaviour`:
    an async generator (yields replies) or a coroutine (writes them to the context)."""
    if inspect.isasyncgenfunction(behaviour):
        async def generator(raw: Any, context: Any) -> AsyncIterator[Any]:
            async for reply in behaviour(await request(raw, context), context):
                yield reply

        return generator

    async def coroutine(raw: Any, context: Any) -> Any:
        return await behaviour(await request(raw, context), context)

    return coroutine


class RequestParsing(grpc.aio.ServerInterceptor):
    """Every method's requests parsed by its handler, not by grpcio (module doc)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _wrap(handler, handler_call_details.method)
