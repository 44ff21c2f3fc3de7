"""The ZeRO strategy: phase DATA, in place of replicated data parallelism when
``parallelism.zero`` is 1, 2 or 3.

It applies last, once every other axis has fixed parameter shapes and placements, so it
shards what tensor parallelism left on this rank (the tensor-local pieces) and, under a
pipeline, the stage's own parameters. It broadcasts parameters and buffers from each
replica group's first rank (as DDP does; a deferred model's draws, the same everywhere,
are not broadcast), then shards: stages 1 and 2 through
:class:`~paraxis_zero.stage12.ShardedOptimizerSync`, stage 3 through
:class:`~paraxis_zero.stage3.ShardedParameters`, which draws a deferred model's shards
itself (the materializer's ``fill``), so no rank makes a whole tensor. Its optimizer
(:func:`~paraxis_zero.optimizer.zero_optimizer`: ``train.optimizer`` over the shards)
steps this rank's shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraxis.parallel.buckets import MiB
from paraxis.parallel.placement import placement_of
from paraxis.parallel.strategy import MATERIALIZE_ATTR, ApplyContext, Phase, Strategy
from paraxis.runtime.collectives import WIRE_DTYPES
from paraxis.runtime.grid import Grid
from paraxis.runtime.world import device_for_rank
from paraxis_zero.optimizer import zero_optimizer
from paraxis_zero.stage3 import ShardedParameters
from paraxis_zero.stage12 import ShardedOptimizerSync

__all__ = ["ZeroStrategy", "broadcast_from_first_replica"]


@torch.no_grad()
def broadcast_from_first_replica(model: nn.Module, grid: Grid) -> None:
    """Every replica starts from the same weights: each parameter from the first rank of
    its gradient-sync group, buffers over the dense replica group."""
    for p in model.parameters():
        group = grid.group(placement_of(p).grad_sync_axes)
        if group.size > 1 and not p.is_meta:  # a deferred draw is the same everywhere
            dist.broadcast(p.data, src=group.first, group=group.pg)
    dense = grid.group(grid.axes.token_axes)
    if dense.size > 1:
        for b in model.buffers():
            dist.broadcast(b, src=dense.first, group=dense.pg)


class ZeroStrategy(Strategy):
    axis = "zero"
    phase = Phase.DATA
    order = 20  # one DATA strategy applies per run: data, zero or offload
    takes_meta = True  # ZeRO-3 draws a deferred model's shards itself

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        par = ctx.config.parallelism
        materialize = getattr(model, MATERIALIZE_ATTR, None)
        fill = getattr(materialize, "fill", None) if par.zero == 3 else None
        if materialize is not None and fill is None:
            materialize(model)  # whole local tensors first, sharded after (stages 1-2)
        broadcast_from_first_replica(model, ctx.grid)
        bucket_bytes = int(par.bucket_mb * MiB)
        wire = WIRE_DTYPES[par.reduce_dtype]
        self.sync: ShardedOptimizerSync | ShardedParameters
        if par.zero == 3:
            device = getattr(materialize, "device", None) or device_for_rank()
            self.sync = ShardedParameters(model, grid=ctx.grid, anatomy=ctx.anatomy,
                                          bucket_bytes=bucket_bytes, wire_dtype=wire,
                                          prefetch=par.zero_prefetch, fill=fill,
                                          device=device, keep=ctx.pipeline is not None)
        else:
            self.sync = ShardedOptimizerSync(model, grid=ctx.grid, stage=par.zero,
                                             bucket_bytes=bucket_bytes, wire_dtype=wire)
        ctx.grad_syncs.append(self.sync)
        ctx.extras["zero"] = self.sync
        return model

    def build_optimizer(self, model: nn.Module, ctx: ApplyContext,
                        train: Any) -> torch.optim.Optimizer:
        return zero_optimizer(self.sync.optimizer_params(), train, grid=ctx.grid,
                              owner=self.sync)
