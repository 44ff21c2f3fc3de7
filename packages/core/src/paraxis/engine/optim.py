"""Core's default optimizer (AdamW, decay for matrices only) and the warmup-cosine
learning-rate schedule. Global gradient-norm clipping is in
:mod:`paraxis.parallel.norms` (axes that own gradient shards call it too)."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["WarmupCosine", "build_adamw"]


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
