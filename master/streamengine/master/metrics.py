"""Prometheus metrics of the master, served with its console (`streamengine.master.console`) only
when `--metrics-port` is given."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass
class Metrics:
    registry: CollectorRegistry
    requests: Counter
    leases_granted: Counter
    lease_heartbeats: Counter
    lease_session_renewals: Counter
    stores_alive: Gauge
    stores_registered: Gauge
    streams: Gauge
    segments: Gauge
    under_replicated: Gauge
    verifying: Gauge
    repairs_done: Gauge
    repairs_failed: Gauge
    repairs_running: Gauge
    durability_debt_seconds: Counter
    bytes_below_n: Gauge
    bytes_below_w: Gauge
    active: Gauge
    certificates: Counter
    replica_checks: Counter
    replicas_bad: Counter
    reader_reports: Counter
    trimmed_segments: Counter
    removed: Counter
    pending_deletes: Gauge
    pending_delete_bytes: Gauge
    pending_delete_at: Gauge

    @classmethod
    def create(cls) -> Metrics:
        r = CollectorRegistry()
        return cls(
            registry=r,
            requests=Counter(
                "streamengine_master_requests",
                "Master RPCs by method and status",
                ["method", "code"],
                registry=r,
            ),
            leases_granted=Counter(
                "streamengine_master_leases_granted", "Epochs granted", registry=r
            ),
            lease_heartbeats=Counter(
                "streamengine_master_lease_heartbeats",
                "Writer heartbeats decided, one per stream (each entry of a batch)",
                registry=r,
            ),
            lease_session_renewals=Counter(
                "streamengine_master_lease_session_renewals",
                "Lease sessions renewed, each for every lease bound to it",
                registry=r,
            ),
            stores_alive=Gauge(
                "streamengine_master_stores_alive", "Stores heard from in time", registry=r
            ),
            stores_registered=Gauge(
                "streamengine_master_stores_registered", "Stores known", registry=r
            ),
            streams=Gauge("streamengine_master_streams", "Streams", registry=r),
            segments=Gauge("streamengine_master_segments", "Segments, all states", registry=r),
            under_replicated=Gauge(
                "streamengine_master_under_replicated_segments",
                "Sealed segments with fewer than N good replicas, a member lacking",
                registry=r,
            ),
            verifying=Gauge(
                "streamengine_master_verifying_segments",
                "Sealed segments with fewer than N good replicas, none lacking: some not "
                "yet reported at the bridge or read back",
                registry=r,
            ),
            repairs_done=Gauge(
                "streamengine_master_repairs_done", "Repair tasks finished", registry=r
            ),
            repairs_failed=Gauge(
                "streamengine_master_repairs_failed", "Repair tasks failed", registry=r
            ),
            repairs_running=Gauge(
                "streamengine_master_repairs_running", "Repair tasks running", registry=r
            ),
            durability_debt_seconds=Counter(
                "streamengine_master_durability_debt_seconds",
                "Segment-seconds sealed segments spent with fewer than N good replicas",
                registry=r,
            ),
            bytes_below_n=Gauge(
                "streamengine_master_durability_bytes_below_n",
                "Bytes of sealed segments with fewer than N good replicas now",
                registry=r,
            ),
            bytes_below_w=Gauge(
                "streamengine_master_durability_bytes_below_w",
                "Bytes of sealed segments with fewer than W good replicas now",
                registry=r,
            ),
            active=Gauge(
                "streamengine_master_active",
                "1 while this master is the active one, 0 while a standby",
                registry=r,
            ),
            certificates=Counter(
                "streamengine_master_certificates",
                "Certificates recorded, by who made them (writer, replicas)",
                ["by"],
                registry=r,
            ),
            replica_checks=Counter(
                "streamengine_master_replica_checks",
                "Scrub reports of sealed replicas, by outcome (verified, bad, damaged, other)",
                ["outcome"],
                registry=r,
            ),
            replicas_bad=Counter(
                "streamengine_master_replicas_bad",
                "Replicas found differing from their segment's certificate",
                registry=r,
            ),
            reader_reports=Counter(
                "streamengine_master_reader_reports",
                "Replicas readers reported suspect (each checked first by its store)",
                registry=r,
            ),
            trimmed_segments=Counter(
                "streamengine_master_trimmed_segments",
                "Sealed segments trimmed, by what trimmed them (retention, hand)",
                ["by"],
                registry=r,
            ),
            removed=Counter(
                "streamengine_master_removed",
                "Deleted streams and trimmed segments removed after their grace, by kind "
                "(stream, segment)",
                ["kind"],
                registry=r,
            ),
            pending_deletes=Gauge(
                "streamengine_master_pending_deletes",
                "Deleted streams and trimmed segments whose data the stores still hold, by "
                "kind (stream, segment)",
                ["kind"],
                registry=r,
            ),
            pending_delete_bytes=Gauge(
                "streamengine_master_pending_delete_bytes",
                "Bytes the stores still hold of deleted streams and trimmed segments",
                registry=r,
            ),
            pending_delete_at=Gauge(
                "streamengine_master_pending_delete_timestamp_seconds",
                "When a stream's pending delete takes effect (Unix seconds): the soonest of "
                "its own deletion (kind stream) or of its trimmed segments (kind trim)",
                ["stream", "kind"],
                registry=r,
            ),
        )
