"""Cut the layer list into consecutive stages.

Default: balance estimated cost, with the embedding on the first stage and the final
norm and output head on the last counted (they are not free: the head's matmul over the
vocabulary costs about ``vocab / (12 x hidden)`` of a layer, Narayanan et al.'s
accounting of 24·h² FLOPs per token per layer against 2·h·V for the logits). Explicit
split points (the first layer of every stage after the first) are taken as given.
Every layer lands on exactly one stage; no stage is empty.

One definition for the pipeline axis (paraxis-pp-schedules cuts the model with it) and
the planner (which counts each stage's layers with it), so a plan and a run agree on
what a stage holds, and which rank holds it (:func:`stage_of`).
"""

from __future__ import annotations

import itertools

__all__ = ["PLACEMENTS", "balanced_split", "head_cost", "ranges_from_points", "stage_of",
           "stage_ranges"]

PLACEMENTS = ("looped", "v")


def stage_of(rank: int, chunk: int, ranks: int, placement: str = "looped") -> int:
    """The global stage that chunk ``chunk`` of pipeline rank ``rank`` runs. ``looped``:
    ``chunk·p + rank`` (Megatron's interleaved placement; one chunk is the plain
    pipeline). ``v``: odd chunks fold back up the ranks, ``(chunk+1)·p - 1 - rank``, so
    rank ``r`` of a two-chunk V holds stages ``r`` and ``2p-1-r`` (ZB-V, DualPipeV)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown stage placement {placement!r}; known: {PLACEMENTS}")
    if placement == "v" and chunk % 2:
        return (chunk + 1) * ranks - 1 - rank
    return chunk * ranks + rank


def ranges_from_points(num_layers: int, points: list[int]) -> list[tuple[int, int]]:
    bounds = [0, *points, num_layers]
    ranges = list(itertools.pairwise(bounds))
    if any(b <= a for a, b in ranges):
        raise ValueError(f"split points {points} leave a stage without layers "
                         f"(of {num_layers})")
    return ranges


def head_cost(hidden: int, vocab: int) -> float:
    """The output head's cost in layers: 2·h·V against a layer's 24·h² FLOPs per token."""
    return vocab / (12 * hidden) if hidden else 0.0


def stage_ranges(num_layers: int, stages: int, *, hidden: int, vocab: int,
                 points: list[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's layers as a (first, end) range: ``points`` as given, else balanced
    with the embedding (a tenth of the head) on the first stage and the head on the
    last."""
    if points:
        return ranges_from_points(num_layers, points)
    head = head_cost(hidden, vocab)
    return balanced_split(num_layers, stages, first_extra=0.1 * head, last_extra=head)


def balanced_split(num_layers: int, stages: int, *, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Consecutive ranges minimizing the costliest stage (layers cost 1; the first and
    last stages carry ``first_extra`` / ``last_extra`` more)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} non-empty stages")

    def cost(s: int, a: int, b: int) -> float:
        return (b - a) + (first_extra if s == 0 else 0.0) + (
            last_extra if s == stages - 1 else 0.0)

    # best[s][i]: minimal max-cost for stages s.. given layers i.. remain.
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(stages + 1)]
    best[stages][num_layers] = 0.0
    for s in range(stages - 1, -1, -1):
        for i in range(num_layers):
            for j in range(i + 1, num_layers - (stages - s - 1) + 1):
                value = max(cost(s, i, j), best[s + 1][j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, i = [], 0
    for s in range(stages):
        j = cut[s][i]
        ranges.append((i, j))
        i = j
    return ranges
