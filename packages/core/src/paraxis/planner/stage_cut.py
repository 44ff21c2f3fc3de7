"""The pipeline stage cut a dry run built, checked without the function that made it.

The planner and the pipeline axis cut the layer list with one function
(:func:`paraxis.parallel.split.stage_ranges`), so a plan and a run agree on what a stage
holds by construction: a wrong cut there would be planned and built alike, and the dry
run's bytes would agree with the plan (issue 32). Here the cut is read from what the
built stages hold, the layer indices of the parameters each stage's modules own
(:func:`held_layers`), and checked against what is derived apart from that function
(:func:`cut_problems`):

* every layer lives on exactly one stage, and the global stages (stage ``k`` on
  pipeline rank ``k mod p``, Megatron's interleaved placement, Narayanan et al.,
  arXiv:2104.04473) hold consecutive layers, in order;
* every rank of a stage holds the same layers, and the layers the plan counts for it;
* with split points given (``schedule.pipeline_split``) the stages start there; else the
  cut is balanced: its costliest stage costs no more than the least any cut can
  (:func:`least_costliest_stage`, by a feasibility argument, not split's dynamic
  program), under the cost split.py documents, written again here: a layer costs 1, the
  output head ``V / (12 h)`` layers on the last stage (2·h·V FLOPs per token for the
  logits against a layer's 24·h²), a tenth of that for the embedding on the first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import nn

__all__ = ["cut_problems", "held_layers", "least_costliest_stage", "stage_costs"]

# Rounding slack on the float costs (a cost is an integer plus one of two extras).
_EPS = 1e-9

Chunks = tuple[tuple[int, ...], ...]  # per model chunk of a rank, its layer indices


def held_layers(chunks: Sequence[nn.Module], list_name: str) -> Chunks:
    """For each model chunk a rank holds, the indices of the layers (in the whole model's
    layer list ``list_name``) whose parameters the chunk owns, sorted."""
    prefix = list_name + "."
    out = []
    for chunk in chunks:
        found = {int(name[len(prefix):].split(".", 1)[0])
                 for name, _ in chunk.named_parameters() if name.startswith(prefix)}
        out.append(tuple(sorted(found)))
    return tuple(out)


def _extras(stages: int, hidden: int, vocab: int) -> list[float]:
    head = vocab / (12 * hidden) if hidden else 0.0
    extras = [0.0] * stages
    extras[0] += 0.1 * head
    extras[-1] += head
    return extras


def stage_costs(sizes: Sequence[int], hidden: int, vocab: int) -> list[float]:
    """The cost of each global stage holding ``sizes`` layers (see the module docstring)."""
    return [n + e for n, e in zip(sizes, _extras(len(sizes), hidden, vocab), strict=True)]


def least_costliest_stage(num_layers: int, stages: int, hidden: int, vocab: int) -> float:
    """The least cost the costliest of ``stages`` non-empty consecutive stages can have.

    Under a bound B stage s can take at most ``floor(B - extra_s)`` layers; counts
    ``1 <= n_s <= cap_s`` summing to ``num_layers`` exist exactly when every cap is at
    least 1 and the caps add up to ``num_layers`` or more. The least B is one of the
    values ``n + extra_s``; the first feasible one, in increasing order, is it."""
    extras = _extras(stages, hidden, vocab)
    for bound in sorted({n + e for e in set(extras) for n in range(1, num_layers + 1)}):
        caps = [math.floor(bound - e + _EPS) for e in extras]
        if min(caps) >= 1 and sum(caps) >= num_layers:
            return bound
    raise ValueError(f"cannot cut {num_layers} layers into {stages} non-empty stages")


def _span(layers: tuple[int, ...]) -> str:
    if not layers:
        return "none"
    return f"{layers[0]}-{layers[-1]} ({len(layers)})"


def cut_problems(measured: Mapping[int, Sequence[Chunks]],
                 planned: Mapping[int, list[tuple[int, int]]], *, num_layers: int,
                 hidden: int, vocab: int,
                 points: Sequence[int] | None = None) -> list[str]:
    """What is wrong with the cut the dry run built. ``measured``: per pipeline rank, the
    :func:`held_layers` of each of its measured ranks; ``planned``: per pipeline rank,
    the plan's chunks as (first layer, count)."""
    problems = []
    p = len(planned)
    held: dict[int, Chunks] = {}
    for stage, per_rank in sorted(measured.items()):
        held[stage] = per_rank[0]
        if any(chunks != per_rank[0] for chunks in per_rank[1:]):
            problems.append(f"pipeline rank {stage}: its ranks hold different layers: "
                            f"{[[_span(c) for c in chunks] for chunks in per_rank]}")
        want = tuple(tuple(range(a, a + n)) for a, n in planned[stage])
        if per_rank[0] != want:
            problems.append(
                f"pipeline rank {stage} holds layers {[_span(c) for c in per_rank[0]]} "
                f"(counted from its modules); the plan gives it {[_span(c) for c in want]}")
    if len(held) != p:
        return problems  # not every stage measured: nothing to say about the whole cut
    chunks = len(held[0])
    order = [held[k % p][k // p] for k in range(p * chunks)]  # global stage order
    if [i for stage in order for i in stage] != list(range(num_layers)):
        problems.append(f"the stages do not hold layers 0-{num_layers - 1} once each, in "
                        f"order: {[_span(s) for s in order]}")
        return problems
    starts = [s[0] for s in order[1:]]
    if points:
        if starts != list(points):
            problems.append(f"schedule.pipeline_split asks for stages starting at "
                            f"{list(points)}; the built stages start at {starts}")
        return problems
    costs = stage_costs([len(s) for s in order], hidden, vocab)
    least = least_costliest_stage(num_layers, len(order), hidden, vocab)
    if max(costs) > least + _EPS:
        worst = costs.index(max(costs))
        problems.append(f"the cut is not balanced: stage {worst} costs {max(costs):.2f} "
                        f"layers' worth (sizes {[len(s) for s in order]}), a cut exists "
                        f"whose costliest stage costs {least:.2f}")
    return problems
