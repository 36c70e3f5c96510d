"""The segment store (`streamengine store`): durable entries per segment in RocksDB.

- `store.py`: the rules (fencing, overwrite rule, matched and acked index) over a KV,
  pure and synchronous; `kv.py`: the KV interface, RocksDB and in-memory; `keys.py`:
  the key and metadata layout.
- `group_commit.py`: one committer batches concurrent mutations into one KV write and
  one sync; `service.py`: the gRPC servicer; `master_link.py`: registration and
  heartbeats; `server.py`: the process; `metrics.py`: Prometheus metrics.
"""
