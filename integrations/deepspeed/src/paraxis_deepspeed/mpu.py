"""paraxis's process grid, seen through Megatron's ``mpu`` interface, which is how
DeepSpeed learns its groups (``deepspeed.initialize(mpu=...)``).

DeepSpeed's data-parallel group (ZeRO's partitioning and gradient averaging) is
paraxis's dense replica group, data x expert x context: the ranks whose gradients
average (DESIGN section 2). Its model-parallel group is the tensor group: DeepSpeed sums
the gradient norm over it, counting a parameter on every tensor rank only if it carries
``tensor_model_parallel`` (its shards differ), else on tensor rank 0 only. There is no
pipeline (the bridge refuses one). DeepSpeed reads ``None`` as "the world" in some
places, so a group of one member is a real one-rank group here, never ``None``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from paraxis.runtime.grid import AxisGroup, Grid

__all__ = ["GridMPU"]


class GridMPU:
    """Megatron's mpu methods over a :class:`paraxis.Grid` (no globals: one per run)."""

    def __init__(self, grid: Grid):
        self.grid = grid
        self.data = grid.group(grid.axes.token_axes)
        self.tensor = grid.group("tensor")
        self._own: list[Any] = []  # one-rank groups this object created
        self._single = self._singles() if grid.world_size > 1 and (
            self.data.size == 1 or self.tensor.size == 1) else None

    def _singles(self) -> Any:
        """One-rank groups for every rank (new_group is collective: all create all)."""
        mine = None
        for r in range(self.grid.world_size):
            pg = dist.new_group(ranks=[r])
            self._own.append(pg)
            if r == self.grid.rank:
                mine = pg
        return mine

    def _pg(self, group: AxisGroup) -> Any:
        if group.pg is not None:
            return group.pg
        return dist.group.WORLD if self.grid.world_size == 1 else self._single

    # data parallel (ZeRO partitions, gradient averaging)
    def get_data_parallel_group(self) -> Any:
        return self._pg(self.data)

    def get_data_parallel_world_size(self) -> int:
        return self.data.size

    def get_data_parallel_rank(self) -> int:
        return self.data.rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.data.ranks)

    # tensor model parallel (norms, checkpoint rank)
    def get_model_parallel_group(self) -> Any:
        return self._pg(self.tensor)

    def get_model_parallel_world_size(self) -> int:
        return self.tensor.size

    def get_model_parallel_rank(self) -> int:
        return self.tensor.rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tensor.first

    # no pipeline under the bridge
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank

    def destroy(self) -> None:
        """Destroy the one-rank groups this object created."""
        for pg in self._own:
            dist.destroy_process_group(pg)
        self._own.clear()
        self._single = None
