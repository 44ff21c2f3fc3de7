"""Parameters ZeRO keeps whole, and which they are.

Some parameters stay whole on every rank: their gradients are all-reduced (averaged) in
flat buckets launched from backward hooks, by the loop plain data parallelism runs
(core's :class:`paraxis.parallel.buckets.FlatAllReduce`), and every rank steps them
whole:

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

from torch import nn

from paraxis.parallel.placement import placement_of
from paraxis.runtime.grid import Grid

__all__ = ["WHOLE_BELOW", "keep_whole"]

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
