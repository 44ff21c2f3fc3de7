"""ZeRO stages 1 and 2: the model stays whole, the optimizer state (stage 1) and the
gradients (stage 2) are sharded (Rajbhandari et al., arXiv:1910.02054, sections 5.1-5.2).

Each parameter ZeRO shards gets a padded storage of ``n`` whole chunks along its shard
dimension (dim 0, or the one :func:`~paraxis_zero.layout.shard_dim` picks for a tensor
with fewer rows than ranks); the model parameter is its first ``rows`` rows and this
rank's *shard* is a view of chunk ``rank``: an fp32 Parameter with its own placement
that the optimizer steps in place, so the master weights are the model's own (no copy,
4 bytes per parameter in fp32).

Gradients travel in core's buckets (:func:`paraxis.parallel.buckets.assign_buckets`),
through core's loop (:class:`paraxis.parallel.buckets.BucketLoop`): in a fixed bucket
order, launched from post-accumulate-grad hooks as backward produces them:
each full bucket is copied rank-major (:class:`~paraxis_zero.layout.ShardLayout`),
divided by ``n`` and reduce-scattered asynchronously, so every rank receives the
average of its own chunk only: half an all-reduce, 2Ψ(n-1)/n with the all-gather that
follows the step (the paper's volume for stages 1 and 2).

* Stage 1 keeps the whole gradient (4Ψ bytes, padded like the parameter); the reduced
  chunk lands in a staging buffer that lives from the launch to the copy back into its
  own rows, and the shard's gradient is a view of them.
* Stage 2 copies a gradient into its bucket's send buffer in the hook and frees it; the
  bucket's receive buffer is the shards' gradients (4Ψ/n).

Under ``no_sync`` (non-final microbatches) gradients accumulate whole, locally, as DDP
and FSDP2 do; beside a pipeline the whole schedule runs so, and every bucket is
reduce-scattered once after it (stage 2 then frees the whole gradients: 4Ψ + 12Ψ/n of
model state between steps). Under HSDP the reduce-scatter runs inside the shard group
and the shards' gradients are then all-reduced over the groups holding the same
shards. After the optimizer step the updated shards are all-gathered into the model
(:meth:`after_step`, called by the optimizer
:func:`~paraxis_zero.optimizer.zero_optimizer` builds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paraxis.parallel.buckets import BucketLoop, FlatAllReduce, assign_buckets
from paraxis.parallel.placement import placement_of, set_placement
from paraxis.parallel.strategy import SyncOrder
from paraxis.runtime.collectives import (
    Pending,
    all_gather_into,
    all_reduce_,
    reduce_scatter_into,
)
from paraxis.runtime.grid import Grid
from paraxis_zero.groups import shard_groups
from paraxis_zero.layout import ShardLayout
from paraxis_zero.whole import WHOLE_BELOW, keep_whole

__all__ = ["ShardedOptimizerSync"]


@dataclass(eq=False)
class _Bucket:
    layout: ShardLayout
    storage: list[torch.Tensor]  # padded parameter storages (n x chunk rows)
    shards: list[nn.Parameter]
    grads: list[torch.Tensor] | None  # stage 1: padded whole-gradient storages
    recv: torch.Tensor | None  # stage 2: the shards' gradients; stage 1: staging
    send: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    work: Pending | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params


def _padded(t: torch.Tensor, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A zeroed storage of ``shape`` (``t`` padded along ``dim``) whose first rows along
    ``dim`` are ``t``'s."""
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


class ShardedOptimizerSync(BucketLoop[_Bucket]):
    """Gradient synchronizer and shard owner for ZeRO stage 1 or 2 (``SyncOrder.DATA``);
    the parameters it keeps whole are its follower's (:class:`FlatAllReduce`)."""

    order = SyncOrder.DATA

    def __init__(self, module: nn.Module, *, grid: Grid, stage: int, bucket_bytes: int,
                 whole_below: int = WHOLE_BELOW, wire_dtype: torch.dtype | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizerSync does ZeRO stages 1 and 2, not {stage}")
        self.grid, self.stage = grid, stage
        params = [p for p in module.parameters() if p.requires_grad]
        whole = [p for p in params if keep_whole(p, grid, whole_below)]
        sharded = [p for p in params if not keep_whole(p, grid, whole_below)]
        self.wire_dtype = wire_dtype  # parallelism.reduce_dtype
        self.whole = FlatAllReduce(whole, grid, bucket_bytes, wire_dtype=wire_dtype)
        self.followers = (self.whole,)
        self.whole_params = whole
        super().__init__([self._bucket(self._layout(g.axes, ps))
                          for g, ps in assign_buckets(sharded, grid, bucket_bytes)])

    def _layout(self, sync_axes: tuple[str, ...], params: list[nn.Parameter]) -> ShardLayout:
        groups = shard_groups(self.grid, sync_axes)
        return ShardLayout.build(groups.shard, params, self.grid.token_replicas,
                                 replicas=groups.replicas, split=groups.split)

    @torch.no_grad()
    def _bucket(self, layout: ShardLayout) -> _Bucket:
        storage, shards, grads = [], [], []
        rank = layout.group.rank
        for i, p in enumerate(layout.params):
            d, c = layout.dims[i], layout.chunk[i]
            padded = _padded(p.data, layout.padded_shape(i), d)
            p.data = padded.narrow(d, 0, layout.rows[i])  # the real rows: no copy
            shard = nn.Parameter(padded.narrow(d, rank * c, c), requires_grad=True)
            set_placement(shard, layout.placement(i, placement_of(p)))
            storage.append(padded)
            shards.append(shard)
            if self.stage == 1:  # the whole gradient, padded so the shard's is a view
                grads.append(torch.zeros_like(padded))
                p.grad = grads[-1].narrow(d, 0, layout.rows[i])
        # Stage 2's reduce-scatter lands in the shards' gradients (kept); stage 1's in
        # a staging buffer made at launch and freed once copied out (issue 36: kept, it
        # was 4/N bytes a parameter of model state for nothing).
        recv = self._recv(layout) if self.stage == 2 else None
        return _Bucket(layout, storage, shards, grads if self.stage == 1 else None, recv)

    @staticmethod
    def _recv(layout: ShardLayout) -> torch.Tensor:
        like = layout.params[0]
        return torch.zeros(layout.per_rank, dtype=like.dtype, device=like.device)

    # ---- what the optimizer steps ----------------------------------------------------

    def optimizer_params(self) -> list[nn.Parameter]:
        return [s for b in self.buckets for s in b.shards] + self.whole_params

    # ---- backward (core's loop calls take and launch) ---------------------------------

    @torch.no_grad()
    def take(self, bucket: _Bucket, i: int) -> None:
        """Parameter ``i``'s gradient is final for this step: stage 1 keeps it in its
        padded storage; stage 2 moves it into the send buffer and frees it."""
        p, layout = bucket.layout.params[i], bucket.layout
        if bucket.grads is not None:
            view = bucket.grads[i].narrow(layout.dims[i], 0, layout.rows[i])
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():  # accumulation replaced it
                view.copy_(p.grad)
            p.grad = view
        else:
            if bucket.send is None:
                bucket.send = torch.empty(layout.group.size * layout.per_rank, dtype=p.dtype,
                                          device=p.device)
            layout.to_rank_major(bucket.send, i, p.grad)
            p.grad = None

    @torch.no_grad()
    def launch(self, bucket: _Bucket) -> None:
        layout, n = bucket.layout, bucket.layout.group.size
        if bucket.grads is not None:  # stage 1: the whole gradients are already padded
            bucket.recv = self._recv(layout)
            bucket.send = torch.empty(n * layout.per_rank, dtype=bucket.recv.dtype,
                                      device=bucket.recv.device)
            for i, g in enumerate(bucket.grads):
                layout.to_rank_major(bucket.send, i, g)
        assert bucket.send is not None and bucket.recv is not None
        bucket.send.div_(layout.divisor)  # pre-divided (Grid.token_replicas)
        bucket.work = reduce_scatter_into(bucket.recv, bucket.send, layout.group, async_op=True,
                                          wire_dtype=self.wire_dtype, consume=True)

    @torch.no_grad()
    def received(self, bucket: _Bucket) -> None:
        """Hand each shard its reduced gradient (the loop's :meth:`finish` calls it once
        the bucket's reduce-scatter completed; it then finishes the whole parameters).
        Under HSDP the shards are first summed over their replicas."""
        bucket.send = None
        layout, rank, recv = bucket.layout, bucket.layout.group.rank, bucket.recv
        assert recv is not None
        if layout.replicas is not None:
            all_reduce_(recv, layout.replicas, wire_dtype=self.wire_dtype)
        for i, shard in enumerate(bucket.shards):
            if bucket.grads is None:
                shard.grad = layout.own(recv, i)
            else:
                d, c = layout.dims[i], layout.chunk[i]
                own = bucket.grads[i].narrow(d, rank * c, c)
                own.copy_(layout.own(recv, i))
                shard.grad = own
        if bucket.grads is not None:
            bucket.recv = None

    # ---- after the step ----------------------------------------------------------------

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather the updated shards into the model's parameters, bucket by bucket,
        the next gather in flight while one is copied out."""
        pending: list[tuple[_Bucket, torch.Tensor, Any]] = []
        for bucket in self.buckets:
            layout = bucket.layout
            mine = torch.cat([s.detach().reshape(-1) for s in bucket.shards])
            gathered = torch.empty(layout.group.size * layout.per_rank, dtype=mine.dtype,
                                   device=mine.device)
            pending.append((bucket, gathered,
                            all_gather_into(gathered, mine, layout.group, async_op=True)))
            if len(pending) > 1:
                self._copy_out(*pending.pop(0))
        for item in pending:
            self._copy_out(*item)

    @staticmethod
    def _copy_out(bucket: _Bucket, gathered: torch.Tensor, work: Any) -> None:
        work.wait()
        for i, storage in enumerate(bucket.storage):
            bucket.layout.from_rank_major(gathered, i, storage)

    def zero_grad(self) -> None:
        """Stage 1 keeps its whole gradients' storage: zero it for the next step."""
        for bucket in self.buckets:
            for g in bucket.grads or ():
                g.zero_()
