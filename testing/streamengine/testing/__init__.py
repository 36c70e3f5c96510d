"""Real `streamengine master`, `streamengine store` and etcd processes for tests and
benchmarks.

Every server runs as its own process on 127.0.0.1 with RocksDB in a temp dir; tests
kill them with SIGKILL / SIGSTOP and wait for conditions with deadlines, never sleeps.

- `ports`: free ports, one share per worker of a parallel run;
- `waiting`: `wait_for` / `wait_until`, a condition with a deadline;
- `processes`: a master, a store, a cluster of them, their logs and metrics;
- `etcd`: etcd members, and clusters of masters on them.
"""

from __future__ import annotations

from streamengine.testing.etcd import (
    ETCD_ELECTION_TIMEOUT_MS,
    ETCD_HEARTBEAT_MS,
    ETCD_READY_TIMEOUT_S,
    EtcdCluster,
    EtcdMember,
    etcd_answers,
    etcd_binary,
    make_etcd,
    running_etcd,
    running_ha_cluster,
)
from streamengine.testing.ports import (
    PORT_SHARD_ENV,
    free_port,
    free_port_run,
    port_shard,
    port_share,
)
from streamengine.testing.processes import (
    LOG_FAULTS,
    MASTER_SERVICE,
    STREAMENGINE,
    ChildProcess,
    Cluster,
    ServerProcess,
    data_address_of,
    is_active_master,
    is_serving,
    log_faults,
    make_master,
    make_store,
    metric_value,
    running_cluster,
    server_env,
    servers_started,
)
from streamengine.testing.waiting import wait_for, wait_until

__all__ = [
    "ETCD_ELECTION_TIMEOUT_MS",
    "ETCD_HEARTBEAT_MS",
    "ETCD_READY_TIMEOUT_S",
    "LOG_FAULTS",
    "MASTER_SERVICE",
    "PORT_SHARD_ENV",
    "STREAMENGINE",
    "ChildProcess",
    "Cluster",
    "EtcdCluster",
    "EtcdMember",
    "ServerProcess",
    "data_address_of",
    "etcd_answers",
    "etcd_binary",
    "free_port",
    "free_port_run",
    "is_active_master",
    "is_serving",
    "log_faults",
    "make_etcd",
    "make_master",
    "make_store",
    "metric_value",
    "port_shard",
    "port_share",
    "running_cluster",
    "running_etcd",
    "running_ha_cluster",
    "server_env",
    "servers_started",
    "wait_for",
    "wait_until",
]
