"""The expert-parallel strategy: phase PARTITION, after a pipeline split, before data.

Written against core's contract of issue 11 (``ApplyContext.aux_losses``,
``ApplyContext.step_hooks``, ``ModelPlan.experts``); until that contract lands, applying
it fails with an error that says so rather than training without the router loss.
"""

from __future__ import annotations

from torch import nn

from paraxis.grid import DENSE_REPLICA_AXES
from paraxis.strategy import ApplyContext, Phase, Strategy
from paraxis_moe.config import MoEConfig
from paraxis_moe.layer import ExpertParallel

__all__ = ["ExpertParallelStrategy"]


class ExpertParallelStrategy(Strategy):
    axis = "expert"
    phase = Phase.PARTITION

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        missing = [f for f in ("aux_losses", "step_hooks") if not hasattr(ctx, f)]
        if missing:
            raise RuntimeError(f"expert parallelism needs ApplyContext.{' and .'.join(missing)} "
                               "from paraxis core (issue 11); upgrade paraxis")
        plan = ctx.plan
        if plan is None:
            raise RuntimeError("expert parallelism needs a model plan naming the MoE blocks "
                               "(paraxis-hf supplies one for transformers models)")
        plan.require("expert")  # type: ignore[attr-defined]
        ep = ExpertParallel(model, plan.experts,  # type: ignore[attr-defined]
                            ctx.grid.group("expert"), moe=MoEConfig.of(ctx.config),
                            token_group=ctx.grid.group(DENSE_REPLICA_AXES))
        for name in ep.losses.names:
            ctx.aux_losses.declare(name)  # type: ignore[attr-defined]
        ep.attach(model, ctx.aux_losses.add)  # type: ignore[attr-defined]
        ctx.step_hooks.append(ep.step_metrics)  # type: ignore[attr-defined]
        ctx.extras["expert"] = ep
        return model
