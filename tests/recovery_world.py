"""One segment's copy set as real store cores over memory, and recovering leaders that
drive `SegmentRecovery` against it one delivered message at a time.

A test decides which in-flight request is delivered next (or lost, or duplicated), so
it can replay RECOVERY-CASES.md's traces step by step. After every change to a store,
`CopySetWorld` checks what the stores serve: an index served twice is served the same (I2),
and what a store served never changes (I4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from streamengine.client.core.recovery import (
    TIMING,
    Action,
    Deposed,
    Done,
    Event,
    MasterSealed,
    ReadAnswered,
    RecoveryFenced,
    RecoveryTiming,
    SealAnswered,
    SealAtMaster,
    SegmentRecovery,
    SendAcked,
    SendRead,
    SendRewrite,
    SendSeal,
    WriteAnswered,
)
from streamengine.client.core.replicator import Tick
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.policy import ReplicationPolicy
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import BelowFence as StoreRefused
from streamengine.segment_store.core.errors import SegmentNotFound
from streamengine.segment_store.kv import MemoryKV
from tests.recovery_notation import entries, notation
from tests.store_commands import CommandedCore


class Violation(AssertionError):
    pass


class CopySetWorld:
    def __init__(self, policy: ReplicationPolicy, names: Sequence[str] = ("A", "B", "C")):
        assert len(names) == policy.replicas
        self.policy = policy
        self.names = tuple(names)
        self.segment = SegmentKey(1, 1)
        self.stores = {n: CommandedCore(MemoryKV()) for n in names}
        # index -> (store, kind, payload) of what some store served there first
        self.served: dict[int, tuple[str, EntryKind, bytes]] = {}
        self.master_final = 0
        self.log: list[str] = []  # what happened, for a failing example's report

    def held(self, store: str) -> list[StoredEntry]:
        try:
            return self.stores[store].reader.read(self.segment, 1)
        except SegmentNotFound:
            return []

    def acked(self, store: str) -> int:
        meta = self.stores[store].catalog.meta(self.segment)
        return meta.acked_index if meta else 0

    def fence(self, store: str) -> int:
        meta = self.stores[store].catalog.meta(self.segment)
        return meta.fence if meta else 0

    def show(self, store: str) -> str:
        """`"e1@2 BR@2 acked=2"`, as the traces print a store (without the fence: the
        model the traces come from fences a store at the first write, a real store only
        when sealed)."""
        return f"{notation(self.held(store))} acked={self.acked(store)}"

    def leader_writes(self, store: str, epoch: int, held: str, acked: int = 0) -> None:
        """The segment's own leader (or an earlier one) wrote these copies to `store`."""
        for e in entries(held):  # one write each: a batch holds consecutive indexes
            self.stores[store].write(self.segment, epoch, acked, [e])
        self.log.append(f"leader {epoch} writes {held} acked={acked} to {store}")
        self.check()

    def check(self) -> None:
        for name in self.names:
            for e in self.held(name):
                if e.index > self.acked(name):
                    break
                first = self.served.setdefault(e.index, (name, e.kind, e.payload))
                if first[1:] != (e.kind, e.payload):
                    raise Violation(
                        f"store {name} serves {_show(e.kind, e.payload)} at index {e.index}; "
                        f"store {first[0]} served {_show(first[1], first[2])} there before"
                    )

    def apply(self, leader_epoch: int, action: Action) -> Event | None:
        """Carry one request to its store (or the master) and return the answer."""
        answer = self._apply(leader_epoch, action)
        self.log.append(f"leader {leader_epoch}: {action} -> {answer}")
        return answer

    def _apply(self, leader_epoch: int, action: Action) -> Event | None:
        seg = self.segment
        try:
            if isinstance(action, SendSeal):
                r = self.stores[action.store].seal(seg, action.new_epoch)
                return SealAnswered(
                    action.store, r.fence, r.acked_index, r.matched_index, r.last_index
                )
            if isinstance(action, SendRead):
                got = self.stores[action.store].reader.read(seg, action.from_index, action.to_index)
                fence = self.fence(action.store)
                return ReadAnswered(
                    action.store, action.from_index, action.to_index, tuple(got), fence
                )
            if isinstance(action, SendRewrite):
                w = self.stores[action.store].write(
                    seg, leader_epoch, action.acked_index, action.entries
                )
                first, last = action.entries[0].index, action.entries[-1].index
                return WriteAnswered(action.store, first, last, w.held_epochs, w.acked_index)
            if isinstance(action, SendAcked):
                w = self.stores[action.store].write(seg, leader_epoch, action.acked_index, [])
                return WriteAnswered(action.store, 0, 0, (), w.acked_index)
        except StoreRefused as refused:
            return RecoveryFenced(getattr(action, "store", ""), refused.fence)
        finally:
            self.check()
        if isinstance(action, SealAtMaster):
            if self.master_final and self.master_final != action.final_index:
                raise Violation(f"sealed at {self.master_final}, now at {action.final_index}")
            self.master_final = action.final_index
            return MasterSealed(action.final_index)
        return None


def _show(kind: EntryKind, payload: bytes) -> str:
    return payload.decode() if kind == EntryKind.EVENT else kind.name


Match = Callable[[Action], bool]


def this(action: Action) -> Match:
    return lambda a: a is action


def seal(store: str) -> Match:
    return lambda a: isinstance(a, SendSeal) and a.store == store


def read(store: str) -> Match:
    return lambda a: isinstance(a, SendRead) and a.store == store


def write(store: str, index: int) -> Match:
    return lambda a: isinstance(a, SendRewrite) and a.store == store and a.entries[0].index == index


def acked(store: str) -> Match:
    return lambda a: isinstance(a, SendAcked) and a.store == store


def at_master() -> Match:
    return lambda a: isinstance(a, SealAtMaster)


class RecoveringLeader:
    """A recovering leader: its operation, its clock (time passes only when a test says
    so: deliveries take none) and the requests it has in flight. A request the operation
    sends again while an equal one is still in flight is not added twice, as a driver
    keeps one call per request."""

    def __init__(
        self,
        world: CopySetWorld,
        epoch: int,
        batch_entries_max: int = 1,
        timing: RecoveryTiming = TIMING,
    ):
        self.world = world
        self.epoch = epoch
        self.now_ms = 0
        self.op = SegmentRecovery(
            world.policy,
            world.segment.epoch,
            epoch,
            world.names,
            batch_entries_max,
            timing,
        )
        self.inflight: list[Action] = []
        self.emitted: list[Action] = []
        self.finished: list[Action] = []  # Done / Deposed
        self._take(self.op.start(self.now_ms))

    def _take(self, actions: Sequence[Action]) -> None:
        self.emitted += actions
        for a in actions:
            if isinstance(a, Done | Deposed):
                self.finished.append(a)
            elif a not in self.inflight:
                self.inflight.append(a)

    def deliver(self, match: Match, keep: bool = False) -> Action:
        """Deliver the first in-flight request `match` accepts and feed back its answer;
        with `keep`, the request stays in flight (it is delivered again later)."""
        for i, a in enumerate(self.inflight):
            if match(a):
                if not keep:
                    del self.inflight[i]
                answer = self.world.apply(self.epoch, a)
                if answer is not None:
                    self._take(self.op.step(self.now_ms, answer))
                return a
        raise AssertionError(f"nothing in flight matches; in flight: {self.inflight}")

    def lose(self, match: Match) -> Action:
        for i, a in enumerate(self.inflight):
            if match(a):
                del self.inflight[i]
                return a
        raise AssertionError(f"nothing in flight matches; in flight: {self.inflight}")

    def wait(self, ms: int) -> None:
        """`ms` pass with nothing answered, and the operation is woken: it retransmits,
        counts silent stores as lost, probes them."""
        self.now_ms += ms
        self.world.log.append(f"leader {self.epoch}: {ms} ms pass (now {self.now_ms})")
        self._take(self.op.step(self.now_ms, Tick()))

    def wait_until_lost(self) -> None:
        """Long enough silence that every store with a request in flight is lost."""
        self.wait(self.op.timing.store_lost_ms)

    def in_flight(self, match: Match) -> bool:
        return any(match(a) for a in self.inflight)

    def ever_sent(self, match: Match) -> bool:
        return any(match(a) for a in self.emitted)

    def run(self, limit: int = 10_000) -> None:
        """Deliver everything in flight, oldest first, until nothing is left."""
        for _ in range(limit):
            if not self.inflight:
                return
            self.deliver(lambda _: True)
        raise AssertionError("recovery does not converge")
