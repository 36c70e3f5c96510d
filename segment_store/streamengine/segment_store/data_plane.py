"""The store's data port: Write, Read and Subscribe served on the framed protocol
(docs/data-plane.md), beside the gRPC port that serves the rest.

The caller of a connection is known at its hello (`framed_server`), by the same
`Callers` the gRPC calls resolve theirs with, and an anonymous one (TLS, neither a
certificate nor a token) is refused there: nothing on the data plane is open to it, so
it holds nothing past its hello. Each request is then admitted as a gRPC streaming
call was (`_admitted`: `StoreContext.admit_stream`, an anonymous caller refused, each
principal's share counted while it runs) and served by `WriteCalls.write`, which
authorizes each batch by its grant, `ReadCalls.read`, or `TailCalls.subscribe`, which
authorizes each tail by its stream's tenant. What ends a request with a status answers
with the status and metadata its gRPC call ended with (`refusals.refusal_of`).

A Read request is one ReadRequest: each reply goes out as the reader's credit allows
(`ServerCall.send` waits for it), and the next page is read only once the one before is
out, so a reader that grants nothing holds the store to one window of replies and a
page in hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import cast

from streamengine.protocol.auth import ANONYMOUS, Denial, Principal
from streamengine.protocol.entry import CorruptEntry
from streamengine.protocol.framed import CallError
from streamengine.protocol.framed_server import DataServer, ServerCall
from streamengine.protocol.framing import Kind, StatusCode
from streamengine.segment_store import metrics
from streamengine.segment_store.core.errors import StoreError
from streamengine.segment_store.reads import ReadCalls
from streamengine.segment_store.refusals import Refusal, RequestEnds, refusal_of
from streamengine.segment_store.store_context import StoreContext
from streamengine.segment_store.tail import TailCalls
from streamengine.segment_store.writes import WriteCalls
from streamengine.v1 import segment_store_pb2


def data_server(store: StoreContext) -> DataServer:
    """The data port's server for `store` (started by `server.serve`)."""
    writes = WriteCalls(store)
    reads = ReadCalls(store)
    tails = TailCalls(store)

    async def write(call: ServerCall) -> None:
        with _admitted(store, call.principal) as caller:
            try:
                await writes.write(_write_requests(call), call.send, caller)
            except RequestEnds as ended:
                raise call_error(ended.refusal()) from None

    async def read(call: ServerCall) -> None:
        with _admitted(store, call.principal) as caller:
            # The message that opened the request (one ReadRequest; what follows it is
            # the client's End).
            request = cast(segment_store_pb2.ReadRequest, await call.receive())
            try:
                async with contextlib.aclosing(reads.read(request, caller)) as replies:
                    async for reply in replies:
                        await call.send(reply)
            except (StoreError, CorruptEntry) as error:
                raise call_error(refusal_of(error, request.segment)) from None

    async def subscribe(call: ServerCall) -> None:
        with _admitted(store, call.principal) as caller:
            try:
                await tails.subscribe(_subscribe_requests(call), call.send, caller)
            except RequestEnds as ended:
                raise call_error(ended.refusal()) from None

    def authenticate(identity: Principal, token: str | None) -> Principal | Denial:
        principal = store.callers.principal_of(identity, token)
        if principal == ANONYMOUS:
            return Denial("the data plane serves callers who show a certificate or a token")
        return principal

    return DataServer(
        {Kind.WRITE_REQUEST: write, Kind.READ_REQUEST: read, Kind.SUBSCRIBE_REQUEST: subscribe},
        authenticate,
        on_connection=metrics.DATA_CONNECTIONS.inc,
    )


@contextlib.contextmanager
def _admitted(store: StoreContext, principal: Principal) -> Iterator[Principal]:
    """The request's caller, counted against its share while the request runs."""
    try:
        caller = store.admit_stream(principal)
    except StoreError as error:
        raise call_error(refusal_of(error)) from None
    try:
        yield caller
    finally:
        store.close_stream(caller)


async def _write_requests(call: ServerCall) -> AsyncIterator[segment_store_pb2.WriteRequest]:
    async for request in call:
        yield cast(segment_store_pb2.WriteRequest, request)


async def _subscribe_requests(
    call: ServerCall,
) -> AsyncIterator[segment_store_pb2.SubscribeRequest]:
    async for request in call:
        yield cast(segment_store_pb2.SubscribeRequest, request)


def call_error(refusal: Refusal) -> CallError:
    """A refusal as the data plane answers it: gRPC's status code, by number."""
    return CallError(StatusCode(refusal.code.value[0]), refusal.details, dict(refusal.metadata))
