"""The Master service's RPCs for the cluster's status and its administration: drains
and rebalances (run by the repairer), and the console's view.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamengine.master import replies
from streamengine.master.console import ConsoleView
from streamengine.master.core import authority, errors, repair
from streamengine.master.core.durability import DURABILITY_WORST_MAX
from streamengine.master.repair import TaskStatus
from streamengine.master.service_calls import Context, Handlers
from streamengine.protocol.auth import Principal, PrincipalKind
from streamengine.protocol.status_view import segment_dict
from streamengine.v1 import entry_pb2, master_pb2

_TASK_STATE = {
    "PENDING": master_pb2.RepairTask.PENDING,
    "RUNNING": master_pb2.RepairTask.RUNNING,
    "DONE": master_pb2.RepairTask.DONE,
    "FAILED": master_pb2.RepairTask.FAILED,
}


class AdminHandlers(Handlers):
    """Cluster status, drains and rebalances."""

    RPCS = (
        "GetClusterStatus",
        "DrainStore",
        "Rebalance",
    )

    async def GetClusterStatus(
        self, request: master_pb2.GetClusterStatusRequest, context: Context
    ) -> master_pb2.ClusterStatus:
        return await self.calls.call(
            context,
            "GetClusterStatus",
            lambda now: self.cluster_status(now, self.calls.require(context, "GetClusterStatus")),
        )

    async def DrainStore(
        self, request: master_pb2.DrainStoreRequest, context: Context
    ) -> master_pb2.RepairPlan:
        def drain(now: int) -> master_pb2.RepairPlan:
            self.calls.require(context, "DrainStore")
            if request.cancel:
                self.state.registry.set_draining(request.store_id, now, draining=False)
                return master_pb2.RepairPlan()
            if request.dry_run:
                refusal = self.state.registry.drain_refusal(request.store_id, now)
                if refusal:
                    raise errors.NotEnoughStores(f"drain of {request.store_id} refused: {refusal}")
            else:
                self.state.registry.set_draining(request.store_id, now)
            tasks, before, after = self.state.replicas.drain_preview(request.store_id, now)
            return self._plan(tasks, before, after)

        plan = await self.calls.call(context, "DrainStore", drain)
        self.calls.repairer.wake()
        return plan

    async def Rebalance(
        self, request: master_pb2.RebalanceRequest, context: Context
    ) -> master_pb2.RepairPlan:
        def plan(now: int) -> tuple[list[repair.Task], dict[str, int], dict[str, int]]:
            self.calls.require(context, "Rebalance")
            return self.state.replicas.rebalance_plan(now, self.calls.repairer.running)

        tasks, before, after = await self.calls.call(context, "Rebalance", plan)
        if not request.dry_run:
            self.calls.repairer.plan_moves(tasks)
        return self._plan(tasks, before, after)

    def console_view(self) -> ConsoleView:
        """What the console serves, filtered per caller there: the whole status, each
        stream's segments, and what checks the callers' tokens. Only while this master
        is the active one (the caller checks `role.state`)."""
        now = self.calls.clock_ms()
        state = self.state
        status = self.full_status(now)
        return ConsoleView(
            status=status,
            segments={
                info.name: [
                    segment_dict(replies.segment_pb(self.state, segment))
                    for segment in state.stream_segments(info.stream_id)
                ]
                for info in status.streams
            },
            verifier=state.verifier,
            revocations=state.issuer.current_revocations(now),
        )

    def cluster_status(self, now: int, principal: Principal) -> master_pb2.ClusterStatus:
        """The status `principal` may see (`authority.visible_status`); a tenant's
        stream rows are its own."""
        tenant = principal.tenant if principal.kind is PrincipalKind.TENANT else ""
        return authority.visible_status(self.full_status(now, tenant), principal)

    def full_status(self, now: int, tenant: str = "") -> master_pb2.ClusterStatus:
        """The whole cluster's status, every tenant's (its stream rows and counts only
        `tenant`'s, when given): filter it before it leaves."""
        st = self.state
        views = st.store_views(now)
        stores = [
            master_pb2.StoreStatus(
                store_id=sid,
                address=st.stores[sid].address,
                zone=view.zone,
                alive=view.alive,
                draining=view.draining,
                used_bytes=view.used_bytes,
                free_bytes=st.live[sid].free_bytes,
                segments=view.segments,
                silent_ms=max(0, now - st.live[sid].last_seen_ms),
                incarnation=st.stores[sid].incarnation,
            )
            for sid, view in views.items()
        ]
        matched, unmatched, bad = st.integrity.replica_verification()
        under_replicated, verifying = st.replicas.below_n(now)
        streams = st.tenancy.summarise(under_replicated, tenant)
        return master_pb2.ClusterStatus(
            cluster_id=st.cluster_id,
            replica_verification=master_pb2.ReplicaVerification(
                matched=matched, unmatched=unmatched, bad=bad
            ),
            stores=stores,
            streams=[
                replies.stream_info_pb(self.state, st.streams[name], now) for name in streams.rows
            ],
            tenant_streams=[
                master_pb2.TenantStreams(
                    tenant=c.tenant,
                    streams=c.streams,
                    under_replicated=c.under_replicated,
                    sealing=c.sealing,
                    deleted=c.deleted,
                )
                for c in streams.tenants
            ],
            under_replicated=[replies.segment_pb(self.state, s) for s in under_replicated],
            verifying=[replies.segment_pb(self.state, s) for s in verifying],
            tasks=[self._task(t) for t in self.calls.repairer.statuses()],
            granting_leases=st.granting_leases(now),
            durability_debt=[
                master_pb2.SegmentDebt(
                    segment=entry_pb2.SegmentId(
                        stream_id=debt.segment[0], epoch=debt.segment[1], stream=debt.stream
                    ),
                    good_replicas=debt.good,
                    replicas=debt.replicas,
                    below_n_ms=debt.below_n_ms,
                    below_w_ms=debt.below_w_ms,
                    bytes=debt.bytes,
                    exposed=debt.exposed,
                )
                for debt in st.durability.worst(DURABILITY_WORST_MAX)
            ],
            bytes_below_n=st.durability.bytes_below_n,
            bytes_below_w=st.durability.bytes_below_w,
            pending_deletes=[
                master_pb2.PendingDelete(
                    stream=p.stream,
                    segment_epoch=p.segment_epoch,
                    removed_at_ms=p.removal_at_ms,
                    bytes=p.bytes,
                )
                for p in st.retention.pending_removals()
            ],
        )

    def _task(self, status: TaskStatus) -> master_pb2.RepairTask:
        task = status.task
        stream_id, epoch = task.segment
        return master_pb2.RepairTask(
            segment=entry_pb2.SegmentId(
                stream_id=stream_id, epoch=epoch, stream=self.state.stream_name(stream_id)
            ),
            source_store=task.source,
            target_store=task.target,
            replaced_store=task.replaced,
            state=_TASK_STATE[status.state],
            error=status.error,
            bytes=task.bytes,
            reason=task.reason,
        )

    def _plan(
        self, tasks: Iterable[repair.Task], before: dict[str, int], after: dict[str, int]
    ) -> master_pb2.RepairPlan:
        return master_pb2.RepairPlan(
            tasks=[self._task(TaskStatus(t, "PENDING")) for t in tasks],
            bytes_before=before,
            bytes_after=after,
        )
