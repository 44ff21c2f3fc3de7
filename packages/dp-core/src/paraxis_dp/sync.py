"""Bucketed, overlapped gradient all-reduce for replicated data parallelism.

The scheme of PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020, arXiv:2006.15704),
written against paraxis placements rather than wrapping ``DistributedDataParallel``:

* parameters are packed into flat buckets of about ``bucket_mb`` MiB (core's layout,
  :mod:`paraxis.parallel.buckets`, shared with ZeRO), filled in reverse
  registration order, which approximates the order backward produces gradients;
* a parameter's gradient lives in its bucket (``param.grad`` is a view of the flat
  buffer), so a full bucket is reduced with no copy;
* a post-accumulate-grad hook marks a gradient ready; when a bucket is full its
  all-reduce starts asynchronously, overlapping the rest of backward;
* buckets start in a fixed order on every rank, so ranks never disagree on which
  collective comes next even if their hooks fire in different orders;
* each parameter's gradient is summed over the group its placement names (dense
  parameters over data x expert x context, expert parameters over data x context) and
  divided by the number of ranks holding distinct tokens (data x expert x context),
  because the engine scales each rank's loss by that number: dense gradients become
  their mean, and an expert's gradient, which already sums every expert rank's tokens
  through the all-to-all, is not counted ``expert`` times (Megatron-Core scales expert
  gradients the same way); one bucket never mixes groups or dtypes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from paraxis.parallel.buckets import FlatBucket, MiB, adopt_grad, assign_buckets
from paraxis.parallel.strategy import SyncOrder
from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import DENSE_REPLICA_AXES, Grid

__all__ = ["DataParallel"]

_Bucket = FlatBucket  # the layout lives in core (paraxis.parallel.buckets), shared with ZeRO


class DataParallel:
    """Average gradients of ``module`` over replicas; call :meth:`finish` before stepping.

    Construct on every rank of ``grid`` at the same point (it broadcasts parameters from
    the first replica). Use :meth:`no_sync` around backward of non-final microbatches.
    It finishes first among the synchronizers (:class:`SyncOrder.DATA`): its all-reduces
    run asynchronously from backward hooks, and nothing else may touch those gradients
    until they are done.
    """

    order = SyncOrder.DATA

    def __init__(self, module: nn.Module, *, grid: Grid, bucket_mb: float = 25.0,
                 broadcast: bool = True, wire_dtype: torch.dtype | None = None):
        self.module = module
        self.wire_dtype = wire_dtype  # parallelism.reduce_dtype (None: the buffer's)
        self.grid = grid
        self.bucket_bytes = int(bucket_mb * MiB)
        self.divisor = grid.token_replicas
        self._sync = True
        self._next = 0  # index of the next bucket to launch
        self.buckets = self._build_buckets()
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {
            p: (b, i) for b in self.buckets for i, p in enumerate(b.params)
        }
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self._where]
        self.last_wait_s = 0.0
        if broadcast:
            self._broadcast_from_first_replica()

    # ---- construction ------------------------------------------------------------

    def _build_buckets(self) -> list[_Bucket]:
        """Core's bucket layout (:mod:`paraxis.parallel.buckets`), shared with ZeRO."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        return [FlatBucket.allocate(group, ps, self.divisor)
                for group, ps in assign_buckets(params, self.grid, self.bucket_bytes,
                                                include_single=self.divisor > 1)]

    @torch.no_grad()
    def _broadcast_from_first_replica(self) -> None:
        by_group: dict[tuple[str, ...], list[torch.Tensor]] = {}
        for b in self.buckets:
            if b.group.size > 1:
                by_group.setdefault(b.group.axes, []).extend(b.params)
        dense = self.grid.group(DENSE_REPLICA_AXES)
        if dense.size > 1:
            by_group.setdefault(dense.axes, []).extend(self.module.buffers())
        for axes, tensors in by_group.items():
            group = self.grid.group(axes)
            for t in tensors:
                dist.broadcast(t.data, src=group.first, group=group.pg)

    # ---- backward ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally; nothing is communicated."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        bucket, i = self._where[param]
        self._adopt_grad(param, bucket.views[i])
        bucket.ready.add(i)
        if bucket.full:
            self._launch_ready()

    _adopt_grad = staticmethod(adopt_grad)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        # Pre-divide, as DDP does (for dense parameters the sum becomes the mean); fp32
        # keeps it exact enough. A group of one only rescales (expert=E alone).
        bucket.buffer.div_(bucket.divisor)
        bucket.work = all_reduce_(bucket.buffer, bucket.group, async_op=True,
                                  wire_dtype=self.wire_dtype)
        self._next += 1

    # ---- step ------------------------------------------------------------------------

    def finish(self) -> float:
        """Launch what is left (parameters unused this step reduce as zeros), wait for
        every bucket, and return the seconds spent blocked."""
        for bucket in self.buckets[self._next:]:
            for i, p in enumerate(bucket.params):
                if i not in bucket.ready:
                    self._adopt_grad(p, bucket.views[i])
                    bucket.ready.add(i)
            self._launch(bucket)
        start = time.perf_counter()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()
        self._next = 0
        self.last_wait_s = time.perf_counter() - start
        return self.last_wait_s

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __repr__(self) -> str:
        sizes = [f"{b.buffer.numel() * b.buffer.element_size() / MiB:.2f}MiB/"
                 f"{'x'.join(b.group.axes)}" for b in self.buckets]
        return f"DataParallel(buckets=[{', '.join(sizes)}])"
