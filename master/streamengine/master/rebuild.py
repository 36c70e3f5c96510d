"""`streamengine master --rebuild`: the metadata rebuilt from the stores' records.

The master starts on empty metadata, serves the stores (they register again on their
own) and nothing else (`MasterCalls.rebuilding`), and asks each registered store for
every segment it holds with the master's record of it and the copy set its grants
listed (`ListSegmentRecords`, with the master's node certificate on a secured cluster).
Once every registered store, every store a record names (or the grants name, of a
segment no record reached) and every store a kept cluster view lists has answered, one
of them keeping a cluster id, or the deadline passed (the stores still missing are
logged), `master.rebuild` decides the catalog, which is committed; the server then
loads it as after a restart (no lease for one lease period). Each store's answer goes
with the incarnation it was registered under when asked, the cluster id it keeps and
its cluster view: a store with a database newer than the records naming it loses the
replicas they name it for (`StoreRecord.lost`), told at its next registration, and no
stream takes an id a view says the lost master gave.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from streamengine.master.catalog import Batch, Catalog
from streamengine.master.core import rebuild
from streamengine.master.core.errors import InvalidArgument
from streamengine.master.core.model import validate_stream_name
from streamengine.master.metadata import OPS_PER_TRANSACTION_MAX
from streamengine.master.records import MalformedRecord, cluster_view_from_pb, record_from_bytes
from streamengine.master.state import MasterState
from streamengine.protocol import transport
from streamengine.protocol.limits import REPLICAS_MAX
from streamengine.v1 import segment_store_pb2, segment_store_pb2_grpc

log = logging.getLogger("streamengine.master")

POLL_S = 0.2
CALL_TIMEOUT_S = 10.0
# Pages of one store's answer: a store of more segments than this times the page is
# read in part, and the rest is logged.
PAGES_PER_STORE_MAX = 100_000


class Rebuilder:
    def __init__(
        self,
        state: MasterState,
        members: transport.Transport,
        wait_s: float,
        clock_ms: Callable[[], int],
    ) -> None:
        self.state = state
        self.members = members
        self.wait_s = wait_s
        self.clock_ms = clock_ms
        self.answers: dict[str, list[rebuild.Holding]] = {}
        # The stores whose answers were whole, as they were when asked.
        self.answered: dict[str, rebuild.Answered] = {}
        self.cluster_ids: dict[str, str] = {}
        # The cluster view each store that answered keeps.
        self.views: dict[str, rebuild.View] = {}

    async def run(self) -> rebuild.Rebuilt:
        """Ask the stores until `rebuild.ready`; the catalog they make."""
        started_ms = self.clock_ms()
        deadline_ms = started_ms + int(self.wait_s * 1000)
        earliest_ms = min(started_ms + rebuild.REGISTRATION_GRACE_MS, deadline_ms)
        log.info("rebuilding the metadata from the stores (waiting up to %.0f s)", self.wait_s)
        channels: dict[str, grpc.aio.Channel] = {}
        try:
            while True:
                for store_id in sorted(set(self.state.stores) - set(self.answers)):
                    address = self.state.address(store_id)
                    if address not in channels:
                        channels[address] = self.members.aio_channel(address)
                    stub: segment_store_pb2_grpc.SegmentStoreAsyncStub = (
                        segment_store_pb2_grpc.SegmentStoreStub(channels[address])
                    )
                    incarnation = self.state.stores[store_id].incarnation
                    try:
                        self.answers[store_id], whole = await self._ask(store_id, stub)
                    except grpc.aio.AioRpcError as error:
                        log.info("store %s did not answer yet: %s", store_id, error.code())
                        continue
                    if whole:
                        self.answered[store_id] = rebuild.Answered(
                            incarnation, self.cluster_ids.get(store_id, "")
                        )
                    log.info("store %s holds %d segments", store_id, len(self.answers[store_id]))
                holdings = [h for answer in self.answers.values() for h in answer]
                named = rebuild.named_stores(holdings, self.views.values())
                registered = set(self.state.stores)
                joined = {s for s in self.answers if self.cluster_ids.get(s)}
                now_ms = self.clock_ms()
                if rebuild.ready(
                    registered,
                    self.answers,
                    named,
                    now_ms,
                    deadline_ms,
                    earliest_ms,
                    joined=joined,
                ):
                    break
                await asyncio.sleep(POLL_S)
        finally:
            for channel in channels.values():
                await channel.close(None)
        absent = rebuild.missing(registered, self.answers, named)
        if absent:
            log.warning("rebuilding without stores %s: they did not answer", ", ".join(absent))
        if not joined:
            log.warning("rebuilding with no store that keeps a cluster id: none knew the cluster")
        rebuilt = rebuild.rebuild(
            holdings, self.clock_ms(), self.answered, self.state.stores, self.views.values()
        )
        rebuilt.cluster_id, notes = rebuild.adopted_cluster_id(
            {**self.state.store_cluster_ids, **self.cluster_ids}
        )
        rebuilt.notes.extend(notes)
        for note in rebuilt.notes:
            log.warning("rebuild: %s", note)
        log.info(
            "rebuilt %d streams, %d segments from %d stores",
            len(rebuilt.streams),
            len(rebuilt.segments),
            len(self.answers),
        )
        return rebuilt

    async def _ask(
        self, store_id: str, stub: segment_store_pb2_grpc.SegmentStoreAsyncStub
    ) -> tuple[list[rebuild.Holding], bool]:
        """What the store holds, and whether that is all of it (every page read)."""
        holdings: list[rebuild.Holding] = []
        after = (0, 0)
        for _ in range(PAGES_PER_STORE_MAX):
            reply = await stub.ListSegmentRecords(
                segment_store_pb2.ListSegmentRecordsRequest(
                    after_stream_id=after[0], after_epoch=after[1]
                ),
                timeout=CALL_TIMEOUT_S,
            )
            if reply.cluster_id:
                self.cluster_ids[store_id] = reply.cluster_id
            if reply.HasField("cluster_view"):
                self.views[store_id] = cluster_view_from_pb(reply.cluster_view)
            for held in reply.segments:
                holdings.append(_holding(store_id, held))
                after = (held.segment.stream_id, held.segment.epoch)
            if not reply.more or not reply.segments:
                return holdings, True
        log.warning(
            "store %s holds more than %d pages: read in part", store_id, PAGES_PER_STORE_MAX
        )
        return holdings, False


def _holding(store_id: str, held: segment_store_pb2.HeldSegmentRecord) -> rebuild.Holding:
    key = (held.segment.stream_id, held.segment.epoch)
    record = None
    if held.record:
        try:
            record = record_from_bytes(held.record)
        except MalformedRecord as error:
            log.warning("store %s, segment %s: %s", store_id, key, error)
        if record is not None and record[1].key != key:
            log.warning("store %s keeps the record of %s as %s", store_id, record[1].key, key)
            record = None
    copy_set = tuple(held.copy_set)
    if len(set(copy_set)) != len(copy_set) or len(copy_set) > REPLICAS_MAX or not all(copy_set):
        log.warning("store %s keeps the copy set of %s as %s: ignored", store_id, key, copy_set)
        copy_set = ()
    stream_name = held.stream_name
    if stream_name:
        try:
            tenant, _ = validate_stream_name(stream_name)
        except InvalidArgument:
            tenant = ""
        if tenant != held.tenant:
            log.warning(
                "store %s keeps the name of stream %d as %r: ignored", store_id, key[0], stream_name
            )
            stream_name = ""
    return rebuild.Holding(
        store_id,
        key[0],
        key[1],
        held.fence,
        held.acked_index,
        held.bridge_index,
        held.tenant,
        record,
        copy_set,
        stream_name,
        held.write_quorum if stream_name and held.write_quorum <= REPLICAS_MAX else 0,
    )


def commit(catalog: Catalog, rebuilt: rebuild.Rebuilt) -> None:
    """The rebuilt records, a transaction at a time, between a first transaction that
    marks the metadata unfinished and a last one that clears the mark (with the next
    stream id and the cluster id): a rebuild cut short is never served."""
    catalog.commit(Batch().rebuilding(True))
    batch = Batch()

    def flush() -> Batch:
        catalog.commit(batch)
        return Batch()

    for tenant, created_at_ms in sorted(rebuilt.tenants.items()):
        batch.tenant(tenant, created_at_ms)
        if batch.ops() >= OPS_PER_TRANSACTION_MAX:
            batch = flush()
    for _, stream in sorted(rebuilt.streams.items()):
        batch.stream(stream)
        if batch.ops() >= OPS_PER_TRANSACTION_MAX:
            batch = flush()
    for _, segment in sorted(rebuilt.segments.items()):
        batch.segment(segment)
        if batch.ops() >= OPS_PER_TRANSACTION_MAX:
            batch = flush()
    for _, store in sorted(rebuilt.stores.items()):
        batch.store(store)
        if batch.ops() >= OPS_PER_TRANSACTION_MAX:
            batch = flush()
    flush()
    last = Batch().rebuilt_through(rebuilt.next_stream_id - 1).rebuilding(False)
    if rebuilt.cluster_id:
        last.cluster_id(rebuilt.cluster_id)
    catalog.commit(last.next_stream_id(rebuilt.next_stream_id))
