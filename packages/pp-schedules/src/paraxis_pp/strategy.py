"""The pipeline strategy: phase SPLIT, before any other axis rewrites a stage.

It cuts the layer list into ``pipeline x virtual_stages`` consecutive stages, checks on
this rank alone that the model's own forward, run stage by stage, reproduces the whole
model (:func:`paraxis.parallel.stages.check_stages`; a family it cannot split is refused here,
with the reason), builds this rank's stages from the model itself, records each
parameter's owning stage, keeps a word embedding tied to the head one parameter (the
first and last stage sum its gradient, as Megatron's embedding group does), and
installs a :class:`PipelineRunner` as the engine's ``forward_backward``.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from paraxis.config.shape import config_size
from paraxis.parallel.model_plan import ModelPlan, PlanError
from paraxis.parallel.numerics import REDUCTION_RTOL
from paraxis.parallel.placement import placement_of, set_placement
from paraxis.parallel.split import stage_ranges as split_ranges
from paraxis.parallel.stages import PipelineChunks, build_stage, check_stages, tied_parameters
from paraxis.parallel.strategy import ApplyContext, Phase, PipelineLayout, Strategy
from paraxis_pp.check import check
from paraxis_pp.executor import PipelineRunner
from paraxis_pp.schedules import build
from paraxis_pp.tied import TiedGradSync

__all__ = ["PipelineStrategy", "stage_ranges"]


def _config_value(model: nn.Module, size: str) -> int:
    """A size from the model's config, in any Hugging Face spelling; 0 when absent."""
    value = config_size(getattr(model, "config", None), size)
    return value if isinstance(value, int) else 0


def stage_ranges(model: nn.Module, num_layers: int, stages: int,
                 points: list[int] | None) -> list[tuple[int, int]]:
    """Core's split (:mod:`paraxis.parallel.split`, the planner's too) for ``model``."""
    return split_ranges(num_layers, stages, hidden=_config_value(model, "hidden_size"),
                        vocab=_config_value(model, "vocab_size"), points=points)


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
        calls = ctx.plugin_manager.hook.paraxis_stage_calls(model=model, plan=plan)
        if calls is None:
            raise PlanError(f"{plan.model_class}: no installed plugin knows how to run it as "
                            "pipeline stages (paraxis-hf does for transformers causal LMs)")
        anatomy = ctx.anatomy
        if anatomy.origin not in ("plan", "declared"):
            # Stages cut the model where its pipeline plan says what runs before and after
            # the layers; a list of layers found by search says neither.
            raise PlanError(f"{plan.model_class}: the pipeline plan names no layer list "
                            f"(layers found by: {anatomy.origin})")
        ranges = stage_ranges(model, anatomy.num_layers, schedule.stages,
                              sched_cfg.pipeline_split)
        vocab = _config_value(model, "vocab_size") or 2
        forward_kwargs = dict(plan.extra.get("forward_kwargs", {}))
        # Stages run the model's own operations (a skipped layer is an identity), so the
        # logits agree to fp32 rounding; a real mismatch (a position added twice) is O(1).
        check_stages(model, anatomy, ranges, calls, vocab=vocab, rtol=REDUCTION_RTOL,
                     forward_kwargs=forward_kwargs)
        tied = tied_parameters(model, anatomy)
        mine = [schedule.stage(group.rank, c) for c in range(schedule.chunks)]
        last = schedule.stages - 1
        chunks = [build_stage(model, anatomy, ranges[s], first=s == 0, last=s == last,
                              calls=calls, in_place=len(mine) == 1) for s in mine]
        for stage, chunk in zip(mine, chunks, strict=True):
            for p in chunk.parameters():
                is_tied = any(p is t for t in tied)
                set_placement(p, dataclasses.replace(
                    placement_of(p), stage=stage, tied=is_tied,
                    mirror=is_tied and stage == last and 0 not in mine))
        # The first and last stage on two ranks sum the tied gradient over the embedding
        # group; on one rank (a V placement's rank 0) both uses already accumulate into
        # the one parameter the two chunks share.
        if tied and (0 in mine) != (last in mine) and ctx.grid.embedding is not None:
            ctx.grad_syncs.append(TiedGradSync(chunks, ctx.grid.embedding))
        ctx.pipeline = PipelineLayout(tuple(mine), tuple(ranges))
        runner = PipelineRunner(chunks, schedule, group, ctx, forward_kwargs,
                                hidden=_config_value(model, "hidden_size"))
        ctx.forward_backward = runner
        ctx.extras["pipeline"] = runner
        return chunks[0] if len(chunks) == 1 else PipelineChunks(chunks)
