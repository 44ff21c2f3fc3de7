"""A small hand-written SVG of a plan: memory per pipeline rank as stacked bars (with the
device's capacity as a line) and communication per axis as bars labelled with the link.
No plotting dependency; the document is a string."""

from __future__ import annotations

from html import escape

from paraxis.planner.evaluate import Plan
from paraxis.planner.memory import TERMS
from paraxis.planner.units import fmt_bytes

__all__ = ["plan_svg", "svg_rect", "svg_text"]

COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#e15759",
          "activations": "#76b7b2", "buffers": "#bab0ac"}
WIDTH, LEFT, BAR_W, ROW = 720, 110, 520, 22


def svg_text(x: float, y: float, s: str, anchor: str = "start", size: int = 12) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-family="sans-serif">{escape(s)}</text>')


def svg_rect(x: float, y: float, w: float, h: float, fill: str, title: str) -> str:
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" '
            f'fill="{fill}"><title>{escape(title)}</title></rect>')


def _memory(plan: Plan, y: float) -> tuple[list[str], float]:
    cap = plan.hardware.device_memory
    scale_max = max([m.total for m in plan.memory] + ([cap] if cap else []))
    out = [svg_text(10, y, f"Memory per rank by pipeline stage ({plan.degrees_text()})",
                 size=14)]
    y += 12
    x = LEFT
    for i, term in enumerate(TERMS):  # legend
        out.append(svg_rect(x + i * 110, y, 10, 10, COLORS[term], term))
        out.append(svg_text(x + i * 110 + 14, y + 9, term, size=11))
    y += 20
    top = y
    for m in plan.memory:
        out.append(svg_text(LEFT - 8, y + 15, f"stage {m.stage}", anchor="end"))
        x = LEFT
        for term in TERMS:
            w = getattr(m, term) / scale_max * BAR_W
            out.append(svg_rect(x, y, w, ROW - 4, COLORS[term],
                             f"stage {m.stage} {term}: {fmt_bytes(getattr(m, term))}"))
            x += w
        out.append(svg_text(x + 4, y + 14, fmt_bytes(m.total), size=11))
        y += ROW
    if cap:
        cx = LEFT + cap / scale_max * BAR_W
        out.append(f'<line x1="{cx:.1f}" y1="{top - 4:.1f}" x2="{cx:.1f}" y2="{y:.1f}" '
                   'stroke="#000" stroke-dasharray="4 3"/>')
        out.append(svg_text(cx, y + 12, f"device {fmt_bytes(cap)}", anchor="middle", size=11))
        y += 14
    return out, y + 16


def _comm(plan: Plan, y: float) -> tuple[list[str], float]:
    out = [svg_text(10, y, f"Communication per step per rank ({plan.work.element_size}-byte "
                 "elements)", size=14)]
    y += 10
    if not plan.comm:
        return [*out, svg_text(LEFT, y + 14, "none: one rank")], y + 30
    most = max(a.bytes for a in plan.comm) or 1.0
    for a in plan.comm:
        fill = "#59a14f" if a.link == "intra" else "#b07aa1"
        w = a.bytes / most * BAR_W * 0.8
        out.append(svg_text(LEFT - 8, y + 15, a.axis, anchor="end"))
        out.append(svg_rect(LEFT, y, w, ROW - 4, fill, f"{a.axis} {a.collective}"))
        out.append(svg_text(LEFT + w + 4, y + 14,
                         f"{fmt_bytes(a.bytes)} {a.collective}, {a.link}", size=11))
        y += ROW
    return out, y + 10


def plan_svg(plan: Plan) -> str:
    """The SVG document for ``plan``."""
    body, y = _memory(plan, 24)
    comm, y = _comm(plan, y + 10)
    height = int(y + 10)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}">\n'
            f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>\n'
            + "\n".join(body + comm) + "\n</svg>\n")
