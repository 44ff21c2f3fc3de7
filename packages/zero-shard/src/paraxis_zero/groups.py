"""The groups ZeRO shards a parameter over, with or without hybrid sharding.

Without ``parallelism.zero_shard`` a parameter is sharded over its gradient-sync group
(data x expert x context for a dense one, data x context for an expert one). With it
(HSDP: FSDP2's ``HYBRID_SHARD``, DeepSpeed's hpZ / MiCS), the data axis is cut into
``data_replica`` x ``data_shard`` (:mod:`paraxis.runtime.subaxes`, the grid builds the
groups): the parameter is sharded over the same axes with ``data`` narrowed to
``data_shard`` (groups of ``zero_shard`` consecutive data ranks, and the expert and
context ranks inside them, which the mesh places closer still), and its shards are
replicated over ``data_replica``, where their gradients are all-reduced after the
reduce-scatter inside the group. Gathers never leave the group.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraxis.runtime.grid import AxisGroup, Grid
from paraxis.runtime.subaxes import sub_axis_names

__all__ = ["ShardGroups", "shard_groups"]


@dataclass(frozen=True)
class ShardGroups:
    """Where a parameter's shards live: the group that splits it, the group holding
    copies of the same shards (None without HSDP) and the cut axis."""

    shard: AxisGroup
    replicas: AxisGroup | None = None
    split: str | None = None


def shard_groups(grid: Grid, sync_axes: tuple[str, ...]) -> ShardGroups:
    """The groups for a parameter whose gradient-sync axes are ``sync_axes``."""
    for axis in grid.layout.splits.inner:
        if axis in sync_axes:
            outer, inner = sub_axis_names(axis)
            narrowed = tuple(inner if a == axis else a for a in sync_axes)
            return ShardGroups(grid.group(narrowed), grid.group((outer,)), axis)
    return ShardGroups(grid.group(sync_axes))
