"""Parameters ZeRO keeps whole, and which they are.

Some parameters stay whole on every rank: their gradients are all-reduced (averaged) in
flat buckets launched from backward hooks, as plain data parallelism does (core's
bucket layout, :mod:`paraxis.parallel.buckets`), and every rank steps them whole:

* vectors (norm weights, biases) below :data:`WHOLE_BELOW` elements: a shard would
  save bytes not worth a collective (the threshold FSDP2 does not have; DeepSpeed's
  ``stage3_param_persistence_threshold`` is the same idea);
* parameters whose gradient a later synchronizer still has to complete: ``partial``
  ones (norms under sequence parallelism, summed over ``tensor`` after data averaging)
  and ``tied`` ones (a word embedding shared by the first and last pipeline stage,
  summed over the embedding group). Those syncs run after ZeRO's
  (:class:`paraxis.parallel.strategy.SyncOrder`) and need the whole gradient on every rank;
* parameters whose gradient-sync group has one member (nothing to shard over).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from paraxis.parallel.buckets import FlatBucket, adopt_grad, assign_buckets
from paraxis.parallel.placement import placement_of
from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import Grid

__all__ = ["WHOLE_BELOW", "WholeReducer", "keep_whole"]

# Vectors with fewer elements than this stay whole (hidden sizes up to 64K).
WHOLE_BELOW = 1 << 16


def keep_whole(p: nn.Parameter, grid: Grid, whole_below: int = WHOLE_BELOW) -> bool:
    """Whether ZeRO leaves ``p`` whole (see the module docstring)."""
    rec = placement_of(p)
    if rec.partial or rec.tied:
        return True
    if grid.group(rec.grad_sync_axes).size == 1:
        return True
    return p.ndim < 2 and p.numel() < whole_below


class WholeReducer:
    """Average the gradients of whole parameters over their sync groups: flat buckets,
    all-reduce launched from post-accumulate-grad hooks in a fixed bucket order."""

    def __init__(self, params: Iterable[nn.Parameter], grid: Grid, bucket_bytes: int,
                 wire_dtype: torch.dtype | None = None):
        self.wire_dtype = wire_dtype  # parallelism.reduce_dtype
        self.params = [p for p in params if p.requires_grad]
        divisor = grid.token_replicas
        self.buckets = [FlatBucket.allocate(g, ps, divisor) for g, ps in
                        assign_buckets(self.params, grid, bucket_bytes,
                                       include_single=divisor > 1)]
        self._where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]
        self._next = 0
        self.sync = True

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket, i = self._where[param]
        adopt_grad(param, bucket.views[i])
        bucket.ready.add(i)
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: FlatBucket) -> None:
        bucket.buffer.div_(bucket.divisor)  # see Grid.token_replicas
        bucket.work = all_reduce_(bucket.buffer, bucket.group, async_op=True,
                                  wire_dtype=self.wire_dtype)
        self._next += 1

    def finish(self) -> float:
        for bucket in self.buckets[self._next:]:
            for i, p in enumerate(bucket.params):
                if i not in bucket.ready:
                    adopt_grad(p, bucket.views[i])
            self._launch(bucket)
        start = time.perf_counter()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()
        self._next = 0
        return time.perf_counter() - start

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
