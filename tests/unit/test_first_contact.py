"""The SDK's first call to the master: a TLS disagreement is reported at once, a master
that closed one connection while going away is not taken for one. Against plain sockets
on 127.0.0.1 that close what they accept, as a TLS server does to a plaintext client."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from streamengine.client.errors import Unavailable
from streamengine.client.stream_client import first_contact
from streamengine.protocol import transport


def closing_server(closes: int | None) -> tuple[int, threading.Event]:
    """A listener that reads and closes its first `closes` connections (all with None),
    then stops listening (a master gone: connections are refused)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    done = threading.Event()

    def run() -> None:
        served = 0
        try:
            while closes is None or served < closes:
                connection, _ = listener.accept()
                connection.recv(65536)  # all the client sent: closed, not reset
                connection.close()
                served += 1
        except OSError:
            pass
        finally:
            listener.close()
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1], done


async def contact(port: int) -> None:
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        await first_contact(channel, address, transport.PLAINTEXT)
    finally:
        await channel.close()


async def test_a_server_that_always_closes_the_connection_is_reported_as_tls() -> None:
    port, _ = closing_server(None)
    with pytest.raises(Unavailable, match="serves TLS"):
        await contact(port)


async def test_a_master_that_closed_one_connection_going_away_is_left_to_the_retries() -> None:
    port, gone = closing_server(1)
    await contact(port)  # no error: the calls that follow retry until a master answers
    assert gone.is_set()
