"""One ZeRO-3 unit at run time: its parameters hold their shard between uses and the
whole tensor while the unit runs.

Each parameter keeps its identity (the module's own ``nn.Parameter``; modules and their
forward stay the model's). Its data is swapped:

* *sharded*: ``p.data`` is this rank's chunk, a view of the unit's flat shard buffer
  (one per gradient-sync group), which the optimizer steps in place; the placement
  record describes that chunk. The shards are the fp32 master weights.
* *gathered*: ``p.data`` is a view of the unit's flat full buffer, filled by one
  all-gather per group (rank-major, then copied out to each parameter's natural layout,
  as FSDP2's ``foreach_all_gather`` does), in the dtype the forward computes in: under
  ``train.precision`` bf16 (fp16) the shard is cast into the all-gather's input and
  the unit is held in bf16 (FSDP2's ``param_dtype``), half the bytes on the wire and
  in memory; autocast would have cast each of these weights where a matmul used it.

Resharding frees the full buffer by resizing its storage to zero and gathering
resizes it back (FSDP's trick, arXiv:2304.11277 section 4): views autograd saved in
forward (a transposed weight) point at the same storage, so they see the gathered
values again in backward, and nothing saved keeps a full copy alive in between.

A deferred model's parameters may still be on the meta device (their values a
function of (seed, name, element), or slices of a file): then ``fill`` (the
materializer's, ``paraxis.parallel.strategy.MATERIALIZE_ATTR``) writes this rank's
chunk straight into the shard buffer, and the whole tensor never exists on the rank.

A group holding one parameter split along dim 0 (the embedding, the head: the largest
tensors a rank gathers whole) is its own rank-major buffer: it is gathered straight into
its full buffer (padded to whole chunks; the parameter is a view of its real rows) and
a whole fp32 gradient is reduce-scattered from where autograd left it, so neither
direction holds a second whole copy of it (FSDP2 copies out per parameter always).

Gradients: when backward has produced every trainable parameter's gradient, they are
copied rank-major into a send buffer and freed, and one reduce-scatter per group
averages them into the unit's flat gradient buffer, whose views become the shards'
gradients (under HSDP then all-reduced over the groups holding the same shards). A
gradient computed against a bf16 unit is bf16; where it must wait for more microbatches
it is added into an fp32 accumulator and freed (:meth:`ShardedUnit.fold`, FSDP2's
``unsharded_accumulated_grad``), so microbatches sum in fp32 as they do without ZeRO.
Frozen parameters (``requires_grad`` False: a LoRA model's base weights) are sharded
and gathered like the others, in flats of their own that no reduction touches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paraxis.parallel.placement import Placement, placement_of, set_placement
from paraxis.runtime.collectives import (
    Pending,
    all_gather_into,
    all_reduce_,
    reduce_scatter_into,
)
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
    trainable: bool
    grad: torch.Tensor | None = None  # the shards' reduced gradients
    shards: list[torch.Tensor] = field(default_factory=list)
    # Every parameter whole, natural layout, one buffer per dtype gathered in; storage
    # freed while sharded.
    fulls: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    gathered: torch.Tensor | None = None
    send: torch.Tensor | None = None
    acc: torch.Tensor | None = None  # fp32 sum of low-precision whole gradients

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.layout.shapes)

    @property
    def padded(self) -> int:
        """Elements of the rank-major buffer: every rank's chunks."""
        return self.layout.group.size * self.layout.per_rank

    @property
    def direct(self) -> bool:
        """One parameter split along dim 0: the rank-major buffer is its natural layout,
        padded at the end."""
        return len(self.layout.params) == 1 and self.layout.prefix[0] == 1

    def gather_dtype(self, compute: torch.dtype | None) -> torch.dtype:
        """What the unit is held in for a forward computing in ``compute``: that dtype
        when it is narrower than the master's, else the master's."""
        master = self.shard.dtype
        if compute is None or not master.is_floating_point or \
                compute.itemsize >= master.itemsize:
            return master
        return compute

    def full(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.fulls:
            numel = self.padded if self.direct else self.numel
            full = torch.empty(numel, dtype=dtype, device=self.shard.device)
            full.untyped_storage().resize_(0)
            self.fulls[dtype] = full
        return self.fulls[dtype]

    def wholes(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Views of the full buffer in ``dtype``, one per parameter, whole-shaped."""
        return self.wholes_of(self.full(dtype))

    def wholes_of(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of a natural-layout flat buffer, one per parameter, whole-shaped."""
        out, start = [], 0
        for shape in self.layout.shapes:
            numel = math.prod(shape)
            out.append(full[start:start + numel].view(shape))
            start += numel
        return out

    def whole_grads(self) -> list[torch.Tensor | None]:
        """Each parameter's whole gradient: the fp32 accumulator (with what autograd
        added since) or the gradient autograd left."""
        if self.acc is None:
            return [p.grad for p in self.layout.params]
        out: list[torch.Tensor | None] = []
        for p, view in zip(self.layout.params, self.wholes_of(self.acc), strict=True):
            if p.grad is not None:
                view.add_(p.grad)
            out.append(view)
        return out


def _as_send(grad: torch.Tensor | None, f: _Flat) -> torch.Tensor | None:
    """A direct flat's whole gradient as its send buffer, when it already is one (no
    padding, the master dtype, contiguous); else None."""
    if grad is None or grad.numel() != f.padded or grad.dtype != f.shard.dtype \
            or not grad.is_contiguous():
        return None
    return grad.view(-1)


def _empty(numel: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype or like.dtype, device=like.device)


class ShardedUnit:
    """The parameters of one unit (``layouts``: one per gradient-sync group and
    trainability), sharded in place at construction."""

    def __init__(self, name: str, module: nn.Module, layouts: list[ShardLayout], *,
                 reshard_after_forward: bool = True, wire_dtype: torch.dtype | None = None,
                 fill: Fill | None = None, device: torch.device | None = None):
        self.name, self.module, self.wire_dtype = name, module, wire_dtype
        self.reshard_after_forward = reshard_after_forward
        self.flats = [self._shard(layout, fill, device) for layout in layouts]
        self.params = [p for f in self.flats for p in f.layout.params]
        self.trainable = [p for f in self.flats if f.trainable for p in f.layout.params]
        self.all_trainable = all(f.trainable for f in self.flats)
        self.state = SHARDED
        self.dtype: torch.dtype | None = None  # what the unit is gathered in
        self.ready: set[int] = set()
        self.prepared = False  # gradients copied into the send buffers
        self.pending: list[Pending] = []  # all-gathers in flight
        self.reducing: list[Pending] = []  # reduce-scatters in flight
        self.replicating: list[Pending] = []  # HSDP all-reduces in flight

    @torch.no_grad()
    def _shard(self, layout: ShardLayout, fill: Fill | None,
               device: torch.device | None) -> _Flat:
        like = layout.params[0]
        drawn = fill is not None and like.is_meta  # else: a copy of the whole tensor
        where = device if drawn and device is not None else like.device
        shard = torch.zeros(layout.per_rank, dtype=like.dtype, device=where)
        flat = _Flat(layout, shard, like.requires_grad)
        for i, p in enumerate(layout.params):
            offset, length, _ = layout.rank_rows(i)
            own = layout.own(shard, i)
            rec = layout.placement(i, placement_of(p))
            flat.shards.append(own)
            if drawn and p.is_meta:
                assert fill is not None
                fill(rec, own)
                new = nn.Parameter(own, requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # the parameter object stays the same
                torch.utils.swap_tensors(p, new)
            else:
                own.narrow(layout.dims[i], 0, length).copy_(
                    p.data.narrow(layout.dims[i], offset, length))
                p.data = own
            set_placement(p, rec)
        return flat

    # ---- gather and reshard ---------------------------------------------------------

    @torch.no_grad()
    def start_gather(self, compute: torch.dtype | None) -> None:
        """Launch the all-gathers for a forward computing in ``compute`` (None: as held;
        asynchronously) unless gathered or under way for it; a unit held for another
        is resharded first."""
        if self.state != SHARDED and self.dtype != compute:
            self.reshard()
        if self.state != SHARDED:
            return
        for f in self.flats:
            dtype = f.gather_dtype(compute)
            full = f.full(dtype)
            full.untyped_storage().resize_(full.numel() * full.element_size())
            part = f.shard if f.shard.dtype == dtype else f.shard.to(dtype)
            f.gathered = full if f.direct else _empty(f.padded, f.shard, dtype)
            work = all_gather_into(f.gathered, part, f.layout.group, async_op=True)
            assert work is not None
            self.pending.append(work)
        self.state, self.dtype = GATHERING, compute

    @torch.no_grad()
    def gather(self, compute: torch.dtype | None) -> None:
        """Make every parameter whole for a forward computing in ``compute`` (waiting
        for a prefetch, or gathering now)."""
        if self.state == GATHERED and self.dtype == compute:
            return
        self.start_gather(compute)
        for work in self.pending:
            work.wait()
        self.pending.clear()
        for f in self.flats:
            assert f.gathered is not None
            wholes = f.wholes(f.gathered.dtype)
            if not f.direct:
                for i, whole in enumerate(wholes):
                    f.layout.from_rank_major(f.gathered, i, whole)
            f.gathered = None
            for p, whole in zip(f.layout.params, wholes, strict=True):
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
            for full in f.fulls.values():
                full.untyped_storage().resize_(0)
        self.state = SHARDED

    # ---- gradients ----------------------------------------------------------------

    @torch.no_grad()
    def fold(self, param: nn.Parameter | None = None) -> None:
        """Add the low-precision whole gradients (of ``param``, or of every trainable
        parameter) into the fp32 accumulator and free them."""
        for f in self.flats:
            if not f.trainable:
                continue
            for i, p in enumerate(f.layout.params):
                grad = p.grad
                if (param is None or p is param) and grad is not None \
                        and grad.dtype != f.shard.dtype:
                    if f.acc is None:
                        f.acc = torch.zeros(f.numel, dtype=f.shard.dtype,
                                            device=f.shard.device)
                    f.wholes_of(f.acc)[i].add_(grad)
                    p.grad = None

    @property
    def accumulating(self) -> bool:
        return any(f.acc is not None for f in self.flats)

    @torch.no_grad()
    def prepare_reduce(self) -> None:
        """Copy the whole gradients rank-major into send buffers (a missing one as
        zeros) and free them."""
        for f in self.flats:
            if not f.trainable:
                continue
            grads = f.whole_grads()
            f.send = _as_send(grads[0], f) if f.direct else None
            if f.send is None:
                # Each whole gradient is freed once copied: the send buffer's pages are
                # touched as they are written, so the two never both hold the unit.
                f.send = _empty(f.padded, f.shard)
                for i, p in enumerate(f.layout.params):
                    f.layout.to_rank_major(f.send, i, grads[i])
                    grads[i] = p.grad = None
            for p in f.layout.params:
                p.grad = None
            f.acc = None
            f.send.div_(f.layout.divisor)  # pre-divided (Grid.token_replicas)
        self.prepared = True

    def launch_reduce(self) -> None:
        for f in self.flats:
            if not f.trainable:
                continue
            assert f.send is not None
            if f.grad is None:
                f.grad = _empty(f.layout.per_rank, f.shard)
            work = reduce_scatter_into(f.grad, f.send, f.layout.group, async_op=True,
                                       wire_dtype=self.wire_dtype, consume=True)
            assert work is not None
            self.reducing.append(work)
        self.prepared = False

    def release_send(self) -> None:
        """Wait for the reduce-scatters and free their send buffers; under HSDP start
        the all-reduces of the shards over their replicas. The reduced shards wait in
        the flat gradient buffer for :meth:`wait_reduce`."""
        for work in self.reducing:
            work.wait()
        self.reducing.clear()
        for f in self.flats:
            f.send = None
            if f.trainable and f.layout.replicas is not None and f.grad is not None:
                replicated = all_reduce_(f.grad, f.layout.replicas, async_op=True,
                                         wire_dtype=self.wire_dtype)
                assert replicated is not None
                self.replicating.append(replicated)

    def wait_reduce(self) -> None:
        """Wait for the reductions; the shards' gradients are views of the result
        (call when sharded, so each parameter has its shard's shape)."""
        if self.reducing:
            self.release_send()
        for work in self.replicating:
            work.wait()
        self.replicating.clear()
        for f in self.flats:
            if not f.trainable:
                continue
            assert f.grad is not None
            for i, p in enumerate(f.layout.params):
                p.grad = f.layout.own(f.grad, i)
