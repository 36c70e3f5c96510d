"""A store process's life: restart keeps state, SIGTERM stops it cleanly (exit 0), an id
generated once is kept, metrics are served, CopySegment pulls a sealed segment from a
peer and checks its digest, and a real master sees the store register."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest

from streamengine.protocol.channels import CLIENT_OPTIONS
from streamengine.protocol.entry import EntryKind
from streamengine.testing import (
    ServerProcess,
    free_port,
    running_cluster,
    wait_for,
    wait_until,
)
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc, segment_store_pb2
from tests.integration.store_helpers import (
    copy_pair,
    entries,
    entry,
    lone_store,
    lone_store_process,
    read_all,
    seal_request,
    seg,
    state,
    store_stub,
    trust_args,
    write_all,
    write_request,
)


async def test_sigterm_stops_gracefully_and_a_restart_keeps_every_segments_state(
    tmp_path: Path,
) -> None:
    segment = seg(501, 3)
    with lone_store(tmp_path) as store:
        async with store_stub(store) as stub:
            await write_all(stub, [write_request(segment, 3, 3, entries(1, 4))])
            await write_all(stub, [write_request(segment, 3, 3, entries(6, 7))])
            await stub.Seal(seal_request(segment, 5))
            before = await state(stub, segment)
        assert store.terminate() == 0
        store.start()
        async with store_stub(store) as stub:
            assert await state(stub, segment) == before
            assert (before.fence, before.acked_index, before.matched_index) == (5, 3, 4)
            assert before.last_index == 7


def test_a_generated_store_id_is_kept_in_the_data_dir(tmp_path: Path) -> None:
    store = lone_store_process(tmp_path, 0)
    at = store.args.index("--id")
    del store.args[at : at + 2]
    try:
        store.start()
        kept = (tmp_path / "store0" / "store-id").read_text().strip()
        assert kept.startswith("store-")
        store.restart()
        assert (tmp_path / "store0" / "store-id").read_text().strip() == kept
    finally:
        store.kill()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
        return body


async def test_metrics_are_served_on_the_metrics_port(tmp_path: Path) -> None:
    port = free_port()
    with lone_store(tmp_path, ["--metrics-port", str(port)]) as store:
        async with store_stub(store) as stub:
            await write_all(stub, [write_request(seg(502, 3), 3, 0, entries(1, 10))])
        text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
        lines = text.decode().splitlines()
        assert "streamengine_store_write_entries_total 10.0" in lines
        assert any(line.startswith("streamengine_store_sync_seconds_count") for line in lines)
        assert any(line.startswith("streamengine_store_queue_bytes") for line in lines)


def _metric(lines: list[str], name: str) -> float:
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " "))


async def test_concurrent_writes_from_several_streams_share_syncs(tmp_path: Path) -> None:
    port = free_port()
    streams, batches = 4, 25
    with lone_store(tmp_path, ["--metrics-port", str(port)]) as store:
        async with store_stub(store) as stub:

            async def leader(stream_id: int) -> None:
                segment = seg(600 + stream_id, 1)
                requests = [
                    write_request(segment, 1, 0, entries(n * 10 + 1, n * 10 + 10, epoch=1), n)
                    for n in range(batches)
                ]
                replies = await write_all(stub, requests)
                assert [r.request_id for r in replies] == list(range(batches))

            await asyncio.gather(*(leader(n) for n in range(streams)))
        text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
    lines = text.decode().splitlines()
    syncs = _metric(lines, "streamengine_store_sync_seconds_count")
    groups = _metric(lines, "streamengine_store_group_commit_commands_count")
    commands = _metric(lines, "streamengine_store_group_commit_commands_sum")
    assert commands == streams * batches and groups == syncs
    assert syncs < streams * batches / 2, f"{syncs} syncs for {commands} batches"


async def test_copy_segment_pulls_a_sealed_segment_and_verifies_its_digest(
    tmp_path: Path,
) -> None:
    segment = seg(503, 3)
    with copy_pair(tmp_path) as (source, target):
        bridge = entry(301, 4, kind=EntryKind.BRIDGE)
        async with store_stub(source) as stub:
            await write_all(
                stub,
                [
                    write_request(segment, 4, 0, entries(1, 150, size=300)),
                    write_request(segment, 4, 0, entries(151, 300, epoch=4)),
                    write_request(segment, 4, 301, [bridge]),
                    write_request(segment, 4, 301, entries(302, 303)),  # stale, past the bridge
                ],
            )
            await stub.Seal(seal_request(segment, 4))
            expected = await stub.Digest(
                segment_store_pb2.DigestRequest(segment=segment, up_to_index=301)
            )
            source_entries = await read_all(stub, segment, 1, 301)
        async with store_stub(target) as stub:
            # A partial copy of an older epoch on the target is overwritten in place.
            await write_all(stub, [write_request(segment, 3, 0, [entry(5, 2, b"stale")])])
            copied = await stub.CopySegment(
                segment_store_pb2.CopySegmentRequest(
                    segment=segment,
                    source_address=source.address,
                    source_data_address=source.data_address,
                    final_index=301,
                    fence=4,
                )
            )
            assert copied.entries_copied == 301 and copied.acked_index == 301
            assert copied.digest == expected.digest
            after = await state(stub, segment)
            assert (after.fence, after.acked_index, after.last_index, after.bridge_index) == (
                4,
                301,
                301,
                301,
            )
            assert await read_all(stub, segment) == source_entries
            with pytest.raises(grpc.aio.AioRpcError) as short:
                await stub.CopySegment(
                    segment_store_pb2.CopySegmentRequest(
                        segment=segment,
                        source_address=source.address,
                        source_data_address=source.data_address,
                        final_index=302,
                        fence=4,
                    )
                )
            assert short.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            here, there = (source.address, source.data_address), ("127.0.0.1:1", "127.0.0.1:1")
            failures = [
                (seg(504, 3), here, grpc.StatusCode.NOT_FOUND),  # not on the source
                (seg(505, 3), here, grpc.StatusCode.FAILED_PRECONDITION),  # unsealed
                (segment, there, grpc.StatusCode.UNAVAILABLE),  # source unreachable
                (segment, (source.address, ""), grpc.StatusCode.INVALID_ARGUMENT),  # no data port
            ]
            async with store_stub(source) as source_stub:
                await write_all(source_stub, [write_request(seg(505, 3), 3, 2, entries(1, 2))])
            for failing, (address, data_address), code in failures:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.CopySegment(
                        segment_store_pb2.CopySegmentRequest(
                            segment=failing,
                            source_address=address,
                            source_data_address=data_address,
                            final_index=2,
                            fence=4,
                        )
                    )
                assert failed.value.code() == code, failed.value
            # None of the failures touched the good copy made before.
            assert await read_all(stub, segment) == source_entries


def _stores_seen(master: ServerProcess) -> list[master_pb2.StoreStatus]:
    with grpc.insecure_channel(master.address, options=CLIENT_OPTIONS) as channel:
        status = master_pb2_grpc.MasterStub(channel).GetClusterStatus(
            master_pb2.GetClusterStatusRequest(), timeout=2
        )
        return list(status.stores)


def test_a_store_registers_and_heartbeats_its_id_zone_and_address(tmp_path: Path) -> None:
    with running_cluster(tmp_path, stores=1, zones=["zone-a"]) as cluster:
        store = cluster.stores[0]
        seen = wait_for(
            lambda: [s for s in _stores_seen(cluster.master) if s.alive],
            timeout_s=15,
            message="the master to see the store alive",
        )
        assert (seen[0].store_id, seen[0].address, seen[0].zone) == (
            "store0",
            store.address,
            "zone-a",
        )
        assert seen[0].free_bytes > 0


async def _lead(master: master_pb2_grpc.MasterAsyncStub, name: str) -> entry_pb2.Segment:
    """Heartbeat as a writer until the master grants leadership; the segment it opened."""
    request = master_pb2.WriterHeartbeatRequest(stream=name, client_id="writer-1")
    replies: list[master_pb2.WriterHeartbeatReply] = []

    async def leader() -> bool:
        try:
            replies.append(await master.WriterHeartbeat(request))
        except grpc.aio.AioRpcError as error:
            # No store usable yet: the master has not heard the new store's first
            # heartbeat (a clean-clone run on a loaded machine got there first).
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return False
        return replies[-1].role == master_pb2.LEADER

    await wait_until(leader, 15, "leadership")
    return replies[-1].segment


async def test_segments_the_master_lists_in_a_heartbeat_reply_are_deleted(
    tmp_path: Path,
) -> None:
    # The store also trusts the tests' key: they write a segment the master never gave out.
    with running_cluster(
        tmp_path,
        stores=1,
        master_args=["--lease-ms", "300", "--delete-grace-s", "0"],
        store_args=trust_args(tmp_path),
    ) as cluster:
        async with grpc.aio.insecure_channel(cluster.master_address) as channel:
            master = master_pb2_grpc.MasterStub(channel)
            await master.CreateStream(
                master_pb2.CreateStreamRequest(
                    name="acme/gone",
                    policy=entry_pb2.ReplicationPolicy(replicas=1, write_quorum=1),
                    create_tenant=True,
                )
            )
            opened = await _lead(master, "acme/gone")
            gone = opened.id
            unknown = seg(gone.stream_id + 1000, 1)  # an id the master never gave out
            async with store_stub(cluster.stores[0]) as stub:
                for segment in (gone, unknown):
                    await write_all(
                        stub,
                        [
                            write_request(
                                segment, segment.epoch, 0, entries(1, 3, epoch=segment.epoch)
                            )
                        ],
                    )
                await master.DeleteStream(master_pb2.DeleteStreamRequest(name="acme/gone"))

                async def deleted() -> bool:
                    try:
                        await state(stub, gone)
                    except grpc.aio.AioRpcError as error:
                        return error.code() == grpc.StatusCode.NOT_FOUND
                    return False

                await wait_until(deleted, 15, "the store to delete the segment")
                assert (await state(stub, unknown)).last_index == 3


def test_a_second_store_on_a_taken_port_or_data_dir_exits_1_with_one_line(
    tmp_path: Path,
) -> None:
    with lone_store(tmp_path) as first:
        same_port = lone_store_process(tmp_path, 1)
        same_port.args[same_port.args.index("--listen") + 1] = first.address
        same_data = lone_store_process(tmp_path, 2)
        same_data.args[same_data.args.index("--data") + 1] = str(tmp_path / "store0")
        for second, expected in ((same_port, "cannot listen"), (same_data, "cannot open")):
            second.start(wait=False)
            assert second.process is not None
            assert second.process.wait(timeout=20) == 1
            lines = second.log().strip().splitlines()
            assert expected in lines[-1] and "Traceback" not in second.log(), second.log()
        assert first.alive()
