"""How ZeRO lays a set of parameters out over one group: per parameter along one dim.

Each parameter is split along one dimension ``d`` into ``n`` chunks of
``ceil(rows / n)`` rows, the last ones padded with zero rows (FSDP2's per-parameter
sharding, Zhao et al., arXiv:2304.11277), so every shard is a region ``[offset,
length]`` of dim ``d`` that a :class:`paraxis.parallel.placement.Placement` describes,
nested inside a tensor-parallel piece when there is one. ``rows`` are the rows of the
*local* tensor (a tensor shard's padding rows included).

``d`` is 0 (FSDP2's dim 0) unless dim 0 has fewer rows than the group has ranks: a
fused expert tensor ``(local experts, rows, cols)`` with one local expert over two
replicas would leave one rank all of it and the other only padding (issue 36: 1.99x
the optimizer state of the plan on Mixtral-8x7B at expert 8 x data 2). Such a tensor is
viewed as ``(prefix, rows of d, suffix)`` over the first dimension ``d`` whose size is
a multiple of ``n``, and split there, as torchtitan shards experts on dim 1 when the
data-parallel degree exceeds their number (its ``shard_placement_fn``): every rank
holds 1/n of it. A split of the flattened elements would do the same but is no region
of the tensor: placements (checkpoints, norms, the planner) describe regions.

One collective moves the shards of all parameters of a :class:`ShardLayout` at once,
through a rank-major flat buffer: rank r's part holds its chunk of every parameter, in
order, ``per_rank`` elements in all. :func:`ShardLayout.to_rank_major` and
:func:`ShardLayout.from_rank_major` convert between that and each parameter's natural
layout; padding travels as zeros.

Under hybrid sharding (``parallelism.zero_shard``, HSDP) the group is a shard group
inside the data axis and ``replicas`` the ranks holding the same shards: the placement
splits ``data`` into its two parts (:mod:`paraxis.runtime.subaxes`) and is sharded over
the inner one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from paraxis.parallel.placement import Placement
from paraxis.runtime.grid import AxisGroup
from paraxis.runtime.subaxes import sub_axis_names

__all__ = ["ShardLayout", "shard_dim"]


def shard_dim(shape: tuple[int, ...] | torch.Size, n: int) -> int:
    """The dimension ZeRO splits a tensor of ``shape`` along over ``n`` ranks: 0 when it
    has at least ``n`` rows, else the first dimension whose size is a multiple of ``n``
    (no padding, every rank 1/n), else 0."""
    if len(shape) < 2 or shape[0] >= n:
        return 0
    return next((d for d in range(1, len(shape)) if shape[d] >= n and shape[d] % n == 0), 0)


@dataclass(eq=False)
class ShardLayout:
    """Parameters of one gradient-sync ``group`` (one dtype), each sharded along its
    ``dims[i]``, viewed as ``(prefix, rows, suffix)`` around it."""

    group: AxisGroup
    params: list[nn.Parameter]
    shapes: list[tuple[int, ...]]  # the local tensors' shapes (ZeRO-3 swaps p.data)
    dims: list[int]
    prefix: list[int]
    rows: list[int]
    suffix: list[int]
    chunk: list[int]
    offsets: list[int]
    per_rank: int
    # What the reduce-scattered sum is divided by: the ranks holding distinct tokens
    # (Grid.token_replicas), which for an expert parameter exceeds its group.
    divisor: int = 0
    # HSDP: the ranks holding the same shards (their gradients are all-reduced there)
    # and the cut axis' (name, outer part, inner part) the placement says.
    replicas: AxisGroup | None = None
    split: tuple[str, str, str] | None = None

    @classmethod
    def build(cls, group: AxisGroup, params: list[nn.Parameter], divisor: int = 0, *,
              replicas: AxisGroup | None = None, split: str | None = None) -> ShardLayout:
        n = group.size
        dims = [shard_dim(p.shape, n) for p in params]
        prefix = [math.prod(p.shape[:d]) for p, d in zip(params, dims, strict=True)]
        rows = [p.shape[d] for p, d in zip(params, dims, strict=True)]
        suffix = [math.prod(p.shape[d + 1:]) for p, d in zip(params, dims, strict=True)]
        chunk = [-(-r // n) for r in rows]
        offsets, total = [], 0
        for a, c, s in zip(prefix, chunk, suffix, strict=True):
            offsets.append(total)
            total += a * c * s
        cut = (split, *sub_axis_names(split)) if split else None
        return cls(group, params, [tuple(p.shape) for p in params], dims, prefix, rows,
                   suffix, chunk, offsets, total, divisor or n, replicas, cut)

    def shard_numel(self, i: int) -> int:
        return self.prefix[i] * self.chunk[i] * self.suffix[i]

    def padded_numel(self, i: int) -> int:
        """Elements of parameter ``i`` padded to ``group.size`` whole chunks."""
        return self.group.size * self.shard_numel(i)

    def shard_shape(self, i: int) -> tuple[int, ...]:
        shape = list(self.shapes[i])
        shape[self.dims[i]] = self.chunk[i]
        return tuple(shape)

    def padded_shape(self, i: int) -> tuple[int, ...]:
        """Parameter ``i``'s shape with ``group.size`` whole chunks along its dim."""
        shape = list(self.shapes[i])
        shape[self.dims[i]] = self.chunk[i] * self.group.size
        return tuple(shape)

    def rank_rows(self, i: int, rank: int | None = None) -> tuple[int, int, int]:
        """(offset, real rows, padding rows) of ``rank``'s chunk of parameter ``i``."""
        rank = self.group.rank if rank is None else rank
        c, r = self.chunk[i], self.rows[i]
        offset = min(rank * c, r)
        length = max(0, min(c, r - offset))
        return offset, length, c - length

    def placement(self, i: int, rec: Placement) -> Placement:
        """``rec`` (the local tensor's record) with this rank's chunk of its dim split
        over the group's axes (under HSDP, the cut axis first split into its parts)."""
        offset, length, padding = self.rank_rows(i)
        if self.split is not None:
            axis, outer, inner = self.split
            rec = dataclasses.replace(rec, replicated=_cut(rec.replicated, axis, outer, inner),
                                      averaged=_cut(rec.averaged, axis, outer, inner))
        return rec.sharded(dim=self.dims[i], axis=self.group.axes, offset=offset,
                           length=length, padding=padding)

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s column of a rank-major ``(n x per_rank)`` buffer: (n, shard)."""
        s = self.offsets[i]
        return buffer.view(self.group.size, self.per_rank)[:, s:s + self.shard_numel(i)]

    def own(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's chunk of parameter ``i`` in a ``per_rank`` buffer, shard-shaped."""
        s = self.offsets[i]
        return buffer[s:s + self.shard_numel(i)].view(self.shard_shape(i))

    def _chunks(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """The slot as (rank, prefix, chunk rows, suffix)."""
        return self.slot(buffer, i).view(self.group.size, self.prefix[i], self.chunk[i],
                                         self.suffix[i])

    def to_rank_major(self, buffer: torch.Tensor, i: int, src: torch.Tensor | None) -> None:
        """Write parameter ``i``'s full tensor ``src`` (natural layout, ``rows`` or
        padded rows along its dim) into its slot of ``buffer``; padding and a missing
        ``src`` are zeros."""
        dst = self._chunks(buffer, i)
        if src is None:
            dst.zero_()
            return
        c, n = self.chunk[i], self.group.size
        src3 = src.reshape(self.prefix[i], -1, self.suffix[i])
        real = min(src3.shape[1], self.rows[i])
        whole = real // c
        if whole:
            dst[:whole].copy_(src3[:, :whole * c].unflatten(1, (whole, c)).transpose(0, 1))
        if whole < n:
            rest = real - whole * c
            dst[whole, :, :rest].copy_(src3[:, whole * c:real])
            dst[whole, :, rest:].zero_()
            dst[whole + 1:].zero_()

    def from_rank_major(self, buffer: torch.Tensor, i: int, dst: torch.Tensor) -> None:
        """Copy parameter ``i`` from its slot of ``buffer`` into ``dst`` (natural layout,
        its real rows, or padded rows along its dim: then the padding is copied too)."""
        src, c = self._chunks(buffer, i), self.chunk[i]
        dst3 = dst.view(self.prefix[i], -1, self.suffix[i])
        real = dst3.shape[1]
        whole = min(real // c, self.group.size)
        if whole:
            dst3[:, :whole * c].unflatten(1, (whole, c)).copy_(src[:whole].transpose(0, 1))
        if whole < self.group.size and real > whole * c:
            dst3[:, whole * c:].copy_(src[whole, :, :real - whole * c])


def _cut(axes: tuple[str, ...], axis: str, outer: str, inner: str) -> tuple[str, ...]:
    """``axes`` with ``axis`` replaced by its two parts."""
    return tuple(part for a in axes for part in ((outer, inner) if a == axis else (a,)))
