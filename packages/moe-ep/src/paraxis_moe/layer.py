"""A model's MoE blocks made expert parallel, with their statistics and router losses.

A block is the model's own module (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``
with its shared expert, ``DeepseekV3MoE``...): paraxis keeps it and its router, and
replaces only its ``experts`` child's forward (:mod:`paraxis_moe.experts`). The router
is the block's ``gate`` or ``router`` child, whichever the family names it; its logits
are the output transformers' own ``router_logits`` recorder reads (the model's
``_can_record_outputs``: JetMoE's gate returns them fifth, Llama 4's second).

At expert degree 1 nothing is dispatched, so a block whose experts paraxis cannot shard
(JetMoE's attention and MLP experts, Llama 4's, LongCat-Flash's with zero-compute
experts) is *kept whole*: its forward stays entirely the model's. Its routers are then
the modules transformers' ``router_logits`` recorder reads (JetMoE's gates sit inside its
attention experts and in MLP blocks without an ``experts`` child; its own loss takes them
all), or the block's ``gate``/``router`` child where the model has no recorder; each is
watched for the losses and statistics under its own module name.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paraxis.parallel.aux_losses import AuxLosses
from paraxis.runtime.clock import Stopwatch
from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import AxisGroup
from paraxis.runtime.world import device_for_rank
from paraxis_moe.balance import BiasBalancer, SequenceLosses, correction_bias, sigmoid_scored
from paraxis_moe.config import MoEConfig, aux_coef, experts_per_token
from paraxis_moe.expert_tensor import ExpertTensor
from paraxis_moe.experts import (
    ExpertParallelExperts,
    UnsupportedMoELayout,
    check_experts,
    shard_experts,
)
from paraxis_moe.overlap import chunked_wanted
from paraxis_moe.router import RouterLosses, watch_router
from paraxis_moe.stats import MoEStats

__all__ = ["ExpertParallel", "find_blocks", "find_router", "logits_index", "moe_block_names"]

ROUTER_NAMES = ("gate", "router")


def find_router(block: nn.Module, name: str) -> nn.Module:
    for attr in ROUTER_NAMES:
        router = getattr(block, attr, None)
        if isinstance(router, nn.Module):
            return router
    raise UnsupportedMoELayout(
        f"{name} ({type(block).__name__}) has no router child named {' or '.join(ROUTER_NAMES)}; "
        "paraxis keeps the model's router and needs to find it")


def moe_block_names(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Module names matching the plan's ``experts`` entries (``*`` for a layer index)."""
    return [n for n, _ in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def find_blocks(model: nn.Module, patterns: Sequence[str], *, keep_whole: bool = False,
                ) -> list[tuple[str, nn.Module | None, Any]]:
    """(name, router, experts) of every MoE block, each checked (nothing is changed);
    :class:`UnsupportedMoELayout` names the first module paraxis cannot shard. With
    ``keep_whole`` (expert degree 1) such a block is returned with ``experts`` None (left
    whole) and ``router`` None where no router is found."""
    found = []
    for name in moe_block_names(model, patterns):
        block = model.get_submodule(name)
        experts = getattr(block, "experts", None)
        try:
            check_experts(experts, f"{name}.experts")
        except UnsupportedMoELayout:
            if not keep_whole:
                raise
            router = next((r for r in (getattr(block, a, None) for a in ROUTER_NAMES)
                           if isinstance(r, nn.Module)), None)
            found.append((name, router, None))
            continue
        found.append((name, find_router(block, name), experts))
    return found


def recorded_routers(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """Every module transformers' ``router_logits`` recorder of ``model`` reads (the
    logits its own load-balancing loss takes), by name; None without a recorder."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if not isinstance(target, type):
        return None
    return [(n, m) for n, m in model.named_modules() if isinstance(m, target)]


def logits_index(model: nn.Module, router: nn.Module) -> int:
    """Where ``router``'s output holds its logits: the index of the model's own
    ``router_logits`` recorder (transformers' ``_can_record_outputs``) when it targets
    this router's class, else 0."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if isinstance(target, type) and isinstance(router, target):
        return int(getattr(recorder, "index", 0) or 0)
    return 0


def _num_experts(parts: list[tuple[str, nn.Module | None, Any]], config: Any,
                 where: str) -> int:
    sizes = {experts.num_experts for _, _, experts in parts if experts is not None}
    if len(sizes) > 1:
        raise UnsupportedMoELayout(f"MoE blocks of {where} have different expert counts "
                                   f"{sorted(sizes)}")
    if sizes:
        return sizes.pop()
    # A pipeline stage without MoE blocks still carries the router counts along.
    from paraxis.config.shape import ModelShape

    count = ModelShape.from_hf_config(config).num_experts if config is not None else 0
    if not count:
        raise UnsupportedMoELayout(f"{where}: no MoE block and no expert count in its config")
    return int(count)


def _with_recorded_routers(parts: list[tuple[nn.Module, str, nn.Module | None, Any]],
                           ) -> list[tuple[nn.Module, str, nn.Module | None, Any]]:
    """With blocks kept whole: the sharded blocks, then every other router the model's
    recorder reads as a part of its own (no experts), or the kept blocks as they are
    where the model has no recorder."""
    out = [p for p in parts if p[3] is not None]
    watched = {id(p[2]) for p in out}
    for root in dict.fromkeys(p[0] for p in parts):
        routers = recorded_routers(root)
        if routers is None:
            out += [p for p in parts if p[0] is root and p[3] is None]
            continue
        out += [(root, name, router, None) for name, router in routers
                if id(router) not in watched]
    return out


class ExpertParallel:
    """Every named MoE block of ``model`` (a module, or the pipeline chunks this rank
    holds) sharded over ``group`` (the expert axis).

    ``token_group`` holds the ranks with distinct tokens (data x expert x context), over
    which the router losses' counts and the statistics are reduced; ``pipeline`` the
    pipeline group, over which the statistics of the stages' layers are gathered. With
    ``allow_empty`` (a pipeline stage) a module without MoE blocks is accepted. With a
    group of one, blocks whose experts cannot be sharded are kept whole (``kept``).
    ``expert_tensor`` splits each expert's FFN over the tensor group
    (:mod:`paraxis_moe.expert_tensor`). ``clock`` times the statistics' seconds (the
    host clock by default; :mod:`paraxis_moe.stats`).
    Every rank of the grid must build it with the same arguments.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], blocks: Sequence[str],
                 group: AxisGroup, *, moe: MoEConfig | None = None,
                 token_group: AxisGroup | None = None, pipeline: AxisGroup | None = None,
                 sequence_groups: tuple[AxisGroup, ...] = (),
                 allow_empty: bool = False, expert_tensor: ExpertTensor | None = None,
                 clock: Stopwatch | None = None):
        self.moe = moe or MoEConfig()
        self.group, self.token_group, self.pipeline = group, token_group, pipeline
        self.roots = [model] if isinstance(model, nn.Module) else list(model)
        cfg = getattr(self.roots[0], "config", None)
        where = type(self.roots[0]).__name__
        parts = [(root, *p) for root in self.roots
                 for p in find_blocks(root, blocks, keep_whole=group.size == 1)]
        if not parts and not allow_empty:
            raise UnsupportedMoELayout(f"no module of {where} matches the MoE blocks "
                                       f"{list(blocks)}")
        self.kept = [name for _, name, _, experts in parts if experts is None]
        if self.kept:
            parts = _with_recorded_routers(parts)
        self.names = [name for _, name, _, _ in parts]
        self.num_experts = _num_experts([p[1:] for p in parts], cfg, where)
        top_k = (getattr(parts[0][2], "top_k", None) if parts else None) or \
            experts_per_token(cfg)
        if not top_k:
            raise UnsupportedMoELayout(f"{where}: cannot find the router's top-k")
        self.top_k = int(top_k)
        self.stats = MoEStats(self.num_experts, self.names, clock)
        self._hooks: list[Any] = []
        biases = {name: bias for root, name, _, _ in parts
                  if (bias := correction_bias(root.get_submodule(name))) is not None}
        # DeepSeek-V3's sequence-wise loss for its sigmoid routers, Switch's otherwise;
        # one choice for the whole model, since pipeline stages carry the loss's numbers
        # along and must agree on their size (a stage may hold no biased router).
        sequence_wise = _agreed(bool(biases) and all(
            sigmoid_scored(r) for _, n, r, _ in parts if n in biases and r is not None),
            pipeline)
        common = {"aux_coef": aux_coef(self.moe, cfg), "z_coef": self.moe.z_loss_coef,
                  "group": token_group}
        self.losses = (SequenceLosses(self.num_experts, self.top_k,
                                      sequence_groups=sequence_groups, **common)
                       if sequence_wise else RouterLosses(self.num_experts, self.top_k,
                                                          **common))
        if isinstance(self.losses, SequenceLosses):
            self._hooks = [root.get_submodule(name).register_forward_pre_hook(
                self.losses.note_block_input) for root, name, _, _ in parts if name in biases]
        # Every stage gets a balancer when any stage holds a bias: its update gathers the
        # metric over the stages, and a stage of dense layers (DeepSeek-V3's first
        # layers) that skipped it would leave the others in a collective of their own.
        self.balancer = (BiasBalancer(biases, self.moe.bias_update_rate, pipeline=pipeline)
                         if self.moe.bias_update_rate > 0 and _agreed(bool(biases), pipeline)
                         else None)
        self.recording = True
        self.recording_losses = True  # also in a gradient check's forward (attach)
        self.experts: dict[str, ExpertParallelExperts] = {}
        chunked = chunked_wanted(self.moe.dispatch_chunks, group)  # once: one warning
        for root, name, router, experts in parts:
            layer = self.stats.layers[name]
            if experts is not None:
                self.experts[name] = shard_experts(experts, group, moe=self.moe, stats=layer,
                                                   name=f"{name}.experts",
                                                   expert_tensor=expert_tensor,
                                                   chunked=chunked)
            if router is not None:
                self._hooks.append(watch_router(router, stats=layer, losses=self.losses,
                                                recording=lambda: self.recording,
                                                recording_losses=lambda: self.recording_losses,
                                                index=logits_index(root, router)))

    def set_recording(self, on: bool) -> None:
        """Off while activations are recomputed: routing is counted once per forward."""
        self.recording = on
        for experts in self.experts.values():
            experts.recording = on

    def set_capacity_groups(self, groups: int) -> None:
        """Apply capacity to ``groups`` equal runs of each forward's tokens separately:
        how one process reproduces the drops of ``groups`` ranks holding those runs
        (:func:`paraxis_moe.capacity.grouped_keep_mask`)."""
        for experts in self.experts.values():
            experts.capacity_groups = groups

    def attach(self, aux: AuxLosses) -> None:
        """Hand each forward's router-loss carry to ``aux`` (core's
        :class:`paraxis.parallel.batch.AuxLosses`, whose carry slot this declares); record
        routing only between the start and end of a forward of a root module."""
        slot = aux.declare_carry(self.losses.carry_size, self.losses.finalize)
        aux.unlike_model = self.losses.unlike_model

        def start(module: nn.Module, args: Any) -> None:
            # Statistics count training forwards only: evaluation is not counted, nor the
            # parity probe and gradient checks (engine.fp32_backward, ``aux.checking``),
            # whose routing would otherwise enter the next step's counts and bias
            # update. The losses are recorded there too: a check's gradients must hold
            # the router loss's (issue 32).
            grad = torch.is_grad_enabled()
            self.set_recording(grad and module.training and not aux.checking)
            self.recording_losses = grad and (module.training or aux.checking)

        def end(module: nn.Module, args: Any, output: Any) -> None:
            self.set_recording(False)
            self.recording_losses = False
            if not torch.is_grad_enabled():
                self.losses.clear()  # evaluation: no loss, nothing carried
                return
            found = self.losses.local()
            if found is not None:
                aux.carry(slot, *found)

        for root in self.roots:
            self._hooks.append(root.register_forward_pre_hook(start))
            self._hooks.append(root.register_forward_hook(end))
        self.set_recording(False)
        self.recording_losses = False

    def step_metrics(self) -> dict[str, float]:
        """This step's statistics, reduced over the token group and gathered over the
        pipeline (collective). The arrays stay in ``self.stats.last``."""
        return self.stats.metrics(self.token_group, self.pipeline)

    def after_step(self) -> dict[str, float]:
        """Core's post-step hook: the step's metrics (:meth:`step_metrics`), then, with
        ``moe.bias_update_rate`` and correction biases, DeepSeek-V3's bias update from
        the same globally reduced counts (:class:`paraxis_moe.balance.BiasBalancer`)."""
        metrics = self.step_metrics()
        if self.balancer is not None:
            metrics.update(self.balancer.update(self.stats.last))
        return metrics

    @property
    def last_step(self) -> dict[str, dict[str, torch.Tensor]]:
        """The last step's per-layer arrays (every layer of the model): per expert
        ``assigned``, ``accepted``, ``dropped``, ``processed``, ``bytes_per_expert``,
        ``compute_s_per_expert``, ``prob_sum``; ``hist`` (routing probabilities, 10 bins
        over [0, 1]); per block ``dispatch_bytes``, ``dispatch_s``, ``expert_compute_s``
        (the busiest rank's), ``entropy_sum``, ``tokens``."""
        return self.stats.last

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _agreed(local: bool, pipeline: AxisGroup | None) -> bool:
    """True when any pipeline stage says so (collective over ``pipeline``)."""
    if pipeline is None or pipeline.size == 1:
        return local
    flag = torch.tensor([float(local)], device=device_for_rank())  # NCCL needs it there
    all_reduce_(flag, pipeline, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)
