"""One layout evaluated: memory per pipeline rank, communication per axis, bubble, step.

:func:`make_layout` turns degrees and options into the :class:`ParallelConfig` a run
would use (microbatches from the global batch); :func:`problems` lists every rule it
breaks, core's validation and the plugins' included; :func:`evaluate` returns a
:class:`Plan`, plain data that prints, serializes and draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paraxis.config.errors import Problem
from paraxis.config.parallel import AXES, SAMPLE_AXES, ParallelConfig
from paraxis.config.rules import check
from paraxis.planner.comm import AxisComm, communication
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.memory import (
    Memory,
    held_params,
    most_trainable,
    rank_layers,
    rank_memory,
)
from paraxis.planner.model import ModelCounts
from paraxis.planner.schedule import Bubble, bubble, holds_ends
from paraxis.planner.step import StepEstimate, estimate_step

__all__ = ["OPTION_KEYS", "Plan", "evaluate", "make_layout", "problems", "unchecked_axes"]

# Options beside the degrees, as ParallelConfig.from_kwargs names them.
OPTION_KEYS = ("zero", "sequence_parallel", "activation_checkpointing", "pipeline_schedule",
               "virtual_stages", "context_mode", "expert_tensor", "zero_shard")


def make_layout(degrees: dict[str, int], options: dict[str, Any], work: Workload,
                bucket_mb: float = 25.0) -> ParallelConfig:
    """The run's config: ``degrees`` and ``options``, with as many microbatches as the
    global batch gives each data x expert replica (at least 1)."""
    replicas = math.prod(degrees.get(a, 1) for a in SAMPLE_AXES) * work.micro_batch
    m = max(1, work.global_batch // replicas)
    return ParallelConfig.from_kwargs(**{a: degrees.get(a, 1) for a in AXES}, **options,
                                      microbatches=m, bucket_mb=bucket_mb)


def problems(counts: ModelCounts, layout: ParallelConfig, work: Workload, *,
             world_size: int | None = None, plugin_manager: Any = None) -> list[Problem]:
    """Every rule the layout breaks for this model and workload: core's and those of
    every installed axis package (the same rules a run checks, through
    ``paraxis_validate_config``; the planner restates none of them). An axis whose
    package is not installed checks nothing here: :func:`unchecked_axes` names it."""
    plugin_manager = plugin_manager or _plugin_manager()
    found = check(layout, world_size=world_size, model=counts.shape(work.seq))
    replicas = layout.sample_shards * work.micro_batch
    if work.global_batch % replicas:
        found.append(Problem(
            "global_batch", work.global_batch, f"must split evenly over data x expert x "
            f"micro-batch = {replicas}", f"use a multiple of {replicas}"))
    plugin_manager.hook.paraxis_validate_config(config=layout, model=counts.shape(work.seq),
                                                problems=found)
    return found


def unchecked_axes(layout: ParallelConfig, plugin_manager: Any = None) -> tuple[str, ...]:
    """The axes ``layout`` needs whose package is not installed: their rules (head and
    width divisibility, supported combinations) were not checked, so the plan may hold
    a layout a run would refuse."""
    from paraxis.engine.plugins import collect_strategies
    from paraxis.engine.resolve import required_axes

    available = collect_strategies(plugin_manager or _plugin_manager())
    return tuple(a for a in required_axes(layout) if a not in available)


def _plugin_manager() -> Any:
    from paraxis.engine.plugins import make_plugin_manager

    return make_plugin_manager()


@dataclass(frozen=True)
class Plan:
    counts: ModelCounts
    layout: ParallelConfig
    work: Workload
    hardware: Hardware
    memory: tuple[Memory, ...]  # per pipeline rank
    comm: tuple[AxisComm, ...]
    bubble: Bubble
    step: StepEstimate  # speeds not given: the efficiency table's device's
    # Axes whose rules were not checked: their package is not installed.
    unchecked: tuple[str, ...] = ()

    @property
    def worst(self) -> Memory:
        """The most loaded rank (the first stage under 1F1B; the lowest stage on ties)."""
        return max(self.memory, key=lambda m: (m.total, -m.stage))

    @property
    def fits(self) -> bool | None:
        usable = self.hardware.usable_memory
        return None if usable is None else self.worst.total <= usable

    def degrees_text(self) -> str:
        return " x ".join(f"{a}={d}" for a, d in self.layout.degrees.items() if d > 1) \
            or "one rank"

    def config_dict(self) -> dict[str, Any]:
        par, sched = self.layout.parallelism, self.layout.schedule
        return {**self.layout.degrees, "zero": par.zero, "zero_shard": par.zero_shard,
                "sequence_parallel": par.sequence_parallel, "expert_tensor": par.expert_tensor,
                "recompute": sched.activation_checkpointing,
                "schedule": sched.pipeline_schedule, "virtual_stages": sched.virtual_stages,
                "microbatches": sched.microbatches, "micro_batch": self.work.micro_batch,
                "global_batch": self.work.global_batch, "seq": self.work.seq,
                "precision": self.work.precision, "world_size": self.layout.world_size}

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        out: dict[str, Any] = {
            "model": {"family": self.counts.family, "parameters": self.counts.total,
                      "non_embedding": self.counts.non_embedding,
                      "layers": self.counts.num_layers, "tied": self.counts.tied,
                      "trainable": self.counts.trainable, "lora_rank": self.counts.lora_rank},
            "config": self.config_dict(),
            "memory": {**worst.as_dict(), "stage": worst.stage, "fits": self.fits,
                       "device_memory": self.hardware.device_memory,
                       "headroom": self.hardware.headroom},
            "memory_per_stage": [m.as_dict() for m in self.memory],
            "communication": {a.axis: a.bytes for a in self.comm},
            "links": {a.axis: a.link for a in self.comm},
            "element_size": self.work.element_size,
            "bubble": self.bubble.fraction,
            "bubble_source": self.bubble.source,
            "unchecked_axes": list(self.unchecked),
        }
        if self.hardware.timed:
            out["step_time_s"] = self.step.step_s
            out["mfu"] = self.step.mfu
            out["step_components_s"] = self.step.components()
        return out


def evaluate(counts: ModelCounts, layout: ParallelConfig, work: Workload,
             hardware: Hardware, *, simulate: bool = True, every_rank: bool = True,
             plugin_manager: Any = None) -> Plan:
    """Evaluate a layout already checked by :func:`problems`. The search passes
    ``simulate=False`` (closed-form bubble) and ``every_rank=False`` (memory of the first
    and last stages only: the candidates for the most loaded rank)."""
    plugin_manager = plugin_manager or _plugin_manager()
    par, sched = layout.parallelism, layout.schedule
    p, v = par.pipeline, sched.virtual_stages
    ranks = range(p) if every_rank else sorted({0, p - 1})
    memory = tuple(rank_memory(counts, layout, work, r) for r in ranks)
    dense, expert = max((held_params(counts, rank_layers(counts, layout, r),
                                     *holds_ends(sched.pipeline_schedule, p, r),
                                     par.tensor, par.expert, p)
                         for r in range(p)), key=sum)  # the rank with most gradients
    comm = tuple(communication(counts, layout, work, gpus_per_node=hardware.gpus_per_node,
                               dense_grad_params=dense, expert_grad_params=expert,
                               trainable_params=most_trainable(counts, layout)))
    bub = bubble(sched.pipeline_schedule, p, sched.microbatches, v, simulate=simulate,
                 plugin_manager=plugin_manager)
    step = estimate_step(counts, layout, work, list(comm), bub.fraction,
                         hardware.with_device_speeds())
    return Plan(counts, layout, work, hardware, memory, comm, bub, step,
                unchecked_axes(layout, plugin_manager))


def world_of(degrees: dict[str, int]) -> int:
    return math.prod(degrees.get(a, 1) for a in AXES)
