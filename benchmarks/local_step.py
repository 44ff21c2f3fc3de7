"""A peer's optimizer step on its parameters' local tensors: what every benchmark's DTensor
or FSDP2 peer steps with, so the peer pays what paraxis pays.

torch's AdamW and ``clip_grad_norm_`` on DTensor parameters dispatch every elementwise
op through DTensor, one parameter at a time (foreach kernels refuse DTensors on CPU):
an earlier measurement put the MoE peer's optimizer step at about 2x its local-tensor
cost, and issue 32 found the tensor- and data-parallel peers paying the same while
moving the same bytes as paraxis (tp_vs_dtensor: 9.01 vs 9.01 MiB, 137 vs 192 ms).
paraxis steps plain local tensors (foreach). Here the peer does too: AdamW (foreach)
over leaf tensors that alias each parameter's local shard, and one global-norm clip
whose sum of squares over sharded gradients is one all-reduce on the peer's group (a
replicated parameter counted once). The update is the peer's own algorithm; only the
dispatch overhead is gone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["LocalAdamW", "local_grad"]


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's gradient laid out as its parameter (a gradient that comes back in
    another placement, a Replicate embedding gradient of a Shard(0) weight or a
    Partial one, is redistributed first: the peer's own communication)."""
    g = p.grad
    if not isinstance(g, DTensor):
        return g
    if g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local()


def _sharded(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


class LocalAdamW:
    """AdamW with global-norm clipping over ``params`` (DTensors or plain tensors) on
    their local tensors; ``group`` is the process group the sharded ones are split over
    (None: the world). Weight decay on matrices only, as paraxis applies it, unless
    ``decay_vectors``."""

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0,
                 decay_vectors: bool = False, group: dist.ProcessGroup | None = None):
        self.params = list(params)
        self.group = group
        with torch.no_grad():  # leaves aliasing each parameter's local storage
            self.local = [p.to_local() if isinstance(p, DTensor) else p for p in self.params]
        self.sharded = [_sharded(p) for p in self.params]
        decays = [decay_vectors or p.ndim >= 2 for p in self.params]
        groups = [{"params": [t for t, d in zip(self.local, decays, strict=True) if d],
                   "weight_decay": weight_decay},
                  {"params": [t for t, d in zip(self.local, decays, strict=True) if not d],
                   "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                     foreach=True)

    def zero_grad(self) -> None:
        for p, t in zip(self.params, self.local, strict=True):
            p.grad = None
            t.grad = None

    def step(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: no clipping) and step; returns the norm before."""
        grads = [local_grad(p) for p in self.params]
        zero = torch.zeros((), dtype=torch.float32)
        split = [g for g, s in zip(grads, self.sharded, strict=True) if s]
        whole = [g for g, s in zip(grads, self.sharded, strict=True) if not s]
        sq = torch.stack([g.float().square().sum() for g in split]).sum() if split else zero
        if split:
            dist.all_reduce(sq, group=self.group)
        if whole:
            sq = sq + torch.stack([g.float().square().sum() for g in whole]).sum()
        norm = sq.sqrt()
        if max_norm:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        for t, g in zip(self.local, grads, strict=True):
            t.grad = g
        self.opt.step()
        return norm
