"""The SegmentStore gRPC service: a thin adapter from the wire to `SegmentStoreCore`,
composed of one handler object per group of calls over one shared `StoreContext`:

- `writes.WriteCalls`: Seal (the writer's; Write is served on the data port,
  `data_plane.py`);
- `reads.ReadCalls`: Digest (Read is served on the data port, `data_plane.py`);
- `tail.TailCalls`: Subscribe;
- `catalog.CatalogCalls`: GetSegmentState, ListSegmentRecords, Delete, CopySegment.

gRPC serves one handler per service: `add_to_server` builds it from the groups' methods,
each wired with its messages and streaming kind as the service's descriptor declares
them, and asserts that every RPC of the service has exactly one handler. Every mutation
goes through the group committer; reads run in worker threads. One table
(`refusals.STATUS`) maps the store's errors to gRPC statuses; a refused request changes
nothing.

A streaming call (Subscribe) is admitted when it opens, before any of its
messages is read (`_admitted_at_open`): its caller proven from the call's metadata and
counted against its share (`StoreContext.open_stream`); its behaviour then takes that
caller as a third argument and authorizes each request with it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass

from streamengine.protocol.auth import Principal
from streamengine.segment_store.catalog import CatalogCalls
from streamengine.segment_store.core.errors import StoreError
from streamengine.segment_store.reads import ReadCalls
from streamengine.segment_store.refusals import abort
from streamengine.segment_store.store_context import StoreContext
from streamengine.segment_store.tail import TailCalls
from streamengine.segment_store.writes import WriteCalls
from streamengine.v1 import segment_store_pb2

if TYPE_CHECKING:
    # grpcio's stubs make it generic; the runtime class is not subscriptable.
    Handler = grpc.RpcMethodHandler[Any, Any]

SERVICE = segment_store_pb2.DESCRIPTOR.services_by_name["SegmentStore"]

# Each streaming kind (requests streamed, replies streamed) and how grpc wraps it.
_HANDLER_OF_KIND = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def method_behaviours(store: StoreContext) -> dict[str, Callable[..., Any]]:
    """Each RPC's name -> the method of its group that serves it."""
    groups = (WriteCalls(store), ReadCalls(store), TailCalls(store), CatalogCalls(store))
    behaviours: dict[str, Callable[..., Any]] = {}
    for group in groups:
        for name, behaviour in group.methods().items():
            assert name not in behaviours, f"{name} is served by two groups"
            behaviours[name] = behaviour
    assert behaviours.keys() == set(SERVICE.methods_by_name), "every RPC has one handler"
    return behaviours


def add_to_server(store: StoreContext, server: grpc.aio.Server) -> None:
    """Serve the SegmentStore service on `server`."""
    handlers = _method_handlers(store, method_behaviours(store))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _method_handlers(
    store: StoreContext, behaviours: Mapping[str, Callable[..., Any]]
) -> dict[str, Handler]:
    handlers = {}
    for name, behaviour in behaviours.items():
        method = SERVICE.methods_by_name[name]
        if method.client_streaming or method.server_streaming:
            behaviour = _admitted_at_open(store, behaviour)
        handlers[name] = _method_handler(method, behaviour)
    return handlers


async def _open(store: StoreContext, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
    try:
        return store.open_stream(context)
    except StoreError as error:
        await abort(context, error)


def _admitted_at_open(store: StoreContext, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A streaming behaviour `(request, context, caller)` served as grpc calls it, once
    its caller is admitted (module doc), of the same kind: an async generator (yields
    replies) or a coroutine (writes them to the context)."""
    if inspect.isasyncgenfunction(behaviour):

        async def generator(request: Any, context: Any) -> AsyncIterator[Any]:
            caller = await _open(store, context)
            try:
                async for reply in behaviour(request, context, caller):
                    yield reply
            finally:
                store.close_stream(caller)

        return generator

    async def coroutine(request: Any, context: Any) -> Any:
        caller = await _open(store, context)
        try:
            return await behaviour(request, context, caller)
        finally:
            store.close_stream(caller)

    return coroutine


def _method_handler(method: MethodDescriptor, behaviour: Callable[..., Any]) -> Handler:
    make = _HANDLER_OF_KIND[(method.client_streaming, method.server_streaming)]
    handler: Handler = make(
        behaviour,
        request_deserializer=GetMessageClass(method.input_type).FromString,
        response_serializer=GetMessageClass(method.output_type).SerializeToString,
    )
    return handler
