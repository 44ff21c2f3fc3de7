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
from typing import Any

import torch
from torch import nn

from paraxis.config.errors import Problem
from paraxis.config.parallel import SPLIT_BACKWARD_SCHEDULES
from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.model_plan import ModelPlan
from paraxis.parallel.numerics import REDUCTION_RTOL
from paraxis.parallel.placement import placement_of
from paraxis.parallel.stages import chunks_of
from paraxis.parallel.strategy import ApplyContext, Phase, Strategy, SyncOrder
from paraxis.runtime.collectives import all_gather_into, all_reduce_
from paraxis.runtime.cuda_paths import cuda_path_on
from paraxis.runtime.grid import AxisGroup
from paraxis.runtime.world import device_for_rank
from paraxis_tp.apply import TensorParallelApplied, apply_tensor_plan, mark_partial
from paraxis_tp.rng import TensorParallelRNG
from paraxis_tp.rules import check_split_widths
from paraxis_tp.sequence import shard_sequence

__all__ = ["PartialGradSync", "TensorParallelStrategy", "overlap_wanted"]


class PartialGradSync:
    """Sum the gradients of parameters that each tensor rank only partly saw (norms
    under sequence parallelism, ``replicated_with_grad_allreduce``), once per step and
    after data-parallel averaging (:class:`SyncOrder.PARTIAL`): the data-parallel
    all-reduce may still be writing these very gradients until it finishes.

    ``candidates`` are the other parameters replicated over the group. At the first
    backward (the parity probe's, or the first step's) their gradients are compared
    across tensor ranks: one that differs saw only this rank's part of a split
    activation (a layer's norm under sequence parallelism; an activation function's own
    parameter between a column- and a row-parallel layer, or a per-head norm the plan did
    not mark), so it is a partial sum too, and joins the summed ones (its placement says
    so); one used on whole activations (a learned position embedding before the
    sequence is split) has the same gradient everywhere and is left alone. Every rank
    compares the same gathered numbers, so all decide alike; the probe's gradient norm
    then checks the result, so a parameter this rule misjudges is refused, never
    trained."""

    order = SyncOrder.PARTIAL

    def __init__(self, params: list[nn.Parameter], group: AxisGroup,
                 candidates: list[nn.Parameter] | None = None):
        self.params, self.group = list(params), group
        seen = {id(p) for p in self.params}
        self.candidates = [p for p in candidates or [] if id(p) not in seen]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # nothing happens during backward; finish() does it all

    def finish(self) -> float:
        start = time.perf_counter()
        if self.candidates and self.group.size > 1:
            self.params += self._partial_candidates()
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or self.group.size == 1:
            return time.perf_counter() - start
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_(flat, self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return time.perf_counter() - start

    def _partial_candidates(self) -> list[nn.Parameter]:
        """The candidates whose gradients differ across tensor ranks (see the class).
        One whose gradient is zero on every rank (not used by this batch: an expert no
        token reached) stays a candidate until a backward decides it."""
        params = self.candidates
        mine = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params]).float()
        every = torch.empty(self.group.size * mine.numel(), dtype=mine.dtype,
                            device=mine.device)
        all_gather_into(every, mine, self.group)
        every = every.view(self.group.size, -1)
        partial, undecided, offset = [], [], 0
        for p in params:
            seg = every[:, offset:offset + p.numel()]
            offset += p.numel()
            scale = float(seg.abs().max())
            if scale == 0.0:
                undecided.append(p)
            elif float((seg - seg[0]).abs().max()) > REDUCTION_RTOL * scale:
                partial.append(p)
        self.candidates = undecided
        mark_partial(partial)
        return partial


def overlap_wanted(option: str, group: AxisGroup) -> bool:
    """``parallelism.tensor_overlap`` resolved for ``group`` (sequence parallel only),
    once per run. On gloo ``auto`` is off: benchmarks/tp_overlap.py measured no step-time
    gain on this project's CPUs (RESULTS.md, ``tp_overlap``). On a stream-ordered group
    (NCCL: hops on the communicator's stream beside the compute stream) it is the CUDA
    path ``tensor_overlap``, which no GPU has run yet: ``auto`` stays off until one has
    passed the overlap parity tests, and ``on`` runs it with one warning naming it
    (:mod:`paraxis.runtime.cuda_paths`)."""
    if group.stream_ordered:
        return cuda_path_on("tensor_overlap", option)
    return option == "on"


class TensorParallelStrategy(Strategy):
    axis = "tensor"
    phase = Phase.PARTITION
    order = 30  # last in its phase (see docs/architecture.md, "Hooks and phases")

    @classmethod
    def check_model(cls, model: nn.Module, config: Any, plan: object | None,
                    anatomy: Anatomy) -> list[Problem]:
        """Linear layers the plan splits whose width the degree does not divide (a
        shared expert's FFN, say), named before any process group."""
        return check_split_widths(model, plan, config.parallelism.tensor, anatomy)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        plan = ctx.plan
        assert isinstance(plan, ModelPlan)
        plan.require("tensor")
        group = ctx.grid.group("tensor")
        sp = ctx.config.parallelism.sequence_parallel
        # A split backward (ZB-H1, ZB-V, DualPipeV) would run a fused node in both passes
        # (rules.py)
        split_backward = ctx.config.parallelism.pipeline > 1 and \
            ctx.config.schedule.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
        overlap = sp and not split_backward and overlap_wanted(
            ctx.config.parallelism.tensor_overlap, group)
        device = next(model.parameters()).device
        if device.type == "meta":  # weights read after the partition (from_pretrained)
            device = device_for_rank()
        out = TensorParallelApplied()
        out.rng = TensorParallelRNG(torch.initial_seed(), group.rank, device)
        memo: dict[int, nn.Parameter] = {}
        pipeline = ctx.pipeline
        for c, chunk in enumerate(chunks_of(model)):
            apply_tensor_plan(chunk, plan, ctx.anatomy, group, sequence_parallel=sp,
                              rng=out.rng, out=out, memo=memo, overlap=overlap)
            if sp:
                first_layer = pipeline.layers_of(c)[0] if pipeline else 0
                shard_sequence(chunk, ctx.anatomy, group, out, first_layer=first_layer,
                               first_stage=pipeline is None or pipeline.stages[c] == 0)
        if sp:
            ctx.activation_sequence_shards *= group.size
        if out.loss is not None:
            ctx.loss_fn = out.loss
        ctx.rng_streams["tensor_parallel"] = out.rng
        mark_partial(out.partial_params)
        seen = {id(p) for p in out.partial_params}
        # A frozen parameter has no gradient to sum (DESIGN section 10): not a candidate.
        candidates = [p for chunk in chunks_of(model) for p in chunk.parameters()
                      if "tensor" in placement_of(p).replicated and id(p) not in seen
                      and p.requires_grad]
        if out.partial_params or candidates:
            ctx.grad_syncs.append(PartialGradSync(out.partial_params, group, candidates))
        ctx.extras["tensor_parallel"] = out
        return model
