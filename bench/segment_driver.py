"""Make sealed segments with data by driving master and stores over raw gRPC.

For tests of repair, drain and rebalance that need real data on real stores without the
client SDK. It plays one leader doing exactly what docs/design.md's leader does on a roll,
with no failures: heartbeat for the lease and copy set, write events to every store of
the copy set and raise their acked index, RollSegment for the next epoch, Seal the old
segment on its stores with the new epoch, write the BRIDGE and raise the acked index
over it, then SealSegment at the master with the segment's certificate (or without one,
as a segment sealed before certificates existed: `certify=False`). Every write, seal and
master call under an epoch carries the master's grant of it, from the answer that
granted it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from streamengine.protocol import codec, framed, framing
from streamengine.protocol.certificate import certificate_of
from streamengine.protocol.entry import EntryKind, StoredEntry
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

CALL_TIMEOUT_S = 10.0


def store_stub(address: str) -> tuple[grpc.Channel, store_grpc.SegmentStoreStub]:
    channel = grpc.insecure_channel(address)
    return channel, store_grpc.SegmentStoreStub(channel)


class WriteRefused(grpc.RpcError):
    """A Write request refused in its reply, read as an ended call's error."""

    def __init__(self, reply: segment_store_pb2.WriteReply) -> None:
        self.reply = reply
        super().__init__(f"{self.code().name}: {reply.error.details}")

    def code(self) -> grpc.StatusCode:
        return next(c for c in grpc.StatusCode if c.value[0] == self.reply.error.code)

    def details(self) -> str:
        return self.reply.error.details

    def trailing_metadata(self) -> Any:  # (key, value) pairs, as a call's at run time
        return tuple(self.reply.error.metadata.items())


class CallRefused(grpc.RpcError):
    """A Write stream of the data plane ended with a status, read as a gRPC call's
    error (`code`, `details`, `trailing_metadata`)."""

    def __init__(self, error: framed.CallError) -> None:
        self.error = error
        super().__init__(str(error))

    def code(self) -> grpc.StatusCode:
        return next(c for c in grpc.StatusCode if c.value[0] == self.error.code)

    def details(self) -> str:
        return self.error.details

    def trailing_metadata(self) -> Any:
        return tuple(self.error.metadata.items())


async def write_stream(
    data_address: str,
    requests: Iterable[segment_store_pb2.WriteRequest],
    transport: Transport = PLAINTEXT,
    timeout_s: float = CALL_TIMEOUT_S,
) -> list[segment_store_pb2.WriteReply]:
    """Every request on one Write stream of the store's data plane, then its end; the
    replies, in order, refused ones included. Raises framed.CallError for what ends the
    stream with a status."""
    replies: list[segment_store_pb2.WriteReply] = []
    async with asyncio.timeout(timeout_s), framed.connect(data_address, transport) as connection:
        call = await connection.call(framing.WRITE)
        for request in requests:
            await call.send(request)
        await call.end()
        while (reply := await call.receive()) is not None:
            assert isinstance(reply, segment_store_pb2.WriteReply)
            replies.append(reply)
    return replies


def write(
    data_address: str,
    segment: entry_pb2.SegmentId,
    writer_epoch: int,
    entries: list[StoredEntry],
    acked: int,
    grant: bytes,
) -> None:
    """Write `entries` to one store (on its data plane) under `grant` (of
    `writer_epoch`), then raise its acked index to `acked`."""
    requests = [
        codec.write_request(
            entries,
            segment=segment,
            writer_epoch=writer_epoch,
            acked_index=0,
            request_id=1,
            grant=grant,
        ),
        segment_store_pb2.WriteRequest(
            segment=segment, writer_epoch=writer_epoch, acked_index=acked, request_id=2
        ),
    ]
    try:
        replies = asyncio.run(write_stream(data_address, requests))
    except framed.CallError as error:
        raise CallRefused(error) from None
    refused = [reply for reply in replies if reply.status == segment_store_pb2.REFUSED]
    if refused:
        raise WriteRefused(refused[0])
    assert [r.status for r in replies] == [segment_store_pb2.ACCEPTED] * 2, replies
    assert replies[-1].acked_index == acked, replies[-1]


def seal(
    address: str, segment: entry_pb2.SegmentId, new_epoch: int, grant: bytes
) -> segment_store_pb2.SealReply:
    channel, stub = store_stub(address)
    with channel:
        reply: segment_store_pb2.SealReply = stub.Seal(
            segment_store_pb2.SealRequest(segment=segment, new_epoch=new_epoch, grant=grant),
            timeout=CALL_TIMEOUT_S,
        )
        return reply


@dataclass
class Driver:
    """One leader of one stream, driven by hand."""

    master: str
    stream: str
    client_id: str = "driver"
    epoch: int = 0
    segment: entry_pb2.Segment | None = None
    # The master's signed grant of `epoch`, and the lease secret handed with it.
    grant: bytes = b""
    lease_secret: bytes = b""
    # Seal with the certificate of what was written, as a leader's roll does.
    certify: bool = True

    def _stub(self) -> tuple[grpc.Channel, master_pb2_grpc.MasterStub]:
        channel = grpc.insecure_channel(self.master)
        return channel, master_pb2_grpc.MasterStub(channel)

    def lead(self, timeout_s: float = 15.0) -> master_pb2.WriterHeartbeatReply:
        """Heartbeat until this driver leads; returns the last reply."""
        deadline = time.monotonic() + timeout_s
        channel, stub = self._stub()
        with channel:
            while True:
                try:
                    reply = stub.WriterHeartbeat(
                        master_pb2.WriterHeartbeatRequest(
                            stream=self.stream,
                            client_id=self.client_id,
                            epoch=self.epoch,
                            lease_secret=self.lease_secret,
                        ),
                        timeout=CALL_TIMEOUT_S,
                    )
                except grpc.RpcError as error:
                    if (
                        error.code() != grpc.StatusCode.FAILED_PRECONDITION
                        or time.monotonic() > deadline
                    ):
                        raise
                    time.sleep(0.1)
                    continue
                if reply.role == master_pb2.LEADER:
                    self.epoch, self.grant = reply.epoch, reply.grant
                    self.lease_secret = reply.lease_secret or self.lease_secret
                    if reply.HasField("segment"):
                        self.segment = reply.segment
                    return reply
                assert time.monotonic() < deadline, f"{self.client_id} never led {self.stream}"
                time.sleep(0.05)

    def fill_and_roll(
        self,
        events: int,
        payload_bytes: int,
        bridge_on: int | None = None,
        entries: list[StoredEntry] | None = None,
    ) -> entry_pb2.Segment:
        """Write `events` events to the open segment, roll, seal and bridge it; returns
        the sealed segment as the master records it. With `bridge_on`, only that many
        members of the copy set get the bridge (the others missed it). `entries` replaces
        the generated events (e.g. to leave HOLEs as a recovery does)."""
        self.lead()
        assert self.segment is not None, "the leader has no open segment"
        old, old_epoch, old_grant = self.segment, self.epoch, self.grant
        if entries is None:
            entries = [
                StoredEntry.make(i, EntryKind.EVENT, old_epoch, bytes([i % 256]) * payload_bytes)
                for i in range(1, events + 1)
            ]
        events = len(entries)
        for replica in old.copy_set:
            write(replica.data_address, old.id, old_epoch, entries, events, old_grant)
        channel, stub = self._stub()
        with channel:
            rolled = stub.RollSegment(
                master_pb2.RollSegmentRequest(
                    stream=self.stream,
                    client_id=self.client_id,
                    epoch=old_epoch,
                    grant=old_grant,
                    lease_secret=self.lease_secret,
                ),
                timeout=CALL_TIMEOUT_S,
            )
            self.epoch, self.segment, self.grant = rolled.epoch, rolled.segment, rolled.grant
            bridge = StoredEntry.make(events + 1, EntryKind.BRIDGE, self.epoch)
            for number, replica in enumerate(old.copy_set):
                sealed = seal(replica.address, old.id, self.epoch, self.grant)
                assert sealed.fence == self.epoch and sealed.acked_index == events
                if bridge_on is None or number < bridge_on:
                    write(
                        replica.data_address, old.id, self.epoch, [bridge], events + 1, self.grant
                    )
            request = master_pb2.SealSegmentRequest(
                stream=self.stream,
                segment_epoch=old_epoch,
                writer_epoch=self.epoch,
                client_id=self.client_id,
                final_index=events + 1,
                grant=self.grant,
            )
            if self.certify:
                content = [(e.index, int(e.kind), e.payload) for e in [*entries, bridge]]
                request.certificate.CopyFrom(codec.certificate_to_pb(certificate_of(content)))
            result: entry_pb2.Segment = stub.SealSegment(request, timeout=CALL_TIMEOUT_S)
        return result


def sealed_segments(master: str, stream: str) -> list[entry_pb2.Segment]:
    with grpc.insecure_channel(master) as channel:
        reply = master_pb2_grpc.MasterStub(channel).ListSegments(
            master_pb2.ListSegmentsRequest(stream=stream), timeout=CALL_TIMEOUT_S
        )
    return [s for s in reply.segments if s.state == entry_pb2.SEALED]


def replica_digests(segment: entry_pb2.Segment) -> dict[str, tuple[bytes, int]]:
    """(digest up to the bridge, acked index) of every copy-set member that answers."""
    out = {}
    for replica in segment.copy_set:
        channel, stub = store_stub(replica.address)
        with channel:
            try:
                reply = stub.Digest(
                    segment_store_pb2.DigestRequest(
                        segment=segment.id, up_to_index=segment.final_index
                    ),
                    timeout=CALL_TIMEOUT_S,
                )
            except grpc.RpcError:
                continue
        out[replica.store_id] = (reply.digest, reply.acked_index)
    return out


def fully_replicated(segment: entry_pb2.Segment, replicas: int, alive: set[str]) -> bool:
    """N distinct live members, each holding the bridge with one and the same digest."""
    members = [r.store_id for r in segment.copy_set]
    if len(set(members)) != replicas or not set(members) <= alive:
        return False
    digests = replica_digests(segment)
    return (
        len(digests) == replicas
        and len({d for d, _ in digests.values()}) == 1
        and all(acked >= segment.final_index for _, acked in digests.values())
    )
