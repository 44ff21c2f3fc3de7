"""Gradient buckets shared by the data axes: which parameters travel together, and flat
buffers laid out for them.

The scheme of PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020,
arXiv:2006.15704): parameters are packed into buckets of about ``bucket_bytes``, filled
in reverse registration order (which approximates the order backward produces
gradients), one reduction group, dtype and device per bucket, so one collective reduces
a bucket. paraxis-dp-core all-reduces flat buckets whose views are the gradients;
paraxis-zero-shard reduce-scatters buckets of the same assignment and all-reduces flat
buckets of the parameters it keeps whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paraxis.parallel.placement import placement_of
from paraxis.runtime.grid import AxisGroup, Grid

__all__ = ["FlatBucket", "MiB", "adopt_grad", "assign_buckets"]

MiB = 1 << 20


def _sync_axes(p: nn.Parameter) -> tuple[str, ...]:
    return placement_of(p).grad_sync_axes


def assign_buckets(params: Iterable[nn.Parameter], grid: Grid, bucket_bytes: int, *,
                   axes_of: Callable[[nn.Parameter], tuple[str, ...]] = _sync_axes,
                   include_single: bool = False,
                   ) -> list[tuple[AxisGroup, list[nn.Parameter]]]:
    """Buckets of ``params`` in reverse order, keyed by the group ``axes_of`` names (the
    gradient-sync group of each placement by default), dtype and device; a bucket closes
    once it holds ``bucket_bytes``. Parameters whose group has one member need no
    reduction and are left out, unless ``include_single`` (they still need the
    :attr:`~paraxis.runtime.grid.Grid.token_replicas` division). Every rank gets the same
    buckets in the same order."""
    open_buckets: dict[tuple[Any, ...], list[nn.Parameter]] = {}
    sizes: dict[tuple[Any, ...], int] = {}
    done: list[tuple[AxisGroup, list[nn.Parameter]]] = []
    for p in reversed(list(params)):
        group = grid.group(axes_of(p))
        if group.size == 1 and not include_single:
            continue
        key = (group.axes, p.dtype, p.device)
        open_buckets.setdefault(key, []).append(p)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        if sizes[key] >= bucket_bytes:
            done.append((group, open_buckets.pop(key)))
            sizes.pop(key)
    for key, ps in open_buckets.items():
        done.append((grid.group(key[0]), ps))
    return done


@dataclass(eq=False)
class FlatBucket:
    """Parameters whose gradients are views of one flat buffer, reduced by one
    collective over ``group``. ``ready`` holds the indices whose gradient is final this
    step; ``work`` the collective in flight."""

    group: AxisGroup
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    divisor: int = 1  # what the reduced sum is divided by (token_replicas)
    ready: set[int] = field(default_factory=set)
    work: Any = None

    @classmethod
    def allocate(cls, group: AxisGroup, params: list[nn.Parameter],
                 divisor: int = 1) -> FlatBucket:
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        return cls(group, params, buffer, views, divisor)

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)


def adopt_grad(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket view ``view`` (a copy only when the optimizer's
    ``zero_grad(set_to_none=True)`` or accumulation replaced it; zeros if it has none)."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
    param.grad = view
