"""Enumerate every valid grid for a world size, keep those that fit, rank by step time.

For each grid (degrees whose product is the world size, any the user fixed kept), the
options are tried from the simplest system up: ZeRO stage 0 to 3 (2 and 3 only without
a pipeline, as validation rules), recompute none, selective, full, sequence parallelism
off then on. The grid's entry is its fastest fitting option set; on a tie in time
(:mod:`paraxis.planner.reasons`) the simplest wins (the seed's bias toward the smallest
system that fits the constraint). Grids are ranked by step time; grids that tie are
ordered by what else they cost (:func:`~paraxis.planner.reasons.tie_key`). Memory is
checked on every pipeline stage: the most loaded one is not always the first or last.

The seeds' placement order (shared/seeds: "choose tensor parallelism so a layer and its
working set fit inside a fast-link group; add pipeline stages until the model state
fits; place experts within network domains; use remaining devices for data") is
computed too, so the report can say where the ranking departs from it and why.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from paraxis.config.parallel import AXES
from paraxis.planner.evaluate import Plan, evaluate, make_layout, problems
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.memory import layer_activation_bytes, model_state_bytes
from paraxis.planner.model import ModelCounts
from paraxis.planner.reasons import is_tie, tie_key, why_slower

__all__ = ["Ranking", "grids", "rank_plans", "search", "seed_order", "why_slower"]

RECOMPUTE = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grids(world: int, fixed: dict[str, int], *, experts: bool = True,
          ) -> Iterator[dict[str, int]]:
    """Every assignment of degrees to the axes whose product is ``world``."""
    free = [a for a in AXES if a not in fixed and (experts or a != "expert")]
    rest = world
    for d in fixed.values():
        if rest % d:
            return
        rest //= d
    base = {a: 1 for a in AXES} | fixed

    def assign(i: int, left: int, acc: dict[str, int]) -> Iterator[dict[str, int]]:
        if i == len(free) - 1:
            yield acc | {free[i]: left}
            return
        for d in _divisors(left):
            yield from assign(i + 1, left // d, acc | {free[i]: d})

    if not free:
        if rest == 1:
            yield base
        return
    yield from assign(0, rest, base)


def _option_sets(degrees: dict[str, int], fixed: dict[str, Any], max_zero: int = 3,
                 node: int = 8) -> Iterator[dict[str, Any]]:
    zeros = list(range(max_zero + 1))  # every stage beside a pipeline too (issue 36)
    sps = [False, True] if degrees["tensor"] > 1 else [False]
    seen = set()
    for zero, recompute, sp in itertools.product(zeros, RECOMPUTE, sps):
        for shard in _zero_shards(degrees, zero, node):
            opts = {"zero": zero, "activation_checkpointing": recompute,
                    "sequence_parallel": sp, "zero_shard": shard} | fixed
            key = tuple(sorted(opts.items()))
            if key not in seen:
                seen.add(key)
                yield opts


def _zero_shards(degrees: dict[str, int], zero: int, node: int) -> list[int | None]:
    """ZeRO over every data rank (None) and, when the data axis leaves a node, over the
    largest group of data ranks whose shard group (with the expert, context and tensor
    ranks inside it in the mesh) fits one node (HSDP, issue 36): the reduce-scatter and
    gathers then stay on the node's links and only the shards' all-reduce crosses."""
    data = degrees["data"]
    inner = degrees["expert"] * degrees["context"] * degrees["tensor"]
    if not zero or data < 2 or data * inner <= node:
        return [None]
    inside = [n for n in _divisors(data) if 1 < n < data and n * inner <= node
              and node % (n * inner) == 0]
    return [None, *inside[-1:]]


@dataclass(frozen=True)
class Ranking:
    plans: tuple[Plan, ...]  # fitting (or, without a device memory, valid), fastest first
    valid: int  # grids that pass validation with some option set
    grids: int  # grids enumerated
    closest: Plan | None  # the smallest total memory seen, when nothing fits
    seed: Plan | None  # the seeds' placement order's choice, if it fits


def best_for_grid(counts: ModelCounts, degrees: dict[str, int], options: dict[str, Any],
                  work: Workload, hw: Hardware, pm: Any = None, max_zero: int = 3,
                  ) -> tuple[Plan | None, Plan | None, bool]:
    """(fastest fitting plan, smallest plan seen, whether any option set was valid)."""
    best = smallest = None
    valid = False
    for opts in _option_sets(degrees, options, max_zero, hw.gpus_per_node):
        try:
            layout = make_layout(degrees, opts, work)
        except ValueError:
            continue
        if problems(counts, layout, work, plugin_manager=pm):
            continue
        valid = True
        plan = evaluate(counts, layout, work, hw, simulate=False, plugin_manager=pm)
        if smallest is None or plan.worst.total < smallest.worst.total:
            smallest = plan
        if plan.fits is False:
            continue
        if best is None or (plan.step.step_s < best.step.step_s and not is_tie(plan, best)):
            best = plan
    return best, smallest, valid


def search(counts: ModelCounts, work: Workload, hw: Hardware, *, world: int,
           fixed: dict[str, int], options: dict[str, Any], plugin_manager: Any = None,
           ) -> Ranking:
    """Rank every valid grid of ``world`` ranks that fits ``hw.usable_memory``."""
    if plugin_manager is None:  # one for the whole search: each costs an entry-point scan
        from paraxis.engine.plugins import make_plugin_manager

        plugin_manager = make_plugin_manager()
    found: list[Plan] = []
    closest: Plan | None = None
    valid = total = 0
    for degrees in grids(world, fixed, experts=bool(counts.num_experts)):
        total += 1
        best, smallest, ok = best_for_grid(counts, degrees, options, work, hw, plugin_manager)
        valid += ok
        if best is not None:
            found.append(best)
        elif smallest is not None and (closest is None
                                       or smallest.worst.total < closest.worst.total):
            closest = smallest
    found = rank_plans(found)
    seed = seed_order(counts, work, hw, world=world, fixed=fixed, options=options,
                      plugin_manager=plugin_manager)
    return Ranking(tuple(found), valid, total, None if found else closest, seed)


def rank_plans(plans: list[Plan]) -> list[Plan]:
    """By step time; a run of plans each tying the first of the run is ordered by
    :func:`~paraxis.planner.reasons.tie_key`."""
    rest = sorted(plans, key=lambda plan: plan.step.step_s)
    out: list[Plan] = []
    while rest:
        run = [p for p in rest if is_tie(p, rest[0])]
        out += sorted(run, key=tie_key)
        rest = [p for p in rest if not any(p is q for q in run)]
    return out


def _layer_fits(counts: ModelCounts, t: int, work: Workload, hw: Hardware) -> bool:
    """One layer's model state and one microbatch's activations fit a device."""
    usable = hw.usable_memory
    if usable is None:
        return True
    layer = max(counts.layers, key=lambda c: c.total)
    state = sum(model_state_bytes(layer.matrices / t + layer.vectors + layer.experts / t,
                                  zero=0, n_dense=1, precision=work.precision,
                                  optimizer_bytes=work.optimizer_bytes))
    acts = layer_activation_bytes(s=work.seq, b=work.micro_batch, h=counts.hidden_size,
                                  a=counts.num_heads, t=t, element=work.element_size)
    return state + acts <= usable


def seed_order(counts: ModelCounts, work: Workload, hw: Hardware, *, world: int,
               fixed: dict[str, int], options: dict[str, Any], plugin_manager: Any = None,
               ) -> Plan | None:
    """The seeds' procedure: the smallest tensor degree inside a node for which a layer
    fits; then the fewest pipeline stages for which the whole fits, with as many experts
    per node as divide the rest; the remaining ranks data. Pipeline stages, not sharded
    weights, make the state fit here, so ZeRO stops at stage 1 (the optimizer state;
    Megatron's distributed optimizer). Context parallelism is not in the procedure
    (degree 1 unless fixed)."""
    node = min(hw.gpus_per_node, world)
    tensors = [fixed["tensor"]] if "tensor" in fixed else [
        t for t in _divisors(node) if world % t == 0]
    for t in tensors:
        if _layer_fits(counts, t, work, hw) or t == tensors[-1]:
            break
    c = fixed.get("context", 1)
    pipes = [fixed["pipeline"]] if "pipeline" in fixed else _divisors(world // (t * c))
    for p in pipes:
        rest = world // (t * c * p)
        if rest * t * c * p != world:
            continue
        experts = [fixed["expert"]] if "expert" in fixed else [
            e for e in _divisors(rest) if counts.num_experts and e * t <= hw.gpus_per_node
            and counts.num_experts % e == 0] or [1]
        e = max(experts)
        degrees = {"tensor": t, "pipeline": p, "expert": e, "context": c,
                   "data": rest // e if rest % e == 0 else 0}
        if degrees["data"] < 1 or ("data" in fixed and fixed["data"] != degrees["data"]):
            continue
        best, _, _ = best_for_grid(counts, degrees, options, work, hw, plugin_manager,
                                   max_zero=1)
        if best is not None:
            return best
    return None
