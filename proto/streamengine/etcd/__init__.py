"""etcd v3 API stubs, generated from the protos beside them (see proto/etcd_protos.py)."""
