"""Real etcd members for the masters' shared metadata, and clusters of masters on them."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from streamengine.master.etcd import PREFIX_DEFAULT, EtcdTLS, parse_etcd_url
from streamengine.protocol.transport import (
    CA_CERT,
    NODE_CERT,
    NODE_KEY,
)
from streamengine.testing.ports import free_port
from streamengine.testing.processes import (
    ChildProcess,
    Cluster,
    is_active_master,
    make_master,
    make_store,
)
from streamengine.testing.waiting import wait_for
from streamengine.tools.certs import MASTER_COMMON_NAME, LocalCerts
from streamengine.tools.metadata_secure import secure_etcd

ETCD_HEARTBEAT_MS = 50
ETCD_ELECTION_TIMEOUT_MS = 500
ETCD_READY_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    """The etcd server (Debian's `etcd-server`, installed by
    deploy/install-system-deps.sh), or None."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


def etcd_answers(endpoint: str, timeout_s: float = 0.5, tls: EtcdTLS | None = None) -> bool:
    """True when `endpoint` serves a linearizable read (its cluster has a leader); with
    `tls`, over TLS with that client certificate."""
    from streamengine.etcd import rpc_pb2, rpc_pb2_grpc

    channel = (
        grpc.insecure_channel(endpoint)
        if tls is None
        else grpc.secure_channel(endpoint, tls.credentials())
    )
    with channel:
        try:
            rpc_pb2_grpc.KVStub(channel).Range(
                rpc_pb2.RangeRequest(key=b"/health"), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return True


@dataclass
class EtcdMember(ChildProcess):
    """One etcd member on 127.0.0.1, with its data dir; restartable."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    initial_cluster: str = ""
    # With a certs dir (ca.crt + an etcd node certificate): TLS for clients and peers,
    # and a client certificate signed by that CA required of both.
    certs_dir: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    stopped: bool = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def _tls_flags(self) -> list[str]:
        if self.certs_dir is None:
            return []
        ca, cert, key = (self.certs_dir / n for n in (CA_CERT, NODE_CERT, NODE_KEY))
        return [
            f"--cert-file={cert}",
            f"--key-file={key}",
            f"--trusted-ca-file={ca}",
            "--client-cert-auth",
            f"--peer-cert-file={cert}",
            f"--peer-key-file={key}",
            f"--peer-trusted-ca-file={ca}",
            "--peer-client-cert-auth",
        ]

    def start(self) -> EtcdMember:
        binary = etcd_binary()
        assert binary is not None, "etcd is not installed"
        assert self.process is None or self.process.poll() is not None, "already running"
        scheme = "http" if self.certs_dir is None else "https"
        client_url = f"{scheme}://{self.endpoint}"
        peer_url = f"{scheme}://127.0.0.1:{self.peer_port}"
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                binary,
                *self._tls_flags(),
                f"--name={self.name}",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster={self.initial_cluster or f'{self.name}={peer_url}'}",
                "--initial-cluster-state=new",
                f"--heartbeat-interval={ETCD_HEARTBEAT_MS}",
                f"--election-timeout={ETCD_ELECTION_TIMEOUT_MS}",
                "--logger=zap",
                "--log-outputs=stderr",
                "--log-level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.stopped = False
        return self



@dataclass
class EtcdCluster:
    members: list[EtcdMember]
    # etcd's root user (`etcd-root.crt` of the certs' client dir), None: plaintext.
    tls: EtcdTLS | None = None

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def url(self, prefix: str = "") -> str:
        """The master's `--metadata` for this etcd, keys under `prefix`."""
        return "etcd://" + ",".join(self.endpoints) + (f"/{prefix.strip('/')}" if prefix else "")

    def wait_ready(self, timeout_s: float = ETCD_READY_TIMEOUT_S) -> None:
        def ready() -> bool:
            for member in self.members:
                if member.process is not None and member.process.poll() is not None:
                    raise RuntimeError(f"etcd {member.name} exited:\n{member.log()}")
            return all(etcd_answers(m.endpoint, tls=self.tls) for m in self.members if m.alive())

        wait_for(ready, timeout_s, 0.05, "etcd answering")

    def stop_all(self) -> None:
        for member in self.members:
            with contextlib.suppress(Exception):
                member.kill()


def make_etcd(root: Path, members: int = 1, certs: LocalCerts | None = None) -> EtcdCluster:
    names = [f"etcd{n}" for n in range(members)]
    ports = [(free_port(), free_port()) for _ in names]
    scheme = "http" if certs is None else "https"
    initial = ",".join(
        f"{name}={scheme}://127.0.0.1:{peer}" for name, (_, peer) in zip(names, ports, strict=True)
    )
    cluster = []
    for name, (client_port, peer_port) in zip(names, ports, strict=True):
        data = root / name
        data.mkdir(parents=True, exist_ok=True)
        data.chmod(0o700)  # what etcd asks of its data dir
        certs_dir = None if certs is None else certs.add_node(name, etcd=True)
        cluster.append(
            EtcdMember(name, client_port, peer_port, data, root / f"{name}.log", initial, certs_dir)
        )
    if certs is None:
        return EtcdCluster(cluster)
    certs.add_etcd_root()
    return EtcdCluster(cluster, EtcdTLS.from_certs_dir(certs.client_dir))


@contextlib.contextmanager
def running_etcd(
    root: Path, members: int = 1, certs: LocalCerts | None = None, prefix: str = PREFIX_DEFAULT
) -> Iterator[EtcdCluster]:
    """Start an etcd of `members` members on free 127.0.0.1 ports; kill it on exit.
    With `certs`: TLS for clients and peers, each member with its own certificate, and
    etcd's auth on as `metadata secure` leaves it: the masters alone reach the keys under
    `prefix`, the cluster's `tls` (etcd's root) everything."""
    cluster = make_etcd(root, members, certs)
    try:
        for member in cluster.members:
            member.start()
        cluster.wait_ready()
        if cluster.tls is not None:
            secure_etcd(parse_etcd_url(cluster.url(prefix)), cluster.tls, [MASTER_COMMON_NAME])
        yield cluster
    finally:
        cluster.stop_all()


@contextlib.contextmanager
def running_ha_cluster(
    root: Path,
    etcd: EtcdCluster,
    masters: int = 2,
    stores: int = 3,
    master_args: list[str] | None = None,
    store_args: list[str] | None = None,
    prefix: str = "",
    certs: LocalCerts | None = None,
) -> Iterator[Cluster]:
    """`masters` masters on `etcd` (keys under `prefix`), the first one started becoming
    the active one, and `stores` stores given every master; kill everything on exit.
    With `certs` (those of a TLS `etcd`), every process serves TLS and the masters reach
    etcd with their node certificates (their user given `prefix` too)."""
    metadata = ["--metadata", etcd.url(prefix), *(master_args or [])]
    if etcd.tls is not None and prefix:
        secure_etcd(parse_etcd_url(etcd.url(prefix)), etcd.tls, [MASTER_COMMON_NAME])
    processes = [make_master(root, metadata, certs, name=f"master{n}") for n in range(masters)]
    cluster = Cluster(root, processes[0], [], certs, standbys=processes[1:])
    try:
        processes[0].start()
        first = processes[0]
        wait_for(
            lambda: is_active_master(first.address, transport=first.transport),
            20.0,
            0.02,
            "master0 active",
        )
        for standby in processes[1:]:
            standby.start()
        for number in range(stores):
            cluster.stores.append(
                make_store(root, number, cluster.master_address, "", store_args, certs)
            )
        for store in cluster.stores:
            store.start(wait=False)
        for store in cluster.stores:
            store.wait_serving()
        yield cluster
    finally:
        cluster.stop_all()
