"""A client's lease session renews every lease bound to it in one call per interval:
idle leaders send no heartbeat of their own (docs/design.md, "Lease sessions")."""

from __future__ import annotations

import asyncio
import contextlib

from streamengine.client import StreamClient
from streamengine.client.core.writer import SESSION_BOUND_HEARTBEAT_MS, Role
from streamengine.client.types import SegmentState
from streamengine.protocol.clock import monotonic_ms
from streamengine.testing import Cluster, wait_until

STREAMS = 40
# Renewals waited for: each a lease/3 apart, so two leases pass.
RENEWALS = 6


async def test_idle_leaders_are_renewed_by_their_session_alone(cluster: Cluster) -> None:
    async with StreamClient(cluster.master_address) as client:
        names = [f"acme/idle{n}" for n in range(STREAMS)]
        await client.create_streams(names)
        async with contextlib.AsyncExitStack() as stack:
            writers = [await stack.enter_async_context(client.writer(name)) for name in names]
            for writer in writers:
                await writer.append(b"before")
            session = client._leases
            assert session is not None

            async def all_bound() -> bool:
                return all(w._core.session_incarnation for w in writers)

            await wait_until(all_bound, timeout_s=10, message="every lease bound")
            own_before, renewals_before = session.entries_sent, session.renewals_sent

            async def renewed_a_while() -> bool:
                return session.renewals_sent >= renewals_before + RENEWALS

            await wait_until(renewed_a_while, timeout_s=30, message="the session renewing")
            elapsed_ms = RENEWALS * 2000 // 3
            assert elapsed_ms < SESSION_BOUND_HEARTBEAT_MS
            assert session.entries_sent == own_before, "no writer heartbeated on its own"
            now = monotonic_ms()
            for writer in writers:
                assert writer._core.role is Role.LEADING
                assert writer._core.lease_until_ms > now, "renewed by the session"
            for writer in writers:
                await writer.append(b"after")


async def test_recoveries_of_many_streams_seal_at_the_master_in_batches(cluster: Cluster) -> None:
    """A process taking over many streams recovers their open segments at once: their
    seals at the master go as a few `SealSegments` calls, each answered as its own
    `SealSegment` (issue #38), and every stream is led and appended to after."""
    names = [f"acme/taken{n}" for n in range(STREAMS)]
    async with StreamClient(cluster.master_address) as client:
        await client.create_streams(names)
        async with contextlib.AsyncExitStack() as stack:
            writers = [await stack.enter_async_context(client.writer(name)) for name in names]
            for writer in writers:
                await writer.append(b"left open")  # the next leader seals it
    async with StreamClient(cluster.master_address) as client, contextlib.AsyncExitStack() as stack:
        writers = list(
            await asyncio.gather(*(stack.enter_async_context(client.writer(n)) for n in names))
        )

        async def all_recovered() -> bool:
            return all(not w._core.recovering for w in writers)

        await wait_until(all_recovered, timeout_s=30, message="every segment recovered")
        session = client._leases
        assert session is not None
        seals = session.seals
        assert seals.entries_sent >= STREAMS and seals.lone_sent == 0, vars(seals)
        assert seals.batches_sent < seals.entries_sent, "some batch carried several seals"
        for writer in writers:
            await writer.append(b"after")
        for name in names:
            first, *_ = await client.list_segments(name)
            assert first.state is SegmentState.SEALED and first.final_index == 2, first
