"""Which layers a pipeline rank holds, how many microbatches' activations it keeps alive,
and the pipeline bubble.

* Stages: layers cut into ``p x v`` consecutive chunks as evenly as possible (the first
  chunks take the remainder, so stage 0, already the most loaded, is never lighter);
  global stage ``k`` lives on rank ``k % p`` (Megatron's interleaved placement).
  paraxis_pp balances by cost instead and may move a layer.
* Alive activations on rank ``r`` (in chunk-microbatch units): GPipe ``m`` per chunk
  (Huang et al., arXiv:1811.06965); 1F1B ``min(p - r, m)`` (Narayanan et al.,
  arXiv:2104.04473: the first stage holds ``p``); ZB-H1 the same (Qi et al.,
  arXiv:2401.10241 keep 1F1B's memory limit); interleaved 1F1B the warm-up forwards plus
  one, ``2(p - r - 1) + (v - 1)p + 1`` chunks of ``L/(pv)`` layers: on the first rank
  ``L(1 + (p-1)/(pv))`` layers' worth, as Korthikanti et al. (arXiv:2205.05198, section
  4.2.3) state. Without a pipeline, microbatches run one after another: one alive.
* Bubble (idle share of the step): ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
  ``(p-1)/(v·m+p-1)`` interleaved (Narayanan et al., section 2.2), ``(p-1)/(3m+p-1)``
  for ZB-H1 with equal F, B and W costs (Qi et al.: its bubble is ``(p-1)(F+B-W)``
  against 1F1B's ``(p-1)(F+B+W)``). When paraxis_pp is installed and the schedule is
  small enough, its simulator replaces the closed form (core does not require it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Bubble", "alive_units", "bubble", "closed_form_bubble", "rank_chunks"]

SIMULATE_MAX_ACTIONS = 3_000  # beyond this, the closed form (the search never simulates)


def rank_chunks(num_layers: int, p: int, v: int = 1) -> list[list[tuple[int, int]]]:
    """Per pipeline rank, its chunks as (first layer, layer count), in chunk order."""
    chunks = p * v
    base, extra = divmod(num_layers, chunks)
    sizes = [base + (1 if k < extra else 0) for k in range(chunks)]
    starts = [sum(sizes[:k]) for k in range(chunks)]
    return [[(starts[k], sizes[k]) for k in range(r, chunks, p)] for r in range(p)]


def alive_units(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Chunk-microbatches whose activations rank ``rank`` holds at its peak."""
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved_1f1b":
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    return min(p - rank, m)  # 1f1b, zero_bubble_h1


@dataclass(frozen=True)
class Bubble:
    fraction: float  # idle share of ranks x step time
    source: str  # "closed form" or "paraxis_pp simulation"
    formula: str


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1) -> Bubble:
    if p == 1:
        return Bubble(0.0, "closed form", "no pipeline")
    if schedule == "interleaved_1f1b":
        return Bubble((p - 1) / (v * m + p - 1), "closed form", "(p-1)/(v·m+p-1)")
    if schedule == "zero_bubble_h1":
        return Bubble((p - 1) / (3 * m + p - 1), "closed form", "(p-1)/(3m+p-1)")
    return Bubble((p - 1) / (m + p - 1), "closed form", "(p-1)/(m+p-1)")


def bubble(schedule: str, p: int, m: int, v: int = 1, *, simulate: bool = True) -> Bubble:
    """The closed form, or paraxis_pp's dry run (unit forward, backward input-gradient and
    weight-gradient costs: the backward is twice the forward) when it is installed."""
    closed = closed_form_bubble(schedule, p, m, v)
    if not simulate or p == 1 or 3 * p * m * v > SIMULATE_MAX_ACTIONS:
        return closed
    try:
        from paraxis_pp import build
        from paraxis_pp import simulate as run
    except ImportError:
        return closed
    try:
        timeline = run(build(schedule, p, m, v), f=1.0, b=1.0, w=1.0)
    except ValueError:
        return closed
    return Bubble(timeline.bubble, "paraxis_pp simulation", closed.formula)
