"""Expert tensor parallelism: each expert's FFN split over the tensor group
(Megatron-Core's ``expert_tensor_parallel_size``, ETP; the column/row split of
Megatron-LM, arXiv:1909.08053, applied per expert).

With ``parallelism.expert_tensor`` equal to the tensor degree, the fused expert tensors
of transformers 5.x are split a second time, after the expert axis' dim-0 split: the
gate/up projection column-wise (its output features; the gate and up halves each keep
their own slice, a packed dimension of two parts), the down projection row-wise (its
input features). Each rank then computes a partial sum of every expert output, and:

* under sequence parallelism (each tensor rank routes its own tokens) the rows a rank's
  experts received are all-gathered over the tensor group, the split FFN runs on all of
  them, and the partial outputs are reduce-scattered back, so each rank gets its own
  rows' summed output (Megatron-Core's ETP path). Row counts differ per rank, so both
  are uneven exchanges (:func:`gather_rows`, :func:`scatter_sum_rows`), made of
  point-to-point sends and receives: gloo's all-gather and all-to-all take no uneven
  sizes, and an all-to-all of the rows repeated ``t`` times would hold ``t`` copies;
* without it (every tensor rank holds the same tokens) the input enters by Megatron's f
  (identity, backward all-reduce) and the output leaves by g (all-reduce, backward
  identity): gathering would count each token ``t`` times.

The router stays whole. A rank's expert shard sees every token of its group, so its
gradient is whole (not a partial sum over tensor) and is reduced over data x context
only, as its placement now says. Refused, naming the module (:func:`refusals`): an
expert width the degree does not divide, biases (a row-parallel bias would be added
``t`` times), a post-expert norm (it needs the summed output), and a family's own gate
function (GPT-OSS's interleaved gate/up layout would not split as two halves).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraxis.parallel.placement import placement_of, set_placement
from paraxis.runtime.collectives import Pending, all_gather_into, record
from paraxis.runtime.differentiable import copy_to, on_wire, reduce_from, wire_dtype
from paraxis.runtime.grid import AxisGroup
from paraxis.runtime.liveness import guard
from paraxis.runtime.works import Works
from paraxis_moe.dispatcher import local_ids as received_ids

__all__ = ["ExpertTensor", "expert_width", "gather_rows", "refusals", "scatter_sum_rows",
           "shard_expert_ffn"]


def expert_width(experts: Any) -> int:
    """The experts' FFN width (``moe_intermediate_size``) from the down projection."""
    down = experts.down_proj
    return int(down.shape[1] if getattr(experts, "is_transposed", False) else down.shape[2])


def refusals(experts: Any, degree: int) -> list[str]:
    """Why ``experts`` cannot be split over ``degree`` tensor ranks (empty: it can)."""
    found = []
    width = expert_width(experts)
    if width % degree:
        found.append(f"its expert FFN width {width} is not divisible by expert_tensor "
                     f"{degree}")
    if getattr(experts, "has_bias", False):
        found.append("its experts have biases (a row-parallel down-projection bias would "
                     "be added once per tensor rank)")
    if getattr(experts, "has_post_expert_norm", False):
        found.append("it normalizes each expert's output, which needs the summed output")
    gate = getattr(type(experts), "_apply_gate", None)
    if getattr(experts, "has_gate", False) and gate is not None and \
            getattr(gate, "__name__", "") != "_default_apply_gate" and \
            not _gate_splits(experts, degree):
        found.append(f"its gate function {gate.__qualname__} does not give each rank's "
                     "slice of its output from that rank's slice of the gate and up "
                     "halves (interleaved halves, or features mixed)")
    return found


def _gate_splits(experts: Any, degree: int) -> bool:
    """Whether a family's own gate function commutes with the packed column split, tried
    on a random input: each rank's slice of the gate half and of the up half must give
    that rank's slice of the whole output (a clamp or an activation applied element by
    element to contiguous halves does; GPT-OSS's interleaved halves do not)."""
    width = 4 * degree
    x = torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            whole = experts._apply_gate(x)
            gate, up = x.chunk(2, dim=-1)
            parts = [experts._apply_gate(torch.cat([g, u], dim=-1)) for g, u in
                     zip(gate.chunk(degree, dim=-1), up.chunk(degree, dim=-1), strict=True)]
    except Exception:
        return False
    return whole.shape == (3, width) and torch.allclose(torch.cat(parts, dim=-1), whole)


def _split(param: nn.Parameter, dim: int, group: AxisGroup, parts: int) -> nn.Parameter:
    """This rank's slice of ``dim`` (within each of ``parts`` packed blocks), with its
    placement record updated in the same step."""
    block = param.shape[dim] // parts
    length = block // group.size
    offset = group.rank * length
    pieces = [param.detach().narrow(dim, k * block + offset, length) for k in range(parts)]
    local = nn.Parameter(torch.cat(pieces, dim).clone(), requires_grad=param.requires_grad)
    set_placement(local, placement_of(param).sharded(dim=dim, axis="tensor", offset=offset,
                                                     length=length, parts=parts))
    return local


def shard_expert_ffn(experts: Any, group: AxisGroup) -> None:
    """Split the fused expert tensors of ``experts`` (already sharded over the expert
    axis) over ``group``: gate/up column-wise, down row-wise."""
    transposed = bool(getattr(experts, "is_transposed", False))
    out_dim, in_dim = (2, 1) if transposed else (1, 2)  # of a (E, out, in) weight
    if experts.has_gate:
        experts.gate_up_proj = _split(experts.gate_up_proj, out_dim, group, parts=2)
    else:
        experts.up_proj = _split(experts.up_proj, out_dim, group, parts=1)
    experts.down_proj = _split(experts.down_proj, in_dim, group, parts=1)
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = expert_width(experts)


def _swap(group: AxisGroup, op: str, sends: list[torch.Tensor],
          recvs: list[torch.Tensor]) -> None:
    """Send ``sends[i]`` to member i and fill ``recvs[j]`` from member j, at once (this
    rank's own and empty ones skipped: both ends know the counts); counts the bytes sent
    under ``op``, and the seconds blocked."""
    me, peer = group.rank, group.ranks
    ops = [dist.P2POp(dist.irecv, t, peer[j], group=group.pg)
           for j, t in enumerate(recvs) if j != me and t.numel()]
    ops += [dist.P2POp(dist.isend, t, peer[i], group=group.pg)
            for i, t in enumerate(sends) if i != me and t.numel()]
    nbytes = sum(t.numel() * t.element_size() for i, t in enumerate(sends) if i != me)
    record(group, op, float(nbytes), 0.0)
    if ops:
        with guard(group, op):
            works = dist.batch_isend_irecv(ops)
        Pending(Works(works), group, op).wait()


def _gather(x: torch.Tensor, group: AxisGroup, counts: list[int]) -> torch.Tensor:
    """Every member's rows in member order, in the one buffer that holds them: this
    rank's rows copied in, the same ``x`` sent to every other member (no copy per
    member; gloo's all-gather and all-to-all take no uneven sizes)."""
    x = x.contiguous()
    out = x.new_empty((sum(counts), *x.shape[1:]))
    slots = list(out.split(counts))  # contiguous views: rows are dim 0
    slots[group.rank].copy_(x)
    _swap(group, "all_gather", [x] * group.size, slots)
    return out


def _scatter(x: torch.Tensor, group: AxisGroup, counts: list[int]) -> torch.Tensor:
    """The ``(n, mine, ...)`` partials of this rank's rows, one from each member (rows
    as :func:`_gather` left them): each member's slice of ``x`` goes to it."""
    x, me = x.contiguous(), group.rank
    parts = x.new_empty((group.size, counts[me], *x.shape[1:]))
    slices = x.split(counts)
    parts[me].copy_(slices[me])
    _swap(group, "reduce_scatter", list(slices), list(parts.unbind(0)))
    return parts


def _gathered(x: torch.Tensor, group: AxisGroup, counts: list[int],
              wire: torch.dtype | None) -> torch.Tensor:
    return on_wire(wire, _gather, x, group, counts)


def _summed(x: torch.Tensor, group: AxisGroup, counts: list[int],
            wire: torch.dtype | None) -> torch.Tensor:
    # Summed in the rows' own dtype, after the wire (as one process sums them).
    return on_wire(wire, _scatter, x, group, counts).sum(0)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, counts: list[int],
                wire: torch.dtype | None) -> torch.Tensor:
        ctx.group, ctx.counts, ctx.wire = group, counts, wire
        return _gathered(x, group, counts, wire)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _summed(grad, ctx.group, ctx.counts, ctx.wire), None, None, None


class _ScatterSumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, counts: list[int]
                ) -> torch.Tensor:
        ctx.group, ctx.counts = group, counts
        return _summed(x, group, counts, None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _gathered(grad, ctx.group, ctx.counts, None), None, None


def gather_rows(x: torch.Tensor, group: AxisGroup, counts: list[int], *,
                narrow: bool = True) -> torch.Tensor:
    """Every rank's rows of ``x`` (``counts[r]`` rows on rank ``r``), concatenated in
    rank order; backward sums each rank's gradient rows and returns this rank's (an
    uneven all-gather whose backward is a reduce-scatter). ``narrow=False`` keeps fp32
    rows fp32 on the wire under autocast. One buffer of the gathered rows is allocated,
    never ``n`` copies of ``x``: each member is sent the same ``x``."""
    if x.shape[0] != counts[group.rank]:
        raise ValueError(f"rank {group.rank} holds {x.shape[0]} rows, counts say "
                         f"{counts[group.rank]}")
    return _GatherRows.apply(x, group, list(counts), wire_dtype(x) if narrow else None)


def scatter_sum_rows(x: torch.Tensor, group: AxisGroup, counts: list[int]) -> torch.Tensor:
    """This rank's rows of the sum over ``group`` of ``x`` (rows ordered as
    :func:`gather_rows` left them); backward all-gathers (an uneven reduce-scatter).
    Outputs travel as computed, as the combine sends them."""
    return _ScatterSumRows.apply(x, group, list(counts))


class ExpertTensor:
    """How one experts module's split FFN meets its rows: over ``group`` (the tensor
    group), with ``sequence_parallel`` saying whether its ranks hold distinct tokens."""

    def __init__(self, group: AxisGroup, *, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel

    def dispatched(self, tokens: torch.Tensor, recv_counts: torch.Tensor,
                   local_ids: torch.Tensor, compute: Any) -> torch.Tensor:
        """``compute(rows, local_ids)`` on the rows an expert dispatch delivered
        (``recv_counts`` (ep, local) of them), with the partial outputs summed."""
        group = self.group
        if not self.sequence_parallel:
            return reduce_from(compute(copy_to(tokens, group), local_ids), group)
        counts_all = torch.empty(group.size * recv_counts.numel(), dtype=recv_counts.dtype,
                                 device=recv_counts.device)
        all_gather_into(counts_all, recv_counts.reshape(-1).contiguous(), group)
        per_rank = counts_all.view(group.size, *recv_counts.shape)
        counts = per_rank.sum((1, 2)).tolist()
        ids = received_ids(per_rank.view(-1, recv_counts.shape[1]).to(local_ids.device))
        out = compute(gather_rows(tokens, group, counts), ids)
        return scatter_sum_rows(out, group, counts)

    def whole(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor, compute: Any) -> torch.Tensor:
        """``compute(hidden, top_k_index, top_k_weights)`` at expert degree 1 (no
        dispatch): the routing weights enter with the tokens, as the model applies them."""
        group = self.group
        if not self.sequence_parallel:
            out = compute(copy_to(hidden, group), top_k_index, copy_to(top_k_weights, group))
            return reduce_from(out, group)
        # Sequence parallelism splits every rank's tokens evenly (validated). The routing
        # weights and the partial outputs travel unrounded, as one process keeps them.
        counts = [hidden.shape[0]] * group.size
        index = top_k_index.new_empty(group.size * top_k_index.numel())
        all_gather_into(index, top_k_index.reshape(-1).contiguous(), group)
        index = index.view(-1, *top_k_index.shape[1:])
        out = compute(gather_rows(hidden, group, counts), index,
                      gather_rows(top_k_weights, group, counts, narrow=False))
        return scatter_sum_rows(out, group, counts)
