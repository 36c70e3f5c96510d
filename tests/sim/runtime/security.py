"""A secured cluster's certificates, made by the shipped `streamengine cert` code.

`cluster_certs()` makes them once per process (ECDSA keys are cheap, but a run should
not pay for them each time), as `streamengine cluster up` lays them out: the CA apart;
one certs dir per member (`ca.crt`, `node.crt` naming the host it is dialed by, and its
key) for the stores `store0`..`store6` and the masters `master`, `m1`..`m3`; the admin's
dir (`client.root`); one admin certificate per client process (`client.c1`..), which
the operator may revoke; and what impostors hold: a store's certificate naming another
store's id, and a certificate of another CA.

The certificates are dated at the simulated wall clock's start (`loop.WALL_START_S`),
so that they are valid through a run whatever the machine's date. Their keys and serials
differ from process to process: nothing a run decides turns on their bytes (the
proofs' signatures differ from run to run anyway, ECDSA draws its nonce).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from cryptography import x509

from streamengine.protocol import transport
from streamengine.protocol.private_files import write_private
from streamengine.tools import certs
from tests.sim.runtime.loop import WALL_START_S

STORES_MAX = 7
MASTERS = ("master", "m1", "m2", "m3")
CLIENT_PROCESSES_MAX = 3
# An impostor's node and the store its certificate names.
IMPOSTOR_OF = "store0"


@dataclass(frozen=True)
class ClusterCerts:
    root: Path

    @property
    def local(self) -> certs.LocalCerts:
        return certs.LocalCerts(self.root)

    def node_dir(self, name: str) -> Path:
        """A member's certs dir (`--certs-dir` of a store or a master)."""
        return self.local.node_dir(name)

    @property
    def admin_dir(self) -> Path:
        """The operator's certs dir: `ca.crt` and `client.root`."""
        return self.local.client_dir

    @property
    def ca_pem(self) -> bytes:
        return (self.local.ca_dir / transport.CA_CERT).read_bytes()

    def process(self, name: str) -> transport.Transport:
        """Client process `name`'s transport: an admin certificate of its own."""
        cert, key = transport.client_cert_paths(self.root / "processes", name)
        return transport.Transport(self.ca_pem, cert.read_bytes(), key.read_bytes())

    def process_cert(self, name: str) -> Path:
        return transport.client_cert_paths(self.root / "processes", name)[0]

    def tenant(self, token: str) -> transport.Transport:
        """A tenant's: the CA and its token (ANONYMOUS over TLS but for the token)."""
        return transport.Transport(self.ca_pem, token=token)

    def impostor(self) -> transport.Transport:
        """A node holding `IMPOSTOR_OF`'s certificate names (another store's id)."""
        return transport.Transport.for_node(self.root / "impostor")

    def foreign(self) -> transport.Transport:
        """A certificate of another CA, naming the admin."""
        cert, key = transport.client_cert_paths(self.root / "foreign", transport.ROOT_CLIENT)
        return transport.Transport(self.ca_pem, cert.read_bytes(), key.read_bytes())


def _at_wall_start() -> datetime.datetime:
    return datetime.datetime.fromtimestamp(WALL_START_S, datetime.UTC)


@functools.cache
def cluster_certs() -> ClusterCerts:
    root = Path(tempfile.mkdtemp(prefix="streamengine-sim-certs-"))
    atexit.register(shutil.rmtree, root, True)  # made once per process: gone with it
    with mock.patch.object(certs, "_now", _at_wall_start):
        local = certs.create_local_certs(root)
        ca_key = local.ca_dir / certs.CA_KEY
        ca = (local.ca_dir / transport.CA_CERT).read_bytes()
        for n in range(STORES_MAX):
            _member(root / f"store{n}", ca, ca_key, f"store{n}", store_id=f"store{n}")
        for name in MASTERS:
            _member(root / name, ca, ca_key, name, master=True)
        for n in range(1, CLIENT_PROCESSES_MAX + 1):
            write_private(root / "processes" / transport.CA_CERT, ca)
            certs.create_client(root / "processes", f"c{n}", admin=True, ca_key_path=ca_key)
        # The impostor's certificate names IMPOSTOR_OF's id for its own host.
        _member(root / "impostor", ca, ca_key, "impostor", store_id=IMPOSTOR_OF)
        foreign = certs.create_local_certs(root / "foreign-ca")
        (root / "foreign").mkdir(mode=0o700)
        for path in transport.client_cert_paths(foreign.client_dir, transport.ROOT_CLIENT):
            write_private(root / "foreign" / path.name, path.read_bytes())
    return ClusterCerts(root)


def _member(
    directory: Path, ca: bytes, ca_key: Path, host: str, *, master: bool = False, store_id: str = ""
) -> None:
    write_private(directory / transport.CA_CERT, ca)
    certs.create_node(directory, [host], master=master, store_id=store_id, ca_key_path=ca_key)


def serial_of(cert_pem: bytes) -> int:
    return x509.load_pem_x509_certificate(cert_pem).serial_number
