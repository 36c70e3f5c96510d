"""Real `streamengine master` / `streamengine store` processes for tests and benchmarks.

Every server runs as its own process on 127.0.0.1 with RocksDB in a temp dir; tests
kill them with SIGKILL / SIGSTOP and wait for conditions with deadlines, never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from streamengine.master.etcd import EtcdTLS
from streamengine.protocol.transport import (
    CA_CERT,
    CERTS_DIR_ENV,
    NODE_CERT,
    NODE_KEY,
    PLAINTEXT,
    TOKEN_ENV,
    Transport,
)
from streamengine.tools.certs import LocalCerts, create_local_certs

T = TypeVar("T")

STREAMENGINE = str(Path(sys.executable).with_name("streamengine"))
# The Master service's name in gRPC health: SERVING only on the active master.
MASTER_SERVICE = "streamengine.v1.Master"


# Ports `free_port` handed out; forgotten past this many (the ephemeral range is far
# larger), so that a long test session still finds ports.
_HANDED_OUT_MAX = 8192
_handed_out: set[int] = set()


# Processes that pick ports side by side (the test runner's workers) each take one
# share of them: "K/N" takes the ports whose `port_share` is K. Within a process
# `_handed_out` keeps ports distinct; across processes only this does.
PORT_SHARD_ENV = "STREAMENGINE_PORT_SHARD"


def port_share(port: int, count: int) -> int:
    """Which of `count` shares `port` falls in. A hash, not `port % count`: Linux hands
    out ports of one parity to bind(0) and of the other to connect()."""
    return zlib.crc32(port.to_bytes(2, "big")) % count


def port_shard() -> tuple[int, int]:
    """(K, N) from `PORT_SHARD_ENV`; (0, 1), every port, when it is unset."""
    raw = os.environ.get(PORT_SHARD_ENV, "")
    if not raw:
        return 0, 1
    shard, _, count = raw.partition("/")
    if not (shard.isdigit() and count.isdigit() and int(shard) < int(count)):
        raise ValueError(f"{PORT_SHARD_ENV}={raw!r}: want K/N with 0 <= K < N")
    return int(shard), int(count)


def free_port() -> int:
    """A port free on 127.0.0.1 now, and not handed out before by this process. Servers
    are given their ports before any of them binds, and the kernel may name the same free
    port twice: once two stores got the same one, the second could not listen, and the
    first answering at that address passed for it (a CI run hung for 300 s)."""
    if len(_handed_out) >= _HANDED_OUT_MAX:
        _handed_out.clear()
    shard, count = port_shard()
    for _ in range(100 * count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port_share(port, count) == shard and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no port free on 127.0.0.1 that was not handed out already")


def wait_for(
    condition: Callable[[], T | None],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    message: str = "condition",
) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as error:
            last_error = error
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{message} not reached in {timeout_s}s (last error: {last_error!r})"
            )
        time.sleep(interval_s)


async def wait_until(
    condition: Callable[[], object],
    timeout_s: float = 30.0,
    message: str = "condition",
    interval_s: float = 0.02,
) -> None:
    """`wait_for` for async tests: poll `condition` (awaiting its result when it is
    awaitable) without blocking the event loop; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} not reached in {timeout_s}s")
        await asyncio.sleep(interval_s)


def is_serving(address: str, timeout_s: float = 0.5, transport: Transport = PLAINTEXT) -> bool:
    with transport.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class ChildProcess:
    """Signals for a child process started by a subclass (`self.process`): kill, pause
    (SIGSTOP, sockets left open) and resume. Calls on a process that is not running do
    nothing."""

    process: subprocess.Popen[bytes] | None
    stopped: bool

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.alive():
            assert self.process is not None
            if self.stopped:
                os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)
        self.stopped = False

    def stop(self) -> None:
        """SIGSTOP: the process hangs with its sockets open."""
        if self.alive():
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped = True

    def cont(self) -> None:
        if self.alive() and self.stopped:
            os.kill(self.pid, signal.SIGCONT)
        self.stopped = False


# Every server this process started, oldest first (`servers_started`): what a suite's
# check of its servers' logs walks. Forgotten past this many, oldest first.
_STARTED_MAX = 4096
_started: list[ServerProcess] = []


def servers_started() -> list[ServerProcess]:
    """The servers this process started so far, each once, oldest first."""
    return list(_started)


# What a server's log says when a handler failed unexpectedly: grpcio's line for an
# exception that escaped a servicer method (its caller got UNKNOWN), a traceback of any
# kind, or an UNKNOWN status named outright. (Not "UNKNOWN" alone: grpc-core opens the
# debug string of every error it reports with it.)
LOG_FAULTS = (
    "Traceback (most recent call last)",
    "raised by servicer method",
    "StatusCode.UNKNOWN",
)


def log_faults(server: ServerProcess) -> list[str]:
    """The lines of `server`'s whole log that say a handler failed (`LOG_FAULTS`)."""
    try:
        text = server.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if any(f in line for f in LOG_FAULTS)]


@dataclass
class ServerProcess(ChildProcess):
    """One server process; restartable with the same arguments and data dir."""

    name: str
    args: list[str]
    address: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    stopped: bool = False
    env: dict[str, str] = field(default_factory=dict)
    # Run under this command, e.g. `ip netns exec NS` to put the server on another host.
    prefix: list[str] = field(default_factory=list)
    # How health checks reach it: plaintext, or TLS trusting the cluster's CA.
    transport: Transport = PLAINTEXT

    def start(self, wait: bool = True) -> ServerProcess:
        assert self.process is None or self.process.poll() is not None, "already running"
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [*self.prefix, STREAMENGINE, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**server_env(), **self.env},
        )
        log.close()
        self.stopped = False
        if not any(server is self for server in _started):
            if len(_started) >= _STARTED_MAX:
                del _started[0]
            _started.append(self)
        if wait:
            self.wait_serving()
        return self

    def wait_serving(self, timeout_s: float = 20.0) -> None:
        def serving() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log()}"
                )
            return is_serving(self.address, transport=self.transport)

        wait_for(serving, timeout_s, 0.05, f"{self.name} serving at {self.address}")

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait for a clean exit; returns the exit code."""
        assert self.process is not None
        if self.stopped:
            self.cont()
        self.process.terminate()
        return self.process.wait(timeout=timeout_s)

    def restart(self) -> ServerProcess:
        self.kill()
        return self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except FileNotFoundError:
            return ""


def server_env() -> dict[str, str]:
    """This environment without the client's TLS variables: a server's `--certs-dir`
    is given or not by its flags alone (servers read STREAMENGINE_<FLAG> too)."""
    return {k: v for k, v in os.environ.items() if k not in (CERTS_DIR_ENV, TOKEN_ENV)}


@dataclass
class Cluster:
    """A master (and with etcd, standby masters) and N stores, each with its own data dir
    under `root`; with `certs`, every process serves TLS with its own node certificate."""

    root: Path
    master: ServerProcess
    stores: list[ServerProcess]
    certs: LocalCerts | None = None
    # Masters beside `master` on the same etcd (`running_ha_cluster`).
    standbys: list[ServerProcess] = field(default_factory=list)

    @property
    def masters(self) -> list[ServerProcess]:
        return [self.master, *self.standbys]

    @property
    def admin_certs_dir(self) -> Path | None:
        """The certs dir a cluster admin's client uses (client.root), None if plaintext."""
        return None if self.certs is None else self.certs.client_dir

    @property
    def client_transport(self) -> Transport:
        """A cluster admin's transport (plaintext without certs)."""
        return Transport.for_client(self.admin_certs_dir)

    @property
    def master_address(self) -> str:
        """Every master, as clients, stores and tools take them: `a:1,b:2`."""
        return ",".join(m.address for m in self.masters)

    def active_master(self) -> ServerProcess | None:
        """The master that says it is the active one now, if any."""
        for master in self.masters:
            if (
                master.alive()
                and not master.stopped
                and is_active_master(master.address, transport=master.transport)
            ):
                return master
        return None

    def wait_active_master(self, timeout_s: float = 20.0) -> ServerProcess:
        return wait_for(self.active_master, timeout_s, 0.01, "an active master")

    def store_by_address(self, address: str) -> ServerProcess:
        for store in self.stores:
            if store.address == address:
                return store
        raise KeyError(address)

    def add_store(self, zone: str = "", extra_args: list[str] | None = None) -> ServerProcess:
        store = make_store(
            self.root, len(self.stores), self.master_address, zone, extra_args, self.certs
        )
        self.stores.append(store)
        return store.start()

    def stop_all(self) -> None:
        for process in [*self.stores, *self.masters]:
            with contextlib.suppress(Exception):
                process.kill()


def _tls_args(certs: LocalCerts | None, name: str, **role: Any) -> tuple[list[str], Transport]:
    """`--certs-dir` of a new node dir for `name`, and how health checks reach it."""
    if certs is None:
        return [], PLAINTEXT
    directory = certs.add_node(name, **role)
    return ["--certs-dir", str(directory)], Transport.for_client(certs.tenant_dir)


def make_master(
    root: Path,
    extra_args: list[str] | None = None,
    certs: LocalCerts | None = None,
    name: str = "master",
) -> ServerProcess:
    port = free_port()
    data = root / name
    data.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{port}"
    tls, transport = _tls_args(certs, name, master=True)
    args = ["master", "--listen", address, "--data", str(data), *tls, *(extra_args or [])]
    return ServerProcess(name, args, address, root / f"{name}.log", transport=transport)


def is_active_master(
    address: str, timeout_s: float = 0.5, transport: Transport = PLAINTEXT
) -> bool:
    """Whether the master at `address` is the active one (its Master service health)."""
    with transport.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=MASTER_SERVICE), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def make_store(
    root: Path,
    number: int,
    master_address: str,
    zone: str = "",
    extra_args: list[str] | None = None,
    certs: LocalCerts | None = None,
    cert_store_id: str = "",
) -> ServerProcess:
    """A store `store{number}`; with `certs`, its certificate names `cert_store_id`
    (default: its own id; another id makes an impersonator)."""
    port = free_port()
    data = root / f"store{number}"
    data.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{port}"
    args = [
        "store",
        "--listen",
        address,
        "--data",
        str(data),
        "--master",
        master_address,
        "--id",
        f"store{number}",
        *(["--zone", zone] if zone else []),
    ]
    tls, transport = _tls_args(certs, f"store{number}", store_id=cert_store_id or f"store{number}")
    args += [*tls, *(extra_args or [])]
    return ServerProcess(
        f"store{number}", args, address, root / f"store{number}.log", transport=transport
    )


@contextlib.contextmanager
def running_cluster(
    root: Path,
    stores: int = 3,
    master_args: list[str] | None = None,
    store_args: list[str] | None = None,
    zones: list[str] | None = None,
    store_args_for: Callable[[int], list[str]] | None = None,
    tls: bool = False,
) -> Iterator[Cluster]:
    """Start a master and `stores` stores; kill everything on exit. `store_args_for`
    adds flags per store number (e.g. a metrics port each). `tls`: certificates under
    `root/certs` (`LocalCerts`), every process serving and calling with its own."""
    certs = create_local_certs(root / "certs") if tls else None
    master = make_master(root, master_args, certs)
    cluster = Cluster(root, master, [], certs)
    try:
        master.start()
        for number in range(stores):
            zone = zones[number] if zones else ""
            extra = [*(store_args or []), *(store_args_for(number) if store_args_for else [])]
            cluster.stores.append(make_store(root, number, master.address, zone, extra, certs))
        for store in cluster.stores:
            store.start(wait=False)
        for store in cluster.stores:
            store.wait_serving()
        yield cluster
    finally:
        cluster.stop_all()


# etcd's minimum lease TTL is 1.5 election ticks rounded up to whole seconds: with its
# defaults (100 ms heartbeats, 1 s election timeout) a 1 s lease silently becomes 2 s.
# Half those give the 1 s election lease masters use, and detect a dead raft leader in
# about half a second.
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

    def restart(self) -> EtcdMember:
        self.kill()
        return self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except FileNotFoundError:
            return ""


@dataclass
class EtcdCluster:
    members: list[EtcdMember]
    # The client certificate its members ask of the masters (None: plaintext).
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
    tls = None if certs is None else EtcdTLS.from_certs_dir(certs.client_dir)
    return EtcdCluster(cluster, tls)


@contextlib.contextmanager
def running_etcd(
    root: Path, members: int = 1, certs: LocalCerts | None = None
) -> Iterator[EtcdCluster]:
    """Start an etcd of `members` members on free 127.0.0.1 ports; kill it on exit.
    With `certs`: TLS for clients and peers, each member with its own certificate."""
    cluster = make_etcd(root, members, certs)
    try:
        for member in cluster.members:
            member.start()
        cluster.wait_ready()
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
    etcd with their node certificates."""
    metadata = ["--metadata", etcd.url(prefix), *(master_args or [])]
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


def metric_value(port: int, name: str, labels: str = "") -> float:
    """One sample of a server's Prometheus endpoint on 127.0.0.1 (0 when absent)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0
