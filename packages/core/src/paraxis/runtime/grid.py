"""The process grid: one rank layout, every named group, passed explicitly.

Mesh order, outermost first, is ``pipeline, data, expert, context, tensor`` (DESIGN
section 2), with any axis a package adds at its declared place (the axis table,
:mod:`paraxis.config.axes`): consecutive ranks differ first in their tensor coordinate,
so tensor groups sit on the fastest links, as in Megatron-LM's
``initialize_model_parallel``. There is no module-level group state; code that needs a
group takes the :class:`Grid` (or one :class:`AxisGroup`) as an argument.

:class:`GridLayout` is the pure arithmetic (rank <-> coordinates, who shares a group) and
needs no processes; :class:`Grid` adds the torch.distributed groups.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist

from paraxis.config.axes import BUILTIN_AXES, AxisTable
from paraxis.config.errors import ConfigError, Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.runtime.comm_stats import CommStats
from paraxis.runtime.cuda_paths import cuda_path_on
from paraxis.runtime.group import AxisGroup
from paraxis.runtime.liveness import Heartbeat
from paraxis.runtime.subaxes import AxisSplits, config_splits, sub_axis_names

__all__ = ["DENSE_REPLICA_AXES", "EXPERT_REPLICA_AXES", "SEQUENCE_SHARD_AXES", "AxisGroup",
           "Grid", "GridLayout", "shutdown", "standard_groups"]

# The built-in table's groups (a run's own are its grid's: Grid.axes).
# Dense parameters are identical over the ranks holding distinct tokens, and their
# gradients are averaged there (paraxis.config.parallel.TOKEN_AXES).
DENSE_REPLICA_AXES: tuple[str, ...] = BUILTIN_AXES.token_axes
# Expert parameters are sharded over `expert`, so they are replicated only over these.
EXPERT_REPLICA_AXES: tuple[str, ...] = BUILTIN_AXES.expert_replica_axes
# Under sequence parallelism a module outside the tensor-parallel regions (a router) sees
# only its tensor rank's share of the sequence: these ranks hold distinct tokens there.
SEQUENCE_SHARD_AXES: tuple[str, ...] = BUILTIN_AXES.sequence_shard_axes


class GridLayout:
    """Rank arithmetic for degrees in mesh order (the axes of ``table``, the built-in
    ones by default; an axis not given has degree 1); no processes involved."""

    def __init__(self, degrees: Mapping[str, int], table: AxisTable = BUILTIN_AXES,
                 splits: Mapping[str, int] | None = None):
        self.table = table
        self.axes = table.names
        unknown = set(degrees) - set(self.axes)
        if unknown:
            raise KeyError(f"unknown grid axes {sorted(unknown)}; the axes are "
                           f"{list(self.axes)}")
        self.degrees: dict[str, int] = {a: int(degrees.get(a, 1)) for a in self.axes}
        self.size = math.prod(self.degrees.values())
        # Axes cut into an outer and an inner part (HSDP, paraxis.runtime.subaxes).
        self.splits = AxisSplits(splits or {}, self.degrees)
        # Row-major strides: the last axis (tensor) varies fastest.
        self._strides: dict[str, int] = {}
        stride = 1
        for axis in reversed(self.axes):
            self._strides[axis] = stride
            stride *= self.degrees[axis]

    def degree(self, axis: str) -> int:
        """The degree of an axis or of a sub-axis."""
        return self.splits.parts[axis][1] if axis in self.splits.parts else self.degrees[axis]

    def canonical(self, axes: str | Iterable[str]) -> tuple[str, ...]:
        """``axes`` (a name or several, any order) in mesh order."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in names if a not in self.axes and a not in self.splits.parts]
        if unknown:
            raise KeyError(f"unknown grid axes {unknown}; the axes are {list(self.axes)}")
        order = {a: i for i, a in enumerate(self.axes)}
        return tuple(sorted(set(names), key=lambda a: self.splits.order(order, a)))

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.size:
            raise IndexError(f"rank {rank} outside a grid of {self.size}")
        coords = {a: (rank // self._strides[a]) % self.degrees[a] for a in self.axes}
        return {**coords, **self.splits.coords(coords)}

    def rank(self, **coords: int) -> int:
        return sum(coords.get(a, 0) * self._strides[a] for a in self.axes)

    def group_ranks(self, axes: str | Iterable[str]) -> list[list[int]]:
        """All groups of ranks that differ only along ``axes``, each sorted, in order."""
        along = self.splits.atoms(self.canonical(axes))
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            key = tuple(c[a] for a in self.splits.atoms(self.axes) if a not in along)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def group_of(self, rank: int, axes: str | Iterable[str]) -> list[int]:
        return next(g for g in self.group_ranks(axes) if rank in g)


class Grid:
    """The process grid of a run, built once on an initialized default group."""

    def __init__(self, layout: GridLayout, rank: int, groups: Mapping[tuple[str, ...], AxisGroup],
                 comm: CommStats | None = None, embedding: AxisGroup | None = None):
        self.layout = layout
        self.rank = rank
        self.coords = layout.coords(rank)
        self._groups = dict(groups)
        self.comm = comm if comm is not None else CommStats()
        # First and last pipeline stage of this rank's pipeline (None elsewhere and
        # without a pipeline): the ranks that hold a tied embedding (Megatron's
        # embedding group).
        self.embedding = embedding
        self.heartbeat: Heartbeat | None = None

    @classmethod
    def build(cls, config: ParallelConfig | Mapping[str, int]) -> Grid:
        """Create every standard group. Collective: all ranks must call it together."""
        if not dist.is_initialized():
            raise RuntimeError("Grid.build needs torch.distributed initialized first "
                               "(torchrun, or dist.init_process_group)")
        if isinstance(config, ParallelConfig):
            layout = GridLayout(config.degrees, config.axis_table, config_splits(config))
        else:
            layout = GridLayout(dict(config))
        world = dist.get_world_size()
        if world != layout.size:
            raise ConfigError([Problem("world_size", world,
                                       f"must equal the product of degrees {layout.degrees} "
                                       f"= {layout.size}", "launch that many processes")])
        rank = dist.get_rank()
        comm = CommStats(on_stream=_stream_timing(config))
        groups: dict[tuple[str, ...], AxisGroup] = {}
        for axes in standard_groups(layout.table, layout.splits.inner):
            axes = layout.canonical(axes)
            if axes not in groups:
                groups[axes] = _new_axis_group(layout, rank, axes, comm)
        embedding = None
        if layout.degrees["pipeline"] > 1:
            ends = [[g[0], g[-1]] for g in layout.group_ranks("pipeline")]
            embedding = _new_group_of(ends, layout, rank, ("pipeline",), comm)
        grid = cls(layout, rank, groups, comm, embedding)
        if dist.get_backend() != "fake":  # a dry run's fake group has no store to beat in
            grid.heartbeat = Heartbeat(rank).start()  # so a dead peer can be named
        return grid

    @property
    def axes(self) -> AxisTable:
        """The grid's axes and the groups of them the rules need."""
        return self.layout.table

    def group(self, axes: str | Iterable[str]) -> AxisGroup:
        """This rank's group along ``axes`` (a name or several, any order)."""
        key = self.layout.canonical(axes)
        if key not in self._groups:
            raise KeyError(f"group {key} was not built; standard groups: "
                           f"{[list(k) for k in self._groups]}")
        return self._groups[key]

    @property
    def world(self) -> AxisGroup:
        """Every rank (the default group), for grid-wide collectives."""
        return self._groups[self.layout.axes]

    def size(self, axis: str) -> int:
        return self.layout.degree(axis)

    @property
    def world_size(self) -> int:
        return self.layout.size

    def sample_shard(self) -> tuple[int, int]:
        """(index, count) of this rank's share of each global batch: samples are split
        over the sample axes (data x expert, :attr:`AxisTable.sample_axes`); tensor,
        context and pipeline ranks of a replica share them."""
        index = 0
        for axis in self.axes.sample_axes:  # row-major over the sample axes, mesh order
            index = index * self.layout.degrees[axis] + self.coords[axis]
        count = math.prod(self.layout.degrees[a] for a in self.axes.sample_axes)
        return index, count

    @property
    def token_replicas(self) -> int:
        """Ranks holding distinct tokens (data x expert x context), which every gradient
        synchronizer divides each gradient by. The engine scales each rank's loss by this
        number, so for a dense parameter, reduced over exactly these ranks, dividing the
        sum by it gives the mean; an expert parameter is reduced over data x context
        only, but the all-to-all already brought it the gradients of every expert rank's
        tokens, so it is divided by the same number (its group's size would count those
        tokens ``expert`` times)."""
        return math.prod(self.layout.degrees[a] for a in self.axes.token_axes)

    @property
    def logging_rank(self) -> int:
        """The rank that logs: the first rank of the last pipeline stage, where the loss
        is computed."""
        return self.layout.rank(pipeline=self.layout.degrees["pipeline"] - 1)

    def describe(self) -> dict[str, Any]:
        """Degrees, this rank's coordinates and the members of its groups, for logs."""
        return {
            "world_size": self.layout.size,
            "degrees": dict(self.layout.degrees),
            "rank": self.rank,
            "coords": dict(self.coords),
            "groups": {"x".join(k) or "self": list(g.ranks) for k, g in self._groups.items()},
        }

    def __repr__(self) -> str:
        coords = ", ".join(f"{a}={c}" for a, c in self.coords.items())
        return f"Grid(rank={self.rank}, {coords}, degrees={self.layout.degrees})"

    def destroy(self) -> None:
        """Destroy the process groups this grid created (not the default group)."""
        groups = list(self._groups.values())
        if self.embedding is not None:
            groups.append(self.embedding)
        destroyed = set()
        for g in groups:
            if g.pg is not None and g.pg is not dist.group.WORLD and id(g.pg) not in destroyed:
                destroyed.add(id(g.pg))
                dist.destroy_process_group(g.pg)
        self._groups.clear()
        self.embedding = None
        if self.heartbeat is not None:
            self.heartbeat.stop()


def standard_groups(table: AxisTable, cut: Mapping[str, int] | None = None,
                    ) -> tuple[tuple[str, ...], ...]:
    """The groups every run gets (more can be asked for by axis tuple): each axis, the
    dense and expert replica groups, the sequence shards and the world; for an axis
    ``cut`` in two (HSDP), its replicas and each replica group with the axis narrowed
    to its inner part (the shard groups)."""
    groups = (*((a,) for a in table.names), table.token_axes, table.expert_replica_axes,
              table.sequence_shard_axes, table.names)
    for axis in cut or {}:
        outer, inner = sub_axis_names(axis)
        groups += ((outer,), *(tuple(inner if a == axis else a for a in g)
                               for g in (table.token_axes, table.expert_replica_axes)))
    return groups


def _stream_timing(config: ParallelConfig | Mapping[str, int]) -> bool:
    """``parallelism.stream_timing`` resolved once per run: only NCCL's groups have a
    stream to time on; there it is a CUDA path (``stream_timing``) that warns when on
    by hand while unvalidated (:mod:`paraxis.runtime.cuda_paths`)."""
    if dist.get_backend() != "nccl":
        return False
    option = config.parallelism.stream_timing if isinstance(config, ParallelConfig) \
        else "auto"
    return cuda_path_on("stream_timing", option)


def _new_group_of(members: list[list[int]], layout: GridLayout, rank: int,
                  axes: tuple[str, ...], comm: CommStats) -> AxisGroup | None:
    """Create a process group for each list of ``members``; return this rank's."""
    mine: AxisGroup | None = None
    for ranks in members:
        pg = None
        if len(ranks) > 1:
            # new_group is collective over the default group: every rank creates every
            # group, in the same order, even the ones it is not in.
            pg = dist.new_group(ranks=ranks) if len(ranks) < layout.size else dist.group.WORLD
        if rank in ranks:
            nccl = pg is not None and dist.get_backend(pg) == "nccl"
            mine = AxisGroup(axes, tuple(ranks), ranks.index(rank), pg, comm, nccl)
    return mine


def _new_axis_group(layout: GridLayout, rank: int, axes: tuple[str, ...],
                    comm: CommStats) -> AxisGroup:
    mine = _new_group_of(layout.group_ranks(axes), layout, rank, axes, comm)
    assert mine is not None
    return mine


def shutdown(grid: Grid | None = None) -> None:
    """Leave torch.distributed cleanly: collect what still holds communication state,
    meet at a barrier, destroy the grid's groups, then the default group.

    Free models, optimizers and synchronizers (``del``) before calling it. torch 2.13
    aborts at interpreter exit ("terminate called without an active exception") in a
    fraction of runs when a gloo group is torn down while another rank still talks or
    while objects holding work handles are alive.
    """
    gc.collect()
    if not dist.is_initialized():
        return
    dist.barrier()
    if grid is not None:
        grid.destroy()
    dist.destroy_process_group()
