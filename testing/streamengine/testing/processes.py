"""Real `streamengine master` / `streamengine store` processes and the clusters they form."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from streamengine.protocol.transport import (
    CERTS_DIR_ENV,
    PLAINTEXT,
    TOKEN_ENV,
    Transport,
)
from streamengine.testing.ports import free_port
from streamengine.testing.waiting import Hopeless, wait_for
from streamengine.tools.certs import LocalCerts, create_local_certs

STREAMENGINE = str(Path(sys.executable).with_name("streamengine"))
# The Master service's name in gRPC health: SERVING only on the active master.
MASTER_SERVICE = "streamengine.v1.Master"


def is_serving(address: str, timeout_s: float = 0.5, transport: Transport = PLAINTEXT) -> bool:
    with transport.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class ChildProcess:
    """Signals for a child process started by a subclass (`self.process`, `start`): kill,
    pause (SIGSTOP, sockets left open), resume and restart. Calls on a process that is not
    running do nothing."""

    process: subprocess.Popen[bytes] | None
    stopped: bool
    log_path: Path

    def start(self) -> Self:
        raise NotImplementedError

    def restart(self) -> Self:
        self.kill()
        return self.start()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except FileNotFoundError:
            return ""

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


def data_address_of(address: str) -> str:
    """The data port of the store this process started at gRPC `address`."""
    found = [server.data_address for server in _started if server.address == address]
    assert found and found[-1], f"no store of this process serves at {address}"
    return found[-1]


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
    # A store's data port (Write, on the framed protocol), `host:port`; "" for a master.
    data_address: str = ""

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
                raise Hopeless(
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
    # Its own port of this process's share, not the gRPC port + 1 (another's share).
    data_address = f"127.0.0.1:{free_port()}"
    args = [
        "store",
        "--listen",
        address,
        "--data-listen",
        data_address,
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
        f"store{number}",
        args,
        address,
        root / f"store{number}.log",
        transport=transport,
        data_address=data_address,
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
