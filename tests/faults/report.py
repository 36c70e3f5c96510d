"""The report: per run a picture (throughput, latency and every process's memory over
time, fault windows shaded) beside its `verdict.json`; per report folder an
`index.html` and a summary `verdict.json` linking every run."""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.faults.checker import operations
from tests.faults.history import Record

# Streams drawn one line each; beyond, their sum.
PLOTTED_STREAMS_MAX = 4
FAULT_COLOURS = {"w": "tab:red", "s": "tab:orange", "m": "tab:purple", "r": "tab:green"}


def fault_windows(records: list[Record]) -> list[tuple[float, float, str]]:
    """(start, stop, label) of every fault; one still open at the end closes at heal."""
    open_: dict[tuple[str, str], float] = {}
    windows = []
    end = records[-1]["t"] if records else 0.0
    for record in records:
        if record["type"] != "nemesis":
            continue
        key = (record["fault"], record["target"])
        if record["phase"] == "start":
            open_[key] = record["t"]
        elif record["phase"] == "stop" and key in open_:
            windows.append((open_.pop(key), record["t"], f"{key[0]} {key[1]}"))
    windows.extend((start, end, f"{f} {t}") for (f, t), start in open_.items())
    return sorted(windows)


def per_second(records: list[Record], origin: float) -> dict[str, Any]:
    acked: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    latency: dict[int, list[float]] = defaultdict(list)
    failed: list[tuple[float, str]] = []
    for op in operations(records):
        if op.status == "ok" and op.end_t is not None:
            second = math.floor(op.end_t - origin)
            acked[op.stream][second] += len(op.ids)
            latency[second].append(op.end_t - op.invoke_t)
        elif op.status in ("fail", "info"):
            failed.append(((op.end_t or op.invoke_t) - origin, op.status))
    delivered: dict[int, int] = defaultdict(int)
    for record in records:
        if record["type"] == "deliver":
            delivered[math.floor(record["t"] - origin)] += len(record["events"])
    return {"acked": acked, "latency": latency, "failed": failed, "delivered": delivered}


def rss_series(records: list[Record], origin: float
               ) -> dict[str, tuple[list[float], list[float]]]:
    """Per process: sample times (since `origin`) and resident MiB."""
    out: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for record in records:
        if record["type"] == "rss":
            for name, mib in record["mib"].items():
                out[name][0].append(record["t"] - origin)
                out[name][1].append(mib)
    return dict(out)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def plot_run(run_dir: Path, records: list[Record], result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases: dict[str, float] = {r["name"]: r["t"] for r in records if r["type"] == "phase"}
    origin = phases.get("faults", records[0]["t"] if records else 0.0)
    series = per_second(records, origin)
    figure, (top, bottom, memory) = plt.subplots(
        3, 1, figsize=(11, 9), sharex=True, gridspec_kw={"height_ratios": [3, 3, 2]})
    acked = series["acked"]
    if len(acked) > PLOTTED_STREAMS_MAX:
        # Many streams: their sum (one stream's few events a second would lie flat on
        # the sum's scale; the stalls are in the verdict, per stream).
        total: dict[int, int] = defaultdict(int)
        for counts in acked.values():
            for second, count in counts.items():
                total[second] += count
        acked = {f"all {len(series['acked'])} streams": total}
    for stream, counts in sorted(acked.items()):
        seconds = sorted(counts)
        top.plot(seconds, [counts[s] for s in seconds], label=f"acked {stream}", lw=1.2)
    if series["delivered"]:
        seconds = sorted(series["delivered"])
        top.plot(seconds, [series["delivered"][s] for s in seconds], color="grey", lw=0.8,
                 ls="--", label="delivered to readers (all)")
    top.set_ylabel("events / s")
    top.legend(loc="upper right", fontsize=8)
    seconds = sorted(series["latency"])
    p50 = [_quantile(series["latency"][s], 0.5) * 1000 for s in seconds]
    p99 = [_quantile(series["latency"][s], 0.99) * 1000 for s in seconds]
    bottom.plot(seconds, p50, label="ack latency p50", lw=1.2)
    bottom.plot(seconds, p99, label="ack latency p99", lw=1.2)
    for status, colour, marker in (("info", "tab:orange", "x"), ("fail", "tab:red", "v")):
        times = [t for t, s in series["failed"] if s == status]
        if times:
            low = max(1.0, min(p50, default=1.0))
            bottom.scatter(times, [low] * len(times), marker=marker, color=colour, s=18,
                           label=f"append {status} ({len(times)})", zorder=3)
    if seconds:
        bottom.set_yscale("log")
    bottom.set_ylabel("ms (log)")
    bottom.legend(loc="upper right", fontsize=8)
    for name, (times, mib) in sorted(rss_series(records, origin).items()):
        memory.plot(times, mib, lw=0.9, label=name)
    memory.set_ylabel("RSS MiB")
    memory.set_xlabel("seconds since the faults began")
    memory.legend(loc="upper left", fontsize=7, ncol=5)
    labelled: set[str] = set()
    for start, stop, label in fault_windows(records):
        colour = FAULT_COLOURS.get(label.split()[-1][:1], "tab:blue")
        for axis in (top, bottom, memory):
            axis.axvspan(start - origin, max(stop - origin, start - origin + 0.2),
                         color=colour, alpha=0.15, lw=0)
        if label not in labelled and len(labelled) < 12:
            labelled.add(label)
            top.text(start - origin, top.get_ylim()[1] * 0.97, label, fontsize=7,
                     rotation=90, va="top", color=colour)
    for name in ("heal", "final"):
        if name in phases:
            for axis in (top, bottom, memory):
                axis.axvline(phases[name] - origin, color="black", lw=0.8, ls=":")
            top.text(phases[name] - origin, 0, f" {name}", fontsize=7, va="bottom")
    verdict = "valid" if result.get("valid") else f"INVALID {result.get('checks_failed')}"
    figure.suptitle(f"{result['scenario']} {result['title']}, seed {result['seed']}: {verdict}")
    figure.tight_layout()
    name = f"{result['scenario']}.png"
    figure.savefig(run_dir / name, dpi=90)
    plt.close(figure)
    return name


def _figure(measurements: dict[str, Any], key: str) -> str:
    value = measurements.get(key)
    if not isinstance(value, dict) or value.get("p50") is None:
        return ""
    return f"{value['p50']:.2f} / {value['p99']:.2f}"


def _memory(measurements: dict[str, Any]) -> str:
    rss = measurements.get("rss_mib", {})
    return " / ".join(f"{rss[role]['growth']:.0f}" if role in rss else "-"
                      for role in ("writer", "store"))


def _bounds(checked: dict[str, Any]) -> str:
    missed = [key for key, value in checked.items() if not value.get("ok")]
    if not checked:
        return ""
    if not missed:
        return "<span class='ok'>within</span>"
    return "<span class='bad'>missed: " + html.escape(", ".join(missed)) + "</span>"


def write_index(out: Path, results: list[dict[str, Any]]) -> Path:
    """`index.html` and the summary `verdict.json` of a report folder."""
    summary = {
        "valid": all(r.get("valid") or r.get("documented_loss") for r in results),
        "within_bounds": all(not r.get("bounds_missed") for r in results),
        "runs": [
            {k: r.get(k) for k in ("scenario", "seed", "valid", "checks_failed", "counts",
                                   "measurements", "bounds", "bounds_missed",
                                   "documented_loss", "nemesis_errors", "replay",
                                   "wall_s")}
            | {"folder": f"{r['scenario']}-seed{r['seed']}"}
            for r in results
        ],
    }
    (out / "verdict.json").write_text(json.dumps(summary, indent=2))
    rows = []
    for r in results:
        folder = f"{r['scenario']}-seed{r['seed']}"
        m = r.get("measurements", {})
        state = "valid" if r.get("valid") else "INVALID " + html.escape(
            json.dumps(r.get("checks_failed")))
        if r.get("documented_loss"):
            loss = r["documented_loss"]
            state = (f"expected loss: {loss['events_lost']} of {loss['events_acked']} acked "
                     "events (fsync=never)")
        throughput = m.get("throughput_events_per_s")
        rows.append(
            "<tr>"
            f"<td>{html.escape(r['scenario'])}</td><td>{html.escape(r['title'])}</td>"
            f"<td>{r['seed']}</td><td class='{'ok' if r.get('valid') else 'bad'}'>{state}</td>"
            f"<td>{r['counts'].get('events_ok', 0)}</td>"
            f"<td>{'' if throughput is None or math.isnan(throughput) else throughput}</td>"
            f"<td>{_figure(m, 'ack_latency_s')}</td>"
            f"<td>{_figure(m, 'writer_failover_s')}</td>"
            f"<td>{_figure(m, 'append_stall_after_store_fault_s')}</td>"
            f"<td>{_memory(m)}</td>"
            f"<td>{_bounds(r.get('bounds', {}))}</td>"
            f"<td><a href='{folder}/verdict.json'>verdict</a> "
            f"<a href='{folder}/history.jsonl'>history</a></td>"
            "</tr>"
            f"<tr><td colspan='12'><a href='{folder}/{r.get('picture', '')}'>"
            f"<img src='{folder}/{r.get('picture', '')}' width='820'></a></td></tr>"
        )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Stream Engine fault runs</title>
<style>body{{font-family:sans-serif}} td,th{{padding:2px 8px;text-align:left}}
.ok{{color:green}} .bad{{color:red;font-weight:bold}}</style></head><body>
<h1>Stream Engine fault runs: {'all valid' if summary['valid'] else 'ANOMALIES FOUND'},
{'every bound met' if summary['within_bounds'] else 'BOUNDS MISSED'}</h1>
<p>Checks C1-C12 (safety: the verdict) and C13 (liveness bounds), FAULTS.md §6.2.
Figures are p50 / p99 seconds.
Replay one run with <code>make faults SCENARIO=S2 SEED=3</code>.</p>
<table><tr><th>scenario</th><th>name</th><th>seed</th><th>verdict</th><th>events acked</th>
<th>events/s</th><th>ack latency</th><th>writer failover</th><th>stall after store fault</th>
<th>RSS growth MiB writer / store</th><th>liveness bounds (C13)</th><th>files</th></tr>
{''.join(rows)}
</table></body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path
