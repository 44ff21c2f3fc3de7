"""The pipeline strategy: phase SPLIT, before any other axis rewrites the stage.

It cuts the layer list into ``pipeline x virtual_stages`` consecutive stages, asks the
model's plugin (``paraxis_pipeline_stage``) to build this rank's stage modules, records
each parameter's owning stage in its placement, and installs a :class:`PipelineRunner`
as the engine's ``forward_backward``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from paraxis.placement import placement_of, set_placement
from paraxis.plan import ModelPlan, PlanError
from paraxis.strategy import ApplyContext, Phase, Strategy
from paraxis_pp.check import check
from paraxis_pp.executor import PipelineRunner
from paraxis_pp.schedules import build
from paraxis_pp.split import balanced_split, ranges_from_points

__all__ = ["PipelineInfo", "PipelineStrategy", "stage_ranges"]


@dataclass(frozen=True)
class PipelineInfo:
    """What other axes may need to know: ``ctx.extras["pipeline"]``."""

    rank: int
    stages: tuple[int, ...]  # global stage indices held here
    ranges: tuple[tuple[int, int], ...]  # layer range of every global stage
    holds_first_layer: bool
    holds_last_layer: bool
    runner: PipelineRunner


def _layer_list(model: nn.Module, plan: ModelPlan) -> tuple[str, nn.ModuleList]:
    for name in plan.pipeline:
        module = model.get_submodule(name)
        if isinstance(module, nn.ModuleList):
            return name, module
    raise PlanError(f"{plan.model_class}: the pipeline plan names no layer list")


def stage_ranges(model: nn.Module, num_layers: int, stages: int,
                 points: list[int] | None) -> list[tuple[int, int]]:
    if points:
        return ranges_from_points(num_layers, points)
    cfg = getattr(model, "config", None)
    hidden, vocab = getattr(cfg, "hidden_size", 0), getattr(cfg, "vocab_size", 0)
    head = vocab / (12 * hidden) if hidden else 0.0  # 2hV vs 24h^2 FLOPs per token
    return balanced_split(num_layers, stages, first_extra=0.1 * head, last_extra=head)


class PipelineStrategy(Strategy):
    axis = "pipeline"
    phase = Phase.SPLIT

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        plan = ctx.plan
        assert isinstance(plan, ModelPlan)
        plan.require("pipeline")
        sched_cfg = ctx.config.schedule
        group = ctx.grid.group("pipeline")
        schedule = build(sched_cfg.pipeline_schedule, group.size, sched_cfg.microbatches,
                         sched_cfg.virtual_stages)
        check(schedule)
        _, layers = _layer_list(model, plan)
        ranges = stage_ranges(model, len(layers), schedule.stages, sched_cfg.pipeline_split)
        mine = [schedule.stage(group.rank, c) for c in range(schedule.chunks)]
        chunks = []
        for stage in mine:
            module = ctx.plugin_manager.hook.paraxis_pipeline_stage(
                model=model, plan=plan, layers=ranges[stage], first=stage == 0,
                last=stage == schedule.stages - 1)
            if module is None:
                raise PlanError(f"{plan.model_class}: no installed plugin builds pipeline "
                                "stages for it (paraxis-hf does for transformers decoders)")
            for p in module.parameters():
                set_placement(p, dataclasses.replace(placement_of(p), stage=stage))
            chunks.append(module)
        hidden = getattr(model.config, "hidden_size", None)
        device = next(model.parameters()).device

        def hidden_shape(batch: int, seq: int) -> tuple[int, ...]:
            shards = getattr(chunks[0], "sequence_shards", 1)
            return (batch, seq // shards, hidden)

        runner = PipelineRunner(chunks, schedule, group, hidden_shape, device)
        ctx.forward_backward = runner
        ctx.extras["pipeline"] = PipelineInfo(group.rank, tuple(mine), tuple(ranges),
                                              0 in mine, schedule.stages - 1 in mine, runner)
        return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
