"""The optimizer of a ZeRO rank: AdamW over what this rank owns.

ZeRO (Rajbhandari et al., arXiv:1910.02054, section 5) has each data-parallel rank keep
and update only its partition of the optimizer state. The parameters given here are
this rank's fp32 shards (stages 1 and 2: views of the model's own parameters; stage 3:
the model's parameters, which hold their shard between uses) and the parameters kept
whole; each carries a placement record, so checkpoints store the state where it lives
and the global gradient norm counts every element once
(:func:`paraxis.parallel.norms.clip_grad_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from paraxis.parallel.norms import clip_grad_norm
from paraxis.runtime.grid import Grid

__all__ = ["ShardOwner", "ZeroAdamW"]


class ShardOwner(Protocol):
    """What the optimizer calls back: after each step (stages 1 and 2 all-gather the
    updated shards into the model) and on ``zero_grad``."""

    def after_step(self) -> None: ...

    def zero_grad(self) -> None: ...


class ZeroAdamW(torch.optim.AdamW):
    """AdamW over this rank's shards; matrices decay, vectors do not (as core's AdamW)."""

    def __init__(self, params: list[nn.Parameter], *, grid: Grid, owner: ShardOwner,
                 lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)):
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]], lr=lr, betas=betas)
        self.grid, self.owner = grid, owner
        self.owned = params

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        self.owner.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.owner.zero_grad()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the shards' gradients to a global norm of ``max_norm`` (every element
        counted once across the grid, from placements); returns the norm before."""
        return clip_grad_norm(self.owned, max_norm, self.grid)
