"""The segment store (`streamengine store`): durable entries per segment in RocksDB.

- `core/store.py`: the rules (fencing, overwrite rule, matched and acked index) over a
  KV, pure and synchronous; `core/kv.py`: the KV interface, and `kv.py` its RocksDB and
  in-memory engines; `core/keys.py`: the key and metadata layout; the other pure rules
  (`core/`) as docs/design.md lists them.
- `group_commit.py`: one committer batches concurrent mutations into one KV write and
  one sync; `service.py`: the gRPC servicer; `master_link.py`: registration and
  heartbeats; `server.py`: the process; `metrics.py`: Prometheus metrics.
"""
