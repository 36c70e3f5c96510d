"""One shared pool of gRPC channels per client, and of its data-plane connections."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from streamengine.client.data_connections import DataConnections
from streamengine.client.errors import StreamEngineError
from streamengine.protocol.framed import ClientCall
from streamengine.protocol.framing import Method
from streamengine.protocol.transport import PLAINTEXT, Transport


class ChannelPool:
    """One asyncio channel per address, created on first use with the client's
    transport (plaintext, or TLS with its CA, certificate and token), closed together.

    `dial` translates addresses as the cluster advertises them (the master's, the
    stores' registered ones) into the addresses this process reaches them at: a client
    behind NAT or a port forward, or one whose traffic to a store goes through a proxy.
    Addresses it does not name are dialled as they are."""

    def __init__(
        self, transport: Transport = PLAINTEXT, dial: Mapping[str, str] | None = None
    ) -> None:
        self.transport = transport
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._data = DataConnections(transport)
        self._dial = dict(dial or {})
        self.closed = False

    def get(self, address: str) -> grpc.aio.Channel:
        self.check_open()
        channel = self._channels.get(address)
        if channel is None:
            channel = self.transport.aio_channel(self.dial(address))
            self._channels[address] = channel
        return channel

    async def data_call(self, data_address: str, method: Method) -> ClientCall:
        """A request of `method` on this client's connection to the store's data port
        at `data_address` (as the cluster advertises it). Raises CallError."""
        self.check_open()
        return await self._data.call(self.dial(data_address), method)

    def dial(self, address: str) -> str:
        """Where this process reaches `address` as the cluster advertises it."""
        return self._dial.get(address, address)

    def check_open(self) -> None:
        """Raise `StreamEngineError` once closed: what a writer's or reader's call meets
        after its client closed."""
        if self.closed:
            raise StreamEngineError("the StreamClient is closed")

    async def close(self) -> None:
        self.closed = True
        await self._data.close()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
