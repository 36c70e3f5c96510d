"""The end of a run: seal every stream, read each from 0 with fresh readers, and dump
every replica of every segment (FAULTS.md §6.1 "End of run"). The result is plain data
(`final.json`), the checker's second input."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from streamengine.client import DataLossError
from streamengine.protocol.sequence import pack_sequence
from streamengine.testing import STREAMENGINE
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc
from tests.faults import payload
from tests.faults.channels import open_channel, stream_client
from tests.tree import child_env

SEAL_TIMEOUT_S = 60
READ_TIMEOUT_S = 120.0
DUMP_TIMEOUT_S = 30.0
FRESH_READERS = 2


def seal(master: str, stream: str) -> str:
    """`streamengine seal`; returns "" or what went wrong."""
    result = subprocess.run(
        [STREAMENGINE, "seal", stream, "--master", master, "--timeout", str(SEAL_TIMEOUT_S)],
        capture_output=True, text=True, timeout=SEAL_TIMEOUT_S + 30, env=child_env(),
    )
    return "" if result.returncode == 0 else (result.stdout + result.stderr).strip()[-500:]


async def fresh_read(master: str, stream: str, losses: list[list[int]]) -> list[list[Any]]:
    """Every event of `stream` from 0. A range the SDK reports lost (`DataLossError`)
    is appended to `losses` as [epoch, first index, last index], and the read goes on
    just past it, as a reader that accepts the loss would."""
    events: list[list[Any]] = []
    start = 0
    async with stream_client(master) as client:
        async with asyncio.timeout(READ_TIMEOUT_S):
            while True:
                try:
                    async for event in client.read(stream, start=start):
                        parsed = payload.parse(event.payload)
                        events.append([event.sequence, event.epoch, event.index, parsed.pid,
                                       payload.fingerprint(event.payload), parsed.intact])
                    return events
                except DataLossError as lost:
                    losses.append([lost.segment_epoch, lost.first_index, lost.last_index])
                    start = past_loss(lost)


def past_loss(lost: DataLossError) -> int:
    """The sequence just past a lost range: the cursor goes on to the next segment."""
    return pack_sequence(lost.segment_epoch, lost.last_index + 1)


def dump_replica(address: str, segment: entry_pb2.SegmentId) -> dict[str, Any]:
    """Everything one store holds of a segment, acked or not, beyond the bridge too."""
    entries: list[list[Any]] = []
    acked = fence = 0
    try:
        with open_channel(address) as channel:
            replies = store_grpc.SegmentStoreStub(channel).Read(
                segment_store_pb2.ReadRequest(segment=segment, from_index=1, to_index=0),
                timeout=DUMP_TIMEOUT_S,
            )
            for reply in replies:
                acked, fence = reply.acked_index, reply.fence
                for entry in reply.entries:
                    kind = entry_pb2.EntryKind.Name(entry.kind)
                    fp = payload.fingerprint(entry.payload) if kind == "EVENT" else ""
                    entries.append([entry.index, kind, entry.epoch, fp, entry.crc32c])
    except grpc.RpcError as error:
        return {"error": f"{error.code().name}: {error.details()}"}
    return {"acked_index": acked, "fence": fence, "entries": entries}


def probe_fence(address: str, segment: entry_pb2.SegmentId, fence: int, index: int) -> str:
    """C10: a write one epoch below the store's fence, of an event past the bridge, must
    be refused with FAILED_PRECONDITION. Returns "refused", "accepted" or the error."""
    from streamengine.protocol import codec
    from streamengine.protocol.entry import EntryKind, StoredEntry

    entry = StoredEntry.make(index, EntryKind.EVENT, fence - 1, b"fence-probe")
    request = codec.write_request([entry], segment=segment, writer_epoch=fence - 1,
                                  request_id=1)
    try:
        with open_channel(address) as channel:
            replies = store_grpc.SegmentStoreStub(channel).Write(iter([request]),
                                                                 timeout=DUMP_TIMEOUT_S)
            for reply in replies:
                if reply.status == segment_store_pb2.ACCEPTED:
                    return "accepted"
    except grpc.RpcError as error:
        # The probe carries no grant of the master's, so a store refuses it before its
        # fence is looked at (PERMISSION_DENIED): refused all the same, nothing written.
        if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED):
            return "refused"
        return f"{error.code().name}: {error.details()}"
    return "no answer"


_LOOP: asyncio.AbstractEventLoop | None = None
_T = TypeVar("_T")


def _run_async(work: Coroutine[Any, Any, _T]) -> _T:
    """Run `work` on one event loop kept for the whole harness process: grpc.aio's
    completion queue outlives an `asyncio.run`, and calls back into the loop it closed
    ("Event loop is closed") when the next run starts."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="final-reads", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(work, _LOOP).result()


def segments_of(master: str, stream: str) -> master_pb2.ListSegmentsReply:
    with open_channel(master) as channel:
        return master_pb2_grpc.MasterStub(channel).ListSegments(
            master_pb2.ListSegmentsRequest(stream=stream), timeout=10.0
        )


def final_state(master: str, streams: list[str], write_quorum: int) -> dict[str, Any]:
    out: dict[str, Any] = {"streams": {}}
    for stream in streams:
        started = time.monotonic()
        errors = []
        problem = seal(master, stream)
        if problem:
            errors.append(f"seal: {problem}")
        reads = []
        losses: list[list[list[int]]] = []
        for _ in range(FRESH_READERS):
            losses.append([])
            try:
                reads.append(_run_async(fresh_read(master, stream, losses[-1])))
            except Exception as error:
                errors.append(f"read: {type(error).__name__}: {error}")
        listing = segments_of(master, stream)
        segments: list[dict[str, Any]] = []
        for segment in listing.segments:
            segment_id = entry_pb2.SegmentId(
                stream_id=listing.stream_id, epoch=segment.id.epoch, stream=stream
            )
            segments.append({
                "epoch": segment.id.epoch,
                "state": entry_pb2.SegmentState.Name(segment.state),
                "final_index": segment.final_index,
                "copy_set": [replica.store_id for replica in segment.copy_set],
                "replicas": {
                    replica.store_id: dump_replica(replica.address, segment_id)
                    for replica in segment.copy_set
                },
            })
        # C10 after the dumps: an accepted probe would change what they recorded.
        for dumped in segments:
            if dumped["state"] != "SEALED":
                continue
            segment_id = entry_pb2.SegmentId(
                stream_id=listing.stream_id, epoch=dumped["epoch"], stream=stream
            )
            addresses = {r.store_id: r.address for s in listing.segments
                         if s.id.epoch == dumped["epoch"] for r in s.copy_set}
            dumped["fence_probes"] = {
                store: probe_fence(addresses[store], segment_id, dump["fence"],
                                   dumped["final_index"] + 1)
                for store, dump in sorted(dumped["replicas"].items())
                if dump.get("fence", 0) > 1
            }
        for dumped in segments:
            held = max((dump.get("acked_index", 0) for dump in dumped["replicas"].values()),
                       default=0)
            if dumped["state"] != "SEALED" and held:
                # The fresh reads stop before it: its acked events would look lost.
                errors.append(f"segment {dumped['epoch']} is {dumped['state']} after the "
                              f"seal with {held} acked entries (did a writer outlive the run?)")
        out["streams"][stream] = {
            "reads": reads,
            "losses": losses,
            "read_errors": errors,
            "segments": segments,
            "write_quorum": write_quorum,
            "final_s": round(time.monotonic() - started, 2),
        }
    return out


def save(final: dict[str, Any], path: Path) -> None:
    import json

    path.write_text(json.dumps(final, separators=(",", ":")))
