"""Spark's JVM for a driver that already talks gRPC: started without a fork of Python.

PySpark's own launch (`pyspark.java_gateway.launch_gateway`) starts `spark-submit` with
a `preexec_fn` (to ignore SIGINT in the JVM), so Python forks the whole driver, runs
Python in the child, then execs. With gRPC's threads running, gRPC's fork handlers
skip ("Other threads are currently calling into gRPC, skipping fork() handlers"), its
poller saw `epoll_wait ... Bad file descriptor`, and once the JVM never answered
(`JAVA_GATEWAY_EXITED`). `start_jvm` starts the same command with no `preexec_fn`, which
lets Python spawn it with vfork and exec (no fork handler runs, no Python runs in the
child), in a session of its own, which keeps a terminal's Ctrl-C from it as the ignored
SIGINT did. It then hands PySpark the JVM's port and secret the way `spark-submit`
hands them to a driver it starts (PYSPARK_GATEWAY_PORT / _SECRET), so
`SparkSession.builder...getOrCreate()` connects to it instead of launching its own, on
the first start and on every later one in the process.

The JVM lives as long as this process: it exits when its stdin, held here, closes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

# The JVM's start took 8 to 9 s on an idle 2-core host; give a loaded one far more.
JVM_START_S_MAX = 120.0
JVM_START_POLL_S = 0.05

GATEWAY_PORT_ENV = "PYSPARK_GATEWAY_PORT"
GATEWAY_SECRET_ENV = "PYSPARK_GATEWAY_SECRET"

# The running JVM, kept so its stdin stays open (closing it ends the JVM).
_jvm: subprocess.Popen[bytes] | None = None


def start_jvm(conf: Mapping[str, str] | None = None) -> None:
    """Start Spark's JVM for this process unless one runs (ours, or the one that
    `spark-submit` started this driver from); `conf` as `--conf` flags, for settings read
    only at the JVM's start. Raises RuntimeError when it does not come up."""
    global _jvm
    if os.environ.get(GATEWAY_PORT_ENV):
        return
    from pyspark.find_spark_home import _find_spark_home

    command = [str(Path(_find_spark_home()) / "bin" / "spark-submit")]
    for key, value in (conf or {}).items():
        command += ["--conf", f"{key}={value}"]
    command += shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell"))
    conn_info_dir = Path(tempfile.mkdtemp())
    conn_info = conn_info_dir / "gateway"
    try:
        env = os.environ | {
            "SPARK_CONNECT_MODE": "0",
            "_PYSPARK_DRIVER_CONN_INFO_PATH": str(conn_info),
        }
        process = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, start_new_session=True)
        deadline = time.monotonic() + JVM_START_S_MAX
        # The JVM writes the file whole, then renames it into place.
        while not conn_info.exists():
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"Spark's JVM exited with {code} before it answered")
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"Spark's JVM did not answer within {JVM_START_S_MAX} s")
            time.sleep(JVM_START_POLL_S)
        port, secret = _gateway_address(conn_info.read_bytes())
    finally:
        shutil.rmtree(conn_info_dir, ignore_errors=True)
    _jvm = process
    os.environ[GATEWAY_PORT_ENV] = str(port)
    os.environ[GATEWAY_SECRET_ENV] = secret


def _gateway_address(conn_info: bytes) -> tuple[int, str]:
    """The port and secret the JVM wrote (as PySpark reads them: a big-endian int, then
    a UTF-8 string after its big-endian length)."""
    port, length = struct.unpack_from(">ii", conn_info)
    return port, conn_info[8 : 8 + length].decode()
