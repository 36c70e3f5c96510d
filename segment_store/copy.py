"""CopySegment on the target store: the client that pulls a sealed segment from a peer
store over gRPC and applies it through the group committer, step by step as
`copy_rules` says (fence first, copied batches raising no acked index, digest, then
one confirming write). A failed copy is left as it is, unconfirmed: never deleted,
nor is its fence.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from streamengine.protocol import codec
from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.segment_store import copy_rules
from streamengine.segment_store.group_commit import GroupCommitter
from streamengine.segment_store.store import (
    Command,
    CopyRefused,
    Outcome,
    SegmentKey,
    SegmentNotFound,
    SegmentStoreCore,
    StoreError,
    WriteResult,
)
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
    `source_address` and returns what the confirmed copy holds."""

    def __init__(
        self,
        core: SegmentStoreCore,
        committer: GroupCommitter,
        in_thread: InThread,
        segment: SegmentKey,
        source_address: str,
        final_index: int,
        requested_fence: int,
    ) -> None:
        copy_rules.check_request(final_index, source_address)
        self.core = core
        self.committer = committer
        self.in_thread = in_thread
        self.segment = segment
        self.source_address = source_address
        self.final_index = final_index
        self.requested_fence = requested_fence
        self.segment_pb = entry_pb2.SegmentId(stream_id=segment.stream_id, epoch=segment.epoch)

    async def run(self) -> CopyReport:
        try:
            async with grpc.aio.insecure_channel(
                self.source_address, options=CLIENT_OPTIONS
            ) as channel:
                source = segment_store_pb2_grpc.SegmentStoreStub(channel)
                fence = await self._fence(source)
                return await self._copy(source, fence)
        except grpc.aio.AioRpcError as error:
            raise _source_error(self.source_address, error) from None

    async def _fence(self, source: segment_store_pb2_grpc.SegmentStoreAsyncStub) -> int:
        """Raise the local fence to the copy's before anything is copied."""
        state = await source.GetSegmentState(
            segment_store_pb2.GetSegmentStateRequest(segment=self.segment_pb),
            timeout=COPY_CALL_TIMEOUT_S,
        )
        local = self.core.meta(self.segment)
        fence = copy_rules.copy_fence(
            self.segment,
            self.final_index,
            state.fence,
            state.acked_index,
            self.requested_fence,
            local.fence if local is not None else 0,
        )
        await self._submit(copy_rules.fence_command(self.segment, fence))
        return fence

    async def _copy(
        self, source: segment_store_pb2_grpc.SegmentStoreAsyncStub, fence: int
    ) -> CopyReport:
        final = self.final_index
        copied = 0
        reads = source.Read(
            segment_store_pb2.ReadRequest(segment=self.segment_pb, from_index=1, to_index=final),
            timeout=COPY_READ_TIMEOUT_S,
        )
        async for reply in reads:
            try:
                entries = codec.entries_from_pb(reply.entries)
            except codec.MalformedEntry as error:
                raise CopyRefused(f"the source sent a malformed entry: {error}") from None
            if entries:
                await self._submit(copy_rules.write_command(self.segment, fence, entries))
                copied += len(entries)
        expected = await source.Digest(
            segment_store_pb2.DigestRequest(segment=self.segment_pb, up_to_index=final),
            timeout=COPY_CALL_TIMEOUT_S,
        )
        local = await self.in_thread(functools.partial(self.core.digest, self.segment, final))
        copy_rules.verify(self.segment, final, local, expected.digest)
        confirmed = await self._submit(copy_rules.confirm_command(self.segment, fence, final))
        assert isinstance(confirmed, WriteResult) and confirmed.acked_index >= final
        return CopyReport(copied, local.digest, confirmed.acked_index)

    async def _submit(self, command: Command) -> Outcome:
        outcome = await self.committer.submit(command)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def _source_error(address: str, error: grpc.aio.AioRpcError) -> StoreError:
    """The source's refusal, as the store's own error: a segment it lacks, one it
    cannot serve yet, or a source out of reach."""
    message = f"copy from {address} failed: {error.code().name} {error.details()}"
    if error.code() == grpc.StatusCode.NOT_FOUND:
        return SegmentNotFound(message)
    if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return CopyRefused(message)
    return CopySourceUnavailable(message)
