"""A stream whose acked events no store can serve (issue #36, item 0): events appended
and acked, then every store SIGSTOPped, hanging with its sockets open; the stores are
continued when the block ends, whatever happened in it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from streamengine.client import StreamClient
from streamengine.testing import Cluster

# A bounded read of paused stores must raise within this: it gives up on its replicas
# 10 s after its start (`FollowerTiming.unreachable_read_ms`), once it has asked every
# one: for the open segment's acked end, again each second (each ask 2 s at most);
# for its events, leaving each hanging replica after 4 s of silence.
READ_RAISES_S_MAX = 30.0
# The reads' own give-up time (`give_up_after_s`, `tail --give-up-after`): what a read to
# the acked end waits for an answer before it raises (by default 10 s). A read to a given
# end leaves the three hanging replicas one after another (`silent_replica_ms` each).
GIVE_UP_AFTER_S = 5.0


@dataclass(frozen=True)
class PausedStream:
    name: str
    last_sequence: int  # of the last acked event
    stores: tuple[str, ...]  # the open segment's copy set


@asynccontextmanager
async def acked_then_paused(
    cluster: Cluster, client: StreamClient, name: str, events: int = 100
) -> AsyncIterator[PausedStream]:
    await client.create_stream(name)
    async with client.writer(name) as writer:
        sequences = await writer.append_batch([f"{name}-{i}".encode() for i in range(events)])
    listed = await client.list_segments(name)
    stores = tuple(replica.address for replica in listed[-1].copy_set)
    for store in cluster.stores:
        store.stop()
    try:
        yield PausedStream(name, sequences[-1], stores)
    finally:
        for store in cluster.stores:
            store.cont()
