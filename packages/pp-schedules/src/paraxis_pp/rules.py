"""The pipeline axis' own configuration rules, checked before any process group exists
(through the ``paraxis_validate_config`` hook)."""

from __future__ import annotations

from paraxis.config.errors import Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.config.shape import ModelShape
from paraxis_pp.schedules import V_SCHEDULES

__all__ = ["check_pipeline"]


def check_pipeline(config: ParallelConfig, model: ModelShape | None) -> list[Problem]:
    par, sched = config.parallelism, config.schedule
    problems: list[Problem] = []
    v, name = sched.virtual_stages, sched.pipeline_schedule
    # DualPipeV runs at least one microbatch per stage (DeepSeek's DualPipeV asserts it,
    # as torch's ScheduleDualPipeV does); every other schedule one per rank.
    least, per = (2 * par.pipeline, "stage") if name == "dualpipev" else (par.pipeline, "rank")
    if par.pipeline > 1 and sched.microbatches < least:
        problems.append(Problem(
            "schedule.microbatches", sched.microbatches,
            f"{name} needs at least one microbatch per pipeline {per} ({least}) or "
            "stages sit idle", f"set schedule.microbatches >= {least}"))
    if name in V_SCHEDULES:
        if v != 2:
            why = (f"an odd number of chunks per rank ({v}) cannot fold into a V (down "
                   "the ranks and back up)" if v % 2 else
                   f"{name} places exactly two chunks per rank in a V, not {v}")
            problems.append(Problem("schedule.virtual_stages", v, why,
                                    "set virtual_stages: 2"))
    elif (v > 1) != (name == "interleaved_1f1b"):
        problems.append(Problem(
            "schedule.virtual_stages", v, "more than one model chunk per rank goes with "
            "the interleaved_1f1b schedule (two with zbv and dualpipev), and only with them",
            "set pipeline_schedule: interleaved_1f1b with virtual_stages > 1, or "
            "virtual_stages: 1"))
    if name == "interleaved_1f1b" and sched.microbatches % par.pipeline:
        problems.append(Problem(
            "schedule.microbatches", sched.microbatches, "interleaved 1F1B works on groups "
            f"of pipeline-degree ({par.pipeline}) microbatches",
            f"use a multiple of {par.pipeline}"))
    if model is None or model.num_layers is None or par.pipeline == 1:
        return problems
    stages = par.pipeline * v
    if stages > model.num_layers:
        problems.append(Problem(
            "parallelism.pipeline", par.pipeline,
            f"each of the {stages} stages needs at least one of the {model.num_layers} "
            "layers", f"set pipeline x virtual_stages <= {model.num_layers}"))
    split = sched.pipeline_split
    if split is not None and (len(split) != stages - 1 or sorted(set(split)) != split
                              or split[0] <= 0 or split[-1] >= model.num_layers):
        problems.append(Problem(
            "schedule.pipeline_split", split,
            f"needs {stages - 1} increasing layer indices in (0, {model.num_layers}), one "
            "per stage boundary, so every layer lands on exactly one stage",
            "list the first layer of every stage after the first, or drop it to balance"))
    return problems

