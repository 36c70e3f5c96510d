"""Packed `Read` replies as Arrow columns, and events as Arrow record batches.

A packed reply holds the stored values of consecutive indexes back to back (kind u8 |
epoch u64 | crc32c u32 | payload, each verified by the store before it is sent) and
their lengths. `Packed` turns one into columns (a kind and a payload per index) without
a Python object per entry, feeds the certificate check over whole buffers, and cuts
the EVENT rows out as a record batch. Shared by Spark (`streamengine.client.spark`) and the SDK's
batch readers (`streamengine.client.subscription`); a `Released` part of a pushed batch
(`ListRun`) becomes a record batch here too, so both kinds of run leave the same way.

Columns of an event batch (`EVENT_SCHEMA`): epoch int32, index int64, sequence int64,
payload binary; Spark puts the stream's name in front.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from streamengine.client.core.subscription import ListRun, Released, StreamEvent
from streamengine.protocol.certificate import ChunkCheck
from streamengine.protocol.entry import VALUE_HEADER_BYTES, EntryKind
from streamengine.protocol.limits import EVENT_BYTES_MAX
from streamengine.protocol.sequence import pack_sequence
from streamengine.v1 import segment_store_pb2

EVENT_FIELDS = [
    pa.field("epoch", pa.int32(), nullable=False),
    pa.field("index", pa.int64(), nullable=False),
    pa.field("sequence", pa.int64(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),
]
EVENT_SCHEMA = pa.schema(EVENT_FIELDS)

_EVENT = pa.scalar(bytes([EntryKind.EVENT]), pa.binary())
_ONE = pa.scalar(1, pa.int64())


@dataclass(frozen=True)
class Packed:
    """One packed Read reply as Arrow columns: kinds and payloads, one row per index
    (a `Run` of the cursor)."""

    first_index: int
    kind_column: pa.BinaryArray
    payloads: pa.BinaryArray
    lengths: pa.UInt32Array
    kinds: bytes  # one byte per index, as the cursor reads them

    @classmethod
    def of(cls, reply: segment_store_pb2.ReadReply) -> Packed | None:
        count = len(reply.value_lengths)
        if count == 0:
            return None
        offsets = pc.cumulative_sum(pa.array([0, *reply.value_lengths], pa.int32()))
        values = pa.BinaryArray.from_buffers(
            pa.binary(), count, [None, offsets.buffers()[1], pa.py_buffer(reply.packed_values)]
        )
        kinds = pc.binary_slice(values, 0, 1)
        # An explicit stop: pyarrow 26 miscomputes the output size of an open-ended slice
        # ("Negative buffer resize"). No payload is longer than EVENT_BYTES_MAX.
        payloads = pc.binary_slice(values, VALUE_HEADER_BYTES, VALUE_HEADER_BYTES + EVENT_BYTES_MAX)
        lengths = pc.binary_length(payloads).cast(pa.uint32())
        kinds_data = kinds.buffers()[2]
        kind_bytes = kinds_data.to_pybytes()[:count] if kinds_data is not None else b""
        return cls(reply.first_index, kinds, payloads, lengths, kind_bytes)

    @property
    def last_index(self) -> int:
        return self.first_index + len(self.kinds) - 1

    def feed(self, check: ChunkCheck) -> int:
        """Feed the certificate check the whole reply, as columns; `verified_through`."""
        payload_data = self.payloads.buffers()[2]
        offsets = memoryview(self.payloads.buffers()[1]).cast("i")
        assert self.kind_column.offset == 0 and self.payloads.offset == 0, "fresh arrays"
        assert sys.byteorder == "little", "Arrow buffers are little-endian"
        lengths = array.array("I")  # native u32, as the Arrow buffer holds them
        lengths.frombytes(memoryview(self.lengths.buffers()[1])[: 4 * len(self.lengths)])
        return check.feed_packed(
            self.first_index,
            self.kinds,
            lengths,
            memoryview(payload_data) if payload_data is not None else b"",
            offsets,
        )

    def columns(self, start: int, stop: int) -> tuple[pa.Array, pa.Array]:
        """Indexes and payloads of the EVENT rows at positions `start..stop-1`."""
        count = stop - start
        payloads = self.payloads.slice(start, count)
        # first, first + 1, ... built in Arrow: no Python int per row.
        indexes = pc.cumulative_sum(pa.repeat(_ONE, count), start=self.first_index + start - 1)
        if self.kinds.count(EntryKind.EVENT, start, stop) != count:  # holes
            events = pc.equal(self.kind_column.slice(start, count), _EVENT)
            indexes = pc.filter(indexes, events)
            payloads = pc.filter(payloads, events)
        return indexes, payloads


def event_columns(epoch: int, indexes: pa.Array, payloads: pa.Array) -> list[pa.Array]:
    """The columns of `EVENT_SCHEMA` for events of segment `epoch`."""
    return [
        pa.repeat(pa.scalar(epoch, pa.int32()), len(indexes)),
        indexes,
        pc.add(indexes, pack_sequence(epoch, 0)),
        payloads,
    ]


def event_batch(epoch: int, indexes: pa.Array, payloads: pa.Array) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(event_columns(epoch, indexes, payloads), schema=EVENT_SCHEMA)


def released_batch(released: Released) -> pa.RecordBatch:
    """The EVENT rows of what the cursor released, as one record batch."""
    run, start, stop = released.run, released.start, released.stop
    if isinstance(run, Packed):
        indexes, payloads = run.columns(start, stop)
        return event_batch(released.epoch, indexes, payloads)
    assert isinstance(run, ListRun)
    first = run.first_index + start
    values: Sequence[bytes] = run.payloads[start:stop]
    numbers: Sequence[int] = range(first, first + stop - start)
    if not released.all_events:
        kinds = run.kinds[start:stop]
        keep = [i for i in range(len(kinds)) if kinds[i] == EntryKind.EVENT]
        values, numbers = [values[i] for i in keep], [first + i for i in keep]
    return event_batch(released.epoch, pa.array(numbers, pa.int64()), pa.array(values, pa.binary()))


def released_events(released: Released, stream: str = "") -> list[StreamEvent]:
    """What the cursor released, as one `StreamEvent` per EVENT (tagged with `stream`)."""
    run, start, stop = released.run, released.start, released.stop
    if isinstance(run, Packed):
        return released.events(run.payloads.slice(start, stop - start).to_pylist(), stream)
    assert isinstance(run, ListRun)
    return released.events(run.payloads[start:stop], stream)


def one_batch(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)
