from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamengine.testing import (
    PORT_SHARD_ENV,
    Cluster,
    EtcdCluster,
    etcd_binary,
    running_cluster,
    running_etcd,
)
from tests.metadata_backends import BACKENDS, MetadataPlace, open_backend
from tests.tree import child_env

ETCD_MISSING = "etcd is not installed (deploy/install-system-deps.sh installs Debian's etcd-server)"

# Every process a test starts (servers, the CLI, writers, Spark workers) imports the code
# of this working tree, wherever the installed copy points.
os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]

# `make test` runs two workers (pytest-xdist): each picks its ports from its own share
# (`harness.port_share`), so servers of two tests never get the same one, and the
# processes it starts inherit the share.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER:
    os.environ[PORT_SHARD_ENV] = (
        f"{int(_WORKER.removeprefix('gw'))}/{os.environ['PYTEST_XDIST_WORKER_COUNT']}"
    )

# What `make test`'s workers take as one unit, in order, on one worker: a test file, as
# `--dist loadfile` would (a file's module fixtures are set up once), except that the
# fault suite and the netns tests are a single unit (they share namespace names, bridges
# and iptables), that the files on the shared SparkSession (`tests/integration/test_spark*`)
# are one unit, so that one worker starts Spark's JVM (10 s or more of a core), not both,
# and that the Spark tests that start a JVM of their own (`OWN_JVM`, 25-35 s each) are a
# unit each, which the other worker may take. (xdist's `loadgroup` says this with marks,
# but loses its groups under pytest 9, whose node ids it cannot rename.)
SYSTEM_WIDE = ("tests/faults/", "tests/integration/test_netns.py")
SPARK_SESSION = "tests/integration/test_spark"
OWN_JVM = (
    "tests/integration/test_spark.py::test_the_readme_spark_example_runs_as_written",
    "tests/integration/test_spark.py::test_spark_starts_in_a_driver_already_inside_grpc",
)
# Units of real processes or of the simulator take seconds a test; the rest (pure code)
# take milliseconds. Workers take the former first and the latter last, so that whichever
# worker ends its last long unit first fills the wait with short ones: the pass ends
# within a short unit of both workers' ends, not a long one.
LONG_UNITS = ("tests/integration/", "tests/sim/", "system-wide", "spark-session")


def work_unit(nodeid: str) -> str:
    """The unit of `nodeid`: its file, "system-wide", "spark-session", or itself."""
    if nodeid.startswith(SYSTEM_WIDE):
        return "system-wide"
    if nodeid.startswith(OWN_JVM):
        return nodeid
    if nodeid.startswith(SPARK_SESSION):
        return "spark-session"
    return nodeid.split("::", 1)[0]


def in_worker_order(nodeids: list[str]) -> list[int]:
    """The positions of `nodeids` in the order workers take them: long units first, each
    kind by its number of tests, most first (as xdist's own order), a unit's tests
    together in their order of collection."""
    counts = Counter(work_unit(nodeid) for nodeid in nodeids)

    def key(position: int) -> tuple[bool, int, int]:
        unit = work_unit(nodeids[position])
        return not unit.startswith(LONG_UNITS), -counts[unit], first_seen[unit]

    first_seen: dict[str, int] = {}
    for position, nodeid in enumerate(nodeids):
        first_seen.setdefault(work_unit(nodeid), position)
    return sorted(range(len(nodeids)), key=key)


# `make test`'s second pass collects only these paths: a test marked `faults` or `netns`
# anywhere else would never run there, and fails collection instead.
SECOND_PASS_MARKS = ("faults", "netns")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stray = [
        item.nodeid
        for item in items
        if any(item.get_closest_marker(mark) for mark in SECOND_PASS_MARKS)
        and not item.nodeid.startswith(SYSTEM_WIDE)
    ]
    if stray:
        raise pytest.UsageError(
            f"marked {' or '.join(SECOND_PASS_MARKS)} outside {', '.join(SYSTEM_WIDE)} "
            f"(make test's second pass collects those alone): {stray[:3]}"
        )
    if _WORKER:
        items[:] = [items[i] for i in in_worker_order([item.nodeid for item in items])]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    # Units in the order the workers collected them (`in_worker_order`), not xdist's.
    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A master and three stores, fresh for the test."""
    with running_cluster(tmp_path, stores=3, master_args=["--lease-ms", "1000"]) as running:
        yield running


@pytest.fixture(scope="session")
def session_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member for the whole session, started on first use; tests keep apart by
    key prefix."""
    if etcd_binary() is None:
        pytest.skip(ETCD_MISSING)
    with running_etcd(tmp_path_factory.mktemp("etcd")) as etcd:
        yield etcd


@pytest.fixture(params=BACKENDS)
def metadata_place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MetadataPlace]:
    """Where a master keeps its metadata: the embedded RocksDB, or etcd (the master's unit
    tests run over both)."""
    endpoint = ""
    if request.param == "etcd":
        endpoint = request.getfixturevalue("session_etcd").endpoints[0]
    place = open_backend(request.param, tmp_path, endpoint)
    yield place
    place.close()


@pytest.fixture(scope="session")
def spark():
    """One SparkSession for the whole test session (startup costs ~10 s). It retries a
    failed task once (`local[2,2]`), for the tests of a task retried
    (`spark_task_retries`); in every other test a retry that hid a failure fails the
    test (`no_spark_task_retried`)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from streamengine.client.spark_jvm import start_jvm

    start_jvm()  # earlier tests left gRPC's threads running: no fork of this process
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("streamengine-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


# How long a test's end waits for Spark's status store to hear of its last tasks.
SPARK_EVENTS_WAIT_MS = 10_000


@pytest.fixture(autouse=True)
def no_spark_task_retried(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test on the shared SparkSession whose job succeeded only because a failed
    task was retried fails, unless it is marked `spark_task_retries`: the session's
    retry must never hide a failure."""
    if "spark" not in request.fixturenames:
        yield
        return
    context = request.getfixturevalue("spark").sparkContext._jsc.sc()
    status = context.statusStore()
    seen = {job.jobId() for job in _jobs(status)}
    yield
    if request.node.get_closest_marker("spark_task_retries") is not None:
        return
    # The status store learns of tasks through Spark's listener bus, after the job.
    context.listenerBus().waitUntilEmpty(SPARK_EVENTS_WAIT_MS)
    retried = [
        f"job {job.jobId()}: {job.numFailedTasks()} failed task(s) retried"
        for job in _jobs(status)
        if job.jobId() not in seen
        and job.status().toString() == "SUCCEEDED"
        and job.numFailedTasks()
    ]
    assert not retried, "; ".join(retried)


def _jobs(status: Any) -> list[Any]:
    """Every job Spark's status store holds (py4j objects of its JobData)."""
    jobs = status.jobsList(None)
    return [jobs.apply(i) for i in range(jobs.size())]
