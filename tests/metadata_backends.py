"""The master's metadata back ends for tests that run the master's state over each.

`BACKENDS` parametrizes a test; `open_backend` gives a `MetadataPlace` that opens the
metadata (and opens it again, as a restarted master would). The etcd place uses the
session's etcd (`tests/conftest.py`), a key prefix of its own, and the masters'
election: it joins with a lease of its own before it writes, and a restart revokes that
lease and joins again, so every commit of these tests is conditional on an election key
exactly as a running master's is.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Protocol

import grpc

from streamengine.etcd import rpc_pb2
from streamengine.master.catalog import Catalog
from streamengine.master.etcd import EtcdClient, parse_etcd_url
from streamengine.master.etcd_metadata import EtcdMetadata
from streamengine.master.metadata import prefix_end
from streamengine.master.rocksdb_metadata import RocksDBMetadata

BACKENDS = ["rocksdb", "etcd"]
# Long enough that no test outlives it: these tests keep no keepalive running.
TEST_LEASE_TTL_S = 600

_prefixes = itertools.count(1)


class MetadataPlace(Protocol):
    def open(self) -> Catalog:
        """The catalog of a master starting (or restarting) over this place."""
        ...

    def close(self) -> None: ...


class RocksDBPlace:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.catalog: Catalog | None = None

    def open(self) -> Catalog:
        self.close()
        self.catalog = Catalog(RocksDBMetadata(self.path))
        return self.catalog

    def close(self) -> None:
        if self.catalog is not None:
            self.catalog.close()
            self.catalog = None


def join_election(metadata: EtcdMetadata, address: str) -> int:
    """Join the master election with a fresh lease, as `master.election` does, and guard
    `metadata` with the key; returns the lease id (revoke it to step down). These tests
    run one master at a time per prefix, so its key is the oldest."""
    client = metadata.client
    kv, member = client.kv(client.member), client.member
    lease = client.lease(member).LeaseGrant(
        rpc_pb2.LeaseGrantRequest(TTL=TEST_LEASE_TTL_S), timeout=10
    )
    key = client.config.election_name + b"/" + f"{lease.ID:x}".encode()
    put = rpc_pb2.PutRequest(key=key, value=address.encode(), lease=lease.ID)
    joined = kv.Txn(rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_put=put)]), timeout=10)
    election = client.config.election_name + b"/"
    oldest = kv.Range(
        rpc_pb2.RangeRequest(
            key=election,
            range_end=prefix_end(election),
            sort_target=rpc_pb2.RangeRequest.CREATE,
            limit=1,
        ),
        timeout=10,
    ).kvs[0]
    assert oldest.key == key, "one master at a time per prefix in these tests"
    metadata.activate(key, joined.header.revision)
    return lease.ID


class EtcdPlace:
    def __init__(self, endpoint: str = "", url: str = "") -> None:
        """A new key prefix on the etcd at `endpoint`, or the place at `url`."""
        self.url = url or f"etcd://{endpoint}/test{next(_prefixes)}"
        self.metadata: EtcdMetadata | None = None
        self.lease_id = 0

    def open(self) -> Catalog:
        self.close()
        self.metadata = EtcdMetadata(EtcdClient(parse_etcd_url(self.url)))
        self.lease_id = join_election(self.metadata, "test-master:1")
        return Catalog(self.metadata)

    def step_down(self) -> None:
        """Revoke this master's election lease: its key is gone at once."""
        assert self.metadata is not None
        client = self.metadata.client
        try:
            client.lease(client.member).LeaseRevoke(
                rpc_pb2.LeaseRevokeRequest(ID=self.lease_id), timeout=10
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:  # revoked already
                raise

    def close(self) -> None:
        if self.metadata is not None:
            self.step_down()
            self.metadata.close()
            self.metadata = None


def open_backend(backend: str, tmp_path: Path, etcd_endpoint: str) -> MetadataPlace:
    if backend == "rocksdb":
        return RocksDBPlace(tmp_path / "m")
    assert backend == "etcd", backend
    return EtcdPlace(etcd_endpoint)
