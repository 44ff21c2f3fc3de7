"""The data-parallel strategy: applied last (phase DATA), once every other axis has fixed
parameter shapes and placements."""

from __future__ import annotations

from torch import nn

from paraxis.parallel.strategy import ApplyContext, Phase, Strategy
from paraxis.runtime.collectives import WIRE_DTYPES
from paraxis_dp.sync import DataParallel

__all__ = ["DataParallelStrategy"]


class DataParallelStrategy(Strategy):
    axis = "data"
    phase = Phase.DATA
    order = 10  # one DATA strategy applies per run: data, zero or offload

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        par = ctx.config.parallelism
        sync = DataParallel(model, grid=ctx.grid, bucket_mb=par.bucket_mb,
                            wire_dtype=WIRE_DTYPES[par.reduce_dtype])
        ctx.grad_syncs.append(sync)
        return model
