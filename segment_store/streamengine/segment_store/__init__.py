"""The segment store (`streamengine store`): durable entries per segment in RocksDB.

- `core/`: the rules, pure and synchronous, over a KV: `store.py` (the core and its
  plan/write/publish cycle), `writes.py` (fencing, overwrite rule, matched and acked
  index), `reads.py` (reads, digests), `catalog.py` (what is held, identity, damage),
  `commands.py` and `errors.py` (the vocabulary); `core/kv.py`: the KV interface
  (`kv.py`: RocksDB and in-memory); `core/keys.py`: the key and metadata layout.
- `group_commit.py`: one committer batches concurrent mutations into one KV write and
  one sync; `service.py`: the gRPC service, composed of the calls in `writes.py`,
  `reads.py`, `tail.py` and `catalog.py` over `store_context.py`, refused by
  `refusals.py`; `copy.py`: a segment copy; `scrub.py`: the scrub;
  `master_link.py`: registration and heartbeats; `server.py`: the process;
  `metrics.py`: Prometheus metrics.
"""
