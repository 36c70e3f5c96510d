"""CopySegment on the target store: the client that pulls a sealed segment from a peer
store (its entries read on the source's data port, `framed_read`; its state and digest
asked over gRPC) and applies it through the group committer, step by step as
`core.copy` says (fence first, the old copies dropped for a refill in place, copied
batches raising no acked index, digest, then one confirming write). A failed copy is
left as it is, unconfirmed: never deleted, nor is its fence.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from streamengine.protocol import framed_read, transport
from streamengine.protocol.certificate import Certificate
from streamengine.protocol.entry import CorruptEntry, PackedEntries
from streamengine.protocol.framed import CallError
from streamengine.protocol.limits import WRITE_BATCH_BYTES_MAX, WRITE_BATCH_ENTRIES_MAX
from streamengine.segment_store.core import copy as copy_rules
from streamengine.segment_store.core.commands import Command, Outcome, SegmentKey
from streamengine.segment_store.core.errors import (
    BadRequest,
    CopyRefused,
    SegmentNotFound,
    StoreError,
)
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.group_commit import GroupCommitter
from streamengine.v1 import entry_pb2, segment_store_pb2, segment_store_pb2_grpc

T = TypeVar("T")


class InThread(Protocol):
    """Runs a blocking read of the KV off the event loop."""

    def __call__(self, function: Callable[[], T], /) -> Awaitable[T]: ...


COPY_CALL_TIMEOUT_S = copy_rules.TIMEOUTS.call_ms / 1000
COPY_READ_TIMEOUT_S = copy_rules.TIMEOUTS.read_ms / 1000


class CopySourceUnavailable(StoreError):
    """The source store could not be reached, or failed mid-copy: retry later or from
    another replica."""


@dataclass(frozen=True, slots=True)
class CopyReport:
    entries_copied: int
    digest: bytes
    acked_index: int


class SegmentCopy:
    """One CopySegment: `run()` copies `segment` 1..final_index from the store at
    `source_address` (its data port at `source_data_address`) and returns what the
    confirmed copy holds."""

    def __init__(
        self,
        core: SegmentStoreCore,
        committer: GroupCommitter,
        in_thread: InThread,
        members: transport.Transport,
        segment: SegmentKey,
        source_address: str,
        source_data_address: str,
        final_index: int,
        requested_fence: int,
        tenant: str = "",
        certificate: Certificate | None = None,
        replace_held: bool = False,
    ) -> None:
        if not source_data_address:
            raise BadRequest("missing source_data_address")
        self.op = copy_rules.CopyOp(
            segment, source_address, final_index, requested_fence, tenant, certificate,
            replace_held,
        )
        self.core = core
        self.committer = committer
        self.in_thread = in_thread
        self.members = members
        self.segment = segment
        self.source_address = source_address
        self.source_data_address = source_data_address
        self.segment_pb = entry_pb2.SegmentId(stream_id=segment.stream_id, epoch=segment.epoch)

    async def run(self) -> CopyReport:
        try:
            async with self.members.aio_channel(self.source_address) as channel:
                source = segment_store_pb2_grpc.SegmentStoreStub(channel)
                action: copy_rules.CopyAction | None = self.op.start()
                while not isinstance(action, copy_rules.Finished):
                    assert action is not None
                    action = await self._carry_out(source, action)
                return CopyReport(action.entries_copied, action.digest, action.acked_index)
        except grpc.aio.AioRpcError as error:
            raise _source_error(self.source_address, error.code().name, error.details()) from None
        except CallError as error:
            raise _source_error(self.source_data_address, error.code.name, error.details) from None

    async def _carry_out(
        self, source: segment_store_pb2_grpc.SegmentStoreAsyncStub, action: copy_rules.CopyAction
    ) -> copy_rules.CopyAction | None:
        """One action of the copy; the op's next one."""
        op = self.op
        if isinstance(action, copy_rules.AskSourceState):
            state = await source.GetSegmentState(
                segment_store_pb2.GetSegmentStateRequest(segment=self.segment_pb),
                timeout=COPY_CALL_TIMEOUT_S,
            )
            local = self.core.catalog.meta(self.segment)
            local_fence = local.fence if local is not None else 0
            return op.source_state(state.fence, state.acked_index, local_fence)
        if isinstance(action, copy_rules.Submit):
            return op.submitted(await self._submit(action.command))
        if isinstance(action, copy_rules.ReadSource):
            reads = framed_read.read(
                self.source_data_address,
                self.members,
                segment_store_pb2.ReadRequest(
                    segment=self.segment_pb,
                    from_index=action.from_index,
                    to_index=action.to_index,
                    packed=True,
                ),
                COPY_READ_TIMEOUT_S,
            )
            async with contextlib.aclosing(reads):
                async for reply in reads:
                    await self._apply(reply)
            return op.source_read_ended()
        if isinstance(action, copy_rules.ReadBack):
            copied = await self.in_thread(
                functools.partial(self.core.reader.certify, self.segment, action.final_index)
            )
            return op.read_back(copied)
        assert isinstance(action, copy_rules.AskDigests), action
        expected = await source.Digest(
            segment_store_pb2.DigestRequest(
                segment=self.segment_pb, up_to_index=action.up_to_index
            ),
            timeout=COPY_CALL_TIMEOUT_S,
        )
        local_digest = await self.in_thread(
            functools.partial(self.core.reader.digest, self.segment, action.up_to_index)
        )
        return op.digests(local_digest, expected.digest)

    async def _apply(self, reply: segment_store_pb2.ReadReply) -> None:
        """The entries of one packed reply of the source, written as the op says."""
        try:
            batch = PackedEntries.from_wire(
                reply.first_index, reply.packed_values, reply.value_lengths
            )
            # A packed reply may hold more than one Write may carry.
            writes = [
                self.op.source_entries(piece)
                for piece in batch.pieces(WRITE_BATCH_ENTRIES_MAX, WRITE_BATCH_BYTES_MAX)
            ]
        except CorruptEntry as error:
            raise CopyRefused(f"the source sent a malformed batch: {error}") from None
        for write in writes:
            if write is not None:
                assert isinstance(write, copy_rules.Submit)
                assert self.op.submitted(await self._submit(write.command)) is None

    async def _submit(self, command: Command) -> Outcome:
        outcome = await self.committer.submit(command)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def _source_error(address: str, code: str, details: str | None) -> StoreError:
    """The source's refusal (a status, by name: gRPC's or the data plane's), as the
    store's own error: a segment it lacks, one it cannot serve yet, or a source out of
    reach."""
    message = f"copy from {address} failed: {code} {details}"
    if code == "NOT_FOUND":
        return SegmentNotFound(message)
    if code == "FAILED_PRECONDITION":
        return CopyRefused(message)
    return CopySourceUnavailable(message)
