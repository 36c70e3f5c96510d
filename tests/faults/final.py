"""The end of a run: seal every stream, read each from 0 with fresh readers, and dump
every replica of every segment (FAULTS.md §6.1 "End of run"). The result is plain data
(`final.json`), the checker's second input.

Every stream is sealed in this process through the SDK, as `streamengine seal` does
(`StreamClient.seal`), `SEALS_IN_FLIGHT` at once, each again after a failure; then
`STREAMS_IN_FLIGHT` streams at once are read back and dumped, the dumps on
`DUMPS_IN_FLIGHT` threads: 1,000 streams cost no process each, and the stores' calls stay
far below what a store serves at once."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc

from streamengine.client import DataLossError, StreamClient
from streamengine.protocol import framed_read
from streamengine.protocol.framed import CallError
from streamengine.protocol.sequence import pack_sequence
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from tests.faults import payload
from tests.faults.channels import harness_transport, open_channel, stream_client

log = logging.getLogger(__name__)

SEAL_TIMEOUT_S = 60
READ_TIMEOUT_S = 120.0
DUMP_TIMEOUT_S = 30.0
FRESH_READERS = 2
SEALS_IN_FLIGHT = 16
STREAMS_IN_FLIGHT = 8
DUMPS_IN_FLIGHT = 16


async def seal_all(master: str, streams: list[str]) -> dict[str, tuple[str, float]]:
    """Seal every stream's open segment (`StreamClient.seal`, what `streamengine seal`
    calls), again after a failure until `SEAL_TIMEOUT_S` has passed, as an operator
    would; per stream, "" or what went wrong last, and the seconds it took."""
    slots = asyncio.Semaphore(SEALS_IN_FLIGHT)
    async with stream_client(master) as client:

        async def seal(stream: str) -> tuple[str, float]:
            async with slots:
                started = time.monotonic()
                while True:
                    left = SEAL_TIMEOUT_S - (time.monotonic() - started)
                    try:
                        await client.seal(stream, timeout_s=max(1.0, left))
                        return "", time.monotonic() - started
                    except Exception as error:
                        # On a loaded box a seal that leads for a moment can lose its
                        # own lease (LeadershipLost) before it is done.
                        problem = f"{type(error).__name__}: {error}"[:500]
                        log.info("seal of %s failed, again: %s", stream, problem)
                    if time.monotonic() - started >= SEAL_TIMEOUT_S:
                        return problem, time.monotonic() - started

        outcomes = await asyncio.gather(*(seal(stream) for stream in streams))
    return dict(zip(streams, outcomes, strict=True))


async def fresh_read(client: StreamClient, stream: str, losses: list[list[int]]
                     ) -> list[list[Any]]:
    """Every event of `stream` from 0, read by `client` (a fresh reader's, which reads
    each stream once). A range the SDK reports lost (`DataLossError`) is appended to
    `losses` as [epoch, first index, last index], and the read goes on just past it, as
    a reader that accepts the loss would."""
    events: list[list[Any]] = []
    start = 0
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


class ServerChannels:
    """One channel per server address (the master's, each store's) for the whole final
    phase, when nothing is faulted any more (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, grpc.Channel] = {}

    def __call__(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._open:
                self._open[address] = open_channel(address)
            return self._open[address]

    def close(self) -> None:
        with self._lock:
            for channel in self._open.values():
                channel.close()
            self._open.clear()


def dump_replica(data_address: str, segment: entry_pb2.SegmentId) -> dict[str, Any]:
    """Everything one store holds of a segment, acked or not, beyond the bridge too
    (read on its data plane)."""
    entries: list[list[Any]] = []
    acked = fence = 0
    try:
        replies = framed_read.read_sync(
            data_address,
            harness_transport(),
            segment_store_pb2.ReadRequest(segment=segment, from_index=1, to_index=0),
            DUMP_TIMEOUT_S,
        )
        for reply in replies:
            acked, fence = reply.acked_index, reply.fence
            for entry in reply.entries:
                kind = entry_pb2.EntryKind.Name(entry.kind)
                fp = payload.fingerprint(entry.payload) if kind == "EVENT" else ""
                entries.append([entry.index, kind, entry.epoch, fp, entry.crc32c])
    except CallError as error:
        return {"error": f"{error.code.name}: {error.details}"}
    return {"acked_index": acked, "fence": fence, "entries": entries}


def probe_fence(data_address: str, segment: entry_pb2.SegmentId, fence: int, index: int
                ) -> str:
    """C10: a write one epoch below the store's fence, of an event past the bridge, must
    be refused with FAILED_PRECONDITION. Returns "refused", "accepted" or the error.
    On the store's data plane, as writers write."""
    from bench.segment_driver import write_stream
    from streamengine.protocol import codec
    from streamengine.protocol.entry import EntryKind, StoredEntry
    from streamengine.protocol.framed import CallError

    entry = StoredEntry.make(index, EntryKind.EVENT, fence - 1, b"fence-probe")
    request = codec.write_request([entry], segment=segment, writer_epoch=fence - 1,
                                  request_id=1)
    # The probe carries no grant of the master's, so a store refuses it before its fence
    # is looked at (PERMISSION_DENIED): refused all the same, nothing written.
    refusals = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED)
    try:
        replies = asyncio.run(write_stream(data_address, [request], harness_transport(),
                                           DUMP_TIMEOUT_S))
        for reply in replies:
            if reply.status == segment_store_pb2.ACCEPTED:
                return "accepted"
            if reply.status == segment_store_pb2.REFUSED:
                # A store answers a refused request in its reply and reads on (the
                # Write stream carries other segments' requests too).
                code = next((c for c in grpc.StatusCode if c.value[0] == reply.error.code),
                            None)
                if code in refusals:
                    return "refused"
                return f"{code.name if code else reply.error.code}: {reply.error.details}"
    except CallError as error:
        if error.code.value in (code.value[0] for code in refusals):
            return "refused"
        return f"{error.code.name}: {error.details}"
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


def segments_of(channel: grpc.Channel, stream: str) -> master_pb2.ListSegmentsReply:
    return master_pb2_grpc.MasterStub(channel).ListSegments(
        master_pb2.ListSegmentsRequest(stream=stream), timeout=10.0
    )


def final_state(master: str, streams: list[str], write_quorum: int) -> dict[str, Any]:
    return _run_async(_final_state(master, streams, write_quorum))


async def _final_state(master: str, streams: list[str], write_quorum: int) -> dict[str, Any]:
    sealed = await seal_all(master, streams)
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(STREAMS_IN_FLIGHT)
    channels = ServerChannels()
    readers = [stream_client(master) for _ in range(FRESH_READERS)]
    try:
        with ThreadPoolExecutor(DUMPS_IN_FLIGHT, thread_name_prefix="final-dumps") as pool:
            for reader in readers:
                await reader.__aenter__()

            async def blocking(call: Callable[[], _T]) -> _T:
                return await loop.run_in_executor(pool, call)

            async def one(stream: str) -> dict[str, Any]:
                async with slots:
                    problem, seal_s = sealed[stream]
                    return await stream_final(master, stream, write_quorum, problem, seal_s,
                                              readers, channels, blocking)

            states = await asyncio.gather(*(one(stream) for stream in streams))
    finally:
        for reader in readers:
            await reader.close()
        channels.close()
    return {"streams": dict(zip(streams, states, strict=True))}


async def stream_final(master: str, stream: str, write_quorum: int, seal_problem: str,
                       seal_s: float, readers: list[StreamClient], channels: ServerChannels,
                       blocking: Callable[[Callable[[], Any]], Coroutine[Any, Any, Any]]
                       ) -> dict[str, Any]:
    """A sealed stream read from 0 by every fresh reader at once, then every replica of
    every segment dumped and probed (`blocking` runs a gRPC call on a thread)."""
    started = time.monotonic()
    errors = [f"seal: {seal_problem}"] if seal_problem else []
    losses: list[list[list[int]]] = [[] for _ in readers]
    outcomes = await asyncio.gather(
        *(fresh_read(reader, stream, lost) for reader, lost in zip(readers, losses, strict=True)),
        return_exceptions=True)
    # `losses` keeps one list per fresh reader, as read (a failed read's too).
    reads = []
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            errors.append(f"read: {type(outcome).__name__}: {outcome}")
        else:
            reads.append(outcome)
    to_master = channels(master)
    listing = await blocking(lambda: segments_of(to_master, stream))
    data_addresses = {(s.id.epoch, r.store_id): r.data_address for s in listing.segments
                      for r in s.copy_set}

    def segment_id(epoch: int) -> entry_pb2.SegmentId:
        return entry_pb2.SegmentId(stream_id=listing.stream_id, epoch=epoch, stream=stream)

    async def dump(epoch: int, store: str) -> dict[str, Any]:
        data_address = data_addresses[(epoch, store)]
        return await blocking(lambda: dump_replica(data_address, segment_id(epoch)))

    segments: list[dict[str, Any]] = []
    for segment in listing.segments:
        stores = [replica.store_id for replica in segment.copy_set]
        dumps = await asyncio.gather(*(dump(segment.id.epoch, store) for store in stores))
        segments.append({
            "epoch": segment.id.epoch,
            "state": entry_pb2.SegmentState.Name(segment.state),
            "final_index": segment.final_index,
            "copy_set": stores,
            "replicas": dict(zip(stores, dumps, strict=True)),
        })
    # C10 after the dumps: an accepted probe would change what they recorded.
    for dumped in segments:
        if dumped["state"] != "SEALED":
            continue
        probed = [(store, dump["fence"]) for store, dump in sorted(dumped["replicas"].items())
                  if dump.get("fence", 0) > 1]

        async def probe(store: str, fence: int, dumped: dict[str, Any] = dumped) -> str:
            data_address = data_addresses[(dumped["epoch"], store)]
            return await blocking(lambda: probe_fence(
                data_address, segment_id(dumped["epoch"]), fence, dumped["final_index"] + 1))

        outcomes_of = await asyncio.gather(*(probe(store, fence) for store, fence in probed))
        dumped["fence_probes"] = {store: outcome for (store, _), outcome
                                  in zip(probed, outcomes_of, strict=True)}
    for dumped in segments:
        held = max((dump.get("acked_index", 0) for dump in dumped["replicas"].values()),
                   default=0)
        if dumped["state"] != "SEALED" and held:
            # The fresh reads stop before it: its acked events would look lost.
            errors.append(f"segment {dumped['epoch']} is {dumped['state']} after the "
                          f"seal with {held} acked entries (did a writer outlive the run?)")
    return {
        "reads": reads,
        "losses": losses,
        "read_errors": errors,
        "segments": segments,
        "write_quorum": write_quorum,
        "final_s": round(seal_s + time.monotonic() - started, 2),
    }


def save(final: dict[str, Any], path: Path) -> None:
    import json

    path.write_text(json.dumps(final, separators=(",", ":")))
