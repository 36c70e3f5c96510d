"""How a scenario's streams are named and handed to writers and readers, and how the
metadata sampler takes them in turn (no servers)."""

from __future__ import annotations

from pathlib import Path

from tests.faults.cluster import SAMPLED_STREAMS_MAX, MetaSampler
from tests.faults.history import Recorder
from tests.faults.scenarios import (
    SCENARIOS,
    STREAMS,
    reader_streams,
    stream_names,
    writer_streams,
)


def test_two_streams_and_two_writers_run_as_every_scenario_always_has() -> None:
    assert stream_names(2) == STREAMS
    assert writer_streams(STREAMS, 2) == {"w1": STREAMS, "w2": STREAMS}
    assert reader_streams(STREAMS, 0, 1, "r1") == STREAMS
    assert all((s.streams, s.writers, s.reader_streams, s.multiplexed_readers)
               == (2, 2, 0, False) for s in SCENARIOS.values() if s.name != "S18")


def test_many_streams_are_shared_out_among_writers_and_sampled_by_readers() -> None:
    streams = stream_names(1000)
    assert len(set(streams)) == 1000
    assert {name.split("/")[0] for name in streams} == {"t1", "t2", "t3", "t4"}
    shares = writer_streams(streams, 4)
    assert sorted(name for share in shares.values() for name in share) == sorted(streams)
    assert {len(share) for share in shares.values()} == {250}
    sample = reader_streams(streams, 100, 1, "r1")
    assert len(sample) == 100 == len(set(sample))
    assert sample == reader_streams(streams, 100, 1, "r1")  # seeded
    assert sample != reader_streams(streams, 100, 1, "r2")


def test_the_sampler_takes_every_stream_in_turn(tmp_path: Path) -> None:
    streams = stream_names(120)
    sampler = MetaSampler("127.0.0.1:1", streams, Recorder(tmp_path / "meta.jsonl", "meta"))
    turns = [sampler.turn() for _ in range(3)]
    assert all(len(turn) == SAMPLED_STREAMS_MAX for turn in turns)
    assert set(turns[0] + turns[1] + turns[2]) == set(streams)
    few = MetaSampler("127.0.0.1:1", STREAMS, Recorder(tmp_path / "few.jsonl", "meta"))
    assert few.turn() == few.turn() == STREAMS
    sampler.recorder.close()
    few.recorder.close()
