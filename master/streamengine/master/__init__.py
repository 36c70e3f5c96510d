"""The master: tenants and streams, leases and epochs, segments and copy sets, store
liveness, placement and repair.

Where things live:
- pure decisions in `core/`, time passed in as `now_ms`, table-tested:
  `core.leadership` (the lease state machine), `core.placement` (copy sets, repair
  targets, rebalance plans), `core.repair` (which sealed replicas are bad and which
  copies to run), and the others docs/design.md lists, over the records of
  `core.model`;
- `catalog`: the records and their key layout, over `metadata`, the narrow interface of
  the metadata store, with two back ends: `rocksdb_metadata` (embedded, under --data)
  and `etcd_metadata` (etcd v3, every commit guarded by the master's election key);
- `state`: the records in memory, written through to the catalog before any answer;
- `etcd`, `election`, `ha`, `role`: with etcd, several masters and one active: the
  lease election, the life of a master (stand by, serve, deposed), and the role every
  request checks first;
- `repair`: carries repair tasks out against the stores (copy, digest, swap, delete);
- `service`: the gRPC servicer, with the one table from `core.errors` to gRPC statuses;
- `server`: `streamengine master` (flags, health, metrics, signals).

After a start (or on becoming the active master) the master grants no lease for one
lease period. Writer heartbeats in that window are answered FOLLOWER (not UNAVAILABLE),
naming the holder of the latest epoch as it was persisted; that holder's own heartbeats
renew its lease, since it may still lead.
"""
