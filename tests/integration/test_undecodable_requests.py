"""Bytes that do not parse as a method's request get INVALID_ARGUMENT naming the
method, on every RPC of the master and the stores and on the stores' data plane, and
leave no traceback in the server's log (grpcio alone answers UNKNOWN and logs one per
request)."""

from __future__ import annotations

import random

import grpc

from streamengine.protocol.transport import PLAINTEXT
from streamengine.testing import Cluster, is_serving
from tests.faults import badinput


def test_every_rpc_answers_undecodable_bytes_with_invalid_argument(cluster: Cluster) -> None:
    rng = random.Random(7)
    addresses = {"master": cluster.master_address, "store": cluster.stores[0].address}
    for server, method in badinput.methods():
        data = badinput.random_bytes(rng, method)
        payloads = [data, data] if method.client_streaming else [data]
        if isinstance(method, badinput.DataMethod):  # the stores' data plane
            data_address = cluster.stores[0].data_address
            got, details = badinput.data_call(PLAINTEXT, data_address, method, payloads)
        else:
            with grpc.insecure_channel(addresses[server]) as channel:
                got, details = badinput.call(channel, method, payloads)
        assert (got, method.name in details) == ("INVALID_ARGUMENT", True), (
            method.name,
            got,
            details,
        )
    for process in (cluster.master, cluster.stores[0]):
        assert is_serving(process.address)
        assert "Traceback" not in process.log(), process.log()[-2000:]
