"""Sequence parallel's collectives overlapped with the GEMMs next to them
(``parallelism.tensor_overlap``; Megatron-LM's ``tp_comm_overlap``, torch's "async TP";
Wang et al., ASPLOS 2023, decomposition of a collective into ring steps).

Without it, the all-gather before a column-parallel GEMM and the reduce-scatter after a
row-parallel one block the GEMM that needs them (:mod:`paraxis_tp.layers`). Here each is
cut into ``t`` ring steps (:mod:`paraxis.runtime.ring`) and every step's transfer runs
while the GEMM on a block already held is computed:

* entry (:class:`OverlappedEntry`, :class:`_GatherLinears`): the block input's sequence
  blocks go round the ring; every column-parallel projection fed that input (q, k, v;
  gate, up: the gather is still done once for all) is computed on this rank's block
  first, then on each block as it arrives; outputs are assembled in sequence order.
  Backward: the input gradient is reduce-scattered round the ring, one destination's
  block computed while the previous one travels, and the weight gradients are computed
  while the last hop is in flight. The gathered input is kept for the weight gradient,
  as without overlap (nothing is gathered twice).
* exit (:class:`_LinearScatter`): the row-parallel GEMM is computed one destination
  block at a time, the block for the previous rank first and this rank's own last, each
  partial sum travelling while the next is computed. Backward: the output gradient's
  blocks go round the ring and each block's input gradient is computed as it arrives.

Only modules whose forward is ``nn.Linear``'s own take part (a subclass keeps its own
forward and the plain collectives). Sums are taken in ring order, not the collective's,
so results agree with the plain path at the reduction tolerance, not bit for bit. On a
stream-ordered group (NCCL) transfers run on the communicator's stream while the GEMMs
run on the current one; that path has never run (no GPU was lent): it is the CUDA path
``tensor_overlap`` of :mod:`paraxis.runtime.cuda_paths`, off under ``auto`` until a GPU
run validates it (:func:`paraxis_tp.strategy.overlap_wanted`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paraxis.runtime.differentiable import (
    autocast_as,
    autocast_state,
    linear_weight_grad,
    wire_dtype,
)
from paraxis.runtime.group import AxisGroup
from paraxis.runtime.ring import ring_gather, ring_reduce_scatter

__all__ = ["OverlappedEntry", "overlap_row"]

SEQ_DIM = -2  # as paraxis_tp.layers.SEQ_DIM (this module is imported by that one)


class _GatherLinears(torch.autograd.Function):
    """(gathered x, x W_1^T + b_1, ...) from this rank's sequence block of x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, *params: Any) -> Any:
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.wire, ctx.autocast = group, wire_dtype(x), autocast_state(x.device)
        ctx.set_materialize_grads(False)  # None for an output nothing used
        outs: list[list[torch.Tensor]] = [[] for _ in weights]
        order: list[int] = []

        def on_block(index: int, block: torch.Tensor) -> None:
            block = block.to(x.dtype)  # as the plain gather's cast back from the wire
            order.append(index)
            for out, w, b in zip(outs, weights, biases, strict=True):
                out.append(F.linear(block, w, b))

        send = x.contiguous() if ctx.wire is None else x.to(ctx.wire)
        blocks = ring_gather(send, group, on_block)
        full = torch.cat([b.to(x.dtype) for b in blocks], dim=SEQ_DIM)
        position = sorted(range(len(order)), key=order.__getitem__)  # sequence order
        ys = [torch.cat([out[i] for i in position], dim=SEQ_DIM) for out in outs]
        ctx.save_for_backward(full, *weights)
        ctx.has_bias = [b is not None for b in biases]
        return (full, *ys)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor | None, *grads: Any) -> Any:
        full, *weights = ctx.saved_tensors
        group, n = ctx.group, ctx.group.size
        used = [i for i, g in enumerate(grads) if g is not None]
        grad_chunks = [g.chunk(n, dim=SEQ_DIM) if g is not None else None for g in grads]
        full_chunks = grad_full.chunk(n, dim=SEQ_DIM) if grad_full is not None else None
        out: list[Any] = [None] * (2 * len(weights))

        def partial(block: int) -> torch.Tensor:
            total = full_chunks[block].clone() if full_chunks is not None else None
            for i in used:
                part = (grad_chunks[i][block] @ weights[i]).to(full.dtype)
                total = part if total is None else total + part
            return total if total is not None else full.new_zeros(
                full.chunk(n, dim=SEQ_DIM)[block].shape)

        def weight_grads() -> None:  # while the last hop of the input gradient travels
            for i in used:
                out[2 * i] = linear_weight_grad(full, grads[i]).to(weights[i].dtype)
                if ctx.has_bias[i]:
                    out[2 * i + 1] = grads[i].flatten(0, -2).sum(0).to(weights[i].dtype)

        with autocast_as(ctx.autocast):
            grad_x = ring_reduce_scatter(partial, group, wire=ctx.wire,
                                         before_last_wait=weight_grads)
        return (grad_x, None, *out)


class _LinearScatter(torch.autograd.Function):
    """This rank's sequence block of the sum over ``group`` of x W^T (no bias)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: AxisGroup,
                ) -> torch.Tensor:
        ctx.group, ctx.autocast = group, autocast_state(x.device)
        n = group.size
        if x.shape[SEQ_DIM] % n:
            raise ValueError(f"a sequence of {x.shape[SEQ_DIM]} tokens does not split over "
                             f"{n} tensor ranks")
        blocks = x.chunk(n, dim=SEQ_DIM)
        out = ring_reduce_scatter(lambda b: F.linear(blocks[b], weight), group)
        ctx.save_for_backward(x, weight)
        ctx.wire = wire_dtype(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad_x: list[torch.Tensor | None] = [None] * ctx.group.size

        def on_block(index: int, block: torch.Tensor) -> None:  # a block of the grad
            grad_x[index] = (block.to(grad.dtype) @ weight).to(x.dtype)

        with autocast_as(ctx.autocast):
            send = grad.contiguous() if ctx.wire is None else grad.to(ctx.wire)
            arrived = ring_gather(send, ctx.group, on_block)
            full = torch.cat([b.to(grad.dtype) for b in arrived], dim=SEQ_DIM)
            grad_w = linear_weight_grad(x, full).to(weight.dtype)
        return torch.cat(grad_x, dim=SEQ_DIM), grad_w, None  # type: ignore[arg-type]


def overlap_row(linear: nn.Linear, group: AxisGroup) -> None:
    """Make ``linear`` (row parallel, bias held back by its hooks) return this rank's
    sequence block of the summed output, the reduce-scatter pipelined with its GEMM."""
    linear.forward = lambda x: _LinearScatter.apply(x, linear.weight, group)  # type: ignore[method-assign]


class OverlappedEntry:
    """Sequence parallel's entry to a block, fused with the column-parallel projections
    fed the entered tensor. Called on the block's input (this rank's tokens), it returns
    the gathered input (the block still sees the whole sequence) and keeps each
    consumer's output; a consumer called on that very tensor takes its kept output,
    called on anything else computes as usual. Consumers are learnt at the first call:
    one the block did not feed its input is dropped from later fused calls."""

    def __init__(self, group: AxisGroup):
        self.group = group
        self.consumers: list[nn.Linear] = []
        self._learnt, self._called = False, False
        self._taken: set[int] = set()
        self._x: torch.Tensor | None = None
        self._out: dict[int, torch.Tensor] = {}

    def add(self, linear: nn.Linear) -> None:
        self.consumers.append(linear)
        linear.forward = lambda x: self._forward(linear, x)  # type: ignore[method-assign]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        params: list[Any] = []
        for c in self.consumers:
            params += [c.weight, c.bias]
        full, *ys = _GatherLinears.apply(x.contiguous(), self.group, *params)
        self._x, self._out = full, {id(c): y for c, y in zip(self.consumers, ys, strict=True)}
        self._called = True
        return full

    def _forward(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if x is self._x and id(linear) in self._out:
            self._taken.add(id(linear))
            out = self._out.pop(id(linear))
            if not self._out:
                self._x = None
            return out
        return F.linear(x, linear.weight, linear.bias)

    def clear(self) -> None:
        """The block returned: drop what it did not take; learn the consumers once."""
        if self._called and not self._learnt:
            self.consumers = [c for c in self.consumers if id(c) in self._taken]
            self._learnt = True
        self._x, self._out = None, {}
