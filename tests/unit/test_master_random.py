"""Random schedules against the master's state over each metadata back end, with restarts.

Each seed drives writers (heartbeat, roll, seal, release), store deaths and master
restarts on a virtual clock, and checks after every step:
- epochs handed out strictly increase, across restarts (invariant 5);
- at most two unsealed segments per stream (invariant 5);
- no two clients ever hold leases that overlap on the master's clock, a restart
  included (the start-up window);
- what a restart loads equals what was in memory.
Reproduce a failure with its seed: `pytest -k 'test_random_schedule and SEED'`.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from streamengine.master.core.errors import MasterError
from streamengine.master.core.model import SegmentState
from streamengine.master.state import MasterState
from streamengine.protocol.limits import UNSEALED_SEGMENTS_MAX
from tests.metadata_backends import MetadataPlace
from tests.unit.lease_helpers import fixed_secrets, writer

LEASE = 1000
TIMEOUT = 3000
CLIENTS = ["w0", "w1", "w2"]
STORES = ["s0", "s1", "s2", "s3"]
STEPS = 150


class World:
    def __init__(self, place: MetadataPlace, seed: int):
        self.place = place
        self.rng = random.Random(seed)
        self.now = 1_000_000
        self.catalog = place.open()
        self.state = fixed_secrets(MasterState(self.catalog, self.now, LEASE, TIMEOUT))
        self.dead: set[str] = set()
        self.epochs_seen: list[int] = []
        # Leases as granted or renewed: (client, epoch, from_ms, until_ms).
        self.leases: list[tuple[str, int, int, int]] = []
        self.known_epoch = dict.fromkeys(CLIENTS, 0)
        for sid in STORES:
            self.state.registry.register_store(
                sid, f"127.0.0.1:{STORES.index(sid) + 1}", "", 0, self.now
            )
        self.state.tenancy.create_stream("t/s", 3, 2, 0, 0, True, self.now)

    def stores_beat(self) -> None:
        for sid in STORES:
            if sid not in self.dead:
                self.state.registry.store_heartbeat(sid, 0, 0, {}, self.now)

    def step(self) -> None:
        self.now += self.rng.choice([1, 50, 200, 400, LEASE])
        self.stores_beat()
        action = self.rng.choice(
            ["beat"] * 6 + ["roll", "seal", "release", "kill", "revive", "restart"]
        )
        client = self.rng.choice(CLIENTS)
        with contextlib.suppress(MasterError):
            getattr(self, action)(client)

    def _record(self, client: str, epoch: int) -> None:
        if not self.epochs_seen or epoch != self.epochs_seen[-1]:
            assert not self.epochs_seen or epoch > self.epochs_seen[-1], (self.epochs_seen, epoch)
            self.epochs_seen.append(epoch)
        self.leases.append((client, epoch, self.now, self.now + LEASE))
        self.known_epoch[client] = epoch

    def beat(self, client: str) -> None:
        view = self.state.leadership.writer_heartbeat(
            "t/s", writer(client), self.known_epoch[client], 0, 0, self.now
        )
        if view.leads:
            self._record(client, view.lease.epoch)
        else:
            self.known_epoch[client] = 0

    def roll(self, client: str) -> None:
        view = self.state.leadership.roll_segment(
            "t/s", writer(client), self.known_epoch[client], [], self.now
        )
        self._record(client, view.lease.epoch)

    def seal(self, client: str) -> None:
        epoch = self.known_epoch[client]
        unsealed = [s for s in self.state.unsealed(1) if s.epoch < epoch]
        if unsealed:
            self.state.integrity.seal_segment(
                "t/s", unsealed[0].epoch, epoch, self.rng.randint(1, 9), self.now
            )

    def release(self, client: str) -> None:
        if self.state.leadership.release_lease(
            "t/s", writer(client), self.known_epoch[client], self.now
        ):
            # The lease ends now: cut the recorded one short.
            c, e, start, _ = self.leases[-1]
            self.leases[-1] = (c, e, start, self.now)
            self.known_epoch[client] = 0

    def kill(self, _: str) -> None:
        if len(self.dead) < 1:
            self.dead.add(self.rng.choice(STORES))

    def revive(self, _: str) -> None:
        self.dead.clear()

    def restart(self, _: str) -> None:
        before = (dict(self.state.streams), dict(self.state.segments), dict(self.state.stores))
        self.catalog = self.place.open()
        self.state = fixed_secrets(MasterState(self.catalog, self.now, LEASE, TIMEOUT))
        after = (dict(self.state.streams), dict(self.state.segments), dict(self.state.stores))
        assert after == before, "a restart loads exactly what was answered"

    def check(self) -> None:
        assert len(self.state.unsealed(1)) <= UNSEALED_SEGMENTS_MAX
        states = [s.state for s in self.state.stream_segments(1)]
        assert states.count(SegmentState.OPEN) <= 1
        # Leases of different clients never overlap (a holder renewing is one lease).
        last_until: dict[str, int] = {}
        for client, _, start, until in sorted(self.leases, key=lambda lease: lease[2]):
            for other, other_until in last_until.items():
                assert other == client or start >= other_until, (client, start, other, other_until)
            last_until[client] = max(last_until.get(client, 0), until)


@pytest.mark.parametrize("seed", range(4))
def test_random_schedule(metadata_place: MetadataPlace, seed: int) -> None:
    world = World(metadata_place, seed)
    for _ in range(STEPS):
        world.step()
        world.check()
    assert len(world.epochs_seen) > 3, "the schedule exercised grants"
