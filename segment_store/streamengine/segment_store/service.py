"""The SegmentStore gRPC service: a thin adapter from the wire to `SegmentStoreCore`,
composed of one handler object per group of calls over one shared `StoreContext`:

- `writes.WriteCalls`: Seal (the writer's; Write is served on the data port,
  `data_plane.py`, and so are Read and Subscribe, `reads.ReadCalls` and
  `tail.TailCalls`);
- `reads.ReadCalls`: Digest;
- `catalog.CatalogCalls`: GetSegmentState, ListSegmentRecords, Delete, CopySegment.

gRPC serves one handler per service: `add_to_server` builds it from the groups' methods,
each wired with its messages and streaming kind as the service's descriptor declares
them, and asserts that every RPC of the service has exactly one handler. Every mutation
goes through the group committer; reads run in worker threads. One table
(`refusals.STATUS`) maps the store's errors to gRPC statuses; a refused request changes
nothing.

Every call here is unary: the streaming ones (Write, Read, Subscribe) are the data
port's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass

from streamengine.segment_store.catalog import CatalogCalls
from streamengine.segment_store.reads import ReadCalls
from streamengine.segment_store.store_context import StoreContext
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
    groups = (WriteCalls(store), ReadCalls(store), CatalogCalls(store))
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
        assert not (method.client_streaming or method.server_streaming), (
            f"{name} streams: streaming calls are the data port's"
        )
        handlers[name] = _method_handler(method, behaviour)
    return handlers


def _method_handler(method: MethodDescriptor, behaviour: Callable[..., Any]) -> Handler:
    make = _HANDLER_OF_KIND[(method.client_streaming, method.server_streaming)]
    handler: Handler = make(
        behaviour,
        request_deserializer=GetMessageClass(method.input_type).FromString,
        response_serializer=GetMessageClass(method.output_type).SerializeToString,
    )
    return handler
