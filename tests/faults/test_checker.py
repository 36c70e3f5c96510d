"""The checker, proven: hand-made histories with one anomaly each must be reported with
their witness; the clean history passes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.faults.checker import check, pack
from tests.faults.measure import bounds, measure

STREAM = "t/s"


def event(epoch: int, index: int, pid: str, intact: bool = True) -> list[Any]:
    return [pack(epoch, index), epoch, index, pid, f"fp-{pid}", intact]


def entry(index: int, kind: str, epoch: int, pid: str = "") -> list[Any]:
    return [index, kind, epoch, f"fp-{pid}" if kind == "EVENT" else "", hash((kind, pid)) & 0xFF]


def rec(t: float, type_: str, process: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "type": type_, "process": process, "inc": 1, "stream": STREAM, **fields}


def clean() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """w1 leads epoch 1 (two ok appends), w2 epoch 2 (one in doubt that made it, one
    definite failure); r1 reads everything, with a resume in between."""
    records = [
        rec(0.5, "grant", "w1", epoch=1, client="w1.1-1"),
        rec(1.0, "invoke", "w1", op=0, ids=["a0", "a1"], session="s1"),
        rec(2.0, "ok", "w1", op=0, seqs=[pack(1, 1), pack(1, 2)]),
        rec(2.5, "invoke", "w1", op=1, ids=["b0"], session="s1"),
        rec(3.0, "ok", "w1", op=1, seqs=[pack(1, 3)]),
        rec(3.2, "grant", "w2", epoch=2, client="w2.1-1"),
        rec(3.5, "invoke", "w2", op=0, ids=["c0"], session="s2"),
        rec(3.6, "invoke", "w2", op=1, ids=["d0"], session="s2"),
        rec(3.7, "fail", "w2", op=1, error="AppendFailed: never sent"),
        rec(1.1, "subscribe", "r1", **{"from": 0}),
        rec(2.1, "deliver", "r1", events=[event(1, 1, "a0"), event(1, 2, "a1")]),
        rec(2.2, "subscribe", "r1", **{"from": pack(1, 2) + 1}),
        rec(4.0, "deliver", "r1", events=[event(1, 3, "b0"), event(2, 1, "c0")]),
        rec(1.0, "meta", "meta", segments=[[1, "OPEN"]]),
        rec(3.3, "meta", "meta", segments=[[1, "SEALING"], [2, "OPEN"]]),
        rec(5.0, "meta", "meta", segments=[[1, "SEALED"], [2, "SEALED"], [3, "OPEN"]]),
    ]
    records.sort(key=lambda r: r["t"])
    final_events = [event(1, 1, "a0"), event(1, 2, "a1"), event(1, 3, "b0"), event(2, 1, "c0")]
    one = [entry(1, "EVENT", 1, "a0"), entry(2, "EVENT", 1, "a1"), entry(3, "EVENT", 1, "b0"),
           entry(4, "BRIDGE", 2)]
    two = [entry(1, "EVENT", 2, "c0"), entry(2, "BRIDGE", 3)]

    def replicas(entries: list[list[Any]], final_index: int) -> dict[str, Any]:
        return {
            store: {"acked_index": final_index, "fence": 3, "entries": copy.deepcopy(entries)}
            for store in ("s0", "s1", "s2")
        }

    final = {"streams": {STREAM: {
        "reads": [final_events, copy.deepcopy(final_events)],
        "read_errors": [],
        "write_quorum": 2,
        "segments": [
            {"epoch": 1, "state": "SEALED", "final_index": 4, "replicas": replicas(one, 4)},
            {"epoch": 2, "state": "SEALED", "final_index": 2, "replicas": replicas(two, 2)},
            {"epoch": 3, "state": "OPEN", "final_index": 0, "replicas": {}},
        ],
    }}}
    return records, final


def failed(records: list[dict[str, Any]], final: dict[str, Any]) -> dict[str, list[Any]]:
    verdict = check(sorted(records, key=lambda r: r["t"]), final)
    out: dict[str, list[Any]] = {}
    for anomaly in verdict.anomalies:
        out.setdefault(anomaly["check"], []).append(anomaly)
    return out


def stream_of(final: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = final["streams"][STREAM]
    return state


def test_a_clean_history_passes() -> None:
    records, final = clean()
    verdict = check(records, final)
    assert verdict.valid, verdict.anomalies
    assert verdict.counts["appends_ok"] == 2
    assert verdict.counts["appends_info"] == 1 and verdict.counts["appends_fail"] == 1


def test_c1_an_acked_event_missing_from_the_final_stream_is_lost() -> None:
    records, final = clean()
    for run in stream_of(final)["reads"]:
        del run[1]  # a1
    anomalies = failed(records, final)
    assert [a["payload"] for a in anomalies["C1"]] == ["a1"]
    assert anomalies["C1"][0]["op"] == "w1.1 op 0"
    assert anomalies["C1"][0]["last_sequence_read"] == pack(2, 1)


def test_c1_a_failed_final_read_is_reported() -> None:
    records, final = clean()
    stream_of(final)["read_errors"] = ["read: DataLossError: ..."]
    assert "C1" in failed(records, final)


def test_c2_an_acked_event_at_another_sequence_than_returned() -> None:
    records, final = clean()
    ok = next(r for r in records if r["type"] == "ok" and r["op"] == 1)
    ok["seqs"] = [pack(1, 4)]
    anomalies = failed(records, final)
    assert anomalies.keys() == {"C2"}
    assert anomalies["C2"][0]["returned"] == pack(1, 4)
    assert anomalies["C2"][0]["actual"] == [pack(1, 3)]


def test_c3_a_payload_twice_in_the_final_stream() -> None:
    records, final = clean()
    for run in stream_of(final)["reads"]:
        run.append(event(2, 2, "b0"))
    anomalies = failed(records, final)
    assert anomalies["C3"][0]["payload"] == "b0"
    assert anomalies["C3"][0]["sequences"] == [pack(1, 3), pack(2, 2)]


def test_c4_a_definitely_failed_append_that_is_read() -> None:
    records, final = clean()
    records.append(rec(4.1, "deliver", "r1", events=[event(2, 2, "d0")]))
    anomalies = failed(records, final)
    witness = anomalies["C4"][0]
    assert witness["payload"] == "d0" and witness["reader"] == "r1"
    assert witness["problem"] == "the append definitely failed"


def test_c4_a_payload_nobody_wrote_and_a_corrupted_one() -> None:
    records, final = clean()
    records.append(rec(4.1, "deliver", "r1", events=[event(2, 2, "zz")]))
    records.append(rec(4.2, "deliver", "r1", events=[event(2, 3, "a0", intact=False)]))
    problems = {a["problem"] for a in failed(records, final)["C4"]}
    assert problems == {"never written by any append", "corrupted payload (digest mismatch)"}


def test_c5_two_readers_see_different_values_at_one_sequence() -> None:
    records, final = clean()
    other = event(1, 2, "a1")
    other[4] = "fp-other"
    records.append(rec(2.3, "subscribe", "r2", **{"from": pack(1, 2)}))
    records.append(rec(2.4, "deliver", "r2", events=[other]))
    anomalies = failed(records, final)
    witness = anomalies["C5"][0]
    assert witness["sequence"] == pack(1, 2)
    assert witness["values"]["r2"] == "fp-other"
    assert witness["values"]["final-reader-0"] == "fp-a1"


def test_c5_a_replica_holding_a_hole_where_readers_saw_an_event() -> None:
    records, final = clean()
    dump = stream_of(final)["segments"][0]["replicas"]["s2"]["entries"]
    dump[2] = entry(3, "HOLE", 2)
    anomalies = failed(records, final)
    assert anomalies["C5"][0]["values"]["replica s2"] == "HOLE"
    assert anomalies["C9"][0]["index"] == 3  # and the replicas differ


def test_c6_a_reader_going_backwards() -> None:
    records, final = clean()
    records.append(rec(4.5, "deliver", "r1", events=[event(1, 3, "b0")]))
    witness = failed(records, final)["C6"][0]
    assert witness["reader"] == "r1" and witness["s1"] == pack(2, 1)
    assert witness["s2"] == pack(1, 3)


def test_c6_a_reader_skipping_an_event() -> None:
    records, final = clean()
    deliver = next(r for r in records if r["type"] == "deliver" and r["t"] == 4.0)
    deliver["events"] = [event(2, 1, "c0")]  # b0 skipped
    witness = failed(records, final)["C6"][0]
    assert witness["skipped"] == [pack(1, 3)]
    assert (witness["s1"], witness["s2"]) == (pack(1, 2), pack(2, 1))


def test_c6_a_first_delivery_after_events_it_should_have_read() -> None:
    records, final = clean()
    first = next(r for r in records if r["type"] == "deliver" and r["t"] == 2.1)
    first["events"] = [event(1, 2, "a1")]  # a0 skipped from 0
    witness = failed(records, final)["C6"][0]
    assert witness["skipped"] == [pack(1, 1)] and witness["s1"] is None


def test_c6_a_resume_elsewhere_than_after_the_token() -> None:
    records, final = clean()
    resume = next(r for r in records if r["type"] == "subscribe" and r["t"] == 2.2)
    resume["from"] = pack(1, 2)  # would re-read a1
    witness = failed(records, final)["C6"][0]
    assert witness["problem"] == "resumed elsewhere than just after its token"


def test_c7_one_writer_sequencing_against_its_invocation_order() -> None:
    records, final = clean()
    for record in records:
        if record["type"] == "ok" and record["op"] == 1:
            record["seqs"] = [pack(1, 1)]
        if record["type"] == "ok" and record["op"] == 0 and record["process"] == "w1":
            record["seqs"] = [pack(1, 2), pack(1, 3)]
    witness = failed(records, final)["C7"][0]
    assert (witness["first"], witness["second"]) == ("w1.1 op 0", "w1.1 op 1")


def test_c7_acked_before_another_writer_invoked_yet_sequenced_after() -> None:
    records, final = clean()
    records.append(rec(5.0, "invoke", "w2", op=2, ids=["e0"], session="s2"))
    records.append(rec(5.5, "ok", "w2", op=2, seqs=[pack(1, 2)]))
    for run in stream_of(final)["reads"]:
        run.append(event(3, 1, "e0"))
    anomalies = failed(records, final)
    assert any(
        a["first"] == "w1.1 op 1" and a["second"] == "w2.1 op 2" for a in anomalies["C7"]
    )


def test_c8_a_replica_with_a_gap_or_an_entry_beyond_the_bridge() -> None:
    records, final = clean()
    replicas = stream_of(final)["segments"][0]["replicas"]
    del replicas["s1"]["entries"][1]
    replicas["s2"]["entries"].append(entry(5, "EVENT", 1, "x"))
    anomalies = failed(records, final)["C8"]
    assert {(a["store"], a["index"]) for a in anomalies} == {("s1", 2), ("s2", 5)}


def test_c8_a_sequence_that_is_not_epoch_and_index() -> None:
    records, final = clean()
    stream_of(final)["reads"][0][0][0] = pack(1, 7)
    assert failed(records, final)["C8"][0]["index"] == 1


def test_c9_replicas_that_differ_and_too_few_complete_ones() -> None:
    records, final = clean()
    segments = stream_of(final)["segments"]
    segments[0]["replicas"]["s1"]["entries"][0][3] = "another payload"
    segments[1]["replicas"]["s1"] = {"error": "UNAVAILABLE"}
    segments[1]["replicas"]["s2"]["acked_index"] = 1
    anomalies = failed(records, final)["C9"]
    differ = next(a for a in anomalies if a.get("index") == 1)
    assert differ["segment"] == 1 and differ["stores"] == ["s0", "s1"]
    assert any(a.get("holders") == ["s0"] for a in anomalies)


def test_c9_a_copy_rewritten_by_recovery_at_its_own_epoch_is_the_same_entry() -> None:
    """Recovery rewrites the chosen copy above a store's acked index with its own epoch,
    so the crc (which binds the epoch) differs from the original's; kind and payload
    are what replicas must agree on (found by S9 seed 1)."""
    records, final = clean()
    row = stream_of(final)["segments"][0]["replicas"]["s1"]["entries"][0]
    row[2], row[4] = row[2] + 1, 999
    assert "C9" not in failed(records, final)


def test_c10_a_store_taking_a_write_below_its_fence() -> None:
    records, final = clean()
    segment = stream_of(final)["segments"][0]
    segment["fence_probes"] = {"s0": "refused", "s1": "accepted", "s2": "UNAVAILABLE: down"}
    anomalies = failed(records, final)["C10"]
    assert [(a["store"], a["outcome"], a["epoch"]) for a in anomalies] == [
        ("s1", "accepted", 2), ("s2", "UNAVAILABLE: down", 2)]


def test_c11_one_epoch_granted_to_two_clients() -> None:
    records, final = clean()
    records.append(rec(3.4, "grant", "w1", epoch=2, client="w1.1-2"))
    witness = failed(records, final)["C11"][0]
    assert witness["epoch"] == 2 and witness["clients"] == ["w2.1-1", "w1.1-2"]


def test_c11_epochs_going_backwards_across_a_master_restart() -> None:
    records, final = clean()
    records.append(rec(6.0, "meta", "meta", segments=[[1, "SEALED"], [2, "OPEN"]]))
    witness = failed(records, final)["C11"][0]
    assert witness["epoch"] == 2 and witness["earlier"] == 3


def test_c12_three_unsealed_segments() -> None:
    records, final = clean()
    records.append(rec(3.4, "meta", "meta",
                       segments=[[1, "SEALING"], [2, "SEALING"], [3, "OPEN"]]))
    assert failed(records, final)["C12"][0]["unsealed"] == [1, 2, 3]


def test_an_invoke_without_completion_is_in_doubt_not_lost() -> None:
    records, final = clean()
    for run in stream_of(final)["reads"]:
        del run[3]  # c0, in doubt: may be absent
    assert "C1" not in failed(records, final)


@pytest.mark.parametrize("fault", ["w1", "store1", "master", "master1"])
def test_measure_reads_failover_and_stalls(fault: str) -> None:
    records, _ = clean()
    records.append({"t": 2.9, "type": "nemesis", "phase": "start", "fault": "kill",
                    "target": fault, "process": "nemesis"})
    records.append(rec(4.0, "ok", "w2", op=0, seqs=[pack(2, 1)]))
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    if fault == "w1":
        assert figures["writer_failover_s"]["max"] == pytest.approx(1.1)
    elif fault == "store1":
        assert figures["append_stall_after_store_fault_s"]["count"] == 1
    else:
        stall = figures["append_stall_after_master_fault_s"]
        assert stall["max"] == pytest.approx(1.0)  # acks at 3.0 and 4.0


def test_a_master_fault_stalls_count_from_the_master_back() -> None:
    """FAULTS.md: "master restart -> writers appending again". w1 needed the master
    (say, for a roll) all through its 3 s isolation and appended 0.5 s after the heal:
    that is the stall measured, not the 3.5 s since the isolation began."""
    records, _ = clean()
    records.append({"t": 3.05, "type": "nemesis", "phase": "start", "fault": "partition",
                    "target": "master", "process": "nemesis"})
    records.append({"t": 6.05, "type": "nemesis", "phase": "stop", "fault": "partition",
                    "target": "master", "process": "nemesis"})
    records.append(rec(6.4, "invoke", "w1", op=9, ids=["z0"], session="s1"))
    records.append(rec(6.55, "ok", "w1", op=9, seqs=[pack(3, 1)]))
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    assert figures["append_stall_after_master_fault_s"]["max"] == pytest.approx(0.5)
    # Appending again 2.5 s after the heal is past 2 L + 2 at a lease of 0.2 s.
    records[-1] = rec(8.55, "ok", "w1", op=9, seqs=[pack(3, 1)])
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    assert figures["append_stall_after_master_fault_s"]["max"] == pytest.approx(2.5)
    assert bounds(figures, lease_s=0.2)["append_stall_after_master_fault_s"]["ok"] is False


def test_bounds_flag_what_exceeds_the_liveness_table() -> None:
    figures = {
        "writer_failover_s": {"p99": 3.5},
        "append_stall_after_store_fault_s": {"p99": 0.4},
        "reader_catch_up_s": None,
    }
    checked = bounds(figures, lease_s=1.0)
    assert checked["writer_failover_s"] == {"p99": 3.5, "bound": 3.0, "ok": False}
    assert checked["append_stall_after_store_fault_s"]["ok"] is True
    assert checked["reader_catch_up_s"]["ok"] is False  # never caught up


def test_a_stall_lasting_beyond_the_window_counts_whole() -> None:
    records, _ = clean()
    records.append({"t": 3.05, "type": "nemesis", "phase": "start", "fault": "partition",
                    "target": "master", "process": "nemesis"})
    records.append(rec(20.0, "invoke", "w1", op=9, ids=["z0"], session="s1"))
    records.append(rec(21.0, "ok", "w1", op=9, seqs=[pack(3, 1)]))
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    assert figures["append_stall_after_master_fault_s"]["max"] == pytest.approx(21.0 - 3.05)


def test_a_later_fault_cuts_the_stall_window() -> None:
    """A leader killed 1 s into a store's outage: the store's stall ends there (at
    least that long), the writer's failover is its own figure."""
    records, _ = clean()
    for t, target in ((3.05, "store1"), (3.5, "w2")):
        records.append({"t": t, "type": "nemesis", "phase": "start", "fault": "kill",
                        "target": target, "process": "nemesis"})
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    assert figures["append_stall_after_store_fault_s"]["max"] == pytest.approx(3.5 - 3.05)


def test_link_faults_are_their_own_figure() -> None:
    records, _ = clean()
    records.append({"t": 2.9, "type": "nemesis", "phase": "start", "fault": "blackhole",
                    "target": "store1", "process": "nemesis"})
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    assert "append_stall_after_store_fault_s" not in figures
    assert figures["append_stall_after_link_fault_s"]["count"] == 1


def test_a_clock_jump_is_its_own_figure_bounded_by_two_leases() -> None:
    """S4 seed 1's quick pass in a clean-clone CI: the master's clock jumped an hour
    (every lease ended, the writers contested again) and store0's jumped 1 s later; the
    contest's 1.38 s without an ack was counted as store0's stall against the 1 s of a
    copy-set store's death. FAULTS.md bounds S4 by 2 L after each jump, whoever jumped."""
    records, _ = clean()
    for t, target in ((2.9, "master"), (3.05, "store0")):
        records.append({"t": t, "type": "nemesis", "phase": "start", "fault": "clock-jump",
                        "target": target, "process": "nemesis"})
    records.append(rec(4.3, "invoke", "w1", op=9, ids=["z0"], session="s1"))
    records.append(rec(4.4, "ok", "w1", op=9, seqs=[pack(3, 1)]))
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    assert "append_stall_after_store_fault_s" not in figures
    assert "append_stall_after_master_fault_s" not in figures
    jumps = figures["append_stall_after_clock_jump_s"]
    assert jumps["max"] == pytest.approx(4.4 - 3.05)
    assert bounds(figures, lease_s=1.0)["append_stall_after_clock_jump_s"]["ok"] is True
    assert bounds(figures, lease_s=0.5)["append_stall_after_clock_jump_s"]["ok"] is False


def rss_history(writer_mib: list[float], seconds: float = 1.0) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{"t": 0.0, "type": "phase", "process": "nemesis",
                                      "name": "faults"}]
    for number, mib in enumerate(writer_mib):
        records.append({"t": number * seconds, "type": "rss", "process": "rss",
                        "mib": {"w1": mib, "store0": 60.0, "r1": 40.0}})
    return records


def test_memory_within_its_bound_passes() -> None:
    figures = measure(rss_history([40.0, 45.0, 90.0, 60.0]), "S")
    writer = figures["rss_mib"]["writer"]
    assert (writer["process"], writer["baseline"], writer["growth"]) == ("w1", 40.0, 50.0)
    checked = bounds(figures, lease_s=1.0, streams=2)
    assert checked["rss_growth_mib_writer"]["ok"] is True
    assert "rss_late_growth_mib_writer" not in checked  # too short a run for a trend


def test_memory_past_its_bound_or_growing_fails() -> None:
    over = bounds(measure(rss_history([40.0, 40.0, 400.0]), "S"), lease_s=1.0, streams=2)
    assert over["rss_growth_mib_writer"]["ok"] is False  # 360 MiB > 2 x 64 + 64
    # 90 samples 1 s apart growing 1 MiB/s: +60 MiB between the first and last third.
    growing = bounds(measure(rss_history([40.0 + n for n in range(90)]), "S"), 1.0, 2)
    assert growing["rss_late_growth_mib_writer"] == {
        "value": 60.0, "process": "w1", "bound": 32, "ok": False}
    assert "rss_late_growth_mib_store" not in growing  # memtables grow with the data


def test_catch_up_after_heal_per_reader() -> None:
    """r1 delivers the last event acked before the heal 0.2 s after it; r2 subscribed
    but never got it (a miss); r3, a slow consumer on purpose, is left out."""
    records, _ = clean()
    records += [
        {"t": 3.8, "type": "phase", "process": "nemesis", "name": "heal"},
        rec(1.0, "subscribe", "r2", **{"from": 0}),
        rec(0.1, "start", "r3", role="reader", consume_ms=4.0),
        rec(1.0, "subscribe", "r3", **{"from": 0}),
    ]
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    catch_up = figures["reader_catch_up_after_heal_s"]
    assert catch_up["max"] == pytest.approx(0.2) and catch_up["never"] == ["r2 t/s"]
    assert bounds(figures, lease_s=1.0)["reader_catch_up_after_heal_s"]["ok"] is False


def test_a_reader_started_after_the_heal_counts_from_its_first_subscription() -> None:
    """S16 starts a fresh reader as its schedule ends; on a loaded box its process
    subscribed 5.3 s after the heal. Its catch-up is from then, not from the heal."""
    records, _ = clean()
    records += [
        {"t": 3.8, "type": "phase", "process": "nemesis", "name": "heal"},
        rec(9.1, "subscribe", "r4", **{"from": 0}),
        rec(9.6, "deliver", "r4", events=[event(1, 1, "a0"), event(1, 2, "a1"),
                                          event(1, 3, "b0"), event(2, 1, "c0")]),
    ]
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    catch_up = figures["reader_catch_up_after_heal_s"]
    assert catch_up["max"] == pytest.approx(0.5) and catch_up["never"] == []


def bad_history() -> list[dict[str, Any]]:
    digest = {"master": {"tenants": ["t"], "streams": [["t/s", 1, 3, 2, 0]],
                         "stores": [["s0", "a:1", "", False]], "others": []},
              "stores": {"s0 t/s/1": "ab fence 2"}}
    return [
        {"t": 1.0, "type": "digest", "process": "nemesis", "phase": "before",
         **copy.deepcopy(digest)},
        {"t": 1.1, "type": "bad", "process": "nemesis", "kind": "row", "case": "over the limit",
         "server": "store", "method": "Write", "expected": "INVALID_ARGUMENT",
         "got": "INVALID_ARGUMENT", "details": ""},
        {"t": 1.2, "type": "bad", "process": "nemesis", "kind": "mutated", "case": "0a01",
         "server": "store", "method": "Subscribe", "expected": "parsed", "streaming": True,
         "got": "DEADLINE_EXCEEDED", "details": ""},
        {"t": 1.3, "type": "bad", "process": "nemesis", "kind": "random", "case": "ff",
         "server": "master", "method": "ListTenants", "expected": "INVALID_ARGUMENT",
         "got": "INVALID_ARGUMENT", "details": ""},
        {"t": 2.0, "type": "digest", "process": "nemesis", "phase": "after",
         **copy.deepcopy(digest)},
        {"t": 2.1, "type": "serving", "process": "nemesis", "servers": {"master": True}},
    ]


def test_c15_clean_bad_input_passes() -> None:
    records, final = clean()
    assert "C15" not in failed(records + bad_history(), final)


def test_c15_a_wrong_status_an_unclear_one_a_change_and_a_dead_server() -> None:
    records, final = clean()
    bad = bad_history()
    bad[1]["got"] = "FAILED_PRECONDITION"  # a row's status
    bad[3]["got"] = "UNKNOWN"  # undecodable bytes must be INVALID_ARGUMENT
    bad.append({**bad[2], "method": "Read", "streaming": False, "got": "INTERNAL"})
    bad[4]["stores"]["s0 t/s/1"] = "cd fence 2"
    bad[4]["master"]["stores"][0][3] = True  # drained by bad input
    bad[5]["servers"]["store0"] = False
    witnesses = failed(records + bad, final)["C15"]
    problems = sorted(w["problem"] for w in witnesses)
    assert problems == sorted([
        "not the expected status", "not the expected status",
        "a well-formed request got no clear status", "a sealed replica's contents changed",
        "the master's metadata changed", "no longer serving after bad input"])


def with_segment_destroyed() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The clean history, then every copy of segment 1 (a0, a1, b0; bridge at 4)
    destroyed at t=4.5; both final readers report it lost and read on from segment 2;
    r2 starts from 0 afterwards, is told, and goes past."""
    records, final = clean()
    records += [
        rec(4.5, "lost", "nemesis", epoch=1, final_index=4, events=[1, 2, 3],
            stores=["s0", "s1", "s2"]),
        rec(5.0, "subscribe", "r2", **{"from": 0}),
        rec(5.1, "error", "r2", error="DataLossError", data_loss=[1, 1, 4]),
        rec(5.2, "subscribe", "r2", **{"from": pack(1, 5)}, after_loss=[1, 1, 4]),
        rec(5.3, "deliver", "r2", events=[event(2, 1, "c0")]),
    ]
    state = stream_of(final)
    state["reads"] = [[event(2, 1, "c0")], [event(2, 1, "c0")]]
    state["losses"] = [[[1, 1, 4]], [[1, 1, 4]]]
    for dump in state["segments"][0]["replicas"].values():
        dump.clear()
        dump["error"] = "NOT_FOUND: not held"
    return records, final


def test_c14_a_destroyed_segment_reported_lost_is_honest() -> None:
    records, final = with_segment_destroyed()
    verdict = check(sorted(records, key=lambda r: r["t"]), final)
    assert verdict.valid, verdict.anomalies
    assert verdict.counts["events_lost_declared"] == 3  # a0, a1 and b0: acked, then lost


def test_c14_a_silent_skip_by_a_final_and_a_live_reader() -> None:
    records, final = with_segment_destroyed()
    stream_of(final)["losses"][1] = []  # the second final reader just went on
    records = [r for r in records if not (r["process"] == "r2" and r["t"] in (5.1, 5.2))]
    problems = [w["problem"] for w in failed(records, final)["C14"]]
    assert sorted(problems) == [
        "a destroyed segment skipped without a data-loss error",
        "passed events of a destroyed segment without a data-loss error",
    ]


def test_c14_a_loss_reported_where_nothing_was_destroyed_is_a_loss() -> None:
    records, final = clean()
    state = stream_of(final)
    state["losses"] = [[[1, 1, 4]], []]
    state["reads"][0] = state["reads"][0][3:]  # a0, a1, b0 (segment 1) not read
    found = failed(records, final)
    assert found["C14"][0]["problem"] == "a loss reported where nothing was destroyed"
    assert found["C1"][0]["payload"] == "a0"  # not excused: nothing destroyed it


def test_repair_rate_and_a_drain_that_left_a_replica_behind() -> None:
    records, _ = clean()
    records += [
        {"t": 5.0, "type": "nemesis", "process": "nemesis", "phase": "detail", "fault": "wipe",
         "target": "store1", "detect_s": 3.0, "repair_s": 5.0, "repair_bytes": 10 * 2**20},
        {"t": 6.0, "type": "nemesis", "process": "nemesis", "phase": "detail",
         "fault": "drain", "target": "store2", "drain_s": 4.0, "placed_after": 0,
         "held_after": ["t/s/1"], "cli_exit": 0},
    ]
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    # 2 s to copy 10 MiB: 100 MiB would take 3 s to notice plus 20 s.
    assert figures["repair_s_per_100mb"]["max"] == pytest.approx(23.0)
    drained = bounds(figures, lease_s=1.0)["drained_empty_store2"]
    assert (drained["value"], drained["ok"]) == (1, False)


def test_every_run_names_the_command_that_replays_its_schedule_and_windows() -> None:
    from tests.faults.scenarios import SCENARIOS, replay_command, standard_duration

    s7 = SCENARIOS["S7"]
    assert replay_command(s7, 3, True, s7.quick_s) == "make faults-quick SCENARIO=S7 SEED=3"
    assert replay_command(s7, 3, True, standard_duration(s7)) == "make faults SCENARIO=S7 SEED=3"
    assert replay_command(s7, 3, False, s7.duration_s) == (
        "make faults-long SCENARIO=S7 SEED=3")
    assert replay_command(s7, 3, True, 50.0) == (
        "python -m tests.faults --scenario S7 --seed 3 --quick --duration 50")


def test_a_reader_that_never_caught_up_leaves_its_last_steps_in_the_verdict(tmp_path) -> None:
    from tests.faults.scenarios import _reader_traces, _stalled_readers

    figures = {"reader_catch_up_after_heal_s": {"never": ["r2 t/s"]}, "reader_catch_up_s": 1.0}
    assert _stalled_readers(figures) == ["r2"]
    assert _stalled_readers({"reader_catch_up_s": None}) == ["r1", "r2"]
    records = [rec(1.0, "subscribe", "r2", **{"from": 0}),
               rec(2.0, "deliver", "r2", events=[event(1, i, f"p{i}") for i in (1, 2, 3)]),
               rec(3.0, "error", "r2", error="UNAVAILABLE"),
               rec(3.5, "deliver", "r1", events=[event(1, 1, "p1")])]
    (tmp_path / "r2.log").write_text("subscribing\nwaiting for segment 2\n")
    trace = _reader_traces(records, tmp_path, ["r2"])["r2"]
    assert [r["type"] for r in trace["records"]] == ["subscribe", "deliver", "error"]
    assert trace["records"][1]["count"] == 3 and len(trace["records"][1]["events"]) == 2
    assert trace["log"] == ["subscribing", "waiting for segment 2"]


def test_a_reader_started_late_is_measured_from_when_it_runs_not_while_it_loads() -> None:
    records = rss_history([40.0] * 12)
    for record, mib in zip(records[9:], [28.7, 112.1, 112.2, 112.5], strict=True):
        record["mib"] = {**record["mib"], "r3": mib}  # first seen at 8 s, loading
    figures = measure(records, "S")
    assert figures["rss_mib"]["reader"]["growth"] == pytest.approx(0.4)


def zombie_history(late_status: str, late_seqs: list[int]) -> tuple[list[Any], dict[str, Any]]:
    """w1 leads epoch 1, is paused at 2.6 with op 2 in flight, w2 takes over at 3.2;
    w1 resumes at 3.4 and op 2 ends `late_status`."""
    records, final = clean()
    records += [
        rec(2.55, "invoke", "w1", op=2, ids=["z0"], session="s1"),
        {"t": 2.6, "type": "nemesis", "process": "nemesis", "phase": "start", "fault": "pause",
         "target": "w1", "inc": 1},
        {"t": 3.4, "type": "nemesis", "process": "nemesis", "phase": "stop", "fault": "pause",
         "target": "w1"},
        rec(3.45, late_status, "w1", op=2, seqs=late_seqs, error="NotLeader: fenced"),
        # Made after the resume, before it leads again: a zombie's too.
        rec(3.5, "invoke", "w1", op=3, ids=["z1"], session="s1"),
        rec(3.55, "info", "w1", op=3, error="AppendInDoubt: granted to another writer"),
        # Leading again (epoch 3), its appends are its own.
        rec(3.9, "grant", "w1", epoch=3, client="w1.1-2"),
        rec(3.95, "invoke", "w1", op=4, ids=["y0"], session="s3"),
        rec(3.99, "fail", "w1", op=4, error="AppendFailed: never sent"),
    ]
    return records, final


def test_a_zombie_s_late_failure_is_counted_not_an_anomaly() -> None:
    records, final = zombie_history("fail", [])
    verdict = check(sorted(records, key=lambda r: r["t"]), final)
    assert verdict.anomalies == []
    counts = verdict.counts
    assert counts["zombie_windows"] == 1
    assert (counts["zombie_late_fail"], counts["zombie_late_info"]) == (1, 1)


def test_a_zombie_s_late_ack_not_in_f_is_a_c10_witness() -> None:
    records, final = zombie_history("ok", [pack(1, 4)])
    anomalies = failed(records, final)
    [witness] = anomalies["C10"]
    assert witness["op"] == "w1.1 op 2" and witness["payload"] == "z0"
    assert witness["paused"] == [2.6, 3.4]
    assert "C1" in anomalies, "C1 reports the lost acknowledgement too"


def test_a_pause_nobody_took_over_makes_no_zombie() -> None:
    records, final = zombie_history("fail", [])
    records = [r for r in records if not (r["type"] == "grant" and r["process"] == "w2")]
    verdict = check(sorted(records, key=lambda r: r["t"]), final)
    assert "zombie_windows" not in verdict.counts


def test_a_reader_started_early_in_the_faults_is_measured_from_its_second_sample() -> None:
    """S16's quick pass starts a reader 4 s into the faults: still a late start."""
    records = rss_history([40.0] * 12)
    for record, mib in zip(records[5:9], [8.8, 152.0, 152.1, 154.3], strict=True):
        record["mib"] = {**record["mib"], "r3": mib}  # first seen at 4 s, loading
    figures = measure(records, "S")
    assert figures["rss_mib"]["reader"]["growth"] == pytest.approx(2.3)


# ---- C0: a run whose nemesis injected nothing is invalid, not green ----


def scheduled(nemesis: str | None, *later: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The clean history with its faults phase scheduling `nemesis`, plus `later`."""
    records, final = clean()
    records += [rec(0.1, "phase", "nemesis", name="faults", nemesis=nemesis), *later]
    return records, final


def test_c0_a_nemesis_whose_every_round_skipped_makes_the_run_invalid() -> None:
    records, final = scheduled(
        "store_crash_loop",
        rec(1.5, "nemesis_skip", "nemesis", why="no open copy set listed"),
        rec(2.5, "nemesis_skip", "nemesis", why="no open copy set listed"),
        rec(3.5, "nemesis_error", "nemesis", error="TimeoutError: no victim found"),
    )
    verdict = check(sorted(records, key=lambda r: r["t"]), final)
    assert not verdict.valid
    [witness] = failed(records, final)["C0"]
    assert witness["rounds"] == 3 and witness["injected"] == 0
    assert witness["skipped"] == {"no open copy set listed": 2}
    assert witness["errors"] == ["TimeoutError: no victim found"]
    assert witness["problem"].startswith("store_crash_loop ran 3 rounds and injected no fault")
    assert verdict.counts["faults_injected"] == 0


def test_c0_a_schedule_whose_first_round_never_came_due_is_invalid() -> None:
    records, final = scheduled("kill_leader_loop")
    [witness] = failed(records, final)["C0"]
    assert witness["rounds"] == 0
    assert "no round came due within the faults phase" in witness["problem"]


def test_c0_one_fault_injected_among_skipped_rounds_is_enough() -> None:
    records, final = scheduled(
        "kill_leader_loop",
        rec(1.5, "nemesis_skip", "nemesis", why="no leader to kill"),
        rec(2.6, "nemesis", "nemesis", phase="start", fault="kill", target="w1"),
        rec(2.8, "nemesis", "nemesis", phase="stop", fault="kill", target="w1"),
    )
    verdict = check(sorted(records, key=lambda r: r["t"]), final)
    assert verdict.valid, verdict.anomalies
    assert verdict.counts["faults_injected"] == 1


def test_c0_a_scenario_without_a_nemesis_needs_no_fault() -> None:
    """S1, the baseline; and histories recorded before the phase named its nemesis."""
    for records, final in (scheduled(None), clean()):
        verdict = check(sorted(records, key=lambda r: r["t"]), final)
        assert verdict.valid, verdict.anomalies


# ---- C16: a traceback in a server's log fails the run ----

A_TRACEBACK = """2026-11-27 12:00:01 INFO store serving
Traceback (most recent call last):
  File "service.py", line 10, in heartbeat
    raise KeyError(7)
KeyError: 7
2026-11-27 12:00:02 INFO store serving
"""


def test_c16_a_traceback_in_a_servers_log_makes_the_run_invalid() -> None:
    records, final = clean()
    logs = {"store1": A_TRACEBACK + A_TRACEBACK, "master": "INFO serving\n"}
    verdict = check(records, final, logs)
    assert not verdict.valid
    [witness] = [a for a in verdict.anomalies if a["check"] == "C16"]
    assert witness["process"] == "store1" and witness["tracebacks"] == 2
    assert witness["first"] == "KeyError: 7"


def test_c16_only_servers_logs_are_judged() -> None:
    records, final = clean()
    # A workload process may print its own failures: the checks judge what it recorded.
    assert check(records, final, {"w1": A_TRACEBACK, "master0": "", "store2": ""}).valid


def test_waits_judge_a_sparse_stream_by_its_appends_not_its_pace() -> None:
    """A stream acking every 2 s by its own pace: after a store's kill at 10.0, its
    append invoked at 10.5 waited 0.3 s (the gaps between acks are 2 s, its pace). The
    figure is judged on its largest wait: 0.3 s, within the 1 s bound; an append that
    waited 1.4 s misses it."""
    records = [rec(0.5, "grant", "w1", epoch=1, client="w1.1-1")]
    for op, at in enumerate([6.5, 8.5, 10.5, 12.5]):
        records += [rec(at, "invoke", "w1", op=op, ids=[f"e{op}"], session="w1.1-1"),
                    rec(at + 0.3, "ok", "w1", op=op, seqs=[pack(1, op + 1)])]
    records.append({"t": 10.0, "type": "nemesis", "phase": "start", "fault": "kill",
                    "target": "store1", "process": "nemesis"})
    ordered = sorted(records, key=lambda r: r["t"])
    assert measure(ordered, "S")["append_stall_after_store_fault_s"]["max"] > 1.0
    figures = measure(ordered, "S", stall_by_wait=True)
    assert "append_stall_after_store_fault_s" not in figures
    assert figures["append_wait_after_store_fault_s"]["max"] == pytest.approx(0.3)
    checked = bounds(figures, lease_s=1.0)["append_wait_after_store_fault_s"]
    assert checked == {"max": pytest.approx(0.3), "bound": 1.0, "ok": True}
    slow = [r if not (r["type"] == "ok" and r["op"] == 2) else {**r, "t": 11.9}
            for r in ordered]
    figures = measure(sorted(slow, key=lambda r: r["t"]), "S", stall_by_wait=True)
    assert bounds(figures, lease_s=1.0)["append_wait_after_store_fault_s"]["ok"] is False


def test_waits_count_a_stream_without_a_writer_session() -> None:
    """The session ends 0.2 s after the master's return and the next grant comes 3 s
    later: the stream waited 3 s, though no append of it was pending."""
    records = [
        rec(0.5, "grant", "w1", epoch=1, client="w1.1-1"),
        {"t": 5.0, "type": "nemesis", "phase": "start", "fault": "kill", "target": "master",
         "process": "nemesis"},
        {"t": 6.0, "type": "nemesis", "phase": "stop", "fault": "kill", "target": "master",
         "process": "nemesis"},
        rec(6.2, "session_end", "w1", session="w1.1-1", error="LeadershipLost"),
        rec(9.2, "grant", "w1", epoch=2, client="w1.1-2"),
    ]
    figures = measure(records, "S", stall_by_wait=True)
    assert figures["append_wait_after_master_fault_s"]["max"] == pytest.approx(3.0)


def test_catch_up_counts_only_the_streams_a_reader_follows() -> None:
    """r2 follows another stream (its start record names it): never delivering t/s is
    no miss of its."""
    records, _ = clean()
    records += [
        {"t": 3.8, "type": "phase", "process": "nemesis", "name": "heal"},
        rec(0.1, "start", "r2", role="reader", consume_ms=0.0, streams=["t/other"]),
        {**rec(1.0, "subscribe", "r2", **{"from": 0}), "stream": "t/other"},
    ]
    figures = measure(sorted(records, key=lambda r: r["t"]), "S")
    assert figures["reader_catch_up_after_heal_s"]["never"] == []
