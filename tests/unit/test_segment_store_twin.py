"""Random schedules of writes, seals, deletes, grouped plans and restarts, checked
against a deliberately naive twin of the store's rules after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.segment_store.core.commands import (
    Command,
    DeleteCommand,
    JoinCommand,
    KeepAuthorityCommand,
    KeepClusterViewCommand,
    KeepRecordsCommand,
    RaiseAckedCommand,
    SealCommand,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.errors import BelowFence, ConflictingCopy
from streamengine.segment_store.kv import MemoryKV
from tests.store_commands import CommandedCore

SEGMENTS = [SegmentKey(1, 1), SegmentKey(1, 2)]


@dataclass
class Twin:
    """One segment, the obvious way: a dict of copies, a fence and an acked index."""

    copies: dict[int, StoredEntry] = field(default_factory=dict)
    fence: int = 0
    acked: int = 0

    def matched(self) -> int:
        m = 0
        while m + 1 in self.copies:
            m += 1
        return m

    def write(self, command: WriteCommand) -> WriteResult | BelowFence | ConflictingCopy:
        if command.writer_epoch < self.fence:
            return BelowFence(self.fence)
        for entry in command.batch.entries():
            old = self.copies.get(entry.index)
            if old is not None and entry.epoch == old.epoch and entry != old:
                return ConflictingCopy(entry.index, old.epoch, "other bytes")
        held = []
        for entry in command.batch.entries():
            old = self.copies.get(entry.index)
            if old is None or entry.epoch >= old.epoch:
                self.copies[entry.index] = entry
            held.append(self.copies[entry.index].epoch)
        self.acked = max(self.acked, min(command.acked_index, self.matched()))
        final = min(
            (i for i, e in self.copies.items() if e.kind == EntryKind.BRIDGE and i <= self.acked),
            default=0,
        )
        if final:
            self.copies = {i: e for i, e in self.copies.items() if i <= final}
            self.acked = final
        return WriteResult(self.matched(), self.acked, self.fence, tuple(held))

    def seal(self, epoch: int) -> int | BelowFence:
        if epoch < self.fence:
            return BelowFence(self.fence)
        self.fence = epoch
        return self.fence


kinds = st.sampled_from([EntryKind.EVENT, EntryKind.EVENT, EntryKind.HOLE, EntryKind.BRIDGE])


@st.composite
def write_commands(draw: st.DrawFn) -> WriteCommand:
    segment = draw(st.sampled_from(SEGMENTS))
    writer = draw(st.integers(1, 5))
    first = draw(st.integers(1, 10))
    count = draw(st.integers(0, 4))
    batch = []
    for index in range(first, first + count):
        kind = draw(kinds)
        payload = draw(st.binary(max_size=3)) if kind == EntryKind.EVENT else b""
        batch.append(StoredEntry.make(index, kind, draw(st.integers(1, writer)), payload))
    return WriteCommand.of(segment, writer, draw(st.integers(0, 14)), tuple(batch))


seal_commands = st.builds(SealCommand, st.sampled_from(SEGMENTS), st.integers(1, 6))
delete_commands = st.builds(DeleteCommand, st.sampled_from(SEGMENTS))
commands = st.one_of(write_commands(), write_commands(), seal_commands, delete_commands)
steps: st.SearchStrategy[tuple[str, list[Command]]] = st.one_of(
    st.tuples(st.just("group"), st.lists(commands, min_size=1, max_size=4)),
    st.tuples(st.just("restart"), st.just([])),
)


def _apply_to_twins(twins: dict[SegmentKey, Twin], command: Command) -> object:
    assert not isinstance(
        command,
        KeepAuthorityCommand
        | KeepRecordsCommand
        | KeepClusterViewCommand
        | JoinCommand
        | RaiseAckedCommand,
    ), "the twin draws no authority, records, cluster view, identity nor master's acks"
    if isinstance(command, DeleteCommand):
        existed = command.segment in twins
        twins.pop(command.segment, None)
        return existed
    twin = twins.setdefault(command.segment, Twin())
    if isinstance(command, SealCommand):
        return twin.seal(command.new_epoch)
    assert isinstance(command, WriteCommand), "the twin draws no copy confirmations"
    return twin.write(command)


def _check(core: CommandedCore, twins: dict[SegmentKey, Twin]) -> None:
    assert core.catalog.segments() == sorted(twins)
    for segment, twin in twins.items():
        got = core.catalog.state(segment)
        held = [twin.copies[i] for i in sorted(twin.copies)]
        bridges = [e.index for e in held if e.kind == EntryKind.BRIDGE]
        first_bridge = bridges[0] if bridges and bridges[0] <= twin.acked else 0
        assert (got.fence, got.acked_index, got.matched_index) == (
            twin.fence,
            twin.acked,
            twin.matched(),
        )
        assert got.last_index == max(twin.copies, default=0)
        assert got.bytes == sum(len(e.payload) for e in held)
        assert got.bridge_index == first_bridge
        assert core.reader.read(segment, 1) == held
        assert core.reader.read(segment, 1, 0, acked_only=True) == [
            e for e in held if e.index <= twin.acked
        ]


@settings(max_examples=400, deadline=None)
@given(st.lists(steps, max_size=12))
def test_the_store_agrees_with_a_naive_twin_through_groups_and_restarts(
    schedule: list[tuple[str, list[Command]]],
) -> None:
    kv = MemoryKV()
    core = CommandedCore(kv)
    twins: dict[SegmentKey, Twin] = {}
    for kind, group in schedule:
        if kind == "restart":
            core = CommandedCore(kv)
        else:
            plan = core.plan(group)
            core.apply(plan)
            for command, outcome in zip(group, plan.outcomes, strict=True):
                expected = _apply_to_twins(twins, command)
                if isinstance(expected, BelowFence):
                    assert isinstance(outcome, BelowFence) and outcome.fence == expected.fence
                elif isinstance(expected, ConflictingCopy):
                    assert isinstance(outcome, ConflictingCopy)
                    assert (outcome.index, outcome.epoch) == (expected.index, expected.epoch)
                elif isinstance(expected, WriteResult):
                    assert outcome == expected
                elif isinstance(command, SealCommand):
                    assert getattr(outcome, "fence", None) == expected
                else:
                    assert getattr(outcome, "existed", None) == expected
        _check(core, twins)
