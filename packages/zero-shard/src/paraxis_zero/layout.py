"""How ZeRO lays a set of parameters out over one group: per parameter along dim 0.

Each parameter is split along dim 0 into ``n`` chunks of ``ceil(rows / n)`` rows, the
last ones padded with zero rows (FSDP2's per-parameter sharding, Zhao et al.,
arXiv:2304.11277), so every shard is a region ``[offset, length]`` of dim 0 that a
:class:`paraxis.parallel.placement.Placement` describes, nested inside a tensor-parallel piece
when there is one. ``rows`` are the rows of the *local* tensor (a tensor shard's padding
rows included).

One collective moves the shards of all parameters of a :class:`ShardLayout` at once,
through a rank-major flat buffer: rank r's part holds its chunk of every parameter, in
order, ``per_rank`` elements in all. :func:`ShardLayout.to_rank_major` and
:func:`ShardLayout.from_rank_major` convert between that and each parameter's natural
(row-major) layout; padding travels as zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from paraxis.parallel.placement import Placement
from paraxis.runtime.grid import AxisGroup

__all__ = ["ShardLayout"]


@dataclass(eq=False)
class ShardLayout:
    """Parameters of one gradient-sync ``group`` (one dtype), sharded along dim 0."""

    group: AxisGroup
    params: list[nn.Parameter]
    rows: list[int]
    row_numel: list[int]
    chunk: list[int]
    offsets: list[int]
    per_rank: int
    # What the reduce-scattered sum is divided by: the ranks holding distinct tokens
    # (Grid.token_replicas), which for an expert parameter exceeds its group.
    divisor: int = 0

    @classmethod
    def build(cls, group: AxisGroup, params: list[nn.Parameter],
              divisor: int = 0) -> ShardLayout:
        n = group.size
        rows = [p.shape[0] for p in params]
        row_numel = [math.prod(p.shape[1:]) for p in params]
        chunk = [-(-r // n) for r in rows]
        offsets, total = [], 0
        for c, e in zip(chunk, row_numel, strict=True):
            offsets.append(total)
            total += c * e
        return cls(group, params, rows, row_numel, chunk, offsets, total, divisor or n)

    def shard_numel(self, i: int) -> int:
        return self.chunk[i] * self.row_numel[i]

    def padded_numel(self, i: int) -> int:
        """Elements of parameter ``i`` padded to ``group.size`` whole chunks."""
        return self.group.size * self.shard_numel(i)

    def shard_shape(self, i: int) -> tuple[int, ...]:
        return (self.chunk[i], *self.params[i].shape[1:])

    def rank_rows(self, i: int, rank: int | None = None) -> tuple[int, int, int]:
        """(offset, real rows, padding rows) of ``rank``'s chunk of parameter ``i``."""
        rank = self.group.rank if rank is None else rank
        c, r = self.chunk[i], self.rows[i]
        offset = min(rank * c, r)
        length = max(0, min(c, r - offset))
        return offset, length, c - length

    def placement(self, i: int, rec: Placement) -> Placement:
        """``rec`` (the local tensor's record) with this rank's chunk of dim 0 split over
        the group's axes."""
        offset, length, padding = self.rank_rows(i)
        return rec.sharded(dim=0, axis=self.group.axes, offset=offset, length=length,
                           padding=padding)

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s column of a rank-major ``(n x per_rank)`` buffer: (n, shard)."""
        s = self.offsets[i]
        return buffer.view(self.group.size, self.per_rank)[:, s:s + self.shard_numel(i)]

    def own(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's chunk of parameter ``i`` in a ``per_rank`` buffer, shard-shaped."""
        s = self.offsets[i]
        return buffer[s:s + self.shard_numel(i)].view(self.shard_shape(i))

    def to_rank_major(self, buffer: torch.Tensor, i: int, src: torch.Tensor | None) -> None:
        """Write parameter ``i``'s full tensor ``src`` (natural layout, ``rows`` or
        padded rows) into its slot of ``buffer``; padding and a missing ``src`` are
        zeros."""
        dst = self.slot(buffer, i)
        if src is None:
            dst.zero_()
            return
        flat, s = src.reshape(-1), self.shard_numel(i)
        real = min(flat.numel(), self.rows[i] * self.row_numel[i])
        whole = real // s
        if whole:
            dst[:whole].copy_(flat[:whole * s].view(whole, s))
        if whole < self.group.size:
            rest = real - whole * s
            dst[whole, :rest].copy_(flat[whole * s:real])
            dst[whole, rest:].zero_()
            dst[whole + 1:].zero_()

    def from_rank_major(self, buffer: torch.Tensor, i: int, dst: torch.Tensor) -> None:
        """Copy parameter ``i`` from its slot of ``buffer`` into ``dst`` (natural layout,
        its real rows, or padded rows: then the padding is copied too)."""
        src, flat, s = self.slot(buffer, i), dst.view(-1), self.shard_numel(i)
        real = flat.numel()
        whole = min(real // s, self.group.size)
        if whole:
            flat[:whole * s].view(whole, s).copy_(src[:whole])
        if whole < self.group.size and real > whole * s:
            flat[whole * s:].copy_(src[whole, :real - whole * s])
