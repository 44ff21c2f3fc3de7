"""The closed-form pipeline bubble of each schedule, in one place: the planner plans
with it and the pipeline executor reports its measured bubble against it.

Idle share of ranks x step time with equal stages: ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
``(p-1)/(v·m+p-1)`` interleaved (Narayanan et al., arXiv:2104.04473, section 2.2).

ZB-H1 (Qi et al., arXiv:2401.10241) splits the backward into the input gradient B and the
weight gradient W. paraxis-pp-schedules orders it greedily under 1F1B's activation limit
(rank r keeps at most p - r microbatches and p - r - 1 deferred W's), so the last stage
runs F, B, W back to back and each rank idles ``(p-1)(F+B)`` against 1F1B's
``(p-1)(F+B+W)``: ``2(p-1)/(3m+2(p-1))`` with equal F, B and W costs. The paper's ZB-H1
reaches ``(p-1)(F+B-W)`` by deferring more W's than that limit holds; this is the bubble
of the schedule paraxis runs, and its simulator reproduces it exactly.
"""

from __future__ import annotations

from typing import NamedTuple

from paraxis.config.parallel import PIPELINE_SCHEDULES

__all__ = ["ClosedFormBubble", "closed_form_bubble"]


class ClosedFormBubble(NamedTuple):
    fraction: float
    formula: str


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1) -> ClosedFormBubble:
    """The bubble of ``schedule`` on ``p`` stages, ``m`` microbatches, ``v`` chunks."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {PIPELINE_SCHEDULES}")
    if p == 1:
        return ClosedFormBubble(0.0, "no pipeline")
    if schedule == "interleaved_1f1b":
        return ClosedFormBubble((p - 1) / (v * m + p - 1), "(p-1)/(v·m+p-1)")
    if schedule == "zero_bubble_h1":
        return ClosedFormBubble(2 * (p - 1) / (3 * m + 2 * (p - 1)), "2(p-1)/(3m+2(p-1))")
    return ClosedFormBubble((p - 1) / (m + p - 1), "(p-1)/(m+p-1)")
