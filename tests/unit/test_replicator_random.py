"""The replicator under random schedules, checked against what stores really hold.

Each seed draws appends, deliveries, busy refusals, broken streams, reconnects and time;
the stores are naive twins (a dict per store; matched = the longest held prefix). After
every step: the acked index never covers an index fewer than W stores hold, never goes
down, and every batch sent carries exactly the appended events at their indexes. Then
the network heals and everything appended must be acked.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from streamengine.client.core.replicator import (
    Acked,
    Append,
    Replicator,
    ReplicatorAction,
    ReplicatorLimits,
    SegmentRef,
    SendWrite,
    StoreConnected,
    StoreDetached,
    StoreDisconnected,
    Tick,
    WriteReplied,
    WritesReplied,
)
from streamengine.protocol.policy import ReplicationPolicy

STORES = ("s1", "s2", "s3")
POLICY = ReplicationPolicy(3, 2)


@dataclass
class TwinStore:
    held: dict[int, bytes] = field(default_factory=dict)
    acked: int = 0
    connected: bool = True
    requests: deque[SendWrite] = field(default_factory=deque)  # sent, not yet handled
    replies: deque[WriteReplied] = field(default_factory=deque)  # handled, not yet read

    prefix: int = 0  # the longest held prefix, advanced as entries arrive

    def matched(self) -> int:
        while self.prefix + 1 in self.held:
            self.prefix += 1
        return self.prefix

    def handle(self, send: SendWrite, busy: bool) -> None:
        if not busy:
            for entry in send.entries:
                self.held[entry.index] = entry.payload
        self.acked = max(self.acked, min(send.acked_index, self.matched()))
        self.replies.append(
            WriteReplied(
                "",
                send.request_id,
                busy,
                self.matched(),
                self.acked,
                send.first_index,
                send.last_index,
            )
        )


class World:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        limits = ReplicatorLimits(
            batch_entries_max=self.rng.choice([1, 3, 16]),
            window_batches=self.rng.choice([1, 2, 8]),
            linger_ms=self.rng.choice([0, 2]),
            unacked_bytes_max=(1 << 20) + 4096,
            retained_bytes_max=(1 << 20) + 4096,
        )
        self.replicator = Replicator(SegmentRef(1, 2, "t/s"), 2, POLICY, STORES, limits)
        self.stores = {name: TwinStore() for name in STORES}
        self.payloads: dict[int, bytes] = {}
        self.now = 0
        self.acked = 0
        self.detached: set[str] = set()
        for name in STORES:
            self.apply(self.replicator.step(0, StoreConnected(name)))

    def apply(self, actions: list[ReplicatorAction]) -> None:
        for action in actions:
            if isinstance(action, SendWrite):
                assert action.store not in self.detached
                indexes = [e.index for e in action.entries]
                if indexes:
                    assert indexes == list(range(action.first_index, action.last_index + 1))
                assert all(self.payloads[e.index] == e.payload for e in action.entries)
                assert action.acked_index <= self.acked
                store = self.stores[action.store]
                assert store.connected
                store.requests.append(action)
            elif isinstance(action, Acked):
                assert action.acked_index > self.acked
                self.acked = action.acked_index
            elif isinstance(action, StoreDetached):
                self.detached.add(action.store)
        self.check()

    def check(self) -> None:
        held_prefixes = sorted((s.matched() for s in self.stores.values()), reverse=True)
        assert self.acked <= held_prefixes[POLICY.write_quorum - 1]
        assert self.replicator.acked_index == self.acked
        assert self.replicator.unacked_bytes <= self.replicator.limits.unacked_bytes_max + 2048

    def step(self, event: object) -> None:
        self.apply(self.replicator.step(self.now, event))  # type: ignore[arg-type]

    def append(self) -> None:
        count = self.rng.randint(1, 5)
        payloads = tuple(self.rng.randbytes(self.rng.randint(0, 40)) for _ in range(count))
        if not self.replicator.room_for(sum(len(p) + 32 for p in payloads)):
            return
        first = self.replicator.last_index + 1
        for offset, payload in enumerate(payloads):
            self.payloads[first + offset] = payload
        self.step(Append(payloads))

    def deliver(self, name: str, busy: bool) -> None:
        store = self.stores[name]
        if store.requests:
            store.handle(store.requests.popleft(), busy)

    def answer(self, name: str) -> None:
        """Read one reply, or (as one message of the store carries many) several as
        one batch."""
        store = self.stores[name]
        count = min(len(store.replies), self.rng.choice([1, 1, 2, 4]))
        replies = tuple(
            dataclasses.replace(store.replies.popleft(), store=name) for _ in range(count)
        )
        if len(replies) == 1:
            self.step(replies[0])
        elif replies:
            self.step(WritesReplied(replies))

    def disconnect(self, name: str) -> None:
        store = self.stores[name]
        if not store.connected:
            return
        # Some requests may still reach the store; their replies are lost either way.
        while store.requests and self.rng.random() < 0.5:
            store.handle(store.requests.popleft(), busy=False)
        store.requests.clear()
        store.replies.clear()
        store.connected = False
        self.step(StoreDisconnected(name))

    def reconnect(self, name: str) -> None:
        store = self.stores[name]
        if not store.connected:
            store.connected = True
            self.step(StoreConnected(name))

    def random_step(self) -> None:
        name = self.rng.choice(STORES)
        roll = self.rng.random()
        if roll < 0.25:
            self.append()
        elif roll < 0.55:
            self.deliver(name, busy=self.rng.random() < 0.1)
        elif roll < 0.8:
            self.answer(name)
        elif roll < 0.85:
            self.disconnect(name)
        elif roll < 0.92:
            self.reconnect(name)
        else:
            self.now += self.rng.choice([1, 5, 25])
            self.step(Tick())

    def heal(self) -> None:
        for name in STORES:
            self.reconnect(name)
        for _ in range(100_000):
            busy = [n for n in STORES if self.stores[n].requests or self.stores[n].replies]
            if not busy:
                deadline = self.replicator.deadline_ms(self.now)
                if deadline is None:
                    return
                self.now = max(self.now + 1, deadline)
                self.step(Tick())
                continue
            name = self.rng.choice(busy)
            self.deliver(name, busy=False)
            self.answer(name)
        raise AssertionError("the replicator did not settle")


@pytest.mark.parametrize("seed", range(200))
def test_random_schedules_ack_only_what_w_stores_hold_and_converge(seed: int) -> None:
    world = World(seed)
    for _ in range(world.rng.randint(50, 400)):
        world.random_step()
    world.heal()
    assert world.acked == world.replicator.last_index
    for name, store in world.stores.items():
        if name not in world.detached:
            assert store.matched() == world.replicator.last_index
            assert all(store.held[i] == world.payloads[i] for i in range(1, store.matched() + 1))
