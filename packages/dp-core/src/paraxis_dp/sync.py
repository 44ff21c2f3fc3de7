"""Bucketed, overlapped gradient all-reduce for replicated data parallelism.

The scheme of PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020, arXiv:2006.15704),
written against paraxis placements rather than wrapping ``DistributedDataParallel``:

* parameters are packed into flat buckets of about ``bucket_mb`` MiB (core's layout,
  :mod:`paraxis.parallel.buckets`, shared with ZeRO), filled in reverse
  registration order, which approximates the order backward produces gradients;
* a parameter's gradient lives in its bucket (``param.grad`` is a view of the flat
  buffer), so a full bucket is reduced with no copy;
* a post-accumulate-grad hook marks a gradient ready; when a bucket is full its
  all-reduce starts asynchronously, overlapping the rest of backward; buckets start in
  a fixed order on every rank (core's loop, :class:`paraxis.parallel.buckets.BucketLoop`);
* each parameter's gradient is summed over the group its placement names (dense
  parameters over data x expert x context, expert parameters over data x context) and
  divided by the number of ranks holding distinct tokens (data x expert x context),
  because the engine scales each rank's loss by that number: dense gradients become
  their mean, and an expert's gradient, which already sums every expert rank's tokens
  through the all-to-all, is not counted ``expert`` times (Megatron-Core scales expert
  gradients the same way); one bucket never mixes groups or dtypes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paraxis.parallel.buckets import FlatAllReduce, MiB
from paraxis.parallel.strategy import SyncOrder
from paraxis.runtime.grid import Grid

__all__ = ["DataParallel"]


class DataParallel(FlatAllReduce):
    """Average gradients of ``module`` over replicas; call :meth:`finish` before stepping.

    Core's bucket loop (:class:`paraxis.parallel.buckets.FlatAllReduce`, shared with
    ZeRO's whole parameters) over every trainable parameter, after broadcasting the
    parameters and buffers from the first replica. Construct on every rank of ``grid``
    at the same point. Use :meth:`no_sync` around backward of non-final microbatches.
    It finishes first among the synchronizers (:class:`SyncOrder.DATA`): its all-reduces
    run asynchronously from backward hooks, and nothing else may touch those gradients
    until they are done.
    """

    order = SyncOrder.DATA

    def __init__(self, module: nn.Module, *, grid: Grid, bucket_mb: float = 25.0,
                 broadcast: bool = True, wire_dtype: torch.dtype | None = None):
        self.module = module
        super().__init__(module.parameters(), grid, int(bucket_mb * MiB),
                         wire_dtype=wire_dtype)
        if broadcast:
            self._broadcast_from_first_replica()

    @torch.no_grad()
    def _broadcast_from_first_replica(self) -> None:
        by_group: dict[tuple[str, ...], list[torch.Tensor]] = {}
        for b in self.buckets:
            if b.group.size > 1:
                by_group.setdefault(b.group.axes, []).extend(b.params)
        dense = self.grid.group(self.grid.axes.token_axes)
        if dense.size > 1:
            by_group.setdefault(dense.axes, []).extend(self.module.buffers())
        for axes, tensors in by_group.items():
            group = self.grid.group(axes)
            for t in tensors:
                dist.broadcast(t.data, src=group.first, group=group.pg)

    def __repr__(self) -> str:
        sizes = [f"{b.buffer.numel() * b.buffer.element_size() / MiB:.2f}MiB/"
                 f"{'x'.join(b.group.axes)}" for b in self.buckets]
        return f"DataParallel(buckets=[{', '.join(sizes)}])"
