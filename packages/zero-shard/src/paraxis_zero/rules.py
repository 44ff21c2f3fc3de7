"""The ZeRO axis' configuration rules, checked before any process group exists
(through the ``paraxis_validate_config`` hook)."""

from __future__ import annotations

from paraxis.config.errors import Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.config.shape import ModelShape

__all__ = ["check_zero"]


def check_zero(config: ParallelConfig, model: ModelShape | None) -> list[Problem]:
    par = config.parallelism
    if par.zero == 0:
        return []
    problems: list[Problem] = []
    if config.token_replicas == 1:
        problems.append(Problem(
            "parallelism.zero", par.zero,
            "shards over data-parallel replicas, and data = expert = context = 1 leaves "
            "none: it would be a silent no-op",
            "set parallelism.data > 1, or parallelism.zero: 0"))
    if par.zero >= 2 and par.pipeline > 1:
        why = ("a pipeline runs every microbatch's backward before a stage's gradients "
               "are complete, so ZeRO-2 would hold them whole through the schedule and "
               "save nothing over ZeRO-1" if par.zero == 2 else
               "a pipeline runs forward and backward once per microbatch, so ZeRO-3 "
               "would all-gather every layer 2 x microbatches times per step instead of "
               "twice, on the critical path of every stage")
        problems.append(Problem(
            "parallelism.zero", par.zero, f"does not combine with pipeline parallelism "
            f"(pipeline={par.pipeline}): {why} (DeepSpeed refuses the same)",
            "use parallelism.zero: 1 with a pipeline, or pipeline: 1"))
    return problems
