"""The reader's calls: Read (entries, or packed values back to back; served on the data
port, `data_plane.py`) and Digest (a digest, or the replica's certificate, on gRPC). The
shell of `core.reads`: reads of the KV run in the store's reader threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc

from streamengine.protocol import codec
from streamengine.protocol.auth import Principal
from streamengine.protocol.entry import CorruptEntry, first_corrupt_value
from streamengine.protocol.limits import (
    DATA_REPLY_BYTES_MAX,
    EVENT_BYTES_MAX,
    FRAME_PAYLOAD_BYTES_MAX,
    INDEX_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_BATCH_ENTRIES_MAX,
)
from streamengine.segment_store import metrics
from streamengine.segment_store.core.commands import SegmentKey
from streamengine.segment_store.core.errors import BadRequest, SegmentNotFound, StoreError
from streamengine.segment_store.core.keys import SegmentMeta, entry_index
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.refusals import abort
from streamengine.segment_store.store_context import StoreContext, segment_key
from streamengine.v1 import entry_pb2, segment_store_pb2

# Read replies: entries per message by default; their bytes are the data plane's
# bound on a reply (`DATA_REPLY_BYTES_MAX`), far below a frame's.
READ_REPLY_ENTRIES_DEFAULT = 256
# A packed Read reply: no message per entry. Spark gathers replies into Arrow batches
# of ARROW_BATCH_ROWS; the bound in bytes cuts a reply long before this many entries
# but of the smallest events.
PACKED_REPLY_ENTRIES_MAX = 65536

assert DATA_REPLY_BYTES_MAX <= WRITE_BATCH_BYTES_MAX
# A reply is cut once it reaches its limit, so it passes it by at most one value, and a
# packed one carries a length (a few bytes) per entry.
assert (
    DATA_REPLY_BYTES_MAX + EVENT_BYTES_MAX + 8 * PACKED_REPLY_ENTRIES_MAX <= FRAME_PAYLOAD_BYTES_MAX
)


def read_entries(
    core: SegmentStoreCore,
    segment: SegmentKey,
    first: int,
    upper: int,
    acked_only: bool,
    limit: int,
    verify: bool = True,
) -> list[entry_pb2.Entry]:
    """One reply's worth of wire entries (off the event loop: it reads RocksDB).
    `verify=False` where the receiver checks every crc itself (followers do; RocksDB's
    block checksums still guard the disk)."""
    reader = core.reader
    with reader.reading(segment):
        if acked_only:
            meta = core.catalog.meta(segment)
            upper = min(upper, meta.acked_index) if meta is not None else upper
            # Every acked index is held (acked <= matched): a run, read by value alone.
            values = reader.read_run(segment, first, upper, limit, DATA_REPLY_BYTES_MAX)
            return codec.entries_from_values(range(first, first + len(values)), values, verify)
        rows = reader.read_rows(segment, first, upper, False, limit, DATA_REPLY_BYTES_MAX)
        indexes = [entry_index(key) for key, _ in rows]
        return codec.entries_from_values(indexes, [value for _, value in rows], verify)


class ReadCalls:
    """Read (served on the data port, `data_plane.py`) and Digest."""

    def __init__(self, store: StoreContext) -> None:
        self.store = store

    def methods(self) -> dict[str, Callable[..., Any]]:
        """The gRPC calls (Read is the data plane's)."""
        return {"Digest": self.digest}

    async def read(
        self, request: segment_store_pb2.ReadRequest, caller: Principal
    ) -> AsyncGenerator[segment_store_pb2.ReadReply, None]:
        """The replies of `request` (the data plane's Read, `data_plane.py`, sends each
        as the reader's credit allows: nothing is read ahead of that but one run). Raises
        StoreError or CorruptEntry for what ends the read with a status."""
        segment = segment_key(request.segment)
        self.store.check_reader(caller, "Read", segment)
        meta = self.store.core.catalog.meta(segment)
        if meta is None:
            raise SegmentNotFound(f"segment {segment.stream_id}/{segment.epoch} is not held here")
        if request.to_index and request.to_index < request.from_index:
            raise BadRequest(f"to_index {request.to_index} < from_index {request.from_index}")
        per_reply = min(
            request.max_entries_per_reply or READ_REPLY_ENTRIES_DEFAULT, WRITE_BATCH_ENTRIES_MAX
        )
        upper = min(request.to_index or meta.last_index, meta.last_index, INDEX_MAX)
        if request.acked_only:
            upper = min(upper, meta.acked_index)
        next_index = max(request.from_index, 1)
        if request.packed:
            replies = self._read_packed(
                segment, meta, next_index, upper, verify=not request.reader_verifies
            )
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    yield reply
            return
        sent = False
        while True:
            entries: list[entry_pb2.Entry] = []
            if next_index <= upper:
                entries = await self.store.in_thread(
                    functools.partial(
                        read_entries,
                        self.store.core,
                        segment,
                        next_index,
                        upper,
                        request.acked_only,
                        per_reply,
                    )
                )
            if entries or not sent:
                metrics.READ_ENTRIES.labels("read").inc(len(entries))
                yield segment_store_pb2.ReadReply(
                    entries=entries,
                    acked_index=meta.acked_index,
                    matched_index=meta.matched_index,
                    last_index=meta.last_index,
                    fence=meta.fence,
                    bridge_index=meta.bridge_index,
                )
                sent = True
            if not entries or entries[-1].index >= upper:
                return
            next_index = entries[-1].index + 1

    async def _read_packed(
        self,
        segment: SegmentKey,
        meta: SegmentMeta,
        next_index: int,
        upper: int,
        verify: bool,
    ) -> AsyncGenerator[segment_store_pb2.ReadReply, None]:
        """Read's bulk form: values back to back, a reply per batch of consecutive
        indexes, ending before the first index the store lacks. `verify=False` where
        the reader checks what it hands out against the certificate (`reader_verifies`)."""
        per_reply = PACKED_REPLY_ENTRIES_MAX

        def read_ahead(index: int) -> asyncio.Future[tuple[int, list[bytes]]]:
            return asyncio.ensure_future(
                self.store.in_thread(
                    functools.partial(self.read_values, segment, index, upper, per_reply, verify)
                )
            )

        # The next run is read (and checked) while the reply before it goes out: the
        # store's reading and the network's sending overlap.
        ahead = read_ahead(next_index) if next_index <= upper else None
        try:
            while True:
                first, values = next_index, list[bytes]()
                if ahead is not None:
                    first, values = await ahead
                    ahead = None
                next_index = first + len(values)
                if values and next_index <= upper:
                    ahead = read_ahead(next_index)
                metrics.READ_ENTRIES.labels("read_packed").inc(len(values))
                yield segment_store_pb2.ReadReply(
                    acked_index=meta.acked_index,
                    matched_index=meta.matched_index,
                    last_index=meta.last_index,
                    fence=meta.fence,
                    bridge_index=meta.bridge_index,
                    packed_values=b"".join(values),
                    value_lengths=list(map(len, values)),
                    first_index=first if values else 0,
                )
                # A reply may end early (the byte cap, a gap): only an empty one, or the
                # end of the range, ends the read. A gap gives an empty one next round.
                if not values or next_index > upper:
                    return
        finally:
            if ahead is not None:
                ahead.cancel()

    def read_values(
        self, segment: SegmentKey, first: int, upper: int, limit: int, verify: bool
    ) -> tuple[int, list[bytes]]:
        """Stored values of consecutive indexes from `first` (cut before a gap), each
        verified unless not `verify`; raises CorruptEntry."""
        with self.store.core.reader.reading(segment):
            values = self.store.core.reader.read_run(
                segment, first, upper, limit, DATA_REPLY_BYTES_MAX
            )
            bad = first_corrupt_value(first, values) if verify else None
            if bad is not None:
                raise CorruptEntry(f"index {first + bad}: stored copy fails its crc32c")
        return first, values

    async def digest(
        self,
        request: segment_store_pb2.DigestRequest,
        context: grpc.aio.ServicerContext[
            segment_store_pb2.DigestRequest, segment_store_pb2.DigestReply
        ],
    ) -> segment_store_pb2.DigestReply:
        try:
            segment = segment_key(request.segment)
            self.store.require_reader(context, "Digest", segment)
            if request.up_to_index > INDEX_MAX:
                raise BadRequest(f"up_to_index {request.up_to_index} is over {INDEX_MAX}")
            if request.certificate:
                return await self._certificate_reply(segment, request.up_to_index)
            info = await self.store.in_thread(
                functools.partial(self.store.core.reader.digest, segment, request.up_to_index)
            )
        except (StoreError, CorruptEntry) as error:
            await abort(context, error)
        return segment_store_pb2.DigestReply(
            digest=info.digest,
            up_to_index=info.up_to_index,
            entries_held=info.entries_held,
            acked_index=info.acked_index,
            fence=info.fence,
        )

    async def _certificate_reply(
        self, segment: SegmentKey, up_to: int
    ) -> segment_store_pb2.DigestReply:
        """The replica's certificate up to `up_to` (0: its acked index); none when it
        lacks an index; a damaged copy raises CorruptEntry (DATA_LOSS)."""
        meta = self.store.core.catalog.meta(segment)
        if meta is None:
            raise SegmentNotFound(f"segment {segment.stream_id}/{segment.epoch} is not held here")
        final = up_to or meta.acked_index
        if final == 0:
            raise BadRequest("nothing acked to certify: give up_to_index")
        result = await self.store.in_thread(
            functools.partial(self.store.core.reader.certify, segment, final)
        )
        if result.damaged and not result.missing:
            self.store.core.catalog.mark_damaged(segment)
            raise CorruptEntry(result.detail)
        reply = segment_store_pb2.DigestReply(
            up_to_index=final,
            entries_held=final if result.certificate else result.damaged_index - 1,
            acked_index=meta.acked_index,
            fence=meta.fence,
        )
        if result.certificate is not None:
            reply.certificate.CopyFrom(codec.certificate_to_pb(result.certificate))
        return reply
