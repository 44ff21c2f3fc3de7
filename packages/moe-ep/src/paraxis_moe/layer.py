"""A model's MoE blocks made expert parallel, with their statistics and router losses.

A block is the model's own module (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``
with its shared expert, ``DeepseekV3MoE``...): paraxis keeps it and its router, and
replaces only its ``experts`` child's forward (:mod:`paraxis_moe.experts`). The router
is the block's ``gate`` or ``router`` child, whichever the family names it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from paraxis.grid import AxisGroup
from paraxis_moe.config import MoEConfig, experts_per_token
from paraxis_moe.experts import (
    ExpertParallelExperts,
    UnsupportedMoELayout,
    check_experts,
    shard_experts,
)
from paraxis_moe.router import RouterLosses, watch_router
from paraxis_moe.stats import MoEStats

__all__ = ["ExpertParallel", "find_router", "moe_block_names"]

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
    names = [n for n, _ in model.named_modules()
             if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not names:
        raise UnsupportedMoELayout(f"no module of {type(model).__name__} matches the MoE "
                                   f"blocks {list(patterns)}")
    return names


class ExpertParallel:
    """Every named MoE block of ``model`` sharded over ``group`` (the expert axis).

    ``token_group`` holds the ranks with distinct tokens (data x expert x context), over
    which the router losses' counts and the statistics are reduced. Every rank of the
    grid must build it with the same arguments.
    """

    def __init__(self, model: nn.Module, blocks: Sequence[str], group: AxisGroup, *,
                 moe: MoEConfig | None = None, token_group: AxisGroup | None = None):
        self.moe = moe or MoEConfig()
        self.group, self.token_group = group, token_group
        self.names = moe_block_names(model, blocks)
        parts = []
        for name in self.names:  # check everything before changing anything
            block = model.get_submodule(name)
            experts = getattr(block, "experts", None)
            check_experts(experts, f"{name}.experts")
            parts.append((name, find_router(block, name), experts))
        sizes = {experts.num_experts for _, _, experts in parts}
        if len(sizes) != 1:
            raise UnsupportedMoELayout(f"MoE blocks of {type(model).__name__} have different "
                                       f"expert counts {sorted(sizes)}")
        self.num_experts = sizes.pop()
        cfg = getattr(model, "config", None)
        top_k = getattr(parts[0][1], "top_k", None) or experts_per_token(cfg)
        if not top_k:
            raise UnsupportedMoELayout(f"{self.names[0]}: cannot find the router's top-k")
        self.top_k = int(top_k)
        self.stats = MoEStats(self.num_experts, self.names)
        self.losses = RouterLosses(self.num_experts, self.top_k,
                                   aux_coef=self.moe.aux_coef_for(cfg),
                                   z_coef=self.moe.z_loss_coef, group=token_group)
        self.recording = True
        self.experts: dict[str, ExpertParallelExperts] = {}
        self._hooks: list[Any] = []
        for name, router, experts in parts:
            layer = self.stats.layers[name]
            self.experts[name] = shard_experts(experts, group, moe=self.moe, stats=layer,
                                               name=f"{name}.experts")
            self._hooks.append(watch_router(router, stats=layer, losses=self.losses,
                                            recording=lambda: self.recording))

    def set_recording(self, on: bool) -> None:
        """Off while activations are recomputed: routing is counted once per forward."""
        self.recording = on
        for experts in self.experts.values():
            experts.recording = on

    def attach(self, root: nn.Module, add: Callable[[str, torch.Tensor], None]) -> None:
        """After each forward of ``root``, hand the router-loss parts to ``add`` (core's
        ``AuxLosses.add``); record only between the start and end of that forward."""

        def start(module: nn.Module, args: Any) -> None:
            self.set_recording(True)

        def end(module: nn.Module, args: Any, output: Any) -> None:
            parts = self.losses.parts()  # collective: every forward, every rank
            self.set_recording(False)
            if torch.is_grad_enabled():
                for name, part in parts.items():
                    add(name, part)

        self._hooks.append(root.register_forward_pre_hook(start))
        self._hooks.append(root.register_forward_hook(end))
        self.set_recording(False)

    def step_metrics(self) -> dict[str, float]:
        """This step's statistics, reduced over the token group (collective)."""
        return self.stats.metrics(self.token_group)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
