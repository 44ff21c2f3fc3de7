"""The global gradient norm and clipping, over every axis of the grid.

Clipping reads placement records so each element is counted once across the grid,
however the parameter is sharded, replicated or owned by one pipeline stage. The engine
calls it, and so does an axis whose optimizer owns gradient shards (ZeRO).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from paraxis.parallel.placement import placement_of
from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import Grid

__all__ = ["clip_grad_norm", "grad_norm", "grad_norms_by_name"]


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


def grad_norms_by_name(params: Iterable[nn.Parameter], grid: Grid,
                       names: list[str]) -> torch.Tensor:
    """Each named parameter's global gradient norm (float64, in the order of ``names``),
    every element counted once as in :func:`grad_norm`; one all-reduce of a vector over
    the grid. A name no rank holds (or whose gradient is None everywhere) reads 0.
    Collective: every rank passes the same ``names``."""
    index = {name: i for i, name in enumerate(names)}
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    local = torch.zeros(len(names), dtype=torch.float64, device=device)
    for p in params:
        rec = placement_of(p)
        if p.grad is None or rec.mirror or rec.name not in index:
            continue
        copies = math.prod(grid.size(a) for a in rec.replicated)
        local[index[rec.name]] += p.grad.detach().double().pow(2).sum() / copies
    all_reduce_(local, grid.world)
    return local.sqrt()
