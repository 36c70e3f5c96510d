"""One shared pool of gRPC channels per client."""

from __future__ import annotations

import grpc

from streamengine.protocol.transport import PLAINTEXT, Transport


class ChannelPool:
    """One asyncio channel per address, created on first use with the client's
    transport (plaintext, or TLS with its CA, certificate and token), closed together."""

    def __init__(self, transport: Transport = PLAINTEXT) -> None:
        self.transport = transport
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self.transport.aio_channel(address)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
