"""`bench.append_floor`: the quorum count of its bare exchange, and the exchange itself
over both transports against real server processes (each syncing a RocksDB write)."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest

from bench import append_floor
from bench.append_floor import (
    QUORUM,
    SERVERS,
    WARM_UP,
    ExchangeQuorum,
    serve_floor,
    timed_exchanges,
)
from streamengine.segment_store.kv import RocksKV
from streamengine.testing import free_port

SERVER_START_S = 30.0


@pytest.mark.parametrize(
    ("answers", "acked"),
    [
        ([], False),
        ([0], False),
        ([0, 0], False),  # one server answering twice is still one holder
        ([0, 2], True),
        ([2, 1, 0], True),
    ],
    ids=["none", "one", "one-twice", "two", "three"],
)
def test_an_exchange_is_acked_by_the_quorum_th_server_to_answer_it(
    answers: list[int], acked: bool
) -> None:
    assert (SERVERS, QUORUM) == (3, 2)

    async def run() -> bool:
        quorum = ExchangeQuorum()
        sent: list[bytes] = []
        exchange = asyncio.ensure_future(quorum.exchange(sent.append, b"x"))
        await asyncio.sleep(0)
        for server in answers:
            quorum.answer(server)
        await asyncio.sleep(0)
        done = exchange.done()
        exchange.cancel()
        assert sent == [b"x"]
        return done

    assert asyncio.run(run()) is acked


def test_the_late_answer_of_the_last_exchange_does_not_ack_the_next() -> None:
    async def run() -> None:
        quorum = ExchangeQuorum()
        first = asyncio.ensure_future(quorum.exchange(lambda _: None, b"1"))
        await asyncio.sleep(0)
        quorum.answer(0)
        quorum.answer(1)
        await first
        second = asyncio.ensure_future(quorum.exchange(lambda _: None, b"2"))
        await asyncio.sleep(0)
        quorum.answer(2)  # the first exchange's third answer
        quorum.answer(0)
        await asyncio.sleep(0)
        assert not second.done()
        quorum.answer(2)
        await asyncio.wait_for(second, 1)

    asyncio.run(run())


def test_an_exchange_no_quorum_answers_stops_the_run_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(append_floor, "EXCHANGE_TIMEOUT_S", 0.05)

    async def run() -> None:
        quorum = ExchangeQuorum()
        exchange = asyncio.ensure_future(quorum.exchange(lambda _: None, b"x"))
        await asyncio.sleep(0)
        quorum.answer(1)  # one of three: no quorum
        await exchange

    with pytest.raises(RuntimeError, match=r"exchange 1 not acked by 2 servers.*\[0, 1, 0\]"):
        asyncio.run(run())


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_the_exchange_runs_against_three_syncing_servers(transport: str, tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ports = [free_port() for _ in range(SERVERS)]
    servers = []
    try:
        for number, port in enumerate(ports):
            ready = context.Event()
            server = context.Process(
                target=serve_floor, args=(transport, port, str(tmp_path / str(number)), ready)
            )
            server.start()
            servers.append(server)
            assert ready.wait(SERVER_START_S), f"{transport} server {number} did not start"
        measured = asyncio.run(timed_exchanges(transport, ports, float("inf"), 20, lambda: 0.0))
    finally:
        for server in servers:
            server.kill()
            server.join(10)
    assert 0 < measured.p50_ms <= measured.p99_ms
    # What the servers acknowledged survived their SIGKILL: every exchange is held by a
    # quorum of them. The third server is not waited for, so on a loaded machine it may
    # be any number of exchanges behind when it is killed.
    sent = WARM_UP + 20
    held = []
    for number in range(SERVERS):
        kv = RocksKV(tmp_path / str(number))
        held.append(len(kv.scan(b"", b"\xff" * 9)))
        kv.close()
    assert sorted(held)[-QUORUM:] == [sent] * QUORUM, held
