"""Optimizer, learning-rate schedule and global gradient-norm clipping.

Clipping reads placement records so each element is counted once across the grid,
however the parameter is sharded, replicated or owned by one pipeline stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from paraxis.collectives import all_reduce_
from paraxis.grid import Grid
from paraxis.placement import placement_of

__all__ = ["WarmupCosine", "build_adamw", "clip_grad_norm"]


def build_adamw(model: nn.Module, *, lr: float, weight_decay: float,
                betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, biases) do not, as in GPT-3 / Megatron."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


class WarmupCosine:
    """Linear warmup from 0 to the peak over ``warmup`` steps, then cosine decay to
    ``min_ratio`` x peak at ``total``. A plain object whose state is two ints."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup: int, total: int,
                 min_ratio: float = 0.1):
        self.optimizer, self.warmup, self.total, self.min_ratio = (
            optimizer, warmup, total, min_ratio)
        self.peaks = [g["lr"] for g in optimizer.param_groups]
        self.step_count = 0
        self._apply()

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        f = self.factor(self.step_count)
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = peak * f

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, object]:
        return {"step_count": self.step_count, "peaks": self.peaks}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step_count = int(state["step_count"])  # type: ignore[call-overload]
        self.peaks = [float(x) for x in state["peaks"]]  # type: ignore[attr-defined]
        self._apply()


def grad_norm(params: Iterable[nn.Parameter], grid: Grid) -> torch.Tensor:
    """The global L2 norm of all gradients, every element counted once.

    Each rank adds its local squares divided by the number of ranks holding the same
    values (the product of the degrees the placement says it is replicated over); one
    sum over the whole grid then counts each element exactly once, whatever mix of
    sharded, replicated and stage-local parameters the grid holds.
    """
    by_copies: dict[int, list[torch.Tensor]] = {}
    for p in params:
        rec = placement_of(p)
        if p.grad is not None and not rec.mirror:
            copies = math.prod(grid.size(a) for a in rec.replicated)
            by_copies.setdefault(copies, []).append(p.grad)
    device = next((g[0].device for g in by_copies.values()), torch.device("cpu"))
    local = torch.zeros((), dtype=torch.float64, device=device)  # NCCL needs it on device
    for copies, grads in by_copies.items():
        # One fused kernel per group (torch's clip_grad_norm_ machinery).
        local += torch.nn.utils.get_total_norm(grads).double() ** 2 / copies
    all_reduce_(local, grid.world)
    return local.sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, grid: Grid) -> float:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm
    before clipping. ``max_norm <= 0`` only measures."""
    norm = grad_norm(params, grid)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.float())
    return float(norm)
