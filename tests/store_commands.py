"""The store's core one command at a time, as the tests drive it: each command planned,
written, published and its outcome returned (or its refusal raised), where the server
gathers many into one plan (group commit)."""

from __future__ import annotations

from collections.abc import Sequence

from streamengine.protocol.entry import PackedEntries, StoredEntry
from streamengine.segment_store.core.commands import (
    Command,
    ConfirmCopyCommand,
    DeleteCommand,
    DeleteResult,
    Result,
    SealCommand,
    SealResult,
    SegmentKey,
    WriteCommand,
    WriteResult,
)
from streamengine.segment_store.core.errors import StoreError
from streamengine.segment_store.core.store import SegmentStoreCore


class CommandedCore(SegmentStoreCore):
    def execute(self, command: Command, sync: bool = True) -> Result:
        plan = self.plan([command])
        self.apply(plan, sync)
        outcome = plan.outcomes[0]
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome

    def write(
        self,
        segment: SegmentKey,
        writer_epoch: int,
        acked_index: int,
        entries: Sequence[StoredEntry] | PackedEntries,
        tenant: str = "",
    ) -> WriteResult:
        command = (
            WriteCommand(segment, writer_epoch, acked_index, entries, tenant)
            if isinstance(entries, PackedEntries)
            else WriteCommand.of(segment, writer_epoch, acked_index, entries, tenant)
        )
        result = self.execute(command)
        assert isinstance(result, WriteResult)
        return result

    def seal(self, segment: SegmentKey, new_epoch: int, tenant: str = "") -> SealResult:
        result = self.execute(SealCommand(segment, new_epoch, tenant))
        assert isinstance(result, SealResult)
        return result

    def confirm_copy(self, segment: SegmentKey, fence: int, final_index: int) -> WriteResult:
        result = self.execute(ConfirmCopyCommand(segment, fence, final_index))
        assert isinstance(result, WriteResult)
        return result

    def delete(self, segment: SegmentKey) -> bool:
        result = self.execute(DeleteCommand(segment))
        assert isinstance(result, DeleteResult)
        return result.existed
