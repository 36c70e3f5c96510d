"""Liveness figures from a history (FAULTS.md §1): ack latency and throughput, writer
failover after a leader is killed or paused, the append stall after a store, master or
link fault, the memory of every process; and C13, those figures against §1's bounds.
Pure functions over records, like the checker."""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from typing import Any

from streamengine.client.core.replicator import RETAINED_BYTES_MAX, UNACKED_BYTES_MAX
from streamengine.segment_store.group_commit import STORE_QUEUE_BYTES_MAX
from tests.faults.checker import Op, operations
from tests.faults.history import Record

# A stall is measured over this long after the fault started (or until the next fault).
STALL_WINDOW_S = 10.0
# A writer counts as leading a stream at a fault if it acked there this recently.
LEADING_RECENTLY_S = 1.0
# Faults on a proxy link (S10): the store lives but is slow or silent, and the other
# members of its copy set may be slowed too, so the stall has no §1 bound: reported.
LINK_FAULTS = {"delay", "throttle", "narrow", "blackhole", "loss"}
# S4's jumps of a process's clock: FAULTS.md bounds the unavailability after each by
# 2 L, whichever process jumped (a master's jump ends every lease at once).
CLOCK_FAULTS = {"clock-jump"}

# A partition heals -> every reader caught up to the last ack.
CATCH_UP_S = 5.0

MIB = 1 << 20
# A process's baseline memory: its smallest sample in the first seconds of the faults.
RSS_BASELINE_S = 5.0
# A process first sampled this long after the run's first sample started during the
# faults (a reader started late): two sampling intervals.
RSS_LATE_START_S = 2.0
# Headroom beyond what the configuration lets a process hold (the interpreter, gRPC's
# buffers, the allocator's slack).
RSS_SLACK_MIB = 64
# RocksDB's memtables (2 x 64 MiB by default) fill before they are flushed.
STORE_MEMTABLES_MIB = 128
# Memory growth between the first and the last third of a long run: beyond this a
# process is growing, not just filling its bounded buffers.
RSS_GROWTH_MIB_MAX = 32
RSS_TREND_MIN_S = 60.0
# Whose memory must not grow with the data written. A store's does, by design, until
# RocksDB flushes a memtable (64 MiB): its bound is the absolute one, memtables included.
TREND_ROLES = {"writer", "reader", "master"}


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


def fault_stop_t(records: list[Record], start: Record) -> float | None:
    """When the fault begun by `start` ended (the first stop of its kind and target
    after it), or None."""
    stops = [
        float(record["t"])
        for record in records
        if record["type"] == "nemesis"
        and record.get("phase") == "stop"
        and record["t"] >= start["t"]
        and record.get("fault") == start.get("fault")
        and record.get("target") == start.get("target")
    ]
    return min(stops, default=None)


def measure(records: list[Record], scenario: str, stall_by_wait: bool = False
            ) -> dict[str, Any]:
    """The run's figures. `stall_by_wait`: streams append a few events a second, so the
    gap between two acks is mostly the stream's own pace: a store's or the master's
    fault is judged by how long the streams' appends waited (`waits`), not by the gaps
    between acks (`stalls`)."""
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
    failovers, store_stalls, master_stalls, link_stalls, drain_stalls = [], [], [], [], []
    jump_stalls: list[float] = []
    starts = fault_starts(records)
    waiting = waiting_spans(records, ops) if stall_by_wait else {}

    def stalled(t: float, next_fault_t: float | None) -> list[float]:
        """After a store's or the master's fault."""
        if stall_by_wait:
            return waits(waiting, t, next_fault_t)
        return stalls(by_stream, t, next_fault_t)

    for number, fault in enumerate(starts):
        target, t = str(fault["target"]), float(fault["t"])
        # A later fault ends the window: its own stall is its own figure.
        next_t = float(starts[number + 1]["t"]) if number + 1 < len(starts) else None
        if target.startswith("w"):
            failovers.extend(failover_times(by_stream, target, t))
        elif fault.get("fault") in LINK_FAULTS:
            link_stalls.extend(stalls(by_stream, t, next_t))
        elif fault.get("fault") in CLOCK_FAULTS:
            jump_stalls.extend(stalls(by_stream, t, next_t))
        elif fault.get("fault") == "drain":  # an operator's move, not a failure
            drain_stalls.extend(stalls(by_stream, t, next_t))
        elif target.startswith("store") and not fault.get("quorum_lost"):
            store_stalls.extend(stalled(t, next_t))
        elif target.startswith("master"):  # the master, or one of several on etcd
            # FAULTS.md bounds "master restart -> writers appending again": counted from
            # the moment the master is back (restarted, continued, healed). While it is
            # away a writer that needs it (a roll, a new epoch) waits whatever the fault
            # lasts; a fault without its stop record counts from its start.
            back_t = fault_stop_t(records, fault) or t
            cut_t = next_t if next_t is not None and next_t > back_t else None
            master_stalls.extend(stalled(back_t, cut_t))
    details = [r for r in records if r["type"] == "nemesis" and r.get("phase") == "detail"]
    repairs = [r for r in details if r.get("repair_s") is not None]
    if repairs:
        figures["repair_s"] = summary([float(r["repair_s"]) for r in repairs])
        # Detection (the master's store timeout) is fixed; the copying scales with the
        # bytes: 100 MB takes detection + 100 MB at the copy rate seen.
        per_100mb = [float(r["detect_s"]) + (float(r["repair_s"]) - float(r["detect_s"]))
                     * 100 * MIB / r["repair_bytes"]
                     for r in repairs if r.get("repair_bytes") and r.get("detect_s") is not None]
        if per_100mb:
            figures["repair_s_per_100mb"] = summary(per_100mb)
            figures["repair_bytes"] = sum(r["repair_bytes"] for r in repairs)
            figures["repair_detect_s"] = summary([float(r["detect_s"]) for r in repairs
                                                  if r.get("detect_s") is not None])
    drains = [r for r in details if r.get("fault") == "drain"]
    if drains:
        figures["drain"] = [{k: r.get(k) for k in ("target", "drain_s", "placed_after",
                                                   "held_after", "cli_exit")} for r in drains]
    if failovers:
        figures["writer_failover_s"] = summary(failovers)
    stall = "wait" if stall_by_wait else "stall"
    if store_stalls:
        figures[f"append_{stall}_after_store_fault_s"] = summary(store_stalls)
    if master_stalls:
        figures[f"append_{stall}_after_master_fault_s"] = summary(master_stalls)
    if link_stalls:
        figures["append_stall_after_link_fault_s"] = summary(link_stalls)
    if jump_stalls:
        figures["append_stall_after_clock_jump_s"] = summary(jump_stalls)
    if drain_stalls:
        figures["append_stall_during_drain_s"] = summary(drain_stalls)
    memory = memory_figures(records)
    if memory:
        figures["rss_mib"] = memory
    loads = [float(r["load"]) for r in records if r["type"] == "rss" and "load" in r]
    if loads:
        figures["load_1min"] = {"p50": percentile(loads, 0.5), "max": max(loads)}
    catch_up = catch_up_after_heal(records, acked)
    if catch_up:
        figures["reader_catch_up_after_heal_s"] = {
            **summary([v for v in catch_up.values() if v is not None]),
            "never": sorted(key for key, value in catch_up.items() if value is None)}
    return figures


def catch_up_after_heal(records: list[Record], acked: list[Op]) -> dict[str, float | None]:
    """Per "reader stream" it follows: from the heal until the reader delivered the last event
    acked before it (0 when it already had; None: never). A reader whose first
    subscription came after the heal (S16 starts fresh readers as it ends; on a loaded
    box their process took 5 s to start) counts from that subscription: how long its
    process took to start is not the system's catch-up. Slow consumers on purpose
    (`consume_ms` in their start record) are left out: they are not meant to keep up."""
    phases = {r["name"]: r["t"] for r in records if r["type"] == "phase"}
    heal_t = phases.get("heal")
    if heal_t is None:
        return {}
    last_acked: dict[str, int] = {}
    for op in acked:
        if (op.end_t or 0.0) <= heal_t and op.seqs:
            last_acked[op.stream] = max(last_acked.get(op.stream, -1), max(op.seqs))
    slow = {r["process"] for r in records if r["type"] == "start" and r.get("consume_ms")}
    readers = {r["process"] for r in records
               if r["type"] == "subscribe" and r["process"] not in slow}
    # The streams each reader follows: every one, or those its start record names (a
    # sample of many).
    given: dict[str, set[str]] = defaultdict(set)
    for record in records:
        if record["type"] == "start" and record["process"] in readers:
            given[record["process"]].update(record.get("streams") or last_acked)
    followed = {(reader, stream) for reader in readers
                for stream in (given.get(reader) or last_acked)}
    since: dict[str, float] = {}
    for record in records:
        if record["type"] == "subscribe" and record["process"] not in since:
            since[record["process"]] = max(heal_t, float(record["t"]))
    reached: dict[tuple[str, str], float] = {}
    for record in records:
        if record["type"] != "deliver" or record["process"] not in readers:
            continue
        key = (record["process"], record["stream"])
        goal = last_acked.get(record["stream"])
        if key not in reached and goal is not None and any(
                event[0] >= goal for event in record["events"]):
            reached[key] = max(0.0, record["t"] - since[record["process"]])
    return {f"{reader} {stream}": reached.get((reader, stream))
            for reader, stream in sorted(followed) if stream in last_acked}


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


def stalls(by_stream: dict[str, list[Op]], t: float, next_fault_t: float | None = None
           ) -> list[float]:
    """Per stream: the longest time without an ack among the acks of the window after
    the fault, counting the gap to the first ack after the window (a stall that lasts
    beyond it counts whole); the end of the history is not a stall. A later fault cuts
    the window: a stall still running then counts until that moment (at least that
    long), and what follows is the later fault's."""
    out = []
    end = t + STALL_WINDOW_S
    cut = next_fault_t is not None and next_fault_t < end
    if cut:
        assert next_fault_t is not None
        end = next_fault_t
    for ops_of in by_stream.values():
        ends = [op.end_t or 0.0 for op in ops_of]
        low = bisect.bisect_right(ends, t)
        high = bisect.bisect_right(ends, end)
        after = [end] if cut else ends[high:high + 1]
        moments = [t, *ends[low:high], *after]
        if len(moments) > 1:
            out.append(max(b - a for a, b in itertools.pairwise(moments)))
    return out


def waiting_spans(records: list[Record], ops: list[Op]) -> dict[str, list[tuple[float, float]]]:
    """Per stream, sorted by start: every span during which it waited, an append from
    its invoke to its end (to the end of the history when it never ended), and a writer
    without a session of the stream, from the session's end to the next grant."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for op in ops:
        out[op.stream].append((op.invoke_t, op.end_t if op.end_t is not None else float("inf")))
    ended: dict[str, list[float]] = defaultdict(list)
    for record in records:
        if record["type"] == "session_end":
            ended[record["stream"]].append(float(record["t"]))
        elif record["type"] == "grant" and ended.get(record["stream"]):
            out[record["stream"]].append((min(ended.pop(record["stream"])), float(record["t"])))
    for stream, times in ended.items():
        out[stream].append((min(times), float("inf")))
    for spans in out.values():
        spans.sort()
    return out


def waits(waiting: dict[str, list[tuple[float, float]]], t: float,
          next_fault_t: float | None = None) -> list[float]:
    """Per stream: the longest it waited within the window after the fault (an append
    for its ack, a writer for a new session; from the fault or the wait's start), a
    wait still running at the window's end counting until then. A later fault cuts the
    window, as for `stalls`."""
    end = t + STALL_WINDOW_S
    if next_fault_t is not None and next_fault_t < end:
        end = next_fault_t
    out = []
    for spans in waiting.values():
        high = bisect.bisect_right(spans, (end, float("inf")))
        out.append(max((min(stop, end) - max(start, t) for start, stop in spans[:high]
                        if stop > t), default=0.0))
    return out


def memory_figures(records: list[Record]) -> dict[str, Any]:
    """Per role (master, store, writer, reader): the process whose memory grew most
    during the faults (from its baseline to its peak before the final phase), and, for
    a long run, how much its peak in the last third exceeds the one in the first."""
    phases = {r["name"]: r["t"] for r in records if r["type"] == "phase"}
    start = phases.get("faults")
    if start is None:
        return {}
    stop = phases.get("final", float("inf"))
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for record in records:
        if record["type"] == "rss" and start <= record["t"] <= stop:
            for name, mib in record["mib"].items():
                samples[name].append((record["t"], float(mib)))
    out: dict[str, Any] = {}
    first_sampled = min((points[0][0] for points in samples.values()), default=start)
    for name, points in sorted(samples.items()):
        since = start
        if points[0][0] > first_sampled + RSS_LATE_START_S and len(points) > 1:
            # Started during the faults (a reader started late, however early): its first
            # sample may catch the interpreter still loading, so its baseline starts at
            # the second.
            since = points[1][0]
        early = [mib for t, mib in points if since <= t <= since + RSS_BASELINE_S]
        early = early or [points[0][1]]
        baseline, peak = min(early), max(mib for _, mib in points)
        role = out.setdefault(role_of(name), {"growth": -1.0})
        if peak - baseline > role["growth"]:
            role.update(process=name, baseline=baseline, peak=peak,
                        growth=round(peak - baseline, 1))
        span = points[-1][0] - points[0][0]
        if span >= RSS_TREND_MIN_S:
            third = span / 3
            first = [mib for t, mib in points if t <= points[0][0] + third]
            last = [mib for t, mib in points if t >= points[-1][0] - third]
            late = round(max(last) - max(first), 1)
            if late > role.get("late_growth", float("-inf")):
                role.update(late_growth=late, late_process=name)
    return out


def role_of(process: str) -> str:
    if process.startswith("store"):
        return "store"
    if process.startswith("master"):  # master0, master1, ...: masters on etcd (S17)
        return "master"
    return {"w": "writer", "r": "reader"}.get(process[:1], process)


def rss_bounds_mib(streams: int) -> dict[str, float]:
    """How much each role's memory may grow over its baseline: what its configuration
    lets it buffer, plus slack. A writer retains at most RETAINED_BYTES_MAX per stream
    it leads (unacked appends included); a store queues at most STORE_QUEUE_BYTES_MAX
    of writes and fills its memtables."""
    assert RETAINED_BYTES_MAX >= UNACKED_BYTES_MAX
    return {
        "writer": streams * RETAINED_BYTES_MAX / MIB + RSS_SLACK_MIB,
        "store": STORE_QUEUE_BYTES_MAX / MIB + STORE_MEMTABLES_MIB + RSS_SLACK_MIB,
        "reader": RSS_SLACK_MIB,
        "master": RSS_SLACK_MIB,
    }


def bounds(figures: dict[str, Any], lease_s: float, streams: int = 2) -> dict[str, Any]:
    """C13: the measured figures against FAULTS.md §1's liveness table, each with
    `ok`. Beside the (safety) verdict: a miss fails the run's liveness, not its
    safety."""
    table = {
        "writer_failover_s": lease_s + 2.0,  # writer dies -> a standby's first ack
        "append_stall_after_store_fault_s": 1.0,  # one copy-set store dies, W still live
        "append_stall_after_master_fault_s": 2 * lease_s + 2.0,  # master restart
        "append_stall_after_clock_jump_s": 2 * lease_s,  # S4: after each jump
    }
    # The same bounds where they are judged by how long appends waited (many streams
    # at a few events a second, `measure`'s `stall_by_wait`): on the largest wait of
    # every stream, since a p99 of 1,000 streams would let the slowest ten wait for ever.
    by_max = {
        "append_wait_after_store_fault_s": table["append_stall_after_store_fault_s"],
        "append_wait_after_master_fault_s": table["append_stall_after_master_fault_s"],
    }
    out: dict[str, Any] = {}
    for key, limit in table.items():
        figure = figures.get(key)
        if isinstance(figure, dict) and figure.get("p99") is not None:
            out[key] = {"p99": figure["p99"], "bound": limit, "ok": figure["p99"] <= limit}
    for key, limit in by_max.items():
        figure = figures.get(key)
        if isinstance(figure, dict) and figure.get("max") is not None:
            out[key] = {"max": figure["max"], "bound": limit, "ok": figure["max"] <= limit}
    heal = figures.get("reader_catch_up_after_heal_s")
    if isinstance(heal, dict):
        # Every reader: the largest value (p99 of a handful is the largest anyway).
        worst = heal["max"]
        out["reader_catch_up_after_heal_s"] = {
            "max": worst, "never": heal["never"], "bound": CATCH_UP_S,
            "ok": not heal["never"] and worst is not None and worst <= CATCH_UP_S}
    if "reader_catch_up_s" in figures:
        # After the final seal: None when a reader never reached the end (stuck).
        value = figures["reader_catch_up_s"]
        out["reader_catch_up_s"] = {"value": value, "bound": CATCH_UP_S,
                                    "ok": value is not None and value <= CATCH_UP_S}
    for drain in figures.get("drain", []):
        # A drained store ends up holding nothing, and the drain command succeeded.
        left = (drain["placed_after"] or 0) + len(drain["held_after"] or [])
        out[f"drained_empty_{drain['target']}"] = {
            "value": left, "held": drain["held_after"], "cli_exit": drain["cli_exit"],
            "bound": 0, "ok": left == 0 and drain["placed_after"] == 0
            and drain["cli_exit"] == 0}
    limits = rss_bounds_mib(streams)
    for role, figure in sorted(figures.get("rss_mib", {}).items()):
        if role in limits:
            out[f"rss_growth_mib_{role}"] = {
                "value": figure["growth"], "process": figure["process"],
                "bound": limits[role], "ok": figure["growth"] <= limits[role]}
        if "late_growth" in figure and role in TREND_ROLES:
            out[f"rss_late_growth_mib_{role}"] = {
                "value": figure["late_growth"], "process": figure["late_process"],
                "bound": RSS_GROWTH_MIB_MAX, "ok": figure["late_growth"] <= RSS_GROWTH_MIB_MAX}
    return out


def missed(checked: dict[str, Any]) -> list[str]:
    """The bounds a run missed (C13 fails when this is not empty)."""
    return sorted(key for key, value in checked.items() if not value.get("ok"))


def unsynced_loss(records: list[Record], final: dict[str, Any]) -> dict[str, Any]:
    """With fsync=never (S8d): the acked events the final readers do not have, and how
    long before the power loss that took them each was acked (the window the docs must
    state). Every lost event is attributed to the first power loss after its ack."""
    kept = {event[3] for state in final.get("streams", {}).values()
            for event in (state.get("reads") or [[]])[0]}
    losses = sorted(float(r["t"]) for r in fault_starts(records) if r["fault"] == "power-loss")
    lost, window = 0, []
    for op in operations(records):
        if op.status != "ok" or op.end_t is None:
            continue
        gone = [pid for pid in op.ids if pid not in kept]
        if not gone:
            continue
        lost += len(gone)
        after = [t for t in losses if t >= op.end_t]
        if after:
            window.append(after[0] - op.end_t)
    acked = sum(len(op.ids) for op in operations(records) if op.status == "ok")
    return {"events_acked": acked, "events_lost": lost, "power_losses": len(losses),
            "acked_before_the_power_loss_s": summary(window)}
