"""Differentiable collectives over the tensor group (Megatron-LM, arXiv:1909.08053, and
sequence parallelism, Korthikanti et al., arXiv:2205.05198).

Each op is an autograd function whose backward is the conjugate collective:

| op                    | forward                  | backward                 |
| --------------------- | ------------------------ | ------------------------ |
| ``copy_to_region``    | identity (Megatron's f)  | all-reduce               |
| ``reduce_from_region``| all-reduce (Megatron's g)| identity                 |
| ``gather_last``       | all-gather, last dim     | keep own slice           |
| ``split_last``        | keep own slice, last dim | all-gather               |
| ``gather_seq``        | all-gather, sequence dim | reduce-scatter           |
| ``reduce_scatter_seq``| reduce-scatter, sequence | all-gather               |
| ``split_seq``         | keep own slice, sequence | all-gather               |

Every op counts the bytes it sends into ``CommStats`` when one is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paraxis.grid import AxisGroup

__all__ = [
    "SEQ_DIM",
    "CommStats",
    "copy_to_region",
    "gather_last",
    "gather_seq",
    "reduce_from_region",
    "reduce_scatter_seq",
    "split_last",
    "split_seq",
]

SEQ_DIM = 1  # activations are (batch, sequence, hidden)


@dataclass
class CommStats:
    """Bytes this rank put on the wire for tensor-parallel collectives, by op, using the
    bus-bandwidth convention: ring all-reduce 2(t-1)/t x size, all-gather and
    reduce-scatter (t-1)/t x the full size."""

    bytes_by_op: dict[str, float]

    def __init__(self) -> None:
        self.bytes_by_op = {}

    def add(self, op: str, nbytes: float) -> None:
        self.bytes_by_op[op] = self.bytes_by_op.get(op, 0.0) + nbytes

    @property
    def total(self) -> float:
        return sum(self.bytes_by_op.values())


def _count(stats: CommStats | None, op: str, t: torch.Tensor, group: AxisGroup,
           factor: float) -> None:
    if stats is not None:
        n = group.size
        stats.add(op, factor * (n - 1) / n * t.numel() * t.element_size())


def _all_reduce(x: torch.Tensor, group: AxisGroup, stats: CommStats | None) -> torch.Tensor:
    x = x.contiguous().clone()
    _count(stats, "all_reduce", x, group, 2.0)
    dist.all_reduce(x, group=group.pg)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: AxisGroup,
                stats: CommStats | None) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.pg)
    out = torch.cat(parts, dim=dim)
    _count(stats, "all_gather", out, group, 1.0)
    return out


def _reduce_scatter(x: torch.Tensor, dim: int, group: AxisGroup,
                    stats: CommStats | None) -> torch.Tensor:
    chunks = [c.contiguous() for c in x.chunk(group.size, dim=dim)]
    out = torch.empty_like(chunks[group.rank])
    _count(stats, "reduce_scatter", x, group, 1.0)
    dist.reduce_scatter(out, chunks, group=group.pg)
    return out


def _own(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over "
                         f"{group.size} tensor ranks")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, stats: Any) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_reduce(grad, ctx.group, ctx.stats), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, stats: Any) -> torch.Tensor:
        return _all_reduce(x, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps the slice (``reduce`` False) or
    reduce-scatters (``reduce`` True: the gathered copies each got a gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, reduce: bool, group: AxisGroup,
                stats: Any) -> torch.Tensor:
        ctx.dim, ctx.reduce, ctx.group, ctx.stats = dim, reduce, group, stats
        return _all_gather(x, dim, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.reduce:
            out = _reduce_scatter(grad, ctx.dim, ctx.group, ctx.stats)
        else:
            out = _own(grad, ctx.dim, ctx.group)
        return out, None, None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: AxisGroup,
                stats: Any) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return _own(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_gather(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: AxisGroup,
                stats: Any) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.stats = dim, group, stats
        return _reduce_scatter(x, dim, group, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_gather(grad, ctx.dim, ctx.group, ctx.stats), None, None, None


def copy_to_region(x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None):
    return _CopyToRegion.apply(x, group, stats)


def reduce_from_region(x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None):
    return _ReduceFromRegion.apply(x, group, stats)


def gather_last(x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None):
    return _Gather.apply(x, -1, False, group, stats)


def split_last(x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None):
    return _Split.apply(x, -1, group, stats)


def gather_seq(x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None):
    return _Gather.apply(x, SEQ_DIM, True, group, stats)


def reduce_scatter_seq(x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None):
    return _ReduceScatter.apply(x, SEQ_DIM, group, stats)


def split_seq(x: torch.Tensor, group: AxisGroup, stats: CommStats | None = None):
    return _Split.apply(x, SEQ_DIM, group, stats)
