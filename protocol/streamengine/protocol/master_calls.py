"""Master calls that follow the active master, for the SDK, the stores and the tools.

`AsyncMasters(...).stub` and `SyncMasters(...).stub` stand in for a `MasterStub`: the
same methods, called the same way (`await stub.WriterHeartbeat(request, timeout=...)`).
Each call goes to the master that answered last. When that one answers UNAVAILABLE
(a standby, naming the active master or not; a master that is down), the call goes on
at once to the master `masters.next_master` picks, within the call's own timeout and
at most `masters.attempts_per_call` masters; the last error is raised as it is, so the
caller's own retry policy (heartbeat schedule, `protocol.backoff`) applies as before.
A master that does not answer in time is left for the next call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, cast

import grpc

from streamengine.protocol.masters import attempts_per_call, next_master, parse_masters
from streamengine.protocol.status import ACTIVE_MASTER_METADATA_KEY
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.v1 import master_pb2_grpc

# After these the next call goes to another master; after UNAVAILABLE this one too.
_SWITCH_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def active_hint(error: grpc.RpcError) -> str:
    """The active master a standby named in its answer, or ""."""
    trailing = getattr(error, "trailing_metadata", None)
    pairs = trailing() if callable(trailing) else None
    for key, value in pairs or ():
        if key == ACTIVE_MASTER_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


class _Masters:
    """The list, and the master calls go to now."""

    def __init__(self, masters: str | tuple[str, ...]) -> None:
        self.masters = parse_masters(masters) if isinstance(masters, str) else masters
        self.current = self.masters[0]

    def after_failure(self, address: str, error: grpc.RpcError) -> str | None:
        """Where the next call goes after `address` failed with `error`; the address to
        try now within this call, or None."""
        code = error.code()
        if code not in _SWITCH_CODES:
            return None
        following = next_master(self.masters, address, active_hint(error))
        if self.current == address:
            self.current = following
        if code != grpc.StatusCode.UNAVAILABLE or following == address:
            return None
        return following


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class AsyncMasters(_Masters):
    def __init__(
        self, masters: str | tuple[str, ...], channel: Callable[[str], grpc.aio.Channel]
    ) -> None:
        super().__init__(masters)
        self._channel = channel

    @property
    def stub(self) -> master_pb2_grpc.MasterAsyncStub:
        return cast("master_pb2_grpc.MasterAsyncStub", _AsyncStub(self))

    def held_open(self) -> master_pb2_grpc.MasterAsyncStub:
        """A plain stub on the master last seen active, for a call held open: it does
        not follow another master (its caller opens it again, here, when it ends)."""
        return master_pb2_grpc.MasterStub(self._channel(self.current))

    async def call(
        self, method: str, request: Any, timeout_s: float | None, **kwargs: Any
    ) -> tuple[Any, grpc.aio.UnaryUnaryCall[Any, Any]]:
        """The reply, and the call of the master that answered (its trailing metadata)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        address = self.current
        for attempt in range(attempts_per_call(self.masters)):
            stub = master_pb2_grpc.MasterStub(self._channel(address))
            call = getattr(stub, method)(request, timeout=_remaining(deadline), **kwargs)
            try:
                reply = await call
            except grpc.aio.AioRpcError as error:
                following = self.after_failure(address, error)
                last = attempt + 1 == attempts_per_call(self.masters)
                if following is None or last or _remaining(deadline) == 0.0:
                    raise
                address = following
                continue
            self.current = address
            return reply, call
        raise AssertionError("unreachable: the last attempt returns or raises")


class SyncMasters(_Masters):
    def __init__(self, masters: str | tuple[str, ...], channel: Callable[[str], grpc.Channel]):
        super().__init__(masters)
        self._channel = channel

    @property
    def stub(self) -> master_pb2_grpc.MasterStub:
        return cast("master_pb2_grpc.MasterStub", _SyncStub(self))

    def call(self, method: str, request: Any, timeout: float | None, **kwargs: Any) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        address = self.current
        for attempt in range(attempts_per_call(self.masters)):
            stub = master_pb2_grpc.MasterStub(self._channel(address))
            try:
                reply = getattr(stub, method)(request, timeout=_remaining(deadline), **kwargs)
            except grpc.RpcError as error:
                following = self.after_failure(address, error)
                last = attempt + 1 == attempts_per_call(self.masters)
                if following is None or last or _remaining(deadline) == 0.0:
                    raise
                address = following
                continue
            self.current = address
            return reply
        raise AssertionError("unreachable: the last attempt returns or raises")


@contextmanager
def sync_masters(masters: str, transport: Transport = PLAINTEXT) -> Iterator[SyncMasters]:
    """`SyncMasters` over channels of its own (plaintext, or TLS as `transport` says),
    closed on exit (tools, Spark planning)."""
    channels: dict[str, grpc.Channel] = {}

    def channel(address: str) -> grpc.Channel:
        if address not in channels:
            channels[address] = transport.channel(address)
        return channels[address]

    try:
        yield SyncMasters(masters, channel)
    finally:
        for open_channel in channels.values():
            open_channel.close()


class _FollowingCall:
    """What a `MasterStub` method returns, as far as callers use it: awaited once for
    the reply, then asked for the trailing metadata of the master that answered."""

    def __init__(
        self,
        masters: AsyncMasters,
        method: str,
        request: Any,
        timeout_s: float | None,
        **kwargs: Any,
    ) -> None:
        # Started when awaited (a call never awaited leaves no coroutine behind).
        self._masters, self._method, self._request = masters, method, request
        self._timeout_s, self._kwargs = timeout_s, kwargs
        self._answered: grpc.aio.UnaryUnaryCall[Any, Any] | None = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._reply().__await__()

    async def _reply(self) -> Any:
        reply, self._answered = await self._masters.call(
            self._method, self._request, self._timeout_s, **self._kwargs
        )
        return reply

    async def trailing_metadata(self) -> Any:
        assert self._answered is not None, "awaited first"
        return await self._answered.trailing_metadata()


class _AsyncStub:
    """Any `MasterStub` method, called through `AsyncMasters.call`."""

    def __init__(self, masters: AsyncMasters) -> None:
        self._masters = masters

    def __getattr__(self, method: str) -> Callable[..., _FollowingCall]:
        if method.startswith("_"):
            raise AttributeError(method)

        # `timeout` as gRPC's stubs name it: callers cannot tell this stub from one.
        def call(request: Any, timeout: float | None = None, **kwargs: Any) -> _FollowingCall:
            return _FollowingCall(self._masters, method, request, timeout, **kwargs)

        return call


class _SyncStub:
    """Any `MasterStub` method, called through `SyncMasters.call`."""

    def __init__(self, masters: SyncMasters) -> None:
        self._masters = masters

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)

        def call(request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
            return self._masters.call(method, request, timeout, **kwargs)

        return call
