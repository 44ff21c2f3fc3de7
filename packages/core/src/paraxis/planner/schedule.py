"""Which layers a pipeline rank holds, how many microbatches' activations it keeps alive,
and the pipeline bubble.

* Stages: layers cut into ``p x v`` consecutive chunks by the pipeline axis' split
  (:mod:`paraxis.parallel.split`); global stage ``k`` lives on rank ``k % p``
  (Megatron's interleaved placement), or in a V for ZB-V and DualPipeV (rank ``r``:
  stages ``r`` and ``2p-1-r``, so rank 0 holds the embedding and the head).
* Alive activations on rank ``r`` (in chunk-microbatch units): GPipe ``m`` per chunk
  (Huang et al., arXiv:1811.06965); 1F1B ``min(p - r, m)`` (Narayanan et al.,
  arXiv:2104.04473: the first stage holds ``p``); ZB-H1 the same (Qi et al.,
  arXiv:2401.10241 keep 1F1B's memory limit); interleaved 1F1B the warm-up forwards plus
  one, ``2(p - r - 1) + (v - 1)p + 1`` chunks of ``L/(pv)`` layers: on the first rank
  ``L(1 + (p-1)/(pv))`` layers' worth, as Korthikanti et al. (arXiv:2205.05198, section
  4.2.3) state; ZB-V ``min(2p, m + r + 1)`` chunks of half a stage (1F1B's memory, Qi et
  al. section 6) and DualPipeV ``2p + 1`` (DeepSeek-V3's PP+1 with PP = 2p stages), as
  paraxis_pp's checker counts them. Without a pipeline, microbatches run one after
  another: one alive.
* Bubble (idle share of the step): the closed form of
  :func:`paraxis.parallel.bubble.closed_form_bubble`; when an installed plugin simulates
  the schedule (paraxis-pp-schedules, through ``paraxis_pipeline_bubble``) and it is
  small enough, the dry run replaces it (core does not require one).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from paraxis.config.parallel import V_SCHEDULES
from paraxis.parallel import bubble as theory
from paraxis.parallel.split import stage_of, stage_ranges

__all__ = ["Bubble", "alive_units", "bubble", "closed_form_bubble", "holds_ends",
           "last_stage_alive", "layout_chunks", "rank_chunks"]

SIMULATE_MAX_ACTIONS = 3_000  # beyond this, the closed form (the search never simulates)


def rank_chunks(num_layers: int, p: int, v: int = 1, *, hidden: int = 0, vocab: int = 0,
                points: list[int] | None = None, placement: str = "looped",
                ) -> list[list[tuple[int, int]]]:
    """Per pipeline rank, its chunks as (first layer, layer count), in chunk order: the
    pipeline axis's own split (:func:`paraxis.parallel.split.stage_ranges`, balanced with
    the head's cost from ``hidden`` and ``vocab``, or the given split ``points``) and its
    own placement (:func:`paraxis.parallel.split.stage_of`)."""
    cut = _rank_chunks(num_layers, p, v, hidden, vocab, tuple(points) if points else None,
                       placement)
    return [list(chunks) for chunks in cut]


@functools.lru_cache(maxsize=4096)
def _rank_chunks(num_layers: int, p: int, v: int, hidden: int, vocab: int,
                 points: tuple[int, ...] | None, placement: str,
                 ) -> tuple[tuple[tuple[int, int], ...], ...]:
    # Cached: the search asks for the same cut for every option set and every rank, and
    # the balanced split costs tens of milliseconds for 80 layers over 64 chunks.
    ranges = stage_ranges(num_layers, p * v, hidden=hidden, vocab=vocab,
                          points=list(points) if points else None)
    held = [[ranges[stage_of(r, c, p, placement)] for c in range(v)] for r in range(p)]
    return tuple(tuple((a, b - a) for a, b in row) for row in held)


def holds_ends(schedule: str, p: int, rank: int) -> tuple[bool, bool]:
    """(first stage, last stage) on pipeline rank ``rank``: in a V both on rank 0."""
    if schedule in V_SCHEDULES:
        return rank == 0, rank == 0
    return rank == 0, rank == p - 1


def last_stage_alive(schedule: str, p: int, m: int) -> int:
    """Microbatches whose head activations (logits) the last stage holds at once: a V's
    last stage runs each microbatch's forward and backward back to back (one), as
    1F1B's last rank does."""
    return 1 if schedule in V_SCHEDULES else alive_units(schedule, p, m, 1, p - 1)


def layout_chunks(counts: Any, layout: Any) -> list[list[tuple[int, int]]]:
    """:func:`rank_chunks` of ``counts`` (a ModelCounts) under ``layout``."""
    sched = layout.schedule
    return rank_chunks(counts.num_layers, layout.parallelism.pipeline, sched.virtual_stages,
                       hidden=counts.hidden_size, vocab=counts.vocab_size,
                       points=sched.pipeline_split,
                       placement="v" if sched.pipeline_schedule in V_SCHEDULES else "looped")


def alive_units(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Chunk-microbatches whose activations rank ``rank`` holds at its peak."""
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved_1f1b":
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    if schedule == "zbv":
        return min(2 * p, m + rank + 1)
    if schedule == "dualpipev":
        return 2 * p + 1
    return min(p - rank, m)  # 1f1b, zero_bubble_h1


@dataclass(frozen=True)
class Bubble:
    fraction: float  # idle share of ranks x step time
    source: str  # "closed form" or "paraxis_pp simulation"
    formula: str


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1) -> Bubble:
    fraction, formula = theory.closed_form_bubble(schedule, p, m, v)
    return Bubble(fraction, "closed form", formula)


def bubble(schedule: str, p: int, m: int, v: int = 1, *, simulate: bool = True,
           plugin_manager: Any = None) -> Bubble:
    """The closed form, or an installed plugin's dry run of the schedule (unit forward,
    backward input-gradient and weight-gradient costs) when one answers."""
    closed = closed_form_bubble(schedule, p, m, v)
    if not simulate or p == 1 or 3 * p * m * v > SIMULATE_MAX_ACTIONS:
        return closed
    if plugin_manager is None:
        from paraxis.engine.plugins import make_plugin_manager

        plugin_manager = make_plugin_manager()
    fraction = plugin_manager.hook.paraxis_pipeline_bubble(
        schedule=schedule, stages=p, microbatches=m, virtual_stages=v)
    if fraction is None:
        return closed
    return Bubble(fraction, "simulated by an installed plugin (paraxis-pp-schedules)",
                  closed.formula)
