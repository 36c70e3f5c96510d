"""One client leading hundreds of streams through a master that stutters (issue #38):
no stream is granted more than one epoch, since no writer but the one leads it.

A stuttering master (SIGSTOP for longer than a lease, then a moment's run, again and
again) is what a master too loaded to answer in time looks like: every lease runs out
between two runs, and each run decides heartbeats that sat unread in its socket, with
a deadline counted from when it reads them. Before the fix a writer's own heartbeats,
sent as a follower before its grant's answer came, were granted the next epoch there
(and again, each grant with a secret the writer never saw), and grants answered after
the writer's call gave up reached nobody: two to four epochs per stream here. Once
late grants reached their writers, a clean-clone run on a loaded machine still saw
every stream granted twice: the master decided the batched grants after even the
call's grace had run out. Now each writer draws its lease secret and shows it from its
first heartbeat, so its next heartbeat after a lost answer proves the grant is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from pathlib import Path

import pytest

from streamengine.client import StreamClient
from streamengine.client.writer import Writer
from streamengine.testing import ServerProcess, running_cluster, wait_until

STREAMS = 300
LEASE_MS = 1000
# Each pause outlasts a lease; each run is too short to answer everything queued.
PAUSE_S = 1.3
RUN_S = 0.05
PAUSES = 3
CONCURRENT_CREATES = 100
STORE_TIMEOUT_MS = 30_000


def stutter(master: ServerProcess, done: threading.Event) -> None:
    try:
        for _ in range(PAUSES):
            master.stop()
            time.sleep(PAUSE_S)
            master.cont()
            time.sleep(RUN_S)
    finally:
        master.cont()
        done.set()


async def test_a_stuttering_master_grants_each_stream_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    names = [f"churn/s{number:04d}" for number in range(STREAMS)]
    # Stores are not what stutters here: a store judged dead because its heartbeats sat
    # unread in a stopped master (6 s of them, on a loaded machine) would have every
    # writer roll, an epoch each that no grant made (seen once under CI's load).
    master_args = ["--lease-ms", str(LEASE_MS), "--store-timeout-ms", str(STORE_TIMEOUT_MS)]
    caplog.set_level(logging.INFO, logger="streamengine.client.writer")
    with running_cluster(tmp_path, master_args=master_args, store_args=["--fsync", "never"]) as c:
        async with StreamClient(c.master_address) as client:
            for start in range(0, STREAMS, CONCURRENT_CREATES):
                batch = names[start : start + CONCURRENT_CREATES]
                await asyncio.gather(*(client.create_stream(n, replicas=3) for n in batch))
            done = threading.Event()
            pauses = threading.Thread(target=stutter, args=(c.master, done))
            async with contextlib.AsyncExitStack() as writers_open:
                pauses.start()
                try:
                    writers: list[Writer] = await asyncio.gather(
                        *(
                            writers_open.enter_async_context(
                                client.writer(name, leadership_timeout_s=20)
                            )
                            for name in names
                        )
                    )
                    await wait_until(done.is_set, 2 * PAUSES * PAUSE_S, "the pauses to end")
                finally:
                    await asyncio.to_thread(pauses.join)

                def all_renewed() -> bool:
                    silent = [w.statistics().master_silent_s for w in writers]
                    return all(s is not None and s < LEASE_MS / 1000 for s in silent)

                await wait_until(all_renewed, 3 * LEASE_MS / 1000, "every lease renewed")
                assert [w.stream for w in writers if not w.leading] == []
                rolls = [m for m in caplog.messages if "rolling epoch" in m]
                assert {w.epoch for w in writers} == {1}, rolls[:5]
        grants = re.findall(r'msg="lease granted" stream=(\S+)', c.master.log_path.read_text())
        assert len(grants) == STREAMS, f"{len(grants)} grants for {STREAMS} streams"
