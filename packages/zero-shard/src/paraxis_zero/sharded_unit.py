"""One ZeRO-3 unit at run time: its parameters hold their shard between uses and the
whole tensor while the unit runs.

Each parameter keeps its identity (the module's own ``nn.Parameter``; modules and their
forward stay the model's). Its data is swapped:

* *sharded*: ``p.data`` is this rank's chunk, a view of the unit's flat shard buffer
  (one per gradient-sync group), which the optimizer steps in place and the all-gather
  reads without a copy; the placement record describes that chunk;
* *gathered*: ``p.data`` is a view of the unit's flat full buffer, filled by one
  all-gather per group (rank-major, then copied out to each parameter's natural layout,
  as FSDP2's ``foreach_all_gather`` does).

Resharding frees the full buffer by resizing its storage to zero and gathering
resizes it back (FSDP's trick, arXiv:2304.11277 section 4): views autograd saved in
forward (a transposed weight) point at the same storage, so they see the gathered
values again in backward, and nothing saved keeps a full copy alive in between.

A deferred model's parameters may still be on the meta device (their values a
function of (seed, name, element), or slices of a file): then ``fill`` (the
materializer's, ``paraxis.parallel.strategy.MATERIALIZE_ATTR``) writes this rank's
chunk straight into the shard buffer, and the whole tensor never exists on the rank.

Gradients: when backward has produced every parameter's gradient, they are copied
rank-major into a send buffer and freed, and one reduce-scatter per group averages
them into the unit's flat gradient buffer, whose views become the shards' gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paraxis.parallel.placement import Placement, placement_of, set_placement
from paraxis.runtime.collectives import Pending, all_gather_into, reduce_scatter_into
from paraxis_zero.layout import ShardLayout

__all__ = ["Fill", "ShardedUnit"]

# A materializer's ``fill(record, out)``: the real blocks of ``record`` into ``out``.
Fill = Callable[[Placement, torch.Tensor], None]

SHARDED, GATHERING, GATHERED = "sharded", "gathering", "gathered"


@dataclass(eq=False)
class _Flat:
    """The buffers of one group's parameters within a unit."""

    layout: ShardLayout
    shard: torch.Tensor  # this rank's chunks (the parameters between uses)
    grad: torch.Tensor | None  # the shards' reduced gradients (made at the first reduce)
    full: torch.Tensor  # every parameter whole, natural layout; storage freed when sharded
    shards: list[torch.Tensor] = field(default_factory=list)
    wholes: list[torch.Tensor] = field(default_factory=list)
    gathered: torch.Tensor | None = None
    send: torch.Tensor | None = None

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()


def _empty(numel: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(numel, dtype=like.dtype, device=like.device)


class ShardedUnit:
    """The parameters of one unit (``layouts``: one per gradient-sync group), sharded
    in place at construction."""

    def __init__(self, name: str, module: nn.Module, layouts: list[ShardLayout], *,
                 reshard_after_forward: bool = True, wire_dtype: torch.dtype | None = None,
                 fill: Fill | None = None, device: torch.device | None = None):
        self.name, self.module, self.wire_dtype = name, module, wire_dtype
        self.reshard_after_forward = reshard_after_forward
        self.flats = [self._shard(layout, fill, device) for layout in layouts]
        self.params = [p for f in self.flats for p in f.layout.params]
        self.state = SHARDED
        self.ready: set[int] = set()
        self.prepared = False  # gradients copied into the send buffers
        self.pending: list[Pending] = []  # all-gathers in flight
        self.reducing: list[Pending] = []  # reduce-scatters in flight

    @torch.no_grad()
    def _shard(self, layout: ShardLayout, fill: Fill | None,
               device: torch.device | None) -> _Flat:
        like = layout.params[0]
        drawn = fill is not None and like.is_meta  # else: a copy of the whole tensor
        where = device if drawn and device is not None else like.device
        shard = torch.zeros(layout.per_rank, dtype=like.dtype, device=where)
        full = torch.empty(sum(p.numel() for p in layout.params), dtype=like.dtype,
                           device=where)
        flat = _Flat(layout, shard, None, full)
        start = 0
        for i, p in enumerate(layout.params):
            offset, length, _ = layout.rank_rows(i)
            own = layout.own(shard, i)
            rec = layout.placement(i, placement_of(p))
            flat.wholes.append(full[start:start + p.numel()].view_as(p))
            start += p.numel()
            flat.shards.append(own)
            if drawn and p.is_meta:
                assert fill is not None
                fill(rec, own)
                new = nn.Parameter(own, requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # the parameter object stays the same
                torch.utils.swap_tensors(p, new)
            else:
                own[:length].copy_(p.data[offset:offset + length])
                p.data = own
            set_placement(p, rec)
        full.untyped_storage().resize_(0)
        return flat

    # ---- gather and reshard ---------------------------------------------------------

    @torch.no_grad()
    def start_gather(self) -> None:
        """Launch the all-gathers (asynchronously) unless already gathered or under way."""
        if self.state != SHARDED:
            return
        for f in self.flats:
            f.full.untyped_storage().resize_(f.full_bytes)
            f.gathered = _empty(f.layout.group.size * f.layout.per_rank, f.shard)
            work = all_gather_into(f.gathered, f.shard, f.layout.group, async_op=True)
            assert work is not None
            self.pending.append(work)
        self.state = GATHERING

    @torch.no_grad()
    def gather(self) -> None:
        """Make every parameter whole (waiting for a prefetch, or gathering now)."""
        if self.state == GATHERED:
            return
        self.start_gather()
        for work in self.pending:
            work.wait()
        self.pending.clear()
        for f in self.flats:
            assert f.gathered is not None
            for i, whole in enumerate(f.wholes):
                f.layout.from_rank_major(f.gathered, i, whole)
            f.gathered = None
            for p, whole in zip(f.layout.params, f.wholes, strict=True):
                p.data = whole
        self.state = GATHERED

    def reshard(self) -> None:
        """Back to shards; the full buffers' storage is freed."""
        if self.state == SHARDED:
            return
        for work in self.pending:  # a prefetch nobody used: let it land, then drop it
            work.wait()
        self.pending.clear()
        for f in self.flats:
            f.gathered = None
            for p, own in zip(f.layout.params, f.shards, strict=True):
                p.data = own
            f.full.untyped_storage().resize_(0)
        self.state = SHARDED

    # ---- gradients ----------------------------------------------------------------

    @torch.no_grad()
    def prepare_reduce(self) -> None:
        """Copy the whole gradients rank-major into send buffers (a missing one as
        zeros) and free them."""
        for f in self.flats:
            n = f.layout.group.size
            f.send = _empty(n * f.layout.per_rank, f.shard)
            for i, p in enumerate(f.layout.params):
                f.layout.to_rank_major(f.send, i, p.grad)
                p.grad = None
            f.send.div_(f.layout.divisor)  # pre-divided (Grid.token_replicas)
        self.prepared = True

    def launch_reduce(self) -> None:
        for f in self.flats:
            assert f.send is not None
            if f.grad is None:
                f.grad = _empty(f.layout.per_rank, f.shard)
            work = reduce_scatter_into(f.grad, f.send, f.layout.group, async_op=True,
                                       wire_dtype=self.wire_dtype)
            assert work is not None
            self.reducing.append(work)
        self.prepared = False

    def release_send(self) -> None:
        """Wait for the reduce-scatters and free their send buffers; the reduced shards
        wait in the flat gradient buffer for :meth:`wait_reduce`."""
        for work in self.reducing:
            work.wait()
        self.reducing.clear()
        for f in self.flats:
            f.send = None

    def wait_reduce(self) -> None:
        """Wait for the reduce-scatters; the shards' gradients are views of the result
        (call when sharded, so each parameter has its shard's shape)."""
        for work in self.reducing:
            work.wait()
        self.reducing.clear()
        for f in self.flats:
            f.send = None
            assert f.grad is not None
            for i, p in enumerate(f.layout.params):
                p.grad = f.layout.own(f.grad, i)
