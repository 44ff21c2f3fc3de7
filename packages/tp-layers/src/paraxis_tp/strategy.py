"""The tensor-parallel strategy: phase PARTITION, after the pipeline split, before data.

It shards every stage this rank holds (each chunk, under an interleaved schedule), hands
the engine the vocab-parallel loss when the logits stay split, registers the per-rank
dropout stream, declares that stages pass activations split ``tensor`` ways along the
sequence (sequence parallel), and leaves a :class:`PartialGradSync` for parameters whose
gradients are partial sums over the tensor group.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn

from paraxis.collectives import all_reduce_
from paraxis.grid import AxisGroup
from paraxis.launch import device_for_rank
from paraxis.plan import ModelPlan
from paraxis.stages import chunks_of
from paraxis.strategy import ApplyContext, Phase, Strategy, SyncOrder
from paraxis_tp.apply import TensorParallelApplied, apply_tensor_plan, mark_partial, shard_sequence
from paraxis_tp.rng import TensorParallelRNG

__all__ = ["PartialGradSync", "TensorParallelStrategy"]


class PartialGradSync:
    """Sum the gradients of parameters that each tensor rank only partly saw (norms
    under sequence parallelism, ``replicated_with_grad_allreduce``), once per step and
    after data-parallel averaging (:class:`SyncOrder.PARTIAL`): the data-parallel
    all-reduce may still be writing these very gradients until it finishes."""

    order = SyncOrder.PARTIAL

    def __init__(self, params: list[nn.Parameter], group: AxisGroup):
        self.params, self.group = params, group

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # nothing happens during backward; finish() does it all

    def finish(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or self.group.size == 1:
            return 0.0
        start = time.perf_counter()
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_(flat, self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return time.perf_counter() - start


class TensorParallelStrategy(Strategy):
    axis = "tensor"
    phase = Phase.PARTITION

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        plan = ctx.plan
        assert isinstance(plan, ModelPlan)
        plan.require("tensor")
        group = ctx.grid.group("tensor")
        sp = ctx.config.parallelism.sequence_parallel
        device = next(model.parameters()).device
        if device.type == "meta":  # weights read after the partition (from_pretrained)
            device = device_for_rank()
        out = TensorParallelApplied()
        out.rng = TensorParallelRNG(torch.initial_seed(), group.rank, device)
        memo: dict[int, nn.Parameter] = {}
        pipeline = ctx.pipeline
        for c, chunk in enumerate(chunks_of(model)):
            apply_tensor_plan(chunk, plan, group, sequence_parallel=sp, rng=out.rng, out=out,
                              memo=memo)
            if sp:
                first_layer = pipeline.layers_of(c)[0] if pipeline else 0
                shard_sequence(chunk, plan, group, out, first_layer=first_layer,
                               first_stage=pipeline is None or pipeline.stages[c] == 0)
        if sp:
            ctx.activation_sequence_shards *= group.size
        if out.loss is not None:
            ctx.loss_fn = out.loss
        ctx.rng_streams["tensor_parallel"] = out.rng
        if out.partial_params:
            mark_partial(out.partial_params)
            ctx.grad_syncs.append(PartialGradSync(out.partial_params, group))
        ctx.extras["tensor_parallel"] = out
        return model
