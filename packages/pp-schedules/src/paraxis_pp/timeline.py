"""Pictures of a timeline: ranks by time, F / B / I / W cells, idle time left blank
(SVG), a text table like the seed's, and each rank's measured times in words."""

from __future__ import annotations

from html import escape

from paraxis_pp.schedules import Schedule
from paraxis_pp.simulate import Timeline

__all__ = ["render_svg", "render_text", "stage_times"]

COLORS = {"F": "#4C78A8", "B": "#59A14F", "I": "#8CD17D", "W": "#F28E2B"}
NAMES = (("F", "forward"), ("B", "whole backward"), ("I", "input grad"),
         ("W", "weight grad"))


def render_svg(t: Timeline, *, width: int = 1000, row: int = 28) -> str:
    t0 = min((s for r in t.entries for _, s, _ in r), default=0.0)
    span = t.makespan or 1.0
    left, top = 70, 30
    scale = (width - left - 10) / span
    height = top + row * t.ranks + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="monospace" font-size="11">',
           f'<text x="{left}" y="18">{escape(t.name)}  bubble {t.bubble:.1%}  '
           f'makespan {t.makespan:.3g}</text>']
    for r, entries in enumerate(t.entries):
        y = top + r * row
        out.append(f'<text x="4" y="{y + row * 0.65:.1f}">{_row_name(t)} {r}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{span * scale:.1f}" height="{row - 4}" '
                   'fill="#EEEEEE"/>')  # idle shows through
        for a, s, e in entries:
            x, w = left + (s - t0) * scale, max((e - s) * scale, 1.0)
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 4}" '
                       f'fill="{COLORS[a.kind]}" stroke="white"><title>{a}</title></rect>')
            if w > 18:
                out.append(f'<text x="{x + 3:.1f}" y="{y + row * 0.6:.1f}" fill="white">'
                           f'{escape(str(a))}</text>')
    legend = "  ".join(f"{k}: {name}" for k, name in NAMES)
    out.append(f'<text x="{left}" y="{height - 8}">{legend}; grey: idle</text></svg>')
    return "\n".join(out)


def render_text(t: Timeline, *, unit: float | None = None) -> str:
    """One row per rank (a stage when each holds one), one column per time unit; '.' is
    idle; a cell names its action (``c1``: the rank's second chunk)."""
    unit = unit or min((e - s for r in t.entries for _, s, e in r), default=1.0)
    t0 = min((s for r in t.entries for _, s, _ in r), default=0.0)
    cols = round(t.makespan / unit)
    width = max((len(str(a)) for r in t.entries for a, _, _ in r), default=3)
    lines = []
    for r, entries in enumerate(t.entries):
        cells = ["."] * cols
        for a, s, e in entries:
            for c in range(round((s - t0) / unit), round((e - t0) / unit)):
                cells[min(c, cols - 1)] = str(a)
        lines.append(f"{_row_name(t)} {r}: " + " ".join(c.ljust(width) for c in cells))
    return "\n".join(lines)


def _row_name(t: Timeline) -> str:
    """"stage" when every rank holds one stage, else "rank"."""
    return "rank" if any(a.chunk for row in t.entries for a, _, _ in row) else "stage"


def stage_times(t: Timeline, schedule: Schedule) -> list[str]:
    """Each rank's time in forward, backward and idle, naming only the passes that ran
    apart: ``B+W`` is a whole backward (a B action: the runner records a W that ran the
    whole backward, as on a first stage without deferred weight GEMMs, as the B it
    was), ``I`` the input-gradient and ``W`` the weight-gradient pass of a split
    backward. A column never stands for a pass that was not measured (issue 32: stage 0
    printed "B 0 ms"). ``p2p`` is the part of the idle time a measured rank spent
    handing messages to the transport (posting receives, sending)."""
    out = []
    for r, row in enumerate(t.entries):
        sums: dict[str, float] = {}
        for a, s, e in row:
            label = "B+W" if a.kind == "B" else a.kind
            sums[label] = sums.get(label, 0.0) + e - s
        cols = [f"{k} {sums[k] * 1e3:.3g} ms" for k in ("F", "I", "W", "B+W") if k in sums]
        cols.append(f"idle {(t.makespan - t.busy(r)) * 1e3:.3g} ms")
        if t.transfers and t.transfers[r]:  # of the idle, handing messages over
            cols.append(f"p2p {t.handing(r) * 1e3:.3g} ms")
        held = [schedule.stage(r, c) for c in range(schedule.chunks)]
        name = f"stage {r}" if len(held) == 1 else f"rank {r} (stages {', '.join(map(str, held))})"
        out.append(f"{name}: {', '.join(cols)}")
    return out
