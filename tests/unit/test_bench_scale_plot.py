"""The cost curves of `bench.scale`: a figure's growth against N is named from its
log-log slope, and the rows are drawn and kept so they can be drawn again."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scale import Row
from bench.scale_plot import growth_exponent, growth_lines, growth_word, load, save

SIZES = [100, 1000, 10_000]


@pytest.mark.parametrize(
    ("values", "word"),
    [
        ([5.0, 5.0, 5.0], "flat"),
        ([1.0, 1.2, 1.3], "flat"),
        ([1.0, 3.0, 10.0], "sublinear"),
        ([1.0, 10.0, 100.0], "linear"),
        ([1.0, 100.0, 10_000.0], "faster than linear"),
        ([0.0, 0.0, 0.0], "not measured"),
        ([0.0, 0.0, 4.0], "not measured"),  # one size measured: no slope
    ],
)
def test_growth_is_named_from_the_log_log_slope(values, word):
    assert growth_word(growth_exponent(SIZES, values)) == word


def test_a_linear_figure_has_slope_one():
    assert growth_exponent(SIZES, [3.0, 30.0, 300.0]) == pytest.approx(1.0)


def test_rows_are_kept_and_drawn_and_read_back(tmp_path: Path):
    rows = [
        Row(
            n,
            create_s=n / 9000,
            lead_s=n / 1000,
            append_p50_ms=3.0,
            append_p99_ms=20.0,
            idle_cpu_pct={"master": n / 1000, "client": n / 500, "store0": 0.5},
            rss_mib={"master": 70 + n / 200, "client": 130 + n / 100, "store0": 70.0},
            close_s=1.0,
            problems=("none",) if n == 100 else (),
        )
        for n in SIZES
    ]
    data, picture = save(rows, tmp_path / "scale")
    assert picture.read_bytes().startswith(b"\x89PNG")
    assert load(data) == rows
    lines = growth_lines(rows)
    assert "idle CPU with N leases held, master (% of a core): linear (N^1.00)" in lines
    assert "one append, round robin over every stream, p50 (ms): flat (N^0.00)" in lines
