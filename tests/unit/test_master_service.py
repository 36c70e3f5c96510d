"""The Master servicer is composed of its RPC groups: every RPC the .proto declares is
served, by exactly one group; a call held open is admitted per caller before its group
sees it."""

from __future__ import annotations

from streamengine.master.metrics import Metrics
from streamengine.master.role import MasterRole
from streamengine.master.service import MasterService
from streamengine.v1 import master_pb2


def test_every_rpc_of_the_proto_is_served_by_one_group() -> None:
    service = MasterService(MasterRole("127.0.0.1:1"), lambda: 0, Metrics.create())
    declared = [m.name for m in master_pb2.DESCRIPTOR.services_by_name["Master"].methods]
    served = [name for group in service.groups() for name in group.RPCS]
    assert sorted(served) == sorted(declared)
    handlers = service.handlers()
    held = {
        m.name
        for m in master_pb2.DESCRIPTOR.services_by_name["Master"].methods
        if m.server_streaming
    }
    assert held == {"HoldLease", "HoldLeaseSession"}
    assert all(
        (handlers[name] == getattr(group, name)) == (name not in held)
        for group in service.groups()
        for name in group.RPCS
    )
