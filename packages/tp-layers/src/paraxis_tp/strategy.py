"""The tensor-parallel strategy: phase PARTITION, after pipeline split, before data."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from paraxis.grid import AxisGroup
from paraxis.strategy import ApplyContext, Phase, Strategy
from paraxis_tp.apply import apply_tensor_plan

__all__ = ["PartialGradSync", "TensorParallelStrategy"]


class PartialGradSync:
    """Sum the gradients of parameters that each tensor rank only partly saw (norms
    under sequence parallelism, ``replicated_with_grad_allreduce``), once per step."""

    def __init__(self, params: list[nn.Parameter], group: AxisGroup):
        self.params, self.group = params, group

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # nothing happens during backward; finish() does it all

    def finish(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or self.group.size == 1:
            return 0.0
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group.pg)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return 0.0


class TensorParallelStrategy(Strategy):
    axis = "tensor"
    phase = Phase.PARTITION

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        device = next(model.parameters()).device
        applied = apply_tensor_plan(model, ctx, seed=torch.initial_seed(), device=device)
        if applied.loss is not None:
            ctx.loss_fn = applied.loss
        ctx.rng_streams["tensor_parallel"] = applied.rng
        if applied.partial_params:
            ctx.grad_syncs.append(PartialGradSync(applied.partial_params,
                                                  ctx.grid.group("tensor")))
        ctx.extras["tensor_parallel"] = applied
        return model
