"""The differentiable collectives a model's forward needs, as conjugate pairs.

The differentiable ops are the conjugate pairs of Megatron-LM (arXiv:1909.08053,
section 3) and of sequence parallelism (Korthikanti et al., arXiv:2205.05198):

| op                 | forward                      | backward                       |
| ------------------ | ---------------------------- | ------------------------------ |
| ``copy_to``        | identity (Megatron's f)      | all-reduce                     |
| ``reduce_from``    | all-reduce (Megatron's g)    | identity                       |
| ``all_reduce``     | all-reduce                   | all-reduce (a true sum)        |
| ``all_gather``     | all-gather along ``dim``     | own slice, or reduce-scatter   |
| ``reduce_scatter`` | reduce-scatter along ``dim`` | all-gather                     |
| ``split``          | own slice along ``dim``      | all-gather                     |
| ``all_to_all``     | scatter one dim, gather one  | the reverse exchange           |
| ``all_to_all_uneven`` | rows to ranks by counts   | rows back by the same counts   |

``all_gather(..., grad="slice")`` suits a gathered tensor whose every consumer is
replicated over the group (its gradient is the same on every rank); ``grad="sum"`` a
tensor that each rank uses for different work (the gradient is partial per rank).

Under autocast (``train.precision`` bf16 or fp16) an fp32 activation travels in the
autocast dtype, and so does its gradient: half the bytes. Where the consumer is a
matmul, which autocast would cast to that dtype anyway, nothing changes; elsewhere (a
residual stream, a norm's input) it is one rounding more than one process makes, inside
the bf16 tolerance (:data:`paraxis.parallel.numerics.BF16_RTOL`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paraxis.runtime.collectives import (
    all_to_all_dims,
    exchange_rows,
    gather_along,
    own_part,
    reduce_scatter_along,
    summed,
)
from paraxis.runtime.group import AxisGroup

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_uneven",
    "autocast_as",
    "autocast_dtype",
    "autocast_state",
    "copy_to",
    "linear_weight_grad",
    "on_wire",
    "plain_linear",
    "reduce_from",
    "reduce_scatter",
    "split",
    "wire_dtype",
]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now, or None when it is off:
    what activations travel in (here, ring attention's K/V, a pipeline's hidden states)."""
    return torch.get_autocast_dtype(device_type) \
        if torch.is_autocast_enabled(device_type) else None


def autocast_state(device: torch.device) -> tuple[str, torch.dtype | None]:
    """Autocast on ``device`` now, for :func:`autocast_as` in a custom function's backward."""
    return device.type, autocast_dtype(device.type)


def autocast_as(state: tuple[str, torch.dtype | None]) -> Any:
    """Autocast as :func:`autocast_state` read it (off where it was off): a backward runs
    on autograd's thread, without the forward's region."""
    kind, dtype = state
    return torch.autocast(kind, dtype=dtype, enabled=dtype is not None)


def plain_linear(module: torch.nn.Module) -> bool:
    """An ``nn.Linear`` running ``nn.Linear``'s own forward (not a subclass's, and not
    replaced on the instance by another axis): what a custom linear backward may stand in
    for without dropping someone else's forward."""
    return (isinstance(module, torch.nn.Linear)
            and type(module).forward is torch.nn.Linear.forward
            and "forward" not in vars(module))


def linear_weight_grad(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``dW = dY^T X`` of ``F.linear`` over every leading dim, laid out as the weight
    (autograd's own product)."""
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def wire_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The narrower dtype an fp32 activation travels in under autocast, or None: keep it
    as it is (fp32 training, integer counts, tensors already narrow)."""
    return autocast_dtype(x.device.type) if x.dtype == torch.float32 else None


def on_wire(wire: torch.dtype | None, fn: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``fn(x, *args)`` with ``x`` sent in ``wire`` and the result cast back."""
    return fn(x, *args) if wire is None else fn(x.to(wire), *args).to(x.dtype)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group, ctx.wire = group, wire_dtype(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return on_wire(ctx.wire, summed, grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        return on_wire(wire_dtype(x), summed, x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group, ctx.wire = group, wire_dtype(x)
        return on_wire(ctx.wire, summed, x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return on_wire(ctx.wire, summed, grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: AxisGroup,
                grad_sum: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.grad_sum, ctx.wire = dim, group, grad_sum, wire_dtype(x)
        return on_wire(ctx.wire, gather_along, x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.grad_sum:
            return (on_wire(ctx.wire, reduce_scatter_along, grad, ctx.dim, ctx.group), None,
                    None, None)
        return own_part(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.wire = dim, group, wire_dtype(x)
        out = on_wire(ctx.wire, reduce_scatter_along, x, dim, group)
        # A view of the buffer it was received in; a model that adds to it in place
        # (Llama 4's MoE output) would modify a custom Function's view, which autograd
        # forbids: hand out a tensor of its own.
        return out.clone() if out._base is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return on_wire(ctx.wire, gather_along, grad, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.wire = dim, group, wire_dtype(x)
        return own_part(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return on_wire(ctx.wire, gather_along, grad, ctx.dim, ctx.group), None, None


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, send: tuple[int, ...],
                recv: tuple[int, ...], narrow: bool) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        ctx.wire = wire_dtype(x) if narrow else None
        return on_wire(ctx.wire, exchange_rows, x, group, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (on_wire(ctx.wire, exchange_rows, grad, ctx.group, ctx.recv, ctx.send), None,
                None, None, None)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, scatter_dim: int,
                gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims, ctx.wire = group, (scatter_dim, gather_dim), wire_dtype(x)
        return on_wire(ctx.wire, all_to_all_dims, x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        return (on_wire(ctx.wire, all_to_all_dims, grad, ctx.group, gather_dim, scatter_dim),
                None, None, None)


def copy_to(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``group`` (Megatron's f)."""
    return x if group.size == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum over ``group`` forward; identity backward (Megatron's g)."""
    return x if group.size == 1 else _ReduceFrom.apply(x, group)


def all_reduce(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """A true differentiable sum over ``group``: the gradient is summed too."""
    return x if group.size == 1 else _AllReduce.apply(x, group)


def all_gather(x: torch.Tensor, group: AxisGroup, *, dim: int,
               grad: str = "slice") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``. Backward keeps this rank's slice
    (``grad="slice"``) or reduce-scatters it (``grad="sum"``); see the module docstring."""
    if grad not in ("slice", "sum"):
        raise ValueError(f"grad must be 'slice' or 'sum', not {grad!r}")
    return x if group.size == 1 else _AllGather.apply(x, dim, group, grad == "sum")


def reduce_scatter(x: torch.Tensor, group: AxisGroup, *, dim: int) -> torch.Tensor:
    """This rank's part along ``dim`` of the sum over ``group``; backward all-gathers."""
    return x if group.size == 1 else _ReduceScatter.apply(x, dim, group)


def split(x: torch.Tensor, group: AxisGroup, *, dim: int) -> torch.Tensor:
    """This rank's equal part along ``dim``; backward all-gathers."""
    return x if group.size == 1 else _Split.apply(x, dim, group)


def all_to_all(x: torch.Tensor, group: AxisGroup, *, scatter_dim: int,
               gather_dim: int) -> torch.Tensor:
    """Cut ``scatter_dim`` into ``group.size`` parts, send part i to rank i, and stack
    what arrives along ``gather_dim`` (DeepSpeed-Ulysses' exchange, arXiv:2309.14509)."""
    return x if group.size == 1 else _AllToAll.apply(x, group, scatter_dim, gather_dim)


def all_to_all_uneven(x: torch.Tensor, group: AxisGroup, send: Sequence[int],
                      recv: Sequence[int], *, narrow: bool = True) -> torch.Tensor:
    """Rows of ``x`` go to ranks in order, ``send[i]`` to rank i; ``recv[j]`` rows arrive
    from rank j (exchange the counts first). Backward returns gradients the same way.
    ``narrow=False`` keeps an fp32 result of a computation autocast does not cover in
    fp32 on the wire (one process would add it to the residual stream unrounded)."""
    if group.size == 1:
        return x
    return _AllToAllUneven.apply(x, group, tuple(int(n) for n in send),
                                 tuple(int(n) for n in recv), narrow)
