"""Liveness figures from a history (FAULTS.md §1): ack latency and throughput, writer
failover after a leader is killed or paused, the append stall after a store or master
fault. Pure functions over records, like the checker."""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from typing import Any

from tests.faults.checker import Op, operations
from tests.faults.history import Record

# A stall is measured over this long after the fault started.
STALL_WINDOW_S = 10.0
# A writer counts as leading a stream at a fault if it acked there this recently.
LEADING_RECENTLY_S = 1.0


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return round(ordered[position], 4)


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50": percentile(values, 0.5),
        "p99": percentile(values, 0.99),
        "max": round(max(values), 4) if values else None,
    }


def fault_starts(records: list[Record]) -> list[Record]:
    return [r for r in records if r["type"] == "nemesis" and r.get("phase") == "start"]


def measure(records: list[Record], scenario: str) -> dict[str, Any]:
    ops = operations(records)
    acked = [op for op in ops if op.status == "ok" and op.end_t is not None]
    latencies = [(op.end_t or 0.0) - op.invoke_t for op in acked]
    figures: dict[str, Any] = {"ack_latency_s": summary(latencies)}
    if acked:
        span = max(op.end_t or 0.0 for op in acked) - min(op.invoke_t for op in acked)
        events = sum(len(op.ids) for op in acked)
        figures["throughput_events_per_s"] = round(events / span, 1) if span > 0 else None
    by_stream: dict[str, list[Op]] = defaultdict(list)
    for op in acked:
        by_stream[op.stream].append(op)
    for ops_of in by_stream.values():
        ops_of.sort(key=lambda op: op.end_t or 0.0)
    failovers, store_stalls, master_stalls = [], [], []
    for fault in fault_starts(records):
        target, t = str(fault["target"]), float(fault["t"])
        if target.startswith("w"):
            failovers.extend(failover_times(by_stream, target, t))
        elif target.startswith("store") and not fault.get("quorum_lost"):
            store_stalls.extend(stalls(by_stream, t))
        elif target == "master":
            master_stalls.extend(stalls(by_stream, t))
    repairs = [float(r["repair_s"]) for r in records if r["type"] == "nemesis"
               and r.get("phase") == "detail" and r.get("repair_s") is not None]
    if repairs:
        figures["repair_s"] = summary(repairs)
    if failovers:
        figures["writer_failover_s"] = summary(failovers)
    if store_stalls:
        figures["append_stall_after_store_fault_s"] = summary(store_stalls)
    if master_stalls:
        figures["append_stall_after_master_fault_s"] = summary(master_stalls)
    return figures


def failover_times(by_stream: dict[str, list[Op]], target: str, t: float) -> list[float]:
    """Per stream the target led: from the fault to the first ack of an append another
    writer invoked after it."""
    out = []
    for ops_of in by_stream.values():
        led = any(
            op.process == target and t - LEADING_RECENTLY_S <= (op.end_t or 0.0) <= t
            for op in ops_of
        )
        if not led:
            continue
        first = next(
            (op for op in ops_of if op.process != target and op.invoke_t > t), None
        )
        if first is not None and first.end_t is not None:
            out.append(first.end_t - t)
    return out


def stalls(by_stream: dict[str, list[Op]], t: float) -> list[float]:
    """Per stream: the longest time without an ack among the acks of the window after
    the fault, counting the gap to the first ack after the window (a stall that lasts
    beyond it counts whole); the end of the history is not a stall."""
    out = []
    for ops_of in by_stream.values():
        ends = [op.end_t or 0.0 for op in ops_of]
        low = bisect.bisect_right(ends, t)
        high = bisect.bisect_right(ends, t + STALL_WINDOW_S)
        moments = [t, *ends[low:high], *ends[high:high + 1]]
        if len(moments) > 1:
            out.append(max(b - a for a, b in itertools.pairwise(moments)))
    return out


def bounds(figures: dict[str, Any], lease_s: float) -> dict[str, Any]:
    """C13: the measured figures against FAULTS.md §1's liveness table. Reported beside
    the (safety) verdict; a miss is a finding, not a safety anomaly."""
    table = {
        "writer_failover_s": lease_s + 2.0,  # writer dies -> a standby's first ack
        "append_stall_after_store_fault_s": 1.0,  # one copy-set store dies, W still live
        "append_stall_after_master_fault_s": 2 * lease_s + 2.0,  # master restart
    }
    out: dict[str, Any] = {}
    for key, limit in table.items():
        figure = figures.get(key)
        if isinstance(figure, dict) and figure.get("p99") is not None:
            out[key] = {"p99": figure["p99"], "bound": limit, "ok": figure["p99"] <= limit}
    if "reader_catch_up_s" in figures:  # readers caught up to the last ack after healing
        value = figures["reader_catch_up_s"]
        out["reader_catch_up_s"] = {"value": value, "bound": 5.0,
                                    "ok": value is not None and value <= 5.0}
    return out
