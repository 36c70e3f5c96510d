"""`streamengine cluster up`: a master and N stores as child processes on 127.0.0.1.

Each server has its own RocksDB dir under the data dir; the master serves its web console
on `console_port` when given (`cluster up` always gives one). With TLS (the default) the
certificates live under `DATA/certs` (`tools.certs.LocalCerts`: the CA, a node dir per
process, and `DATA/certs/client` with `client.root` for the CLI), made on the first
start and kept after. A child that exits on its own
is reported and stops the whole cluster (nothing is restarted silently); Ctrl-C and
SIGTERM stop every child cleanly. Children also get SIGKILL from the kernel if this
process dies without cleaning up (PR_SET_PDEATHSIG), so no orphan survives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from streamengine.protocol.private_files import FILE_MODE, private_dir, tightened_message
from streamengine.protocol.transport import (
    CERTS_DIR_ENV,
    MASTER_ENV,
    PLAINTEXT,
    TOKEN_ENV,
    Transport,
)
from streamengine.tools.certs import create_local_certs
from streamengine.tools.lifetime import PARENT_PID_ENV

# How long a stop waits for the servers' own graceful stop before it kills them: `cluster
# up` ends within a second of Ctrl-C or SIGTERM. A server stops in tens of milliseconds
# (`cli.main` ends it without the interpreter's teardown) after at most its gRPC grace
# for calls in flight (a store's `SHUTDOWN_GRACE_S`, 0.3 s); a kill is for a server that
# hangs, and it recovers from it as from a crash.
STOP_GRACE_S = 0.8
READY_TIMEOUT_S = 30.0


@dataclass
class Child:
    name: str
    address: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Without the client's TLS variables: servers read STREAMENGINE_<FLAG> too, and a
        # server's certs dir is its own flag's.
        env = {k: v for k, v in os.environ.items() if k not in (CERTS_DIR_ENV, TOKEN_ENV)}
        # 0600 whatever the umask: a server's log names its tenants and streams.
        descriptor = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
        with os.fdopen(descriptor, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streamengine.tools.cli", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, PARENT_PID_ENV: str(os.getpid())},
            )

    def exited(self) -> int | None:
        assert self.process is not None
        return self.process.poll()


def serving(address: str, transport: Transport = PLAINTEXT) -> bool:
    with transport.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


CERTS_SUBDIR = "certs"


def ports_used(stores: int) -> int:
    """How many consecutive ports from its base a cluster of `stores` takes: the
    master's, each store's gRPC port, the console's (`cluster up`), each data port."""
    return 2 * stores + 2


class LocalCluster:
    def __init__(
        self,
        data_dir: Path,
        stores: int,
        port: int,
        fsync: str = "always",
        tls: bool = True,
        console_port: int | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.master_address = f"127.0.0.1:{port}"
        self.console_port = console_port
        self.children: list[Child] = []
        tightened = private_dir(data_dir)
        if tightened:
            message = tightened_message("data dir", data_dir, tightened)
            print(f"streamengine: {message}", file=sys.stderr)
        self.certs = create_local_certs(data_dir / CERTS_SUBDIR) if tls else None
        # Health checks need no certificate of their own: the CA is enough.
        self.health_transport = (
            PLAINTEXT if self.certs is None else Transport.for_client(self.certs.tenant_dir)
        )
        master_dir = data_dir / "master"
        self.children.append(
            Child(
                "master",
                self.master_address,
                [
                    "master",
                    "--listen",
                    self.master_address,
                    "--data",
                    str(master_dir),
                    *([] if console_port is None else ["--metrics-port", str(console_port)]),
                    *self._tls_args("master", master=True),
                ],
                data_dir / "master.log",
            )
        )
        for number in range(stores):
            address = f"127.0.0.1:{port + 1 + number}"
            # The data ports follow the stores' gRPC ports and the console's (`cluster
            # up`: the master's port + stores + 1): a store's gRPC port + 1 is taken.
            data_address = f"127.0.0.1:{port + 2 + stores + number}"
            store_id = f"store{number}"
            self.children.append(
                Child(
                    store_id,
                    address,
                    [
                        "store",
                        "--listen",
                        address,
                        "--data-listen",
                        data_address,
                        "--data",
                        str(data_dir / store_id),
                        "--master",
                        self.master_address,
                        "--id",
                        store_id,
                        "--zone",
                        f"zone{number % 3}",
                        "--fsync",
                        fsync,
                        *self._tls_args(store_id, store_id=store_id),
                    ],
                    data_dir / f"{store_id}.log",
                )
            )

    @property
    def admin_certs_dir(self) -> Path | None:
        """What the CLI exports as $STREAMENGINE_CERTS_DIR (None: plaintext)."""
        return None if self.certs is None else self.certs.client_dir

    @property
    def console_url(self) -> str | None:
        """The master's web console (HTTPS with TLS), None when not served."""
        if self.console_port is None:
            return None
        scheme = "http" if self.certs is None else "https"
        return f"{scheme}://127.0.0.1:{self.console_port}/"

    def _tls_args(self, name: str, **role: Any) -> list[str]:
        if self.certs is None:
            return []
        return ["--certs-dir", str(self.certs.add_node(name, **role))]

    def start(self) -> None:
        for child in self.children:
            child.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for child in self.children:
            while not serving(child.address, self.health_transport):
                code = child.exited()
                if code is not None:
                    raise RuntimeError(f"{child.name} exited with {code}; see {child.log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} not serving at {child.address}")
                time.sleep(0.05)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL one server (a crash: nothing flushed, nothing said)."""
        child = self.child(name)
        assert child.process is not None
        child.process.kill()
        child.process.wait()

    def restart(self, name: str, wait: bool = True) -> None:
        """Start a killed server again on its data dir (and wait until it serves).

        Call it from a thread that outlives the child: the kernel's parent-death signal
        fires when the *thread* that started a child exits, not the process."""
        self.child(name).start()
        if wait:
            self.wait_serving(name)

    def wait_serving(self, name: str) -> None:
        child = self.child(name)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not serving(child.address, self.health_transport):
            code = child.exited()
            if code is not None:
                raise RuntimeError(f"{child.name} exited with {code}; see {child.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} is not serving; see {child.log_path}")
            time.sleep(0.05)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.exited() is not None), None)

    def stop(self) -> None:
        running = [c for c in self.children if c.process is not None and c.exited() is None]
        for child in reversed(running):  # stores first, master last
            assert child.process is not None
            child.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in running:
            assert child.process is not None
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def run_cluster_up(
    data_dir: Path,
    stores: int,
    port: int,
    fsync: str,
    insecure: bool = False,
    console_port: int | None = None,
) -> int:
    cluster = LocalCluster(
        data_dir, stores, port, fsync, tls=not insecure, console_port=console_port
    )
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            cluster.start()
        except RuntimeError as error:
            print(f"streamengine: error: {error}", file=sys.stderr)
            return 1
        print(f"master  {cluster.master_address}  data {data_dir / 'master'}", flush=True)
        for child in cluster.children[1:]:
            print(f"{child.name:7} {child.address}  data {data_dir / child.name}", flush=True)
        print("cluster up; Ctrl-C or SIGTERM stops it", flush=True)
        if cluster.admin_certs_dir is None:
            print("to use it from another shell (plaintext, loopback only):")
            print(f"export {MASTER_ENV}={cluster.master_address}")
            if cluster.console_url is not None:
                print(f"web console: {cluster.console_url}", flush=True)
        else:
            print("to use it from another shell (TLS, as cluster admin client.root):")
            print(f"export {MASTER_ENV}={cluster.master_address}")
            print(f"export {CERTS_DIR_ENV}={cluster.admin_certs_dir.resolve()}")
            if cluster.console_url is not None:
                print(
                    f"web console: {cluster.console_url} (a tenant's token typed into the "
                    f"page, or {cluster.admin_certs_dir.resolve()}/client.root.crt in the "
                    "browser for everything)"
                )
            print(
                "a tenant's token (a tenant then needs only ca.crt): streamengine token "
                "create --tenant TENANT --role read|write|admin",
                flush=True,
            )
        while True:
            dead = cluster.first_exited()
            if dead is not None:
                print(
                    f"streamengine: error: {dead.name} exited with {dead.exited()} "
                    f"(see {dead.log_path}); stopping the cluster",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.2)
    except _Stop as stop:
        print(f"stopping ({stop})", flush=True)
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        cluster.stop()
