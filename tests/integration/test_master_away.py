"""A leader rides out a master that does not answer (docs/design.md, "Why safety never
rests on the lease"): real master and stores, the master SIGSTOPped under load."""

from __future__ import annotations

import time
from pathlib import Path

from streamengine.client import StreamClient
from streamengine.protocol.sequence import unpack_sequence
from streamengine.testing import running_cluster, wait_until

LEASE_MS = 500
PAUSE_S = 12 * LEASE_MS / 1000
BATCH = 100


async def test_appends_go_on_while_the_only_master_is_paused(tmp_path: Path) -> None:
    name = "away/orders"
    with running_cluster(tmp_path, stores=3, master_args=["--lease-ms", str(LEASE_MS)]) as c:
        async with StreamClient(c.master_address) as client:
            await client.create_stream(name, replicas=3, write_quorum=2)
            async with client.writer(name) as writer:
                epoch = writer.epoch
                appended: list[bytes] = []
                epochs: set[int] = set()  # of the segments the batches went to

                async def append_batch() -> float:
                    """Append one batch; when it was acked."""
                    batch = [b"e-%07d" % (len(appended) + n) for n in range(BATCH)]
                    sequences = await writer.append_batch(batch)
                    epochs.update(unpack_sequence(s)[0] for s in sequences)
                    appended.extend(batch)
                    return time.monotonic()

                for _ in range(10):
                    await append_batch()
                c.master.stop()
                paused_at = last_ack = time.monotonic()
                longest_stall = 0.0
                try:
                    while time.monotonic() - paused_at < PAUSE_S:
                        acked_at = await append_batch()
                        longest_stall = max(longest_stall, acked_at - last_ack)
                        last_ack = acked_at
                    silent = writer.statistics().master_silent_s
                finally:
                    c.master.cont()
                # Twelve lease periods without a master: every append acked, none
                # waited long, and the writer kept its epoch.
                assert silent is not None and silent > PAUSE_S - LEASE_MS / 1000, silent
                assert longest_stall < 1.0, longest_stall
                assert epochs == {epoch} and writer.statistics().role == "leading"
                # Renewals resume: the master answers this writer again. (Waking up, it
                # may find the stores silent for a moment and ask for a roll: the epoch
                # may move on from here.)
                def answered_again() -> bool:
                    silent_s = writer.statistics().master_silent_s
                    return silent_s is not None and silent_s < 1.0

                await wait_until(answered_again, 20, "the master answering the writer again")
                await append_batch()
                assert writer.statistics().role == "leading"
            events = [event.payload async for event in client.read(name)]
            assert events == appended
