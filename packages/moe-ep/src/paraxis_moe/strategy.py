"""The expert-parallel strategy: phase PARTITION, after a pipeline split, before data.

Core applies it to every model whose plan names MoE blocks, at any expert degree (a
group of one at ``expert: 1``): training always includes the router's load-balancing
loss (as transformers does with ``output_router_logits=True``), and the routing
statistics are always logged. It uses core's contracts (docs/architecture.md section 4):

* ``ctx.aux_losses``: declares ``moe/aux_loss`` and ``moe/z_loss`` and a carry slot of
  ``E + 1`` numbers (the router counts), through which the joint Switch loss keeps
  exact one-process parity across pipeline stages;
* ``ctx.step_hooks``: the ``moe/...`` metrics after every optimizer step, and with
  ``moe.bias_update_rate`` DeepSeek-V3's correction-bias update from the global load;
* ``ctx.skip_verify``: with a capacity factor, drops depend on each rank's token group,
  which the one-process parity probe cannot reproduce;
* ``Strategy.check_model``: an MoE layout it cannot shard is refused before any process
  group, naming the module.

Each pipeline chunk this rank holds is handled (a stage may hold no MoE block). Tensor
parallelism splits attention and dense MLPs; the experts stay whole on their expert
rank (paraxis-hf leaves the fused experts out of the tensor plan), and the tensor ranks
of one expert rank dispatch the same tokens over their own expert group; with
``parallelism.expert_tensor`` equal to the tensor degree each expert's FFN is split over
the tensor group instead (:mod:`paraxis_moe.expert_tensor`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paraxis.config.errors import Problem
from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.stages import chunks_of
from paraxis.parallel.strategy import ApplyContext, Phase, Strategy
from paraxis.runtime.clock import Stopwatch
from paraxis_moe.config import group_limit_problems, moe_config
from paraxis_moe.expert_tensor import ExpertTensor, refusals
from paraxis_moe.experts import UnsupportedMoELayout
from paraxis_moe.layer import ExpertParallel, find_blocks

__all__ = ["ExpertParallelStrategy"]


class ExpertParallelStrategy(Strategy):
    axis = "expert"
    phase = Phase.PARTITION
    order = 20  # before tensor (see docs/architecture.md, "Hooks and phases")

    @classmethod
    def check_model(cls, model: nn.Module, config: Any, plan: object | None,
                    anatomy: Anatomy) -> list[Problem]:
        """Every MoE block of the model (its anatomy's, which the plan names) must have
        fused experts paraxis can shard and a router it can find, and its expert count
        must split over the expert degree; a group-limited router's
        ``topk_group``/``n_group`` must be routable. At
        degree 1 nothing is sharded: a block it cannot shard is kept whole (the model's
        own forward; its router watched where found)."""
        routing = group_limit_problems(getattr(model, "config", None))
        if routing:
            return routing
        degree = config.parallelism.expert
        try:
            blocks = find_blocks(model, anatomy.expert_blocks, keep_whole=degree == 1)
        except UnsupportedMoELayout as exc:
            return [Problem("model", type(model).__name__, str(exc),
                            "use a transformers version whose MoE blocks hold fused "
                            "experts (5.x), or a model paraxis-moe-ep supports")]
        found = [Problem(f"model.{name}.experts.num_experts", experts.num_experts,
                         f"must be divisible by the expert degree {degree}",
                         "choose parallelism.expert dividing the expert count")
                 for name, _, experts in blocks
                 if experts is not None and experts.num_experts % degree][:1]
        return found + _expert_tensor_problems(blocks, config.parallelism.expert_tensor)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        if not ctx.anatomy.expert_blocks:
            raise RuntimeError("expert parallelism needs a model plan naming the MoE blocks "
                               "(paraxis-hf supplies one for transformers models)")
        moe = moe_config(ctx.config)
        par = ctx.config.parallelism
        # Under sequence parallelism each tensor rank routes its own share of the
        # sequence (Megatron-Core's rule for tensor x expert): the routing counts and
        # statistics are reduced over the tensor group too, and each rank's loss part is
        # its own, not a copy.
        routes_shard = par.sequence_parallel and par.tensor > 1
        axes = ctx.grid.axes
        token_axes = axes.sequence_shard_axes if routes_shard else axes.token_axes
        ctx.aux_losses.split_over_tensor = routes_shard
        # The groups that split each sequence (DeepSeek-V3's sequence-wise loss sums its
        # per-sequence counts over them).
        splitting = (ctx.grid.group("context"),
                     *((ctx.grid.group("tensor"),) if routes_shard else ()))
        split = (ExpertTensor(ctx.grid.group("tensor"), sequence_parallel=par.sequence_parallel)
                 if par.expert_tensor > 1 else None)
        ep = ExpertParallel(chunks_of(model), ctx.anatomy.expert_blocks, ctx.grid.group("expert"),
                            moe=moe,
                            token_group=ctx.grid.group(token_axes), sequence_groups=splitting,
                            pipeline=ctx.grid.group("pipeline") if ctx.pipeline else None,
                            allow_empty=ctx.pipeline is not None, expert_tensor=split,
                            clock=Stopwatch(on_stream=ctx.grid.comm.on_stream))
        for name in ep.losses.names:
            ctx.aux_losses.declare(name)
        ep.attach(ctx.aux_losses)
        ctx.step_hooks.append(ep.after_step)
        if moe.capacity_factor is not None:
            ctx.skip_verify = (f"moe.capacity_factor={moe.capacity_factor}: each rank drops "
                               "pairs of its own token group, which one process on the "
                               "whole probe batch does not")
        ctx.extras["expert"] = ep
        return model



def _expert_tensor_problems(blocks: list[tuple[str, Any, Any]], degree: int) -> list[Problem]:
    """The first MoE block whose experts cannot be split over ``degree`` tensor ranks
    (:func:`paraxis_moe.expert_tensor.refusals`), or that is kept whole."""
    if degree == 1:
        return []
    for name, _, experts in blocks:
        why = (["its experts are kept whole (no fused per-expert tensors)"]
               if experts is None else refusals(experts, degree))
        if why:
            return [Problem("parallelism.expert_tensor", degree,
                            f"cannot split the experts of {name}: {'; '.join(why)}",
                            "set expert_tensor: 1 (experts whole on every tensor rank)")]
    return []
