"""A real store process: fencing, the overwrite rule, matched index with gaps and
retransmission, seal/read/digest/delete, and bad input that changes nothing.

The store runs alone, its master address unreachable: it must serve regardless.
Each test uses its own stream id, so one store process serves the module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from streamengine.client.errors import EventTooLarge, fence_of, from_rpc_error
from streamengine.protocol.entry import EntryKind
from streamengine.protocol.limits import (
    EVENT_BYTES_MAX,
    WRITE_BATCH_BYTES_MAX,
    WRITE_REQUEST_PARTS_MAX,
)
from streamengine.protocol.status import FENCE_METADATA_KEY, TOO_LARGE_METADATA_KEY
from streamengine.testing import ServerProcess
from streamengine.v1 import entry_pb2, segment_store_pb2
from tests.integration.store_helpers import (
    WriteRefused,
    entries,
    entry,
    lone_store,
    read_all,
    seal_request,
    seg,
    state,
    store_stub,
    with_grants,
    write_all,
    write_replies,
    write_request,
)

ACCEPTED = segment_store_pb2.ACCEPTED


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with lone_store(Path(tmp_path_factory.mktemp("store"))) as running:
        yield running


async def test_a_refused_request_leaves_the_write_stream_to_the_other_segments(
    store: ServerProcess,
) -> None:
    """One Write stream carries many segments: a request refused (below its fence, bad
    input, no grant) is answered with its status, and the requests after it, of its own
    segment or another, are taken as if it had not come."""
    fenced, bad, other = seg(111, 3), seg(112, 3), seg(113, 3)
    async with store_stub(store) as stub:
        await stub.Seal(seal_request(fenced, 5))
        replies = await write_replies(
            stub,
            [
                write_request(other, 3, 0, entries(1, 2), request_id=1),
                write_request(fenced, 3, 0, entries(1, 1), request_id=1),
                write_request(bad, 3, 0, [entry(0)], request_id=1),
                write_request(seg(114, 3), 3, 0, entries(1, 1), request_id=1, grant=b"forged"),
                write_request(other, 3, 2, entries(3, 4), request_id=2),
            ],
        )
        codes = [
            r.error.code if r.status == segment_store_pb2.REFUSED else ACCEPTED for r in replies
        ]
        assert codes == [
            ACCEPTED,
            grpc.StatusCode.FAILED_PRECONDITION.value[0],
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            grpc.StatusCode.PERMISSION_DENIED.value[0],
            ACCEPTED,
        ]
        assert replies[1].error.metadata[FENCE_METADATA_KEY] == "5"
        assert [(r.segment.stream_id, r.request_id) for r in replies] == [
            (113, 1),
            (111, 1),
            (112, 1),
            (114, 1),
            (113, 2),
        ]
        assert (replies[-1].matched_index, replies[-1].acked_index) == (4, 2)
        assert (await state(stub, fenced)).last_index == 0


async def test_one_message_carries_many_segments_and_is_answered_part_by_part(
    store: ServerProcess,
) -> None:
    """A Write message with `parts` is admitted part by part as requests alone would
    be, and answered with one reply holding every part's answer in order: a part
    refused leaves the others, and the stream, to go on."""
    fenced, bad, first, second = seg(121, 3), seg(122, 3), seg(123, 3), seg(124, 3)
    async with store_stub(store) as stub:
        await stub.Seal(seal_request(fenced, 5))
        parts = list(
            with_grants(
                [
                    write_request(first, 3, 0, entries(1, 2), request_id=1),
                    write_request(fenced, 3, 0, entries(1, 1), request_id=1),
                    write_request(bad, 3, 0, [entry(0)], request_id=1),
                    write_request(second, 3, 0, entries(1, 3), request_id=1),
                    write_request(first, 3, 2, entries(3, 4), request_id=2),
                ]
            )
        )
        replies = await write_replies(
            stub,
            [
                segment_store_pb2.WriteRequest(parts=parts),
                write_request(second, 3, 3, [], request_id=2),
            ],
        )
        assert len(replies) == 2
        many, alone = replies
        assert not many.HasField("segment") and len(many.parts) == len(parts)
        assert [(r.segment.stream_id, r.request_id, r.status) for r in many.parts] == [
            (123, 1, ACCEPTED),
            (121, 1, segment_store_pb2.REFUSED),
            (122, 1, segment_store_pb2.REFUSED),
            (124, 1, ACCEPTED),
            (123, 2, ACCEPTED),
        ]
        assert many.parts[1].error.metadata[FENCE_METADATA_KEY] == "5"
        assert many.parts[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert (many.parts[-1].matched_index, many.parts[-1].acked_index) == (4, 2)
        assert (alone.segment.stream_id, alone.acked_index, len(alone.parts)) == (124, 3, 0)
        assert (await state(stub, fenced)).last_index == 0


@pytest.mark.parametrize(
    "message",
    [
        pytest.param(
            lambda part: segment_store_pb2.WriteRequest(
                parts=[part] * (WRITE_REQUEST_PARTS_MAX + 1)
            ),
            id="too-many-parts",
        ),
        pytest.param(
            lambda part: segment_store_pb2.WriteRequest(
                parts=[part, segment_store_pb2.WriteRequest(parts=[part])]
            ),
            id="parts-of-a-part",
        ),
        pytest.param(
            lambda part: segment_store_pb2.WriteRequest(
                parts=[part], segment=part.segment, request_id=9
            ),
            id="fields-beside-parts",
        ),
    ],
)
async def test_a_malformed_message_of_parts_ends_the_stream_writing_nothing(
    store: ServerProcess, message: Callable[[segment_store_pb2.WriteRequest], Any]
) -> None:
    """A message over its bounds, or not shaped as parts, is nobody's part to refuse:
    the stream ends with INVALID_ARGUMENT before any part is admitted."""
    segment = seg(131, 3)
    (part,) = with_grants([write_request(segment, 3, 0, entries(1, 1), request_id=1)])
    async with store_stub(store) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await write_replies(stub, [message(part)])
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as unheld:
            await state(stub, segment)
        assert unheld.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_write_below_the_fence_fails_precondition_with_the_fence(
    store: ServerProcess,
) -> None:
    segment = seg(101, 3)
    async with store_stub(store) as stub:
        await write_all(stub, [write_request(segment, 3, 0, entries(1, 2))])
        sealed = await stub.Seal(seal_request(segment, 5))
        assert (sealed.fence, sealed.matched_index, sealed.last_index) == (5, 2, 2)
        with pytest.raises(WriteRefused) as refused:
            await write_all(stub, [write_request(segment, 4, 2, entries(3, 4, epoch=4))])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert fence_of(refused.value) == 5
        assert dict(refused.value.trailing_metadata() or ())[FENCE_METADATA_KEY] == "5"
        after = await state(stub, segment)
        assert (after.fence, after.matched_index, after.last_index, after.acked_index) == (
            5,
            2,
            2,
            0,
        )
        # A lower seal is refused too, and the fence stays.
        with pytest.raises(grpc.aio.AioRpcError) as lower:
            await stub.Seal(seal_request(segment, 4))
        assert lower.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert fence_of(lower.value) == 5
        again = await stub.Seal(seal_request(segment, 5))
        assert again.fence == 5


async def test_a_copy_replaces_a_stored_one_only_if_its_epoch_is_not_lower(
    store: ServerProcess,
) -> None:
    segment = seg(102, 3)
    async with store_stub(store) as stub:
        await write_all(stub, [write_request(segment, 5, 0, [entry(1, 5, b"five"), entry(2, 3)])])
        (reply,) = await write_all(
            stub,
            [
                write_request(
                    segment,
                    6,
                    0,
                    [entry(1, 4, b"four"), entry(2, 6, b"six"), entry(3, 6)],
                    request_id=9,
                    report_held=True,
                )
            ],
        )
        assert reply.status == ACCEPTED and reply.request_id == 9
        assert list(reply.held_epochs) == [5, 6, 6]
        assert (reply.first_index, reply.last_index, reply.matched_index) == (1, 3, 3)
        held = await read_all(stub, segment)
        assert [(e.index, e.epoch, e.payload) for e in held] == [
            (1, 5, b"five"),
            (2, 6, b"six"),
            (3, 6, b"e3"),
        ]


async def test_matched_index_with_gaps_and_retransmission(store: ServerProcess) -> None:
    segment = seg(103, 3)
    async with store_stub(store) as stub:
        replies = await write_all(
            stub,
            [
                write_request(segment, 3, 5, entries(1, 2), request_id=1),
                write_request(segment, 3, 5, entries(5, 6), request_id=2),  # above a gap
                write_request(segment, 3, 5, entries(8, 9), request_id=3),
                write_request(segment, 3, 5, entries(3, 4), request_id=4),  # fills to 6
                write_request(segment, 3, 9, entries(1, 4), request_id=5),  # retransmission
                write_request(segment, 3, 9, entries(7, 7), request_id=6),
                write_request(segment, 3, 9, [], request_id=7),  # acked index only
            ],
        )
        assert [r.request_id for r in replies] == [1, 2, 3, 4, 5, 6, 7]
        assert [r.matched_index for r in replies] == [2, 2, 2, 6, 6, 9, 9]
        assert [r.acked_index for r in replies] == [2, 2, 2, 5, 6, 9, 9]
        final = await state(stub, segment)
        assert (final.matched_index, final.last_index, final.acked_index) == (9, 9, 9)
        assert final.bytes == sum(len(e.payload) for e in entries(1, 9))
        assert [e.index for e in await read_all(stub, segment)] == list(range(1, 10))


async def test_seal_read_digest_and_delete(store: ServerProcess) -> None:
    segment = seg(104, 3)
    bridge = entry(4, 3, kind=EntryKind.BRIDGE)
    async with store_stub(store) as stub:
        await write_all(stub, [write_request(segment, 3, 2, [*entries(1, 3), bridge])])
        current = await state(stub, segment)
        assert (current.acked_index, current.bridge_index) == (2, 0)
        await write_all(stub, [write_request(segment, 3, 4, [])])
        assert (await state(stub, segment)).bridge_index == 4
        sealed = await stub.Seal(seal_request(segment, 4))
        assert (sealed.fence, sealed.acked_index, sealed.matched_index, sealed.last_index) == (
            4,
            4,
            4,
            4,
        )
        acked = await read_all(stub, segment, 2, 0, acked_only=True)
        assert [e.index for e in acked] == [2, 3, 4]
        paged = stub.Read(
            segment_store_pb2.ReadRequest(segment=segment, from_index=1, max_entries_per_reply=3)
        )
        assert [len(r.entries) async for r in paged] == [3, 1]
        digest = await stub.Digest(segment_store_pb2.DigestRequest(segment=segment))
        assert (digest.up_to_index, digest.entries_held, digest.fence) == (4, 4, 4)
        assert len(digest.digest) == 32
        deleted = await stub.Delete(segment_store_pb2.DeleteRequest(segment=segment))
        assert deleted.existed
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await state(stub, segment)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        again = await stub.Delete(segment_store_pb2.DeleteRequest(segment=segment))
        assert not again.existed


def _bad_crc() -> list:  # type: ignore[type-arg]
    bad = entry(1)
    bad.crc32c ^= 1
    return [bad]


def _unknown_kind(segment: entry_pb2.SegmentId) -> segment_store_pb2.WriteRequest:
    request = write_request(segment, 3, 0, [entry(1)])
    request.packed_values = b"\x07" + request.packed_values[1:]
    return request


def _lengths_off(segment: entry_pb2.SegmentId) -> segment_store_pb2.WriteRequest:
    request = write_request(segment, 3, 0, entries(1, 2))
    request.value_lengths[0] += 1
    return request


def _shorter_than_its_header(segment: entry_pb2.SegmentId) -> segment_store_pb2.WriteRequest:
    return segment_store_pb2.WriteRequest(
        segment=segment, writer_epoch=3, first_index=1, packed_values=b"\x01", value_lengths=[1]
    )


BAD_WRITES = [
    ("value lengths that do not add up", _lengths_off),
    ("a value shorter than its header", _shorter_than_its_header),
    ("bad crc", lambda s: write_request(s, 3, 0, _bad_crc())),
    ("unknown kind", _unknown_kind),
    (
        "oversized entry",
        lambda s: write_request(s, 3, 0, [entry(1, 3, b"x" * (EVENT_BYTES_MAX + 1))]),
    ),
    ("copy epoch above writer", lambda s: write_request(s, 3, 0, [entry(1, 4)])),
    ("missing segment id", lambda s: write_request(seg(0, 0), 3, 0, [entry(1)])),
    ("index zero", lambda s: write_request(s, 3, 0, [entry(0)])),
]


@pytest.mark.parametrize(("case", "make"), BAD_WRITES, ids=[c for c, _ in BAD_WRITES])
async def test_a_malformed_write_gets_invalid_argument_and_changes_nothing(
    store: ServerProcess, case: str, make: Callable[[entry_pb2.SegmentId], object]
) -> None:
    segment = seg(105, 3)
    async with store_stub(store) as stub:
        await write_all(stub, [write_request(segment, 3, 1, entries(1, 1))])
        before = await state(stub, segment)
        with pytest.raises(WriteRefused) as refused:
            bad = make(segment)
            assert isinstance(bad, segment_store_pb2.WriteRequest)
            await write_all(stub, [write_request(segment, 3, 1, entries(2, 2)), bad])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        after = await state(stub, segment)
        # The well-formed batch before it was answered; the bad one changed nothing.
        assert after.last_index == 2 and after.matched_index == 2
        assert (after.fence, after.acked_index) == (before.fence, before.acked_index)
        assert [e.index for e in await read_all(stub, segment)] == [1, 2]
        await stub.Delete(segment_store_pb2.DeleteRequest(segment=segment))  # next case


TOO_LARGE_WRITES = [
    ("an entry", [b"x" * (EVENT_BYTES_MAX + 1)], EVENT_BYTES_MAX),
    (
        "a batch",
        [b"x" * EVENT_BYTES_MAX] * (WRITE_BATCH_BYTES_MAX // EVENT_BYTES_MAX + 1),
        WRITE_BATCH_BYTES_MAX,
    ),
]


@pytest.mark.parametrize(
    ("case", "payloads", "bound"), TOO_LARGE_WRITES, ids=[c for c, _, _ in TOO_LARGE_WRITES]
)
async def test_a_too_large_write_names_its_bound_and_ends_event_too_large(
    store: ServerProcess, case: str, payloads: list[bytes], bound: int
) -> None:
    """The SDK knows EventTooLarge by the bound the store attaches, not by its words."""
    segment = seg(107, 3)
    batch = [entry(index, 3, payload) for index, payload in enumerate(payloads, start=1)]
    async with store_stub(store) as stub:
        with pytest.raises(WriteRefused) as refused:
            await write_all(stub, [write_request(segment, 3, 0, batch)])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert dict(refused.value.trailing_metadata() or ())[TOO_LARGE_METADATA_KEY] == str(bound)
        assert isinstance(from_rpc_error(refused.value), EventTooLarge)
        with pytest.raises(grpc.aio.AioRpcError) as not_held:
            await state(stub, segment)
        assert not_held.value.code() == grpc.StatusCode.NOT_FOUND


async def test_other_malformed_requests_get_clear_statuses(store: ServerProcess) -> None:
    async with store_stub(store) as stub:
        unknown = seg(106, 3)
        cases: list[tuple[Awaitable[object], str]] = [
            (stub.Seal(seal_request(unknown, 0)), "INVALID"),
            (stub.Seal(seal_request(seg(0, 0), 3)), "INVALID"),
            (
                stub.GetSegmentState(segment_store_pb2.GetSegmentStateRequest(segment=unknown)),
                "NOT_FOUND",
            ),
            (stub.Digest(segment_store_pb2.DigestRequest(segment=unknown)), "NOT_FOUND"),
        ]
        for call, expected in cases:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code().name.startswith(expected), refused.value
        with pytest.raises(grpc.aio.AioRpcError) as not_found:
            await read_all(stub, unknown)
        assert not_found.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as bad_copy:
            await stub.CopySegment(
                segment_store_pb2.CopySegmentRequest(segment=unknown, final_index=3)
            )
        assert bad_copy.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            await stub.Delete(segment_store_pb2.DeleteRequest(segment=unknown))
        ).existed is False
    assert store.alive()


async def test_a_packed_read_sends_stored_values_back_to_back_and_stops_at_a_gap(
    store: ServerProcess,
) -> None:
    from streamengine.protocol.entry import VALUE_HEADER_BYTES, decode_value

    segment = seg(131, 3)
    async with store_stub(store) as stub:
        held = [*entries(1, 5), *entries(7, 8)]  # index 6 missing
        await write_all(stub, [write_request(segment, 3, 0, entries(1, 5))])
        await write_all(stub, [write_request(segment, 3, 0, entries(7, 8))])
        request = segment_store_pb2.ReadRequest(segment=segment, from_index=2, packed=True)
        replies = [reply async for reply in stub.Read(request)]
        assert all(not reply.entries for reply in replies)
        values = b"".join(reply.packed_values for reply in replies)
        lengths = [n for reply in replies for n in reply.value_lengths]
        assert replies[0].first_index == 2 and len(lengths) == 4  # 2..5, cut before 6
        offset, decoded = 0, []
        for number, length in enumerate(lengths):
            decoded.append(decode_value(2 + number, values[offset : offset + length]))
            offset += length
        want = held[1:5]
        assert [(e.index, e.payload, e.crc32c) for e in decoded] == [
            (e.index, e.payload, e.crc32c) for e in want
        ]
        assert all(length >= VALUE_HEADER_BYTES for length in lengths)
