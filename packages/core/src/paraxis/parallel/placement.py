"""Placement records: how every parameter is laid out over the grid (DESIGN section 3).

After ``parallelize`` each parameter carries a :class:`Placement`: its global name,
global shape and dtype, the dimensions sharded and along which axis (with this rank's
offset and length), and the axes over which it is replicated. Gradient synchronization,
global norm clipping, memory accounting and resharding checkpoints all read this one
record; an axis that changes a parameter's layout replaces the record in the same step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
from torch import nn

from paraxis.config.axes import BUILTIN_AXES, AxisTable

__all__ = [
    "Piece",
    "Placement",
    "Run",
    "Shard",
    "has_placement",
    "placement_of",
    "record_replicated",
    "set_placement",
]

_ATTR = "_paraxis_placement"


@dataclass(frozen=True)
class Shard:
    """Dimension ``dim`` is split along grid ``axis``; this rank holds
    ``[offset, offset + length)`` of it.

    ``axis`` is one grid axis, or a tuple of axes split as one flattened group (ZeRO
    shards over the gradient-sync group, e.g. data x expert x context).

    ``parts > 1``: the dimension is ``parts`` equal blocks packed together (a fused
    gate_up projection) and the range applies within each block. ``padding``: the local
    tensor has that many extra rows after the real ones (a vocabulary padded to a
    multiple of the tensor degree); they are never saved or counted.

    Shards of one dimension nest, in the order listed: each one's range is in the rows
    of the local tensor the shards before it left (padding rows included), so a data
    shard subdivides a tensor-parallel piece (FSDP2 x TP, arXiv:2304.11277). Only the
    outermost shard of a dimension may be packed.
    """

    dim: int
    axis: str | tuple[str, ...]
    offset: int
    length: int
    parts: int = 1
    padding: int = 0

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)


@dataclass(frozen=True)
class Run:
    """Rows ``[local, local + length)`` of a local tensor's dimension are rows
    ``[start, start + length)`` of packed block ``part`` of the global dimension."""

    local: int
    length: int
    part: int
    start: int


@dataclass(frozen=True)
class Piece:
    """One contiguous block of a local tensor and where it lives globally.

    ``suffix`` names the logical tensor (``#partK`` for a block of a packed dimension,
    else empty), ``region`` is ``[offset, length]`` per dimension within that logical
    tensor of shape ``shape``, and ``where`` the same block as slices of the whole
    global tensor (packed blocks at their place)."""

    suffix: str
    local: tuple[slice, ...]
    shape: tuple[int, ...]
    region: tuple[tuple[int, int], ...]
    where: tuple[slice, ...]


@dataclass(frozen=True)
class Placement:
    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    shards: tuple[Shard, ...] = ()
    replicated: tuple[str, ...] = ()
    # Pipeline stage that owns the parameter (None: the model is not split).
    stage: int | None = None
    # A word embedding tied to the head, held by the first and the last pipeline stage
    # and kept identical by summing its gradient over the two (an axis that replaces
    # the parameter keeps the flag in the shard's record). On the last stage the copy
    # is a ``mirror``: resident, but neither saved nor counted in the gradient norm.
    tied: bool = False
    mirror: bool = False
    # Axes over which this rank's gradient is only a partial sum (a norm that sees one
    # tensor rank's tokens under sequence parallelism); that axis' synchronizer sums
    # it after data-parallel averaging (paraxis.parallel.strategy.SyncOrder).
    partial: tuple[str, ...] = ()
    # The axes whose ranks hold distinct tokens (the grid's token axes): over those of
    # them the parameter is replicated over, its gradient is averaged.
    averaged: tuple[str, ...] = BUILTIN_AXES.token_axes

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        for s in self.shards:
            shape[s.dim] = s.length * s.parts + s.padding
        return tuple(shape)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for s in self.shards for a in s.axes)

    def runs(self, dim: int) -> tuple[list[Run], int]:
        """How the local rows of ``dim`` map to global rows (padding rows map nowhere),
        and the number of packed blocks of that dimension."""
        size = self.global_shape[dim]
        runs, parts = [Run(0, size, 0, 0)], 1
        for s in self.shards:
            if s.dim != dim:
                continue
            if s.parts > 1:
                if parts > 1 or runs != [Run(0, size, 0, 0)]:
                    raise ValueError(f"{self.name}: only the outermost shard of dim {dim} "
                                     "may be packed")
                runs = [Run(k * s.length, s.length, k, s.offset) for k in range(s.parts)]
                parts = s.parts
                continue
            runs = [cut for r in runs if (cut := _within(r, s.offset, s.length))]
        return runs, parts

    def pieces(self) -> list[Piece]:
        """The contiguous blocks of the local tensor that hold real (not padding) rows,
        each with its place in the global tensor; empty if this rank holds only padding."""
        per_dim = [self.runs(d) for d in range(len(self.global_shape))]
        packed = [d for d, (_, parts) in enumerate(per_dim) if parts > 1]
        if len(packed) > 1:
            raise ValueError(f"{self.name}: more than one packed dimension {packed}")
        shape = tuple(n // parts for n, (_, parts) in zip(self.global_shape, per_dim,
                                                          strict=True))
        out = []
        for combo in itertools.product(*(runs for runs, _ in per_dim)):
            part = combo[packed[0]].part if packed else 0
            out.append(Piece(
                f"#part{part}" if packed else "",
                tuple(slice(r.local, r.local + r.length) for r in combo), shape,
                tuple((r.start, r.length) for r in combo),
                tuple(slice(r.part * n + r.start, r.part * n + r.start + r.length)
                      for r, n in zip(combo, shape, strict=True))))
        return out

    @property
    def grad_sync_axes(self) -> tuple[str, ...]:
        """Axes over which gradients are averaged: the axes holding distinct tokens it is
        replicated over. Replication over ``tensor`` needs no reduction unless an axis
        (sequence parallel) says so by handling it itself."""
        return tuple(a for a in self.replicated if a in self.averaged)

    def sharded(self, *, dim: int, axis: str | tuple[str, ...], offset: int, length: int,
                parts: int = 1, padding: int = 0) -> Placement:
        """This record with ``dim`` split along ``axis`` (one axis, or a tuple split as
        one flattened group) and no longer replicated there. A dimension already
        sharded over other axes is subdivided (see :class:`Shard`)."""
        shard = Shard(dim, axis if isinstance(axis, str) or len(axis) > 1 else axis[0],
                      offset, length, parts, padding)
        if any(s.dim == dim and set(s.axes) & set(shard.axes) for s in self.shards):
            raise ValueError(f"{self.name}: dim {dim} is already sharded over {axis}")
        unknown = [a for a in shard.axes if a not in self.replicated]
        if unknown:
            raise KeyError(f"{self.name} is not replicated over {unknown[0]!r} (an unknown "
                           f"grid axis, or one it is split over already); it is replicated "
                           f"over {list(self.replicated)}")
        return replace(self, shards=(*self.shards, shard),
                       replicated=tuple(a for a in self.replicated if a not in shard.axes))

    def with_partial(self, axis: str) -> Placement:
        return replace(self, partial=(*self.partial, axis))


def _within(run: Run, offset: int, length: int) -> Run | None:
    """The part of ``run`` inside local rows ``[offset, offset + length)``, re-based so
    that ``offset`` becomes row 0; None if they do not overlap."""
    a, b = max(run.local, offset), min(run.local + run.length, offset + length)
    if a >= b:
        return None
    return Run(a - offset, b - a, run.part, run.start + a - run.local)


def set_placement(param: torch.Tensor, placement: Placement) -> None:
    if tuple(param.shape) != placement.local_shape:
        raise ValueError(f"{placement.name}: local shape {tuple(param.shape)} does not match "
                         f"the placement's {placement.local_shape}")
    setattr(param, _ATTR, placement)


def has_placement(param: torch.Tensor) -> bool:
    return getattr(param, _ATTR, None) is not None


def placement_of(param: torch.Tensor) -> Placement:
    record = getattr(param, _ATTR, None)
    if record is None:
        raise LookupError("parameter has no placement record; was the model parallelized?")
    return record


def record_replicated(module: nn.Module, axes: AxisTable = BUILTIN_AXES) -> None:
    """Give every parameter without a record a fully replicated one: over every axis of
    ``axes`` but the pipeline's, averaged over those holding distinct tokens.

    Core calls this before any axis applies, so axes only ever *update* records. Tied
    parameters appear once, under their first name.
    """
    for name, param in module.named_parameters():
        if not has_placement(param):
            set_placement(param, Placement(name, tuple(param.shape), param.dtype,
                                           replicated=axes.replicated,
                                           averaged=axes.token_axes))
