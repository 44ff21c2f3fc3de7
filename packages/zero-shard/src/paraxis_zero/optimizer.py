"""The optimizer of a ZeRO rank: ``train.optimizer`` over what this rank owns.

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

from paraxis.config.run import TrainSection
from paraxis.parallel.norms import clip_grad_norm
from paraxis.parallel.optimizers import make_optimizer, optimizer_class
from paraxis.runtime.grid import Grid

__all__ = ["ShardOwner", "zero_optimizer"]


class ShardOwner(Protocol):
    """What the optimizer calls back: after each step (stages 1 and 2 all-gather the
    updated shards into the model) and on ``zero_grad``."""

    def after_step(self) -> None: ...

    def zero_grad(self) -> None: ...


class _StepsShards:
    """Mixed in before the optimizer class: after each step the owner brings the updated
    shards back into the model; ``zero_grad`` clears the owner's buffers too; clipping
    counts every element of the shards once across the grid."""

    grid: Grid
    owner: ShardOwner
    owned: list[nn.Parameter]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = super().step(closure)  # type: ignore[misc]
        self.owner.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        self.owner.zero_grad()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the shards' gradients to a global norm of ``max_norm`` (every element
        counted once across the grid, from placements); returns the norm before."""
        return clip_grad_norm(self.owned, max_norm, self.grid)


def zero_optimizer(params: list[nn.Parameter], train: TrainSection, *, grid: Grid,
                   owner: ShardOwner) -> torch.optim.Optimizer:
    """``train.optimizer`` over this rank's shards (an elementwise one: core refuses the
    others under ZeRO before any process group), as ``Zero<Class>``; matrices decay,
    vectors do not, as core's optimizer."""
    base = optimizer_class(train.optimizer)
    cls = type(f"Zero{base.__name__}", (_StepsShards, base), {})
    optimizer = make_optimizer(params, train, cls)
    optimizer.grid, optimizer.owner, optimizer.owned = grid, owner, params
    return optimizer
