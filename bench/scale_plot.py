"""Cost curves of `bench.scale`: each figure against the number of streams N, drawn and
its growth named (issue #38: nothing idle may grow faster than linearly).

    .venv/bin/python -m bench.scale --plot docs/scale   # measures, then writes
                                                       # docs/scale.png and docs/scale.json
    .venv/bin/python -m bench.scale_plot docs/scale.json docs/scale.png  # draws again

The growth of a figure between two sizes is the slope of its log against log N
(`growth_exponent`): about 0 is flat, about 1 linear, 2 quadratic.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from bench.scale import Row

# (panel title, unit, [(series label, the figure of a row)])
Series = tuple[str, Callable[[Row], float]]
PANELS: tuple[tuple[str, str, tuple[Series, ...]], ...] = (
    (
        "idle CPU with N leases held",
        "% of a core",
        (
            ("master", lambda r: (r.idle_cpu_pct or {}).get("master", 0.0)),
            ("client", lambda r: (r.idle_cpu_pct or {}).get("client", 0.0)),
            ("busiest store", lambda r: _busiest_store(r.idle_cpu_pct)),
        ),
    ),
    (
        "memory",
        "RSS, MiB",
        (
            ("master", lambda r: (r.rss_mib or {}).get("master", 0.0)),
            ("client", lambda r: (r.rss_mib or {}).get("client", 0.0)),
            ("largest store", lambda r: _busiest_store(r.rss_mib)),
        ),
    ),
    (
        "start-up and close",
        "seconds",
        (
            ("create all", lambda r: r.create_s),
            ("lead all", lambda r: r.lead_s),
            ("close all", lambda r: r.close_s),
        ),
    ),
    (
        "one append, round robin over every stream",
        "ms",
        (
            ("p50", lambda r: r.append_p50_ms),
            ("p99", lambda r: r.append_p99_ms),
        ),
    ),
)


def _busiest_store(figures: dict[str, float] | None) -> float:
    return max((v for k, v in (figures or {}).items() if k.startswith("store")), default=0.0)


def growth_exponent(sizes: Sequence[int], values: Sequence[float]) -> float | None:
    """The slope of log(value) against log(N), least squares over the sizes measured;
    None when fewer than two sizes have a positive figure."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values, strict=True) if v > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def growth_word(exponent: float | None) -> str:
    if exponent is None:
        return "not measured"
    if exponent < 0.25:
        return "flat"
    if exponent < 0.75:
        return "sublinear"
    if exponent < 1.25:
        return "linear"
    return "faster than linear"


def growth_lines(rows: Sequence[Row]) -> list[str]:
    """One line per figure: its growth against N over the rows measured."""
    sizes = [row.streams for row in rows]
    lines = []
    for title, unit, series in PANELS:
        for label, figure in series:
            exponent = growth_exponent(sizes, [figure(row) for row in rows])
            shown = "" if exponent is None else f" (N^{exponent:.2f})"
            lines.append(f"{title}, {label} ({unit}): {growth_word(exponent)}{shown}")
    return lines


def draw(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row.streams for row in rows]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (title, unit, series) in zip(axes.flat, PANELS, strict=True):
        for label, value in series:
            values = [value(row) for row in rows]
            exponent = growth_exponent(sizes, values)
            # A log axis has no place for 0 (a figure too small to measure): left out.
            shown = [(n, v) for n, v in zip(sizes, values, strict=True) if v > 0]
            axis.plot(
                [n for n, _ in shown],
                [v for _, v in shown],
                marker="o",
                label=f"{label}: {growth_word(exponent)}",
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(sizes, [f"{n:,}" for n in sizes])
        axis.set_title(title)
        axis.set_xlabel("streams led by one client (N)")
        axis.set_ylabel(unit)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle("Stream Engine: cost against the number of streams (bench.scale)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def save(rows: Sequence[Row], stem: Path) -> tuple[Path, Path]:
    """`stem`.json (the rows) and `stem`.png (their curves)."""
    data = stem.with_suffix(".json")
    picture = stem.with_suffix(".png")
    data.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    draw(rows, picture)
    return data, picture


def load(path: Path) -> list[Row]:
    rows = json.loads(path.read_text())
    return [Row(**{**row, "problems": tuple(row["problems"])}) for row in rows]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bench.scale_plot ROWS.json OUT.png", file=sys.stderr)
        return 2
    rows = load(Path(args[0]))
    draw(rows, Path(args[1]))
    print("\n".join(growth_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
