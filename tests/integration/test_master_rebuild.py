"""A master whose disk is lost rebuilds its metadata from the stores (`master --rebuild`).

Real processes: streams with sealed and open segments, the master SIGKILLed and its data
directory deleted, a master started with `--rebuild` on an empty directory at the same
address. Every acked event is read back in order, every stream takes new appends, and
the new writers' epochs are above every earlier one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from streamengine.client import SegmentState, StreamClient, StreamInfo
from streamengine.client.wire import SEGMENT_STATES
from streamengine.master.core.rebuild import REBUILD_EPOCH_GAP
from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.protocol.sequence import unpack_sequence
from streamengine.protocol.transport import PLAINTEXT, Transport
from streamengine.testing import (
    STREAMENGINE,
    Cluster,
    etcd_binary,
    running_cluster,
    running_etcd,
    running_ha_cluster,
    server_env,
    wait_until,
)
from streamengine.v1 import entry_pb2, master_pb2, segment_store_pb2
from streamengine.v1 import master_pb2_grpc as master_grpc
from streamengine.v1 import segment_store_pb2_grpc as store_grpc

MASTER_ARGS = ["--lease-ms", "1000", "--store-timeout-ms", "2000"]
STREAMS = ["acme/orders", "acme/audit", "beta/clicks"]
EVENTS_PER_WRITER = 15


def payload(stream: str, writer: int, n: int) -> bytes:
    return f"{stream}:{writer}:{n}".encode()


def master_transport(cluster: Cluster) -> Transport:
    """The master's own (its node certificate under TLS): ListSegmentRecords is its call."""
    args = cluster.master.args
    if "--certs-dir" not in args:
        return PLAINTEXT
    return Transport.for_node(Path(args[args.index("--certs-dir") + 1]))


async def records_of(
    address: str, transport: Transport, after: entry_pb2.SegmentId | None = None
) -> dict[tuple[int, int], entry_pb2.SegmentRecord]:
    """The segment records a store keeps (those it holds without one are left out), in
    one page (after the segment `after`)."""
    request = segment_store_pb2.ListSegmentRecordsRequest()
    if after is not None:
        request.after_stream_id, request.after_epoch = after.stream_id, after.epoch
    async with transport.aio_channel(address, CLIENT_OPTIONS) as channel:
        stub = store_grpc.SegmentStoreStub(channel)
        reply = await stub.ListSegmentRecords(request, timeout=5)
        assert not reply.more
    out = {}
    for held in reply.segments:
        if held.record:
            record = entry_pb2.SegmentRecord()
            record.ParseFromString(held.record)
            out[(held.segment.stream_id, held.segment.epoch)] = record
    return out


async def copy_sets_kept(address: str, transport: Transport) -> dict[tuple[int, int], list[str]]:
    """Per segment a store holds, the copy set the grant of its first write or seal
    there listed (the rebuild's for a segment no record reached)."""
    async with transport.aio_channel(address, CLIENT_OPTIONS) as channel:
        reply = await store_grpc.SegmentStoreStub(channel).ListSegmentRecords(
            segment_store_pb2.ListSegmentRecordsRequest(), timeout=5
        )
    return {(h.segment.stream_id, h.segment.epoch): list(h.copy_set) for h in reply.segments}


async def cluster_ids(cluster: Cluster) -> set[str]:
    """The cluster ids the stores keep."""
    ids = set()
    for store in cluster.stores:
        async with master_transport(cluster).aio_channel(store.address, CLIENT_OPTIONS) as channel:
            reply = await store_grpc.SegmentStoreStub(channel).ListSegmentRecords(
                segment_store_pb2.ListSegmentRecordsRequest(), timeout=5
            )
        ids.add(reply.cluster_id)
    return ids


async def stores_know_every_segment(cluster: Cluster, client: StreamClient) -> bool:
    """Every member of every segment keeps the master's record of it as it is now."""
    transport = master_transport(cluster)
    kept = {s.name: await records_of(s.address, transport) for s in cluster.stores}
    for name in STREAMS:
        for segment in await client.list_segments(name):
            key = (segment.stream_id, segment.epoch)
            for replica in segment.copy_set:
                record = kept[replica.store_id].get(key)
                if record is None or (SEGMENT_STATES[record.state], record.final_index) != (
                    segment.state,
                    segment.final_index,
                ):
                    return False
    return True


async def write_history(client: StreamClient) -> tuple[dict[str, list[bytes]], int]:
    """Per stream: a writer's events in a segment sealed by the next writer, whose
    events stay in an open segment. Returns what was acked and the highest epoch."""
    acked: dict[str, list[bytes]] = {}
    epoch_max = 0
    for name in STREAMS:
        await client.create_stream(name, replicas=3, write_quorum=2)
        acked[name] = []
        for writer_number in range(2):
            async with client.writer(name, leadership_timeout_s=10) as writer:
                events = [payload(name, writer_number, n) for n in range(EVENTS_PER_WRITER)]
                sequences = await writer.append_batch(events)
                acked[name] += events
                epoch_max = max(epoch_max, *(unpack_sequence(s)[0] for s in sequences))
    return acked, epoch_max


async def rebuilt(cluster: Cluster) -> bool:
    """The master lists every stream (while it rebuilds it answers UNAVAILABLE)."""
    address = cluster.master.address
    async with cluster.client_transport.aio_channel(address, CLIENT_OPTIONS) as channel:
        stub = master_grpc.MasterStub(channel)
        try:
            reply = await stub.ListStreams(master_pb2.ListStreamsRequest(), timeout=2)
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            return False
    return len(reply.streams) == len(STREAMS)


async def read_all(client: StreamClient, name: str) -> list[bytes]:
    return [event.payload async for event in client.read(name, 0)]


def restart_rebuilding(cluster: Cluster) -> None:
    """SIGKILL the master, lose its data directory, start it with --rebuild."""
    master = cluster.master
    master.kill()
    data = Path(master.args[master.args.index("--data") + 1])
    shutil.rmtree(data)
    data.mkdir()
    master.args += ["--rebuild", "--rebuild-wait-s", "20"]
    master.start()


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_a_master_rebuilt_from_the_stores_loses_no_stream_and_epochs_keep_rising(
    tmp_path: Path, tls: bool
) -> None:
    """Under TLS the master asks the stores with its node certificate, and the stores
    take the rebuilt master's new signing key from its signed replies."""
    with running_cluster(tmp_path, stores=4, master_args=MASTER_ARGS, tls=tls) as cluster:
        certs = cluster.admin_certs_dir
        async with StreamClient(cluster.master.address, certs_dir=certs) as client:
            acked, epoch_before = await write_history(client)
            info_before = {n: await client.describe_stream(n) for n in STREAMS}
            sealed = await client.list_segments(STREAMS[0])
            assert [s.state for s in sealed] == [SegmentState.SEALED, SegmentState.OPEN]
            # The records reach the stores with their heartbeats (a second or so).
            await wait_until(
                lambda: stores_know_every_segment(cluster, client), 20, "records kept", 0.2
            )
            # A page starts after the segment named.
            first = entry_pb2.SegmentId(stream_id=sealed[0].stream_id, epoch=sealed[0].epoch)
            after = await records_of(
                sealed[0].copy_set[0].address, master_transport(cluster), first
            )
            assert after and min(after) > (first.stream_id, first.epoch)
            kept_ids = await cluster_ids(cluster)
            assert len(kept_ids) == 1 and "" not in kept_ids, kept_ids
            # Each member keeps the copy set its grants listed, as the master has it.
            transport = master_transport(cluster)
            kept = {s.name: await copy_sets_kept(s.address, transport) for s in cluster.stores}
            for name in STREAMS:
                for segment in await client.list_segments(name):
                    members = [r.store_id for r in segment.copy_set]
                    for member in members:
                        key = (segment.stream_id, segment.epoch)
                        assert kept[member][key] == members, (name, key, member)
        restart_rebuilding(cluster)
        await check_rebuilt(cluster, acked, epoch_before, info_before, kept_ids)


async def check_rebuilt(
    cluster: Cluster,
    acked: dict[str, list[bytes]],
    epoch_before: int,
    info_before: dict[str, StreamInfo],
    kept_ids: set[str],
) -> None:
    """Every stream as it was, every acked event read back, every stream writable
    under epochs above every epoch granted before the loss, the stores' cluster id."""
    await wait_until(lambda: rebuilt(cluster), 30, "rebuilt", 0.1)
    certs = cluster.admin_certs_dir
    async with StreamClient(cluster.master_address, certs_dir=certs) as client:
        assert "rebuilt 3 streams" in cluster.master.log()
        for name in STREAMS:
            info = await client.describe_stream(name)
            before = info_before[name]
            # Epochs start past every one the lost master may have granted unseen.
            assert (info.stream_id, info.replicas, info.write_quorum, info.epoch) == (
                before.stream_id,
                before.replicas,
                before.write_quorum,
                before.epoch + REBUILD_EPOCH_GAP,
            ), name
            assert await read_all(client, name) == acked[name], name
        created = await client.create_stream("acme/new", replicas=3, write_quorum=2)
        assert created.stream_id > max(i.stream_id for i in info_before.values())
        for name in STREAMS:
            async with client.writer(name, leadership_timeout_s=15) as writer:
                events = [payload(name, 9, n) for n in range(EVENTS_PER_WRITER)]
                sequences = await writer.append_batch(events)
                acked[name] += events
            assert min(unpack_sequence(s)[0] for s in sequences) > epoch_before
            assert await read_all(client, name) == acked[name], name
    # The rebuilt master adopted the stores' cluster id: every store joined it.
    assert all(store.alive() for store in cluster.stores)
    assert await cluster_ids(cluster) == kept_ids


@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (make setup does)")
async def test_masters_on_etcd_rebuild_lost_metadata_from_the_stores(tmp_path: Path) -> None:
    """The etcd records are lost (the masters restart on a prefix etcd never held):
    the first master started with --rebuild rebuilds them; a standby on the same
    command line serves what it rebuilt after a failover."""
    with (
        running_etcd(tmp_path / "etcd") as etcd,
        running_ha_cluster(
            tmp_path, etcd, masters=2, stores=4, master_args=MASTER_ARGS, prefix="/kept"
        ) as cluster,
    ):
        async with StreamClient(cluster.master_address) as client:
            acked, epoch_before = await write_history(client)
            info_before = {n: await client.describe_stream(n) for n in STREAMS}
            await wait_until(
                lambda: stores_know_every_segment(cluster, client), 20, "records kept", 0.2
            )
        kept_ids = await cluster_ids(cluster)
        for master in cluster.masters:
            master.kill()
        for master in cluster.masters:
            at = master.args.index("--metadata") + 1
            master.args[at] = etcd.url("/lost")
            master.args += ["--rebuild", "--rebuild-wait-s", "20"]
        cluster.masters[0].start()
        await check_rebuilt(cluster, acked, epoch_before, info_before, kept_ids)
        standby = cluster.masters[1]
        standby.start()
        cluster.masters[0].kill()
        async with StreamClient(cluster.master_address) as client:
            for name in STREAMS:
                assert await read_all(client, name) == acked[name], name
        assert "rebuilt" not in standby.log(), "it serves what was rebuilt, once"


def test_rebuild_refuses_metadata_that_is_not_empty(tmp_path: Path) -> None:
    with running_cluster(tmp_path, stores=0, master_args=MASTER_ARGS) as cluster:
        master = cluster.master
        master.kill()
        data = master.args[master.args.index("--data") + 1]
        listen = master.args[master.args.index("--listen") + 1]
    done = subprocess.run(
        [STREAMENGINE, "master", "--listen", listen, "--data", data, "--rebuild"],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=60,
    )
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rebuild refused" in lines[0] and "not empty" in lines[0], lines
