"""The shipped segment store on the runtime: its service (`StoreContext` and the call
groups of `segment_store.service`) and core over a `MemoryKV`, with its group committer,
served by a `SimServer` built as `server.serve` builds the real one (the same
interceptors, the same `add_to_server`).

What is not here yet (the next steps, tests/sim/runtime/README.md): the master link
(registration, heartbeats), the scrubber, and restarts from the KV after a crash.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from streamengine.protocol.parsing import RequestParsing
from streamengine.segment_store.core.authority import StoreAuthority
from streamengine.segment_store.core.commands import Plan
from streamengine.segment_store.core.store import SegmentStoreCore
from streamengine.segment_store.group_commit import GroupCommitter, SegmentWatch
from streamengine.segment_store.kv import MemoryKV
from streamengine.segment_store.service import add_to_server
from streamengine.segment_store.store_context import ServiceConfig, StoreContext
from tests.sim.runtime.transport import SimNetwork, SimServer


class SimStore:
    """One store node: `serve()` runs it (in a task of its node's context, see
    `transport.node_context`) until cancelled; its KV outlives it."""

    def __init__(
        self,
        network: SimNetwork,
        store_id: str,
        trusted_keys: Sequence[bytes],
        config: ServiceConfig | None = None,
    ) -> None:
        self.network = network
        self.store_id = store_id
        self.address = f"{store_id}:1"
        self.trusted_keys = tuple(trusted_keys)
        self.config = config or ServiceConfig()
        self.kv = MemoryKV()
        self.serving = asyncio.Event()
        self.server: SimServer | None = None
        self.context: StoreContext | None = None

    async def serve(self) -> None:
        core = SegmentStoreCore(self.kv)
        watch = SegmentWatch()

        def published(plan: Plan) -> None:
            watch.changed(list(plan.metas))

        committer = GroupCommitter(core, True, published)
        authority = StoreAuthority(self.store_id, None, self.trusted_keys)
        self.context = StoreContext(core, committer, watch, self.config, authority)
        self.server = SimServer(self.network, self.store_id, [RequestParsing()])
        add_to_server(self.context, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()
        self.serving.set()
        try:
            await committer.run()
        finally:
            self.serving.clear()
            await self.server.stop(None)
            self.context.close()
