"""PNG charts of a `treadle eval` report: return, success, tool latency and cost over time per policy_version.

Figures are drawn on matplotlib's Agg canvas (no display, no GUI toolkit) through the object API only: pyplot and
matplotlib.use() keep global state, which a long-running process or a test would leak between calls. A chart with
nothing to draw is still written, saying so, so the folder always holds the same four files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure

from treadle.reports.eval_report import Report

_SIZE_INCHES = (9.0, 4.5)
_DPI = 100


@dataclass(frozen=True)
class Line:
    """(column, label suffix, line style) drawn once per policy_version."""

    column: str
    suffix: str = ""
    style: str = "-"


@dataclass(frozen=True)
class Chart:
    file_name: str
    title: str
    ylabel: str
    series: str  # "episode_series" or "latency_series"
    lines: tuple[Line, ...]
    percent: bool = False


CHARTS = (
    Chart("episode_return.png", "Mean episode return", "return (sum of step rewards)", "episode_series",
          (Line("mean_return"),)),
    Chart("success_rate.png", "Episode success rate (done and not truncated)", "success rate", "episode_series",
          (Line("success_rate"),), percent=True),
    Chart("tool_latency.png", "Tool latency", "latency (ms)", "latency_series",
          (Line("latency_p50_ms", " p50", "-"), Line("latency_p95_ms", " p95", "--"))),
    Chart("cost_per_episode.png", "Mean API cost per episode", "cost per episode (USD)", "episode_series",
          (Line("mean_cost_usd"),)),
)  # fmt: skip


def write_charts(report: Report, out_dir: Path) -> list[Path]:
    """Write one PNG per chart into `out_dir` (created if missing); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for chart in CHARTS:
        path = out_dir / chart.file_name
        _draw(chart, getattr(report, chart.series), report.bucket_seconds, path)
        paths.append(path)
    return paths


def _draw(chart: Chart, rows: Sequence[dict[str, Any]], bucket_seconds: int, path: Path) -> None:
    figure = Figure(figsize=_SIZE_INCHES, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set_title(f"{chart.title}, per policy version ({_bucket_label(bucket_seconds)} buckets)")
    axes.set_xlabel("time (UTC, bucket start)")
    axes.set_ylabel(chart.ylabel)
    axes.grid(True, alpha=0.3)
    if rows:
        _plot(axes, chart, rows, bucket_seconds)
    else:
        axes.text(0.5, 0.5, "no data in this range", ha="center", va="center", transform=axes.transAxes)
        axes.plot([], [], label="no data")
    axes.legend(title="policy version", loc="best", fontsize="small")
    figure.savefig(path, format="png")


def _plot(axes: Axes, chart: Chart, rows: Sequence[dict[str, Any]], bucket_seconds: int) -> None:
    versions = sorted({str(row["policy_version"]) for row in rows})
    colors = matplotlib.colormaps["tab10"]
    buckets = sorted({datetime.fromisoformat(row["bucket"].replace("Z", "+00:00")) for row in rows})
    if len(buckets) == 1:  # matplotlib would span years around a single date; show a few buckets instead
        step = timedelta(seconds=bucket_seconds)
        axes.set_xlim(buckets[0] - 2 * step, buckets[0] + 3 * step)
    for index, version in enumerate(versions):
        mine = [row for row in rows if row["policy_version"] == version]
        times = [datetime.fromisoformat(row["bucket"].replace("Z", "+00:00")) for row in mine]
        for line in chart.lines:
            values = [float("nan") if row[line.column] is None else float(row[line.column]) for row in mine]
            if chart.percent:
                values = [v * 100 for v in values]
            axes.plot(times, values, line.style, marker="o", markersize=4, color=colors(index % 10),
                      label=f"{version or '(none)'}{line.suffix}")  # fmt: skip
    locator = AutoDateLocator()
    axes.xaxis.set_major_locator(locator)
    axes.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    if chart.percent:
        axes.set_ylim(-5, 105)


def _bucket_label(seconds: int) -> str:
    for unit, size in (("w", 604_800), ("d", 86_400), ("h", 3600), ("min", 60)):
        if seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
