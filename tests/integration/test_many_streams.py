"""A master started on a catalog of thousands of streams serves within the bound set
for a whole cluster's (issue #38), and ListStreams pages through them, filtered by
tenant and prefix, streams created since in their place."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from bench.scale_metadata import TENANT_STREAMS, seed, stream_name
from streamengine.master.catalog import Catalog
from streamengine.master.rocksdb_metadata import RocksDBMetadata
from streamengine.testing import ServerProcess, make_master, wait_for
from streamengine.tools.ops import list_streams
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc

STREAMS = 3000
# A master on 100,000 streams serves within 10 s of its start (issue #38).
SERVING_S_MAX = 10.0


def serving_a_page(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            master_pb2_grpc.MasterStub(channel).ListStreams(
                master_pb2.ListStreamsRequest(page_size=1), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return True


def start_and_time(master: ServerProcess) -> float:
    started = time.monotonic()
    master.start(wait=False)
    wait_for(lambda: serving_a_page(master.address), SERVING_S_MAX, 0.02, "a page served")
    return time.monotonic() - started


def test_thousands_of_streams_page_by_filter_after_a_start_on_them(tmp_path: Path) -> None:
    catalog = Catalog(RocksDBMetadata(tmp_path / "master"))
    seed(catalog, STREAMS, segments=False)
    catalog.close()
    master = make_master(tmp_path, ["--tenant-streams-max", "0"])
    try:
        assert start_and_time(master) < SERVING_S_MAX
        every = [stream_name(n) for n in range(STREAMS)]
        with grpc.insecure_channel(master.address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            first = stub.ListStreams(master_pb2.ListStreamsRequest(), timeout=5.0)
            assert len(first.streams) == 1000 and first.next_page_token, "a bounded page"
            assert [s.name for s in list_streams(stub, "", "", 700)] == every
            tenant = [s.name for s in list_streams(stub, "meta1", "", 0)]
            assert tenant == every[TENANT_STREAMS : 2 * TENANT_STREAMS]
            prefix = stream_name(2500)[:-1]
            assert [s.name for s in list_streams(stub, "", prefix, 3)] == every[2500:2510]

            stub.CreateStream(
                master_pb2.CreateStreamRequest(
                    name="meta1/s0001000a",
                    policy=entry_pb2.ReplicationPolicy(replicas=3, write_quorum=2),
                ),
                timeout=5.0,
            )
            tenant = [s.name for s in list_streams(stub, "meta1", "", 0)]
            assert tenant[:2] == ["meta1/s0001000", "meta1/s0001000a"]
            assert len(list(list_streams(stub, "", "", 0))) == STREAMS + 1
    finally:
        master.kill()
