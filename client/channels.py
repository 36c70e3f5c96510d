"""One shared pool of gRPC channels per client."""

from __future__ import annotations

import grpc

from streamengine.protocol.channels import CLIENT_OPTIONS


class ChannelPool:
    """One asyncio channel per address, created on first use, closed together."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
