"""The checker: pure functions over a history and the final state (FAULTS.md §6.2).

Inputs are plain data, so a test can hand-make a history with one anomaly and see the
witness. `check(records, final)` returns a `Verdict`; every anomaly names its check
(C1..C12, C14, C15, C16: no server logged a traceback, and C0: the run injected
the faults it scheduled) and carries a witness a person can follow back into
`history.jsonl` (or, for C16, into the server's log).

The final state (`final.json`, built by `tests.faults.final` after every stream was
sealed) holds, per stream: `reads`, the events of fresh readers from 0 to the end (each
`[sequence, epoch, index, payload id, fingerprint, intact]`); `segments`, the master's
segment list with, per copy-set store, a dump of everything it holds
(`{"acked_index", "fence", "entries": [[index, kind, epoch, fingerprint, crc], ...]}`,
or `{"error": ...}` when unreachable); `write_quorum`.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from tests.faults.history import Record

# Anomalies of one kind beyond this are counted, not listed (one witness is a finding).
WITNESSES_MAX = 20
SEQUENCE_SHIFT = 32


def pack(epoch: int, index: int) -> int:
    return epoch << SEQUENCE_SHIFT | index


@dataclass
class Verdict:
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _per_check: Counter[str] = field(default_factory=Counter)

    @property
    def valid(self) -> bool:
        return not self.anomalies

    def add(self, check: str, **witness: Any) -> None:
        self._per_check[check] += 1
        if self._per_check[check] <= WITNESSES_MAX:
            self.anomalies.append({"check": check, **witness})

    def checks_failed(self) -> dict[str, int]:
        return dict(sorted(self._per_check.items()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "checks_failed": self.checks_failed(),
            "anomalies": self.anomalies,
            "counts": self.counts,
        }


@dataclass
class Op:
    """One append operation and how it ended: ok, fail, or info (in doubt)."""

    process: str
    inc: int
    session: str
    stream: str
    op: int
    ids: list[str]
    invoke_t: float
    status: str = "info"
    end_t: float | None = None
    seqs: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def key(self) -> str:
        return f"{self.process}.{self.inc} op {self.op}"


def operations(records: list[Record]) -> list[Op]:
    """Appends with their outcome; an invoke without a completion stays info."""
    ops: dict[tuple[str, int, str, int], Op] = {}
    for record in records:
        kind = record["type"]
        if kind not in ("invoke", "ok", "fail", "info"):
            continue
        key = (record["process"], record.get("inc", 0), record["stream"], record["op"])
        if kind == "invoke":
            ops[key] = Op(
                record["process"],
                record.get("inc", 0),
                str(record.get("session", "")),
                record["stream"],
                record["op"],
                list(record["ids"]),
                record["t"],
            )
            continue
        found = ops.get(key)
        if found is None:
            continue
        found.status, found.end_t = kind, record["t"]
        found.seqs = list(record.get("seqs", []))
        found.error = record.get("error", "")
    return list(ops.values())


@dataclass(frozen=True)
class Delivery:
    reader: str
    sequence: int
    pid: str
    fingerprint: str
    intact: bool
    t: float


@dataclass(frozen=True)
class Resume:
    """A reader (re)subscribed from `start`; `after_loss` names the range [epoch, first,
    last] it was told is lost and goes past, if that is why it starts there."""

    start: int
    after_loss: tuple[int, int, int] | None = None
    t: float = 0.0


Reads = dict[tuple[str, str], list[Delivery | Resume]]


def deliveries(records: list[Record]) -> Reads:
    """Per (reader, stream), in order: deliveries, and the (re)subscriptions between."""
    out: Reads = defaultdict(list)
    for record in records:
        if record["type"] == "subscribe":
            loss = record.get("after_loss")
            out[(record["process"], record["stream"])].append(
                Resume(int(record["from"]), tuple(loss) if loss else None, record["t"]))
        elif record["type"] == "deliver":
            for sequence, _epoch, _index, pid, fp, intact in record["events"]:
                out[(record["process"], record["stream"])].append(
                    Delivery(record["process"], sequence, pid, fp, intact, record["t"])
                )
    return out


def check(
    records: list[Record], final: dict[str, Any], server_logs: dict[str, str] | None = None
) -> Verdict:
    verdict = Verdict()
    check_server_logs(verdict, server_logs or {})
    ops = operations(records)
    streams = final.get("streams", {})
    by_stream: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_stream[op.stream].append(op)
    reads = deliveries(records)
    # Each stream's share of the history, sorted out once: a run with many streams
    # costs the checker in proportion to its records, not records times streams.
    reads_of: dict[str, Reads] = defaultdict(dict)
    for (reader, stream), items in reads.items():
        reads_of[stream][(reader, stream)] = items
    destroyed = destroyed_segments(records)
    grants_of: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        if record["type"] == "grant":
            grants_of[record["stream"]].append(record)
    paused = zombie_windows(records)
    lost_declared = 0
    for name in sorted(set(streams) | set(by_stream)):
        state = streams.get(name)
        if state is None:
            verdict.add("C1", stream=name, problem="no final read of the stream")
            continue
        canonical = canonical_stream(state, verdict, name)
        stream_ops = by_stream.get(name, [])
        stream_reads = reads_of.get(name, {})
        gone = destroyed.get(name, {})
        excused = declared_lost(state, gone)
        check_lost_and_placed(verdict, name, stream_ops, canonical, excused)
        check_duplicates(verdict, name, canonical)
        check_phantoms(verdict, name, stream_ops, canonical, stream_reads)
        check_divergence(verdict, name, state, stream_reads)
        check_reader_order(verdict, name, canonical, stream_reads)
        check_writer_order(verdict, name, stream_ops)
        check_segments(verdict, name, state, set(gone))
        check_fences(verdict, name, state)
        check_zombies(verdict, name, grants_of.get(name, []), paused, stream_ops, canonical)
        check_data_loss(verdict, name, state, gone, stream_reads)
        lost_declared += sum(len(op.ids) for op in stream_ops if op.status == "ok"
                             and op.seqs and op.seqs[0] >> SEQUENCE_SHIFT in excused)
    check_epochs(verdict, records, streams)
    check_unsealed(verdict, records)
    check_bad_input(verdict, records)
    injected = check_faults_injected(verdict, records)
    statuses = Counter(op.status for op in ops)
    verdict.counts = {
        "appends_ok": statuses["ok"],
        "appends_fail": statuses["fail"],
        "appends_info": statuses["info"],
        "events_ok": sum(len(op.ids) for op in ops if op.status == "ok"),
        "events_final": sum(len(canonical_events(s)) for s in streams.values()),
        # Acked, then destroyed with every copy (C14): reported lost, not lost silently.
        "events_lost_declared": lost_declared,
        "deliveries": sum(
            1 for items in reads.values() for item in items if isinstance(item, Delivery)
        ),
        "readers": len({reader for reader, _ in reads}),
        "streams": len(streams),
        "faults_injected": injected,
        **verdict.counts,
    }
    return verdict


# ---- the canonical stream F ----


def canonical_events(state: dict[str, Any]) -> list[list[Any]]:
    runs = state.get("reads") or [[]]
    first: list[list[Any]] = runs[0]
    return first


def canonical_stream(state: dict[str, Any], verdict: Verdict, name: str) -> dict[str, Any]:
    """F: sequence -> (pid, fingerprint) from the first fresh reader, and the positions
    (sorted sequences) to find skips."""
    events = canonical_events(state)
    positions: list[int] = []
    values: dict[int, tuple[str, str]] = {}
    where: dict[str, list[int]] = defaultdict(list)
    for sequence, epoch, index, pid, fp, intact in events:
        if sequence != pack(epoch, index):
            verdict.add("C8", stream=name, sequence=sequence, epoch=epoch, index=index,
                        problem="sequence is not epoch<<32|index")
        if not intact:
            verdict.add("C4", stream=name, sequence=sequence, payload=pid,
                        reader="final", problem="corrupted payload (digest mismatch)")
        positions.append(sequence)
        values[sequence] = (pid, fp)
        where[pid].append(sequence)
    for error in state.get("read_errors", []):
        verdict.add("C1", stream=name, problem=f"the final read failed: {error}")
    return {"positions": sorted(positions), "values": values, "where": where}


# ---- C1, C2: acknowledged appends are in F, at their sequence ----


def check_lost_and_placed(
    verdict: Verdict, name: str, ops: list[Op], canonical: dict[str, Any],
    excused: AbstractSet[int] = frozenset(),
) -> None:
    """`excused`: epochs of segments destroyed with every copy and reported lost by
    every final reader (C14): their events are gone, honestly."""
    where = canonical["where"]
    positions = canonical["positions"]
    last = positions[-1] if positions else None
    for op in ops:
        if op.status != "ok":
            continue
        if len(op.seqs) != len(op.ids):
            verdict.add("C2", stream=name, op=op.key, problem="sequences returned != events",
                        returned=op.seqs, ids=op.ids)
            continue
        for pid, returned in zip(op.ids, op.seqs, strict=True):
            found = where.get(pid)
            if not found and returned >> SEQUENCE_SHIFT in excused:
                continue
            if not found:
                verdict.add("C1", stream=name, payload=pid, op=op.key, returned=returned,
                            acked_at=op.end_t, last_sequence_read=last)
            elif returned not in found:
                verdict.add("C2", stream=name, payload=pid, op=op.key, returned=returned,
                            actual=found)


# ---- C3: at most once ----


def check_duplicates(verdict: Verdict, name: str, canonical: dict[str, Any]) -> None:
    for pid, sequences in canonical["where"].items():
        if len(sequences) > 1:
            verdict.add("C3", stream=name, payload=pid, sequences=sorted(sequences))


# ---- C4: nothing read that was not written, failed, or corrupted ----


def check_phantoms(
    verdict: Verdict,
    name: str,
    ops: list[Op],
    canonical: dict[str, Any],
    reads: Reads,
) -> None:
    status: dict[str, Op] = {}
    for op in ops:
        for pid in op.ids:
            status[pid] = op
    seen: list[tuple[str, int, str, bool]] = [
        ("final", sequence, pid, True) for sequence, (pid, _fp) in canonical["values"].items()
    ]
    for (reader, stream), items in reads.items():
        if stream != name:
            continue
        seen.extend(
            (reader, item.sequence, item.pid, item.intact)
            for item in items
            if isinstance(item, Delivery)
        )
    for reader, sequence, pid, intact in seen:
        if not intact:
            verdict.add("C4", stream=name, reader=reader, sequence=sequence, payload=pid,
                        problem="corrupted payload (digest mismatch)")
            continue
        writer = status.get(pid)
        if writer is None:
            verdict.add("C4", stream=name, reader=reader, sequence=sequence, payload=pid,
                        problem="never written by any append")
        elif writer.status == "fail":
            verdict.add("C4", stream=name, reader=reader, sequence=sequence, payload=pid,
                        op=writer.key, error=writer.error, problem="the append definitely failed")


# ---- C5: one value per sequence, everywhere ----


def check_divergence(
    verdict: Verdict,
    name: str,
    state: dict[str, Any],
    reads: Reads,
) -> None:
    seen: dict[int, dict[str, str]] = defaultdict(dict)
    for number, run in enumerate(state.get("reads", [])):
        for sequence, _epoch, _index, _pid, fp, _intact in run:
            seen[sequence][f"final-reader-{number}"] = fp
    for (reader, stream), items in reads.items():
        if stream != name:
            continue
        for item in items:
            if isinstance(item, Delivery):
                seen[item.sequence].setdefault(reader, item.fingerprint)
    for segment in state.get("segments", []):
        final_index = segment.get("final_index", 0)
        if segment.get("state") != "SEALED":
            continue
        for store, dump in sorted(segment.get("replicas", {}).items()):
            if "entries" not in dump or dump.get("acked_index", 0) < final_index:
                continue
            for index, kind, _epoch, fp, _crc in dump["entries"]:
                if index >= final_index:
                    continue
                value = fp if kind == "EVENT" else kind
                seen[pack(segment["epoch"], index)][f"replica {store}"] = value
    for sequence in sorted(seen):
        values = seen[sequence]
        if len(set(values.values())) > 1:
            verdict.add("C5", stream=name, sequence=sequence, values=values)


# ---- C6: each reader strictly increasing, no skip, across reconnects ----


def check_reader_order(
    verdict: Verdict,
    name: str,
    canonical: dict[str, Any],
    reads: Reads,
) -> None:
    positions: list[int] = canonical["positions"]

    def skipped(after: int, before: int) -> list[int]:
        """Events of F strictly between two positions."""
        low = bisect.bisect_right(positions, after)
        high = bisect.bisect_left(positions, before)
        return positions[low:high]

    for (reader, stream), items in sorted(reads.items()):
        if stream != name:
            continue
        last: int | None = None
        resume_from: int | None = None
        for item in items:
            if isinstance(item, Resume):
                if item.after_loss is not None:
                    # Past a range the SDK said is lost (C14 judges that claim).
                    epoch, _first, lost_last = item.after_loss
                    if item.start != pack(epoch, lost_last + 1):
                        verdict.add("C6", stream=name, reader=reader, resumed_from=item.start,
                                    loss=list(item.after_loss),
                                    problem="resumed elsewhere than just past the lost range")
                    last = item.start - 1 if last is None else max(last, item.start - 1)
                elif last is not None and item.start != last + 1:
                    verdict.add("C6", stream=name, reader=reader, last=last,
                                resumed_from=item.start,
                                problem="resumed elsewhere than just after its token")
                resume_from = item.start
                continue
            if last is not None and item.sequence <= last:
                verdict.add("C6", stream=name, reader=reader, s1=last, s2=item.sequence,
                            problem="went backwards or repeated a sequence", t=item.t)
            else:
                low = last if last is not None else (resume_from or 0) - 1
                gap = skipped(low, item.sequence)
                if gap:
                    verdict.add("C6", stream=name, reader=reader, s1=last, s2=item.sequence,
                                skipped=gap[:5], skipped_count=len(gap), t=item.t)
            last = item.sequence if last is None else max(last, item.sequence)
            resume_from = None


# ---- C7: writer order ----


def check_writer_order(verdict: Verdict, name: str, ops: list[Op]) -> None:
    acked = [op for op in ops if op.status == "ok" and op.seqs and op.end_t is not None]
    sessions: dict[tuple[str, int, str], list[Op]] = defaultdict(list)
    for op in acked:
        sessions[(op.process, op.inc, op.session)].append(op)
    for session_ops in sessions.values():
        session_ops.sort(key=lambda op: op.invoke_t)
        for a, b in itertools.pairwise(session_ops):
            if a.seqs[-1] >= b.seqs[0]:
                verdict.add("C7", stream=name, first=a.key, first_seqs=[a.seqs[0], a.seqs[-1]],
                            second=b.key, second_seqs=[b.seqs[0], b.seqs[-1]],
                            problem="invoked in this order by one writer, sequenced otherwise")
    # Across writers: acked before another was invoked => a smaller sequence.
    by_end = sorted(acked, key=lambda op: op.end_t or 0.0)
    ends = [op.end_t or 0.0 for op in by_end]
    running_max: list[tuple[int, Op]] = []
    best: tuple[int, Op] | None = None
    for op in by_end:
        if best is None or op.seqs[-1] > best[0]:
            best = (op.seqs[-1], op)
        running_max.append(best)
    for b in acked:
        count = bisect.bisect_left(ends, b.invoke_t)
        if count == 0:
            continue
        top, a = running_max[count - 1]
        if top >= b.seqs[0]:
            verdict.add("C7", stream=name, first=a.key, first_seq=top, first_acked_at=a.end_t,
                        second=b.key, second_seq=b.seqs[0], second_invoked_at=b.invoke_t,
                        problem="acked before the other was invoked, yet sequenced after it")


# ---- C8, C9: segment shape and replica identity ----


def check_segments(verdict: Verdict, name: str, state: dict[str, Any],
                   destroyed: AbstractSet[int] = frozenset()) -> None:
    """`destroyed`: epochs whose every copy a scenario destroyed on purpose (C14)."""
    quorum = int(state.get("write_quorum", 1))
    for segment in state.get("segments", []):
        if segment.get("state") != "SEALED" or segment["epoch"] in destroyed:
            continue
        epoch, final_index = segment["epoch"], segment["final_index"]
        complete: dict[str, list[list[Any]]] = {}
        for store, dump in sorted(segment.get("replicas", {}).items()):
            if "entries" not in dump or dump.get("acked_index", 0) < final_index:
                continue
            entries = dump["entries"]
            complete[store] = entries
            check_shape(verdict, name, epoch, final_index, store, entries)
        if len(complete) < quorum:
            verdict.add("C9", stream=name, segment=epoch, holders=sorted(complete),
                        problem=f"fewer than W={quorum} replicas reached the bridge")
        check_identity(verdict, name, epoch, final_index, complete)


def check_shape(
    verdict: Verdict, name: str, epoch: int, final_index: int, store: str,
    entries: list[list[Any]],
) -> None:
    expected = 1
    for index, kind, _epoch, _fp, _crc in entries:
        if index > final_index:
            verdict.add("C8", stream=name, segment=epoch, store=store, index=index,
                        problem=f"an entry beyond the bridge at {final_index}")
            return
        if index != expected:
            verdict.add("C8", stream=name, segment=epoch, store=store, index=expected,
                        problem="missing index below the bridge")
            return
        wanted = "BRIDGE" if index == final_index else ("EVENT", "HOLE")
        if (kind != wanted) if isinstance(wanted, str) else (kind not in wanted):
            verdict.add("C8", stream=name, segment=epoch, store=store, index=index, kind=kind,
                        problem="a BRIDGE only at the final index, events and holes below")
            return
        expected += 1
    if expected <= final_index:
        verdict.add("C8", stream=name, segment=epoch, store=store, index=expected,
                    problem="replica ends before its bridge")


def check_identity(
    verdict: Verdict, name: str, epoch: int, final_index: int,
    complete: dict[str, list[list[Any]]],
) -> None:
    if len(complete) < 2:
        return
    # Kind and payload, not the crc: the crc binds the epoch of the leader that wrote the
    # copy, and a recovery rewrites copies above a store's acked index at its own epoch
    # while another store keeps the original (DESIGN invariant 4: kind and payload).
    views = {
        store: {row[0]: (row[1], row[3]) for row in entries if row[0] <= final_index}
        for store, entries in complete.items()
    }
    stores = sorted(views)
    reference = views[stores[0]]
    for other in stores[1:]:
        for index in range(1, final_index + 1):
            if views[other].get(index) != reference.get(index):
                verdict.add("C9", stream=name, segment=epoch, stores=[stores[0], other],
                            index=index, values=[reference.get(index), views[other].get(index)])
                break


# ---- C10: fences hold ----


def check_fences(verdict: Verdict, name: str, state: dict[str, Any]) -> None:
    for segment in state.get("segments", []):
        for store, outcome in sorted(segment.get("fence_probes", {}).items()):
            if outcome != "refused":
                fence = segment["replicas"][store].get("fence")
                verdict.add("C10", stream=name, segment=segment["epoch"], store=store,
                            epoch=fence - 1 if fence else None, outcome=outcome,
                            problem="a write below the fence was not refused")


def zombie_windows(records: list[Record]) -> list[tuple[str, int, float, float]]:
    """(process, incarnation, SIGSTOP time, SIGCONT time) of every paused writer (S3's
    `pause` windows carry the incarnation; a window still open at the end ends then)."""
    opened: dict[str, tuple[int, float]] = {}
    out = []
    for record in records:
        if record["type"] != "nemesis" or record.get("fault") != "pause":
            continue
        if record["phase"] == "start" and "inc" in record:
            opened[record["target"]] = (int(record["inc"]), record["t"])
        elif record["phase"] == "stop" and record["target"] in opened:
            inc, started = opened.pop(record["target"])
            out.append((record["target"], inc, started, record["t"]))
    end = records[-1]["t"] if records else 0.0
    out.extend((target, inc, started, end) for target, (inc, started) in opened.items())
    return out


def check_zombies(verdict: Verdict, name: str, grants: list[Record],
                  paused: list[tuple[str, int, float, float]], ops: list[Op],
                  canonical: dict[str, Any]) -> None:
    """C10, the zombie's half: the leader of `name` paused while another took it over (a
    grant to another process inside the pause) is a zombie once resumed, until it leads
    again; its appends in flight across the pause or made meanwhile may end failed or in
    doubt, and ok only for events in F at the sequence returned (recovery kept them).
    Counted in `zombie_*` counts. `grants`: the stream's grant records; `paused`: the
    run's `zombie_windows`."""
    counts = verdict.counts
    for process, inc, stopped, resumed in paused:
        before = [r for r in grants if r["t"] < stopped]
        led = bool(before) and before[-1]["process"] == process
        taken_over = any(r["process"] != process and stopped <= r["t"] <= resumed
                         for r in grants)
        if not (led and taken_over):
            continue
        # Until it leads again (a grant of its own), what it appends is a zombie's.
        regained = min((r["t"] for r in grants if r["process"] == process and r["t"] > resumed
                        and int(r.get("inc", inc)) == inc), default=float("inf"))
        late = [op for op in ops if op.process == process and op.inc == inc
                and op.invoke_t < regained and (op.end_t is None or op.end_t >= resumed)]
        counts["zombie_windows"] = counts.get("zombie_windows", 0) + 1
        for op in late:
            counts[f"zombie_late_{op.status}"] = counts.get(f"zombie_late_{op.status}", 0) + 1
            if op.status != "ok":
                continue
            for pid, returned in zip(op.ids, op.seqs, strict=False):
                if returned not in canonical["where"].get(pid, []):
                    verdict.add("C10", stream=name, op=op.key, payload=pid, returned=returned,
                                paused=[round(stopped, 3), round(resumed, 3)],
                                problem="a zombie's late acknowledgement is not in F")


# ---- C0: the faults ran (a run that injected none shows nothing about them) ----


def check_faults_injected(verdict: Verdict, records: list[Record]) -> int:
    """A run whose faults phase scheduled a nemesis (the `phase` record names it) must
    have injected at least one fault (a `nemesis` start). Rounds that found no victim
    (`nemesis_skip`), a nemesis that failed (`nemesis_error`), or a schedule whose first
    round never came due leave the run invalid, not green. Returns the faults
    injected."""
    injected = sum(1 for r in records if r["type"] == "nemesis" and r.get("phase") == "start")
    phase = next((r for r in records if r["type"] == "phase" and r["name"] == "faults"), None)
    scheduled = phase.get("nemesis") if phase is not None else None
    if not scheduled or injected:
        return injected
    skipped = Counter(str(r["why"]) for r in records if r["type"] == "nemesis_skip")
    errors = [str(r["error"]) for r in records if r["type"] == "nemesis_error"]
    rounds = sum(skipped.values()) + len(errors)
    why = "; ".join(
        [f"skipped {count}x: {reason}" for reason, count in sorted(skipped.items())]
        + [f"failed: {error}" for error in errors]
    ) or "no round came due within the faults phase"
    verdict.add("C0", nemesis=scheduled, rounds=rounds, injected=0,
                skipped=dict(sorted(skipped.items())), errors=errors,
                problem=f"{scheduled} ran {rounds} rounds and injected no fault ({why}): "
                "the run shows nothing about the faults it was for")
    return injected


# ---- C16: no server logged a traceback ----

TRACEBACK = "Traceback (most recent call last):"
# A server's log is judged whole; these name the processes that are servers.
SERVER_LOG_PREFIXES = ("master", "store")


def check_server_logs(verdict: Verdict, logs: dict[str, str]) -> None:
    """A traceback in a master's or store's log is an exception nothing handled: a
    defect even when every other check holds (the fault suite found two on S17 only by
    reading the logs). `logs` maps a process name (the log file's stem) to its text."""
    for name, text in sorted(logs.items()):
        if not name.startswith(SERVER_LOG_PREFIXES) or TRACEBACK not in text:
            continue
        lines = text.splitlines()
        starts = [n for n, line in enumerate(lines) if line.endswith(TRACEBACK)]
        # The exception's own line is the first after the frames that is not indented.
        raised = next(
            (line for line in lines[starts[0] + 1:] if line and not line[0].isspace()), "")
        verdict.add("C16", process=name, tracebacks=len(starts), first=raised[:300],
                    problem=f"{name} logged {len(starts)} traceback(s): an exception "
                    "no code handled")


# ---- C11, C12: epochs and unsealed segments from the master's metadata ----


def check_epochs(verdict: Verdict, records: list[Record], streams: dict[str, Any]) -> None:
    holders: dict[tuple[str, int], str] = {}
    for record in records:
        if record["type"] != "grant":
            continue
        key = (record["stream"], int(record["epoch"]))
        client = str(record["client"])
        if key in holders and holders[key] != client:
            verdict.add("C11", stream=key[0], epoch=key[1], clients=[holders[key], client],
                        problem="one epoch granted to two clients")
        holders.setdefault(key, client)
    highest: dict[str, tuple[int, float]] = {}
    for record in records:
        if record["type"] != "meta":
            continue
        epochs = [int(epoch) for epoch, _state in record["segments"]]
        if any(a >= b for a, b in itertools.pairwise(epochs)):
            verdict.add("C11", stream=record["stream"], t=record["t"], epochs=epochs,
                        problem="segment epochs not strictly increasing")
        if epochs:
            previous = highest.get(record["stream"])
            if previous is not None and epochs[-1] < previous[0]:
                verdict.add("C11", stream=record["stream"], t=record["t"], epoch=epochs[-1],
                            earlier=previous[0], earlier_t=previous[1],
                            problem="the latest epoch went backwards")
            if previous is None or epochs[-1] >= previous[0]:
                highest[record["stream"]] = (epochs[-1], record["t"])
    for name, state in streams.items():
        epochs = [segment["epoch"] for segment in state.get("segments", [])]
        if any(a >= b for a, b in itertools.pairwise(epochs)):
            verdict.add("C11", stream=name, epochs=epochs, problem="final epochs not increasing")


def check_unsealed(verdict: Verdict, records: list[Record]) -> None:
    for record in records:
        if record["type"] != "meta":
            continue
        unsealed = [epoch for epoch, state in record["segments"] if state != "SEALED"]
        if len(unsealed) > 2:
            verdict.add("C12", stream=record["stream"], t=record["t"], unsealed=unsealed)


# ---- C15: bad input gets its status and changes nothing ----

# Statuses no server gives on purpose: an unhandled error in a handler.
UNCLEAR_STATUSES = {"UNKNOWN", "INTERNAL"}


def check_bad_input(verdict: Verdict, records: list[Record]) -> None:
    """Rows: exactly the expected status. Random and mutated requests: INVALID_ARGUMENT
    when they do not parse; when they do, a status given on purpose, in time (a
    streaming RPC may run until the deadline). The workload's metadata and sealed
    replicas as before; every server still serving."""
    for record in records:
        if record["type"] == "bad":
            expected, got = record["expected"], record["got"]
            if expected == "parsed":
                late = got == "DEADLINE_EXCEEDED" and not record.get("streaming")
                if got in UNCLEAR_STATUSES or late:
                    verdict.add("C15", request=_bad_request(record), got=got,
                                details=record.get("details"),
                                problem="a well-formed request got no clear status")
            elif got != expected:
                verdict.add("C15", request=_bad_request(record), expected=expected, got=got,
                            details=record.get("details"), problem="not the expected status")
        elif record["type"] == "serving":
            down = sorted(name for name, up in record["servers"].items() if not up)
            if down:
                verdict.add("C15", servers=down, problem="no longer serving after bad input")
    before: Record | None = None
    for record in records:
        if record["type"] != "digest":
            continue
        if record["phase"] == "before":
            before = record
            continue
        if before is None:
            continue
        after = record
        for key in ("tenants", "streams", "stores"):
            if before["master"][key] != after["master"][key]:
                verdict.add("C15", master=key, before=before["master"][key],
                            after=after["master"][key], problem="the master's metadata changed")
        for replica, digest in sorted(before["stores"].items()):
            # A replica moved or repaired meanwhile (another fault's doing, in a soak)
            # answers with a status instead of a digest: only contents are compared.
            later = after["stores"].get(replica)
            if " fence " in digest and later is not None and " fence " in later \
                    and later != digest:
                verdict.add("C15", replica=replica, before=digest, after=later,
                            problem="a sealed replica's contents changed")
        before = None


def _bad_request(record: Record) -> str:
    return f"{record['kind']} {record['server']} {record['method']}: {record['case'][:80]}"


# ---- C14: data loss beyond N - W copies is reported, never skipped silently ----


def destroyed_segments(records: list[Record]) -> dict[str, dict[int, Record]]:
    """stream -> epoch -> the `lost` record of a segment a scenario destroyed with
    every copy (its `final_index`, when, on which stores)."""
    out: dict[str, dict[int, Record]] = defaultdict(dict)
    for record in records:
        if record["type"] == "lost":
            out[record["stream"]][int(record["epoch"])] = record
    return out


def declared_lost(state: dict[str, Any], gone: dict[int, Record]) -> set[int]:
    """Destroyed segments every final reader reported lost."""
    losses = state.get("losses") or []
    if not losses:
        return set()
    return {epoch for epoch in gone
            if all(any(loss[0] == epoch for loss in reader) for reader in losses)}


def check_data_loss(
    verdict: Verdict, name: str, state: dict[str, Any], gone: dict[int, Record], reads: Reads
) -> None:
    """Final readers (from 0) name each destroyed segment whole, [epoch, 1, bridge];
    nobody reports a loss nothing destroyed; a live reader never passes a destroyed
    segment it had not read without having been told."""
    losses = state.get("losses") or []
    for number, run in enumerate(state.get("reads", [])):
        reported = {loss[0]: loss for loss in (losses[number] if number < len(losses) else [])}
        read_epochs = {event[1] for event in run}
        for epoch, record in sorted(gone.items()):
            whole = [epoch, 1, int(record["final_index"])]
            if epoch in read_epochs:
                verdict.add("C14", stream=name, segment=epoch, reader=f"final-reader-{number}",
                            problem="a destroyed segment was still read (a copy survived?)")
            elif epoch not in reported:
                verdict.add("C14", stream=name, segment=epoch, reader=f"final-reader-{number}",
                            problem="a destroyed segment skipped without a data-loss error")
            elif reported[epoch] != whole:
                verdict.add("C14", stream=name, segment=epoch, reader=f"final-reader-{number}",
                            reported=reported[epoch], expected=whole,
                            problem="the data-loss error names another range")
        for epoch, loss in sorted(reported.items()):
            if epoch not in gone:
                verdict.add("C14", stream=name, reported=loss, reader=f"final-reader-{number}",
                            problem="a loss reported where nothing was destroyed")
    for (reader, stream), items in sorted(reads.items()):
        if stream != name:
            continue
        position = -1  # the last sequence the reader had, or resumed just after
        told: set[int] = set()
        for item in items:
            if isinstance(item, Resume):
                position = item.start - 1
                if item.after_loss is None:
                    continue
                epoch, first, final = item.after_loss
                told.add(epoch)
                if epoch not in gone:
                    verdict.add("C14", stream=name, reader=reader, reported=[epoch, first, final],
                                problem="a loss reported where nothing was destroyed")
                elif final != int(gone[epoch]["final_index"]):
                    verdict.add("C14", stream=name, reader=reader, reported=[epoch, first, final],
                                expected_last=gone[epoch]["final_index"],
                                problem="the data-loss error names another range")
                continue
            for epoch, record in gone.items():
                passed = [index for index in record["events"]
                          if position < pack(epoch, index) < item.sequence]
                if passed and epoch not in told and item.t > record["t"]:
                    verdict.add("C14", stream=name, reader=reader, segment=epoch, s1=position,
                                s2=item.sequence, events_passed=len(passed),
                                problem="passed events of a destroyed segment without a "
                                        "data-loss error")
            position = item.sequence
