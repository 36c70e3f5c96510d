"""`cert revoke`: a revoked certificate is refused by the master at once and by a store
within a heartbeat, UNAUTHENTICATED naming the revocation, and after a restart while the
master is away; other certificates are not.
(The list surviving a restart or a failover: test_cert_revocations.)"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from streamengine.protocol import transport
from streamengine.protocol.cert_revocations import serial_text
from streamengine.protocol.transport import Transport
from streamengine.testing import running_cluster, wait_for
from streamengine.tools import revocations
from streamengine.tools.certs import CA_KEY, create_client
from streamengine.v1 import entry_pb2, master_pb2, master_pb2_grpc
from streamengine.v1 import segment_store_pb2 as store_pb2
from streamengine.v1 import segment_store_pb2_grpc as store_pb2_grpc

# The master's --store-timeout-ms; stores heartbeat every quarter of it.
STORE_TIMEOUT_MS = 2000
HEARTBEAT_S = STORE_TIMEOUT_MS / 4 / 1000


def _master_call(address: str, caller: Transport) -> grpc.StatusCode:
    with caller.channel(address) as channel:
        try:
            master_pb2_grpc.MasterStub(channel).GetClusterStatus(
                master_pb2.GetClusterStatusRequest(), timeout=5
            )
        except grpc.RpcError as error:
            assert error.code() != grpc.StatusCode.UNAUTHENTICATED or "revoked" in (
                error.details() or ""
            ), error.details()
            return error.code()
    return grpc.StatusCode.OK


def _store_call(address: str, caller: Transport) -> grpc.StatusCode:
    """A read of a segment no store holds: NOT_FOUND for a caller who may read."""
    request = store_pb2.GetSegmentStateRequest(
        segment=entry_pb2.SegmentId(stream_id=999, epoch=1, stream="nobody/here")
    )
    with caller.channel(address) as channel:
        try:
            store_pb2_grpc.SegmentStoreStub(channel).GetSegmentState(request, timeout=5)
        except grpc.RpcError as error:
            assert error.code() != grpc.StatusCode.UNAUTHENTICATED or "revoked" in (
                error.details() or ""
            ), error.details()
            return error.code()
    return grpc.StatusCode.OK


def _args(master: str, certs_dir: Path, **more: object) -> argparse.Namespace:
    return argparse.Namespace(
        master=master, certs_dir=certs_dir, token=None, token_file=None, **more
    )


def test_a_revoked_certificate_is_refused_everywhere_within_a_heartbeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_cluster(
        tmp_path, stores=1, master_args=["--store-timeout-ms", str(STORE_TIMEOUT_MS)], tls=True
    ) as cluster:
        certs = cluster.certs
        assert certs is not None
        ops_dir = certs.root / "ops"
        os.makedirs(ops_dir, mode=0o700)
        (ops_dir / transport.CA_CERT).write_bytes((certs.ca_dir / transport.CA_CERT).read_bytes())
        cert_path = create_client(ops_dir, "ops", admin=True, ca_key_path=certs.ca_dir / CA_KEY)
        ca = (certs.ca_dir / transport.CA_CERT).read_bytes()
        ops = Transport(ca, cert_path.read_bytes(), cert_path.with_suffix(".key").read_bytes())
        admin = cluster.client_transport
        master, store = cluster.master_address, cluster.stores[0].address
        not_found = grpc.StatusCode.NOT_FOUND
        assert _master_call(master, ops) == grpc.StatusCode.OK
        assert _store_call(store, ops) == not_found

        revoke = _args(
            master, certs.client_dir, certificate=str(cert_path), ca_key=None, yes=False
        )
        assert revocations.cmd_revoke(revoke) == 1  # says what, changes nothing
        assert "nothing changed" in capsys.readouterr().out
        assert _master_call(master, ops) == grpc.StatusCode.OK

        revoke.yes = True
        assert revocations.cmd_revoke(revoke) == 0
        revoked_at = time.monotonic()
        assert _master_call(master, ops) == grpc.StatusCode.UNAUTHENTICATED

        def refused() -> bool:
            return _store_call(store, ops) == grpc.StatusCode.UNAUTHENTICATED

        # The store's next heartbeat brings the list (one interval, and the call's time).
        wait_for(refused, 2 * HEARTBEAT_S + 1.0, 0.05, "the store refusing the revoked cert")
        took_s = time.monotonic() - revoked_at
        assert _master_call(master, admin) == grpc.StatusCode.OK
        assert _store_call(store, admin) == not_found

        serial = serial_text(x509.load_pem_x509_certificate(cert_path.read_bytes()).serial_number)
        by_serial = _args(
            master, certs.client_dir, certificate=serial, ca_key=certs.ca_dir / CA_KEY, yes=True
        )
        assert revocations.cmd_revoke(by_serial) == 0
        assert "revoked already" in capsys.readouterr().out

        assert revocations.cmd_list_revoked(_args(master, certs.client_dir)) == 0
        listed = capsys.readouterr().out
        assert f"serial {serial} (client ops)" in listed, listed

        # A store restarted while the master is away refuses it from what it kept.
        cluster.master.stop()
        try:
            cluster.stores[0].restart()
            assert _store_call(store, ops) == grpc.StatusCode.UNAUTHENTICATED
        finally:
            cluster.master.cont()
    print(f"store refused the revoked certificate {took_s:.2f} s after the revocation")

