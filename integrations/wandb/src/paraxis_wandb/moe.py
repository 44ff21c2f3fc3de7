"""Mixture-of-experts routing as W&B panels: the per-layer, per-expert arrays as a table
and the layer x expert load as a heatmap picture.

paraxis-moe-ep reports them among the step's metrics under ``moe/<block>/<kind>/<expert>``
and ``moe/<block>/prob_hist/<bin>`` (routing probabilities, equal bins over [0, 1]), the
grammar of :mod:`paraxis.parallel.metric_names`. This module only reads those names; it
needs no MoE package.
"""

from __future__ import annotations

import html
from typing import Any

from paraxis.parallel.metric_names import MOE_ARRAY_KINDS, MoeArrays, moe_arrays

__all__ = ["KINDS", "heatmap_svg", "split_moe_arrays"]

# The per-expert columns of the table (the histogram bins are not experts).
KINDS = tuple(k for k in MOE_ARRAY_KINDS if k != "prob_hist")

Arrays = MoeArrays


def split_moe_arrays(metrics: dict[str, float]) -> tuple[dict[str, float], Arrays]:
    """(the scalar metrics, {block: {kind: values by expert (or bin)}}): core's
    :func:`paraxis.parallel.metric_names.moe_arrays`, which every sink reads alike."""
    return moe_arrays(metrics)


def table_rows(arrays: Arrays) -> tuple[list[str], list[list[Any]]]:
    """Columns and one row per (block, expert)."""
    columns = ["layer", "expert", *KINDS]
    rows = []
    for block, kinds in arrays.items():
        for e in range(len(kinds.get("assigned", []))):
            rows.append([block, e, *(kinds.get(k, [0.0] * (e + 1))[e] for k in KINDS)])
    return columns, rows


def heatmap_svg(arrays: Arrays, *, kind: str = "assigned", title: str = "") -> str:
    """Layers (rows) x experts (columns), each cell shaded by its share of the layer's
    mean load (white: no tokens; mid blue: the mean; dark: 2x the mean or more), with
    the count and the ratio written in it."""
    blocks = [b for b in arrays if kind in arrays[b]]
    experts = max((len(arrays[b][kind]) for b in blocks), default=0)
    cell_w, cell_h, left, top = 64, 28, 170, 40
    width, height = left + cell_w * experts + 10, top + cell_h * len(blocks) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="monospace" font-size="11">',
           f'<text x="4" y="16" font-size="13">{html.escape(title or kind)}: layer x expert '
           '(shade = load / layer mean)</text>']
    for e in range(experts):
        out.append(f'<text x="{left + e * cell_w + cell_w // 2}" y="{top - 6}" '
                   f'text-anchor="middle">e{e}</text>')
    for row, block in enumerate(blocks):
        values = arrays[block][kind]
        mean = sum(values) / len(values) if values else 0.0
        y = top + row * cell_h
        out.append(f'<text x="{left - 6}" y="{y + cell_h // 2 + 4}" text-anchor="end">'
                   f'{html.escape(block)}</text>')
        for e, v in enumerate(values):
            ratio = v / mean if mean else 0.0
            shade = min(ratio / 2.0, 1.0)
            fill = f"rgb({int(255 - 225 * shade)},{int(255 - 165 * shade)},{int(255 - 55 * shade)})"
            ink = "white" if shade > 0.6 else "black"
            x = left + e * cell_w
            out.append(f'<rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" '
                       f'fill="{fill}"><title>{html.escape(block)} e{e}: {v:g} '
                       f'({ratio:.2f}x mean)</title></rect>')
            out.append(f'<text x="{x + cell_w // 2}" y="{y + cell_h // 2 + 4}" fill="{ink}" '
                       f'text-anchor="middle">{v:,.0f} {ratio:.2f}x</text>')
    out.append(f'<text x="4" y="{height - 8}">max/mean over all cells: '
               f'{_imbalance(arrays, blocks, kind):.2f}</text></svg>')
    return "\n".join(out)


def _imbalance(arrays: Arrays, blocks: list[str], kind: str) -> float:
    worst = 0.0
    for b in blocks:
        values = arrays[b][kind]
        mean = sum(values) / len(values) if values else 0.0
        if mean:
            worst = max(worst, max(values) / mean)
    return worst
