"""Charts as inline SVG, drawn on the server: arrival-delay histograms, reward over steps, the step timeline.

No chart library and no JavaScript: a page works offline and in any browser, and a test can read the numbers
from the markup (each bar and marker carries `data-*` attributes and a `<title>` tooltip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

LATE = "#c62828"
ON_TIME = "#2e7d32"
GRACE = "#f9a825"
MUTED = "#90a4ae"
INK = "#263238"


def _svg(width: int, height: int, body: list[str], label: str) -> Markup:
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(label)}" class="chart">' + "".join(body) + "</svg>"
    )


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 11, color: str = INK) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{color}">{escape(text)}</text>'
    )


def seconds(value: float) -> str:
    """A duration people read at a glance: 850 ms, 12.5 s, 3.2 min, 1.5 h."""
    sign, value = ("-" if value < 0 else ""), abs(value)
    if value < 1:
        return f"{sign}{value * 1000:.0f} ms"
    if value < 120:
        return f"{sign}{value:.3g} s"
    if value < 7200:
        return f"{sign}{value / 60:.3g} min"
    return f"{sign}{value / 3600:.3g} h"


@dataclass(frozen=True)
class Bin:
    start: float
    end: float
    count: int
    late: bool


def delay_bins(delays: Sequence[float], deadline_s: float, bins: int = 24) -> list[Bin]:
    """Equal-width bins over [min(0, smallest), max(largest, deadline)]; a bin is late if it starts past deadline.

    The deadline (window + grace) is always a bin edge, so no bin mixes rewards in time with late ones.
    """
    if not delays:
        return []
    low = min(0.0, min(delays))
    high = max(max(delays), deadline_s) or 1.0
    before = max(1, round(bins * (deadline_s - low) / (high - low))) if deadline_s > low else 0
    edges: list[float] = []
    if before:
        step = (deadline_s - low) / before
        edges = [low + i * step for i in range(before)] + [deadline_s]
    after = bins - before
    if high > deadline_s and after > 0:
        step = (high - deadline_s) / after
        start = edges[-1] if edges else low
        edges = (edges or [start]) + [start + (i + 1) * step for i in range(after)]
    if len(edges) < 2:
        edges = [low, high]
    counts = [0] * (len(edges) - 1)
    for d in delays:
        i = next((k for k in range(len(edges) - 1) if d < edges[k + 1]), len(edges) - 2)
        counts[i] += 1
    return [Bin(edges[i], edges[i + 1], counts[i], edges[i] >= deadline_s) for i in range(len(counts))]


def delay_histogram(delays: Sequence[float], window_s: float, grace_s: float, title: str) -> Markup:
    """Histogram of arrival delays; bars past window + grace are red; dashed lines mark the window and the grace."""
    width, height, left, bottom, top = 520, 170, 40, 30, 18
    plot_w, plot_h = width - left - 10, height - bottom - top
    deadline = window_s + grace_s
    bins = delay_bins(delays, deadline)
    body = [_text(left, 12, title, size=12)]
    if not bins:
        body.append(_text(width / 2, height / 2, "no rewards", anchor="middle", color=MUTED))
        return _svg(width, height, body, title)
    low, high = bins[0].start, bins[-1].end
    most = max(b.count for b in bins) or 1

    def x(value: float) -> float:
        return left + (value - low) / (high - low) * plot_w

    for b in bins:
        h = b.count / most * plot_h
        color = LATE if b.late else ON_TIME
        body.append(
            f'<rect class="bar{" late" if b.late else ""}" data-count="{b.count}" data-start="{b.start:.6g}" '
            f'data-end="{b.end:.6g}" x="{x(b.start) + 0.5:.1f}" y="{top + plot_h - h:.1f}" '
            f'width="{max(0.5, x(b.end) - x(b.start) - 1):.1f}" height="{h:.1f}" fill="{color}">'
            f"<title>{b.count} between {escape(seconds(b.start))} and {escape(seconds(b.end))}</title></rect>"
        )
    for value, label, color in ((window_s, "window", INK), (deadline, "grace ends", GRACE)):
        if low <= value <= high and not (label == "grace ends" and grace_s == 0):
            body.append(
                f'<line x1="{x(value):.1f}" x2="{x(value):.1f}" y1="{top}" y2="{top + plot_h}" stroke="{color}" '
                f'stroke-dasharray="4 3"/>'
            )
            near_end = x(value) > left + plot_w - 90
            at = x(value) - 3 if near_end else x(value) + 3
            body.append(_text(at, top + 10, f"{label} {seconds(value)}", "end" if near_end else "start", 10, color))
    body.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="{INK}"/>')
    body.append(_text(left, height - 8, seconds(low), size=10))
    body.append(_text(left + plot_w, height - 8, seconds(high), anchor="end", size=10))
    body.append(_text(left - 4, top + 8, str(most), anchor="end", size=10))
    return _svg(width, height, body, title)


def reward_line(points: Sequence[tuple[int, float | None]], title: str = "reward over steps") -> Markup:
    """Reward per step (step index, reward); steps without a reward are gaps, drawn as hollow markers at 0."""
    width, height, left, bottom, top = 520, 150, 40, 24, 18
    plot_w, plot_h = width - left - 10, height - bottom - top
    body = [_text(left, 12, title, size=12)]
    values = [v for _, v in points if v is not None]
    if not points:
        body.append(_text(width / 2, height / 2, "no steps", anchor="middle", color=MUTED))
        return _svg(width, height, body, title)
    low, high = min([0.0, *values]), max([0.0, *values])
    if math.isclose(low, high):
        low, high = low - 1, high + 1
    first, last = points[0][0], points[-1][0]
    span = max(1, last - first)

    def x(step: int) -> float:
        return left + (step - first) / span * plot_w

    def y(value: float) -> float:
        return top + (high - value) / (high - low) * plot_h

    body.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="{MUTED}"/>')
    path = " ".join(
        f"{'M' if i == 0 else 'L'}{x(s):.1f},{y(v):.1f}" for i, (s, v) in enumerate(points) if v is not None
    )
    if path:
        body.append(f'<path d="{path}" fill="none" stroke="{INK}" stroke-width="1.5"/>')
    for step, value in points:
        fill = INK if value is not None else "white"
        shown = "no reward" if value is None else f"{value:.4g}"
        data = "" if value is None else value
        body.append(
            f'<circle class="point" data-step="{step}" data-reward="{data}" cx="{x(step):.1f}" '
            f'cy="{y(value if value is not None else 0):.1f}" r="3" fill="{fill}" stroke="{INK}">'
            f"<title>step {step}: {escape(shown)}</title></circle>"
        )
    body.append(_text(left - 4, top + 8, f"{high:.3g}", anchor="end", size=10))
    body.append(_text(left - 4, top + plot_h, f"{low:.3g}", anchor="end", size=10))
    body.append(_text(left, height - 6, f"step {first}", size=10))
    body.append(_text(left + plot_w, height - 6, f"step {last}", anchor="end", size=10))
    return _svg(width, height, body, title)


@dataclass(frozen=True)
class Mark:
    """One reward on a step's lane: its delay after dispatch, the source's deadline, and its verdict."""

    event_id: str
    source: str
    delay_s: float
    window_s: float
    grace_s: float
    verdict: str  # on_time, late, orphan, duplicate
    value: float


def step_lane(dispatch_s: float, result_s: float | None, status: str | None, marks: Sequence[Mark], scale_s: float,
              width: int = 560) -> Markup:  # fmt: skip
    """One step: the tool call as a bar from dispatch to result, each reward as a dot at its arrival, the window
    of its source as a tick and the grace as a band; late rewards red, orphans hollow, duplicates grey."""
    height, left = 26, 6
    plot_w = width - 2 * left
    scale = max(scale_s, 1e-3)

    def x(offset: float) -> float:
        return left + max(0.0, min(1.0, offset / scale)) * plot_w

    body = [f'<line x1="{left}" x2="{left + plot_w}" y1="13" y2="13" stroke="#eceff1"/>']
    body.append(f'<circle class="dispatch" cx="{x(0):.1f}" cy="13" r="4" fill="{INK}"><title>dispatch</title></circle>')
    if result_s is not None:
        color = ON_TIME if status == "OK" else LATE
        body.append(
            f'<rect class="tool" x="{x(0):.1f}" y="9" width="{max(1.0, x(result_s) - x(0)):.1f}" height="8" '
            f'fill="{color}" opacity="0.5"><title>tool {escape(status or "")} after '
            f"{escape(seconds(result_s))}</title></rect>"
        )
    for m in marks:
        if m.window_s + m.grace_s <= scale:
            band = max(1.0, x(m.window_s + m.grace_s) - x(m.window_s))
            body.append(
                f'<rect class="grace" x="{x(m.window_s):.1f}" y="4" width="{band:.1f}" '
                f'height="18" fill="{GRACE}" opacity="0.25"><title>{escape(m.source)} grace</title></rect>'
            )
            body.append(
                f'<line class="window" x1="{x(m.window_s):.1f}" x2="{x(m.window_s):.1f}" y1="3" y2="23" '
                f'stroke="{MUTED}" stroke-dasharray="2 2"><title>{escape(m.source)} window</title></line>'
            )
    for m in marks:
        color = {"on_time": ON_TIME, "late": LATE, "orphan": LATE, "duplicate": MUTED}[m.verdict]
        fill = "white" if m.verdict == "orphan" else color
        body.append(
            f'<circle class="reward {m.verdict}" data-event-id="{escape(m.event_id)}" data-verdict="{m.verdict}" '
            f'cx="{x(m.delay_s):.1f}" cy="13" r="5" fill="{fill}" stroke="{color}" stroke-width="2">'
            f"<title>{escape(m.source)} = {m.value:.4g}, {escape(m.verdict.replace('_', ' '))}, "
            f"{escape(seconds(m.delay_s))} after dispatch</title></circle>"
        )
    return _svg(width, height, body, "step timeline")


def state_graph(nodes: Sequence[tuple[str, str]], edges: Sequence[tuple[str, str, str]], limit: int = 80) -> Markup:
    """Nodes (id, type) on a circle, edges as lines; beyond `limit` nodes it says so instead of drawing a hairball."""
    size = 460
    center, radius = size / 2, size / 2 - 60
    body: list[str] = []
    if not nodes:
        body.append(_text(center, center, "empty state", anchor="middle", color=MUTED))
        return _svg(size, size, body, "state graph")
    if len(nodes) > limit:
        body.append(_text(center, center, f"{len(nodes)} nodes: see the tables", anchor="middle", color=MUTED))
        return _svg(size, size, body, "state graph")
    types = sorted({t for _, t in nodes})
    palette = ["#1565c0", "#6a1b9a", "#00838f", "#ef6c00", "#2e7d32", "#ad1457", "#4e342e", "#37474f"]
    at: dict[str, tuple[float, float]] = {}
    for i, (node_id, _) in enumerate(nodes):
        angle = 2 * math.pi * i / len(nodes) - math.pi / 2
        at[node_id] = (center + radius * math.cos(angle), center + radius * math.sin(angle))
    for src, dst, kind in edges:
        if src in at and dst in at:
            (x1, y1), (x2, y2) = at[src], at[dst]
            body.append(
                f'<line class="edge" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{MUTED}" '
                f'marker-end="url(#arrow)"><title>{escape(src)} {escape(kind)} {escape(dst)}</title></line>'
            )
    for node_id, node_type in nodes:
        x, y = at[node_id]
        color = palette[types.index(node_type) % len(palette)]
        body.append(
            f'<circle class="node" data-node-id="{escape(node_id)}" cx="{x:.1f}" cy="{y:.1f}" r="7" fill="{color}">'
            f"<title>{escape(node_id)} ({escape(node_type)})</title></circle>"
        )
        if len(nodes) <= 30:
            body.append(_text(x, y - 10, node_id[:24], anchor="middle", size=9))
    arrow = (
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="16" refY="5" markerWidth="6" markerHeight="6" '
        f'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{MUTED}"/></marker></defs>'
    )
    return _svg(size, size, [arrow, *body], "state graph")
