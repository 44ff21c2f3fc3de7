"""ZeRO stages 1 and 2: the model stays whole, the optimizer state (stage 1) and the
gradients (stage 2) are sharded (Rajbhandari et al., arXiv:1910.02054, sections 5.1-5.2).

Each parameter ZeRO shards gets a padded storage of ``n`` whole chunks along dim 0; the
model parameter is its first ``rows`` rows and this rank's *shard* is a view of chunk
``rank``: an fp32 Parameter with its own placement that the optimizer steps in place,
so the master weights are the model's own (no copy, 4 bytes per parameter in fp32).

Gradients travel in core's buckets (:func:`paraxis.parallel.buckets.assign_buckets`),
through core's loop (:class:`paraxis.parallel.buckets.BucketLoop`): in a fixed bucket
order, launched from post-accumulate-grad hooks as backward produces them:
each full bucket is copied rank-major (:class:`~paraxis_zero.layout.ShardLayout`),
divided by ``n`` and reduce-scattered asynchronously, so every rank receives the
average of its own chunk only: half an all-reduce, 2Ψ(n-1)/n with the all-gather that
follows the step (the paper's volume for stages 1 and 2).

* Stage 1 keeps the whole gradient (4Ψ bytes, padded like the parameter); the reduced
  chunk is written back into its own rows, and the shard's gradient is a view of them.
* Stage 2 copies a gradient into its bucket's send buffer in the hook and frees it; the
  bucket's receive buffer is the shards' gradients (4Ψ/n).

Under ``no_sync`` (non-final microbatches) gradients accumulate whole, locally, as DDP
and FSDP2 do. After the optimizer step the updated shards are all-gathered into the
model (:meth:`after_step`, called by the optimizer
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
from paraxis.runtime.collectives import Pending, all_gather_into, reduce_scatter_into
from paraxis.runtime.grid import Grid
from paraxis_zero.layout import ShardLayout
from paraxis_zero.whole import WHOLE_BELOW, keep_whole

__all__ = ["ShardedOptimizerSync"]


@dataclass(eq=False)
class _Bucket:
    layout: ShardLayout
    storage: list[torch.Tensor]  # padded parameter storages (n x chunk rows)
    shards: list[nn.Parameter]
    grads: list[torch.Tensor] | None  # stage 1: padded whole-gradient storages
    recv: torch.Tensor  # stage 2: the shards' gradients; stage 1: a staging buffer
    send: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    work: Pending | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params


def _padded(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A zeroed flat storage of ``numel`` elements whose first elements are ``t``'s."""
    out = torch.zeros(numel, dtype=t.dtype, device=t.device)
    out[:t.numel()].copy_(t.reshape(-1))
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
        super().__init__([self._bucket(ShardLayout.build(g, ps, grid.token_replicas))
                          for g, ps in assign_buckets(sharded, grid, bucket_bytes)])

    @torch.no_grad()
    def _bucket(self, layout: ShardLayout) -> _Bucket:
        storage, shards, grads = [], [], []
        for i, p in enumerate(layout.params):
            padded = _padded(p.data, layout.padded_numel(i))
            p.data = padded[:p.numel()].view_as(p)
            own = padded.view(layout.group.size, -1)[layout.group.rank].view(
                layout.shard_shape(i))
            shard = nn.Parameter(own, requires_grad=True)
            set_placement(shard, layout.placement(i, placement_of(p)))
            storage.append(padded)
            shards.append(shard)
            if self.stage == 1:  # the whole gradient, padded so the shard's is a view
                grads.append(torch.zeros_like(padded))
                p.grad = grads[-1][:p.numel()].view_as(p)
        recv = torch.zeros(layout.per_rank, dtype=layout.params[0].dtype,
                           device=layout.params[0].device)
        return _Bucket(layout, storage, shards, grads if self.stage == 1 else None, recv)

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
            view = bucket.grads[i][:p.numel()].view_as(p)
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
            bucket.send = torch.empty(n * layout.per_rank, dtype=bucket.recv.dtype,
                                      device=bucket.recv.device)
            for i, g in enumerate(bucket.grads):
                layout.slot(bucket.send, i).copy_(g.view(n, -1))
        assert bucket.send is not None
        bucket.send.div_(layout.divisor)  # pre-divided (Grid.token_replicas)
        bucket.work = reduce_scatter_into(bucket.recv, bucket.send, layout.group, async_op=True,
                                          wire_dtype=self.wire_dtype)

    @torch.no_grad()
    def received(self, bucket: _Bucket) -> None:
        """Hand each shard its reduced gradient (the loop's :meth:`finish` calls it once
        the bucket's reduce-scatter completed; it then finishes the whole parameters)."""
        bucket.send = None
        layout, rank = bucket.layout, bucket.layout.group.rank
        for i, shard in enumerate(bucket.shards):
            if bucket.grads is None:
                shard.grad = layout.own(bucket.recv, i)
            else:
                own = bucket.grads[i].view(layout.group.size, -1)[rank].view_as(shard)
                own.copy_(layout.own(bucket.recv, i))
                shard.grad = own

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
