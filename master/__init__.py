"""The master: tenants and streams, leases and epochs, segments and copy sets, store
liveness, placement and repair.

Where things live:
- pure decisions, time passed in as `now_ms`, table-tested: `leadership` (the lease
  state machine), `placement` (copy sets, repair targets, rebalance plans), `repair`
  (which sealed replicas are bad and which copies to run), over the records of `model`;
- `catalog`: the RocksDB metadata (raw mode, every mutation one synced WriteBatch);
- `state`: the records in memory, written through to the catalog before any answer;
- `repairer`: carries repair tasks out against the stores (copy, digest, swap, delete);
- `service`: the gRPC servicer, with the one table from `errors` to gRPC statuses;
- `server`: `streamengine master` (flags, health, metrics, signals).

After a start the master grants no lease for one lease period. Writer heartbeats in that
window are answered FOLLOWER (not UNAVAILABLE), naming the holder of the latest epoch as
it was persisted; that holder's own heartbeats renew its lease, since it may still lead.
"""
