"""The data-parallel strategy: applied last (phase DATA), once every other axis has fixed
parameter shapes and placements."""

from __future__ import annotations

from torch import nn

from paraxis.parallel.strategy import ApplyContext, Phase, Strategy
from paraxis_dp.sync import DataParallel

__all__ = ["DataParallelStrategy"]


class DataParallelStrategy(Strategy):
    axis = "data"
    phase = Phase.DATA

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        sync = DataParallel(model, grid=ctx.grid, bucket_mb=ctx.config.parallelism.bucket_mb)
        ctx.grad_syncs.append(sync)
        return model
