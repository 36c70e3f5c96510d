"""The JSON shape of the cluster's state: `streamengine status --json`, `stream
describe --json` and the master's console (`/api/status`) all print this one shape."""

from __future__ import annotations

from typing import Any

from streamengine.v1 import entry_pb2, master_pb2


def state_name(state: entry_pb2.SegmentState.ValueType) -> str:
    return entry_pb2.SegmentState.Name(state).lower()


def stream_dict(info: master_pb2.StreamInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "stream_id": info.stream_id,
        "replicas": info.policy.replicas,
        "write_quorum": info.policy.write_quorum,
        "segment_bytes": info.segment_bytes,
        "segment_age_ms": info.segment_age_ms,
        "epoch": info.epoch,
        "leader": info.leader_id,
        "acked_index": info.acked_index,
        "open_segment": info.open_segment_epoch,
        "unsealed_segments": info.unsealed_segments,
        "retention_age_ms": info.retention_age_ms,
        "retention_bytes": info.retention_bytes,
        "trimmed_through_epoch": info.trimmed_through_epoch,
        "first_retained_sequence": info.first_retained_sequence,
        "deleted_until_ms": info.deleted_until_ms,
    }


def segment_dict(segment: entry_pb2.Segment) -> dict[str, Any]:
    return {
        "stream": segment.id.stream,
        "epoch": segment.id.epoch,
        "state": state_name(segment.state),
        "final_index": segment.final_index,
        "acked_index": segment.acked_index,
        "copy_set": [replica.store_id for replica in segment.copy_set],
        "bytes": segment.bytes,
    }


def status_dict(status: master_pb2.ClusterStatus) -> dict[str, Any]:
    return {
        "cluster_id": status.cluster_id,
        "stores": [
            {
                "id": s.store_id,
                "address": s.address,
                "zone": s.zone,
                "alive": s.alive,
                "draining": s.draining,
                "bytes": s.used_bytes,
                "free_bytes": s.free_bytes,
                "segments": s.segments,
                "silent_ms": s.silent_ms,
                "incarnation": s.incarnation,
            }
            for s in status.stores
        ],
        "streams": [stream_dict(s) for s in status.streams],
        "under_replicated": [segment_dict(s) for s in status.under_replicated],
        "verifying": [segment_dict(s) for s in status.verifying],
        "tasks": [task_dict(t) for t in status.tasks],
        "granting_leases": status.granting_leases,
        "durability": {
            "bytes_below_n": status.bytes_below_n,
            "bytes_below_w": status.bytes_below_w,
            "worst": [
                {
                    "stream": d.segment.stream,
                    "epoch": d.segment.epoch,
                    "good_replicas": d.good_replicas,
                    "replicas": d.replicas,
                    "below_n_s": d.below_n_ms / 1000,
                    "below_w_s": d.below_w_ms / 1000,
                    "bytes": d.bytes,
                    "exposed": d.exposed,
                }
                for d in status.durability_debt
            ],
        },
        "sealed_replicas": {
            "matched": status.replica_verification.matched,
            "not_matched_yet": status.replica_verification.unmatched,
            "bad": status.replica_verification.bad,
        },
        "pending_deletes": [pending_dict(p) for p in status.pending_deletes],
        "tenant_streams": [
            {
                "tenant": t.tenant,
                "streams": t.streams,
                "under_replicated": t.under_replicated,
                "sealing": t.sealing,
                "deleted": t.deleted,
            }
            for t in status.tenant_streams
        ],
    }


def pending_dict(pending: master_pb2.PendingDelete) -> dict[str, Any]:
    """Data the stores still hold of a deleted stream (segment 0) or a trimmed segment,
    and when it goes (wall-clock ms)."""
    return {
        "stream": pending.stream,
        "segment": pending.segment_epoch,
        "kind": "trim" if pending.segment_epoch else "stream",
        "removed_at_ms": pending.removed_at_ms,
        "bytes": pending.bytes,
    }


def task_dict(task: master_pb2.RepairTask) -> dict[str, Any]:
    return {
        "stream": task.segment.stream,
        "epoch": task.segment.epoch,
        "source": task.source_store,
        "target": task.target_store,
        "replaced": task.replaced_store,
        "state": master_pb2.RepairTask.State.Name(task.state).lower(),
        "reason": task.reason,
        "error": task.error,
        "bytes": task.bytes,
    }
