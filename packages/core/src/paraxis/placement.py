"""Placement records: how every parameter is laid out over the grid (DESIGN section 3).

After ``parallelize`` each parameter carries a :class:`Placement`: its global name,
global shape and dtype, the dimensions sharded and along which axis (with this rank's
offset and length), and the axes over which it is replicated. Gradient synchronization,
global norm clipping, memory accounting and resharding checkpoints all read this one
record; an axis that changes a parameter's layout replaces the record in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from paraxis.config import AXES
from paraxis.grid import DENSE_REPLICA_AXES

__all__ = [
    "Placement",
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

    ``parts > 1``: the dimension is ``parts`` equal blocks packed together (a fused
    gate_up projection) and the range applies within each block. ``padding``: the local
    tensor has that many extra rows after the real ones (a vocabulary padded to a
    multiple of the tensor degree); they are never saved or counted.
    """

    dim: int
    axis: str
    offset: int
    length: int
    parts: int = 1
    padding: int = 0


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
    # it after data-parallel averaging (paraxis.strategy.SyncOrder).
    partial: tuple[str, ...] = ()

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        for s in self.shards:
            shape[s.dim] = s.length * s.parts + s.padding
        return tuple(shape)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(s.axis for s in self.shards)

    @property
    def grad_sync_axes(self) -> tuple[str, ...]:
        """Axes over which gradients are averaged: the data-like axes it is replicated
        over. Replication over ``tensor`` needs no reduction unless an axis (sequence
        parallel) says so by handling it itself."""
        return tuple(a for a in self.replicated if a in DENSE_REPLICA_AXES)

    def sharded(self, *, dim: int, axis: str, offset: int, length: int, parts: int = 1,
                padding: int = 0) -> Placement:
        """This record with ``dim`` split along ``axis`` (and no longer replicated there)."""
        if axis not in AXES:
            raise KeyError(f"unknown grid axis {axis!r}")
        if any(s.dim == dim and s.axis == axis for s in self.shards):
            raise ValueError(f"{self.name}: dim {dim} is already sharded over {axis}")
        return replace(self, shards=(*self.shards,
                                     Shard(dim, axis, offset, length, parts, padding)),
                       replicated=tuple(a for a in self.replicated if a != axis))

    def with_partial(self, axis: str) -> Placement:
        return replace(self, partial=(*self.partial, axis))


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


def record_replicated(module: nn.Module) -> None:
    """Give every parameter without a record a fully replicated one.

    Core calls this before any axis applies, so axes only ever *update* records. Tied
    parameters appear once, under their first name.
    """
    replicated = tuple(a for a in AXES if a != "pipeline")
    for name, param in module.named_parameters():
        if not has_placement(param):
            set_placement(param, Placement(name, tuple(param.shape), param.dtype,
                                           replicated=replicated))
