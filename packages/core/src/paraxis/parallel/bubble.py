"""The closed-form pipeline bubble of each schedule, in one place: the planner plans
with it and the pipeline executor reports its measured bubble against it.

Idle share of ranks x step time with equal stages: ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
``(p-1)/(v·m+p-1)`` interleaved (Narayanan et al., arXiv:2104.04473, section 2.2).

ZB-H1 (Qi et al., arXiv:2401.10241) splits the backward into the input gradient (the
paper's B, paraxis's I) and the weight gradient W. paraxis-pp-schedules orders it
greedily under 1F1B's activation limit (rank r keeps at most p - r microbatches and
p - r - 1 deferred W's), so the last stage runs F, I, W back to back and each rank idles
``(p-1)(F+I)`` against 1F1B's ``(p-1)(F+I+W)``: ``2(p-1)/(3m+2(p-1))`` with equal F, I
and W costs. The paper's ZB-H1 reaches ``(p-1)(F+B-W)`` by deferring more W's than that
limit holds; this is the bubble of the schedule paraxis runs, and its simulator
reproduces it exactly.

The V schedules hold two chunks (half a stage each) per rank in a V; with equal costs
``f`` of a chunk's forward, input gradient and weight gradient a rank works ``6m·f`` a
step. ZB-V (Qi et al., section 6) idles ``max(p-1, 2(2p-1-m))·f`` a rank: ``p-1``
forwards' worth while the first microbatch goes down the V and the last one's
gradients come back (1F1B idles ``6(p-1)·f`` on the same model, ZB-H1 ``4(p-1)·f``),
more when fewer than about ``3p/2`` microbatches cannot fill the warm-up. DualPipeV
(DeepSeek-V3, arXiv:2412.19437, cut into a V) idles ``(p-1)·f`` for every ``m >= 2p`` it
accepts: DeepSeek's ``(PP/2-1)(F&B+B-3W)`` with ``PP = 2p`` stages and an overlapped
pair costing ``F&B = F+B+W`` (no all-to-all to hide it behind: the pair runs one
after the other). Both are the schedules paraxis runs (torch's orders), and the
simulator reproduces both exactly.
"""

from __future__ import annotations

from typing import NamedTuple

from paraxis.config.parallel import PIPELINE_SCHEDULES

__all__ = ["ClosedFormBubble", "closed_form_bubble"]


class ClosedFormBubble(NamedTuple):
    fraction: float
    formula: str


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1) -> ClosedFormBubble:
    """The bubble of ``schedule`` on ``p`` ranks, ``m`` microbatches, ``v`` chunks."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {PIPELINE_SCHEDULES}")
    if p == 1:
        return ClosedFormBubble(0.0, "no pipeline")
    if schedule == "interleaved_1f1b":
        return ClosedFormBubble((p - 1) / (v * m + p - 1), "(p-1)/(v·m+p-1)")
    if schedule == "zero_bubble_h1":
        return ClosedFormBubble(2 * (p - 1) / (3 * m + 2 * (p - 1)), "2(p-1)/(3m+2(p-1))")
    if schedule == "zbv":
        idle = max(p - 1, 2 * (2 * p - 1 - m))
        return ClosedFormBubble(idle / (6 * m + idle), "i/(6m+i), i = max(p-1, 2(2p-1-m))")
    if schedule == "dualpipev":
        return ClosedFormBubble((p - 1) / (6 * m + p - 1), "(p-1)/(6m+p-1)")
    return ClosedFormBubble((p - 1) / (m + p - 1), "(p-1)/(m+p-1)")
