"""Sub-axes: one grid axis cut in two, an outer and an inner part (issue 36).

Hybrid sharding (FSDP2's HSDP, DeepSpeed's hpZ / MiCS, Megatron's partial distributed
optimizer) shards over groups of N consecutive data ranks and replicates across the
data/N groups: the data axis of degree D becomes ``data_replica`` (outer, D/N) x
``data_shard`` (inner, N), so a shard group is N ranks that sit close together in the
mesh (inside a node when the axes inside data fit). The grid knows the two names as
axes of their own (coordinates, sizes, groups), so a placement can say a tensor is
sharded over ``data_shard`` and replicated over ``data_replica``, and everything that
reads placements (gradient norms count copies, checkpoints pick the writer) works
unchanged. The axis itself stays whole: its degree, coordinate and groups are the
same as without the cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from paraxis.config.parallel import ParallelConfig

__all__ = ["AxisSplits", "config_splits", "sub_axis_names"]


def sub_axis_names(axis: str) -> tuple[str, str]:
    """(outer, inner) names of ``axis`` cut in two: the replicas and the shard group."""
    return f"{axis}_replica", f"{axis}_shard"


def config_splits(config: ParallelConfig) -> dict[str, int]:
    """The cuts a configuration asks for: ``parallelism.zero_shard`` runs ZeRO over groups
    of that many data ranks (HSDP)."""
    n = config.parallelism.zero_shard
    return {"data": n} if config.parallelism.zero and n else {}


class AxisSplits:
    """The cuts of a grid: ``inner[axis]`` = the inner part's degree (it divides the
    axis' degree; a cut into 1 or into the whole degree is no cut and is dropped)."""

    def __init__(self, inner: Mapping[str, int], degrees: Mapping[str, int]):
        self.inner: dict[str, int] = {}
        self.parts: dict[str, tuple[str, int]] = {}  # sub-axis -> (axis, its degree)
        for axis, n in inner.items():
            if degrees[axis] % n:
                raise ValueError(f"{axis} (degree {degrees[axis]}) cannot be cut into "
                                 f"groups of {n}: {n} does not divide it")
            if 1 < n < degrees[axis]:
                self.inner[axis] = n
                outer, inner_name = sub_axis_names(axis)
                self.parts[outer] = (axis, degrees[axis] // n)
                self.parts[inner_name] = (axis, n)

    def atoms(self, axes: Iterable[str]) -> list[str]:
        """``axes`` with every cut axis replaced by its two parts (outer first)."""
        return [part for a in axes
                for part in (sub_axis_names(a) if a in self.inner else (a,))]

    def coords(self, coords: Mapping[str, int]) -> dict[str, int]:
        """The sub-axes' coordinates of a rank whose axis coordinates are ``coords``."""
        out = {}
        for axis, n in self.inner.items():
            outer, inner = sub_axis_names(axis)
            out[outer], out[inner] = divmod(coords[axis], n)
        return out

    def order(self, axis_order: Mapping[str, int], name: str) -> tuple[int, int]:
        """Sort key of ``name`` in mesh order: a sub-axis at its axis' place."""
        if name in self.parts:
            parent = self.parts[name][0]
            return axis_order[parent], 1 + sub_axis_names(parent).index(name)
        return axis_order[name], 0
