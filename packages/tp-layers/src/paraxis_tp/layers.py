"""Tensor-parallel sharding of a model's own modules, in place (Megatron-LM,
arXiv:1909.08053, section 3).

A module keeps its class and its forward, so whatever its family does there (an
embedding that scales its output, a linear whose subclass caps it) it keeps doing. Only
its weight is replaced by this rank's shard, with the placement record updated in the
same step, and forward hooks put core's collectives around it:

* :func:`shard_column`: ``Y = X A`` with ``A``'s output features split; each rank
  computes its slice of ``Y`` (a subclass's own per-output-feature parameters, such as
  a learned logit scale, are split with them). The input enters the region first
  (``enter``: Megatron's f, or an all-gather along the sequence under sequence
  parallelism); optionally the output is gathered (``gather_output``), padding columns
  cut.
* :func:`shard_row`: ``A``'s input features split; the module runs on this rank's slice
  of ``X`` *without* its bias, then the partial outputs are summed (all-reduce, or
  reduce-scatter along the sequence under sequence parallelism) and the bias added once.
  With ``overlap`` (sequence parallel, a plain ``nn.Linear``) the reduce-scatter is
  pipelined with the GEMM inside its forward (:mod:`paraxis_tp.overlap`).
* :func:`shard_embedding`: the vocabulary split by token range; ids this rank does not
  own are looked up as row 0, their rows zeroed after the module's forward, and the
  partial embeddings summed.

Shards are built by :func:`shard_rows` (:func:`sharded_parameter` along any dimension,
with its placement); ``memo`` maps a dense weight to its shard, so a
weight two modules share (tied word embeddings) stays one parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraxis.parallel.placement import placement_of, set_placement
from paraxis.runtime.differentiable import all_gather, reduce_from, reduce_scatter, split
from paraxis.runtime.grid import AxisGroup
from paraxis_tp.overlap import overlap_row

__all__ = ["SEQ_DIM", "gather_tokens", "map_first_input", "scatter_tokens", "shard_column",
           "shard_embedding", "shard_row", "shard_rows", "sharded_parameter", "split_tokens"]

# The token dimension: activations are (batch, sequence, hidden), or (tokens, hidden)
# where a block flattens them first (Ernie-4.5's shared experts). Whatever a collective
# returns along it is made contiguous: transformers views activations (Beam's MoE block).
SEQ_DIM = -2


def gather_tokens(x: torch.Tensor, group: AxisGroup, *, grad: str) -> torch.Tensor:
    """All ranks' tokens (sequence parallel's entry; ``grad``: see ``all_gather``)."""
    return all_gather(x, group, dim=SEQ_DIM, grad=grad).contiguous()


def scatter_tokens(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """This rank's tokens of the sum over ``group`` (sequence parallel's exit)."""
    return reduce_scatter(x, group, dim=SEQ_DIM).contiguous()


def split_tokens(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """This rank's tokens (sequence parallel's first split)."""
    return split(x, group, dim=SEQ_DIM).contiguous()


def shard_rows(t: torch.Tensor, group: AxisGroup, *, parts: int = 1,
               padded: int | None = None) -> tuple[torch.Tensor, int, int, int]:
    """This rank's rows of ``t`` (dim 0): (tensor, offset, real length, padding).

    ``parts > 1``: dim 0 is ``parts`` equal blocks (e.g. gate and up) and each block is
    split. ``padded``: dim 0 is first padded with zero rows to that size (a vocabulary
    padded to a multiple of the tensor degree); padding never counts as real rows.
    """
    rows = t.shape[0]
    if parts > 1:
        pieces = [shard_rows(b, group)[0] for b in t.chunk(parts, dim=0)]
        per = rows // parts // group.size
        return torch.cat(pieces), group.rank * per, per, 0
    total = padded or rows
    if total % group.size:
        raise ValueError(f"{rows} rows do not split over {group.size} tensor ranks")
    per = total // group.size
    start = group.rank * per
    real = max(0, min(per, rows - start))
    local = t.new_zeros((per, *t.shape[1:]))
    local[:real] = t[start:start + real]
    return local, start, real, per - real


def sharded_parameter(old: nn.Parameter, group: AxisGroup, memo: dict[int, nn.Parameter], *,
             dim: int = 0, parts: int = 1, padded: int | None = None) -> nn.Parameter:
    """The shard of ``old`` along ``dim`` over the tensor axis, with its placement."""
    if id(old) in memo:
        return memo[id(old)]
    data = old.data if dim == 0 else old.data.transpose(0, dim)
    local, offset, length, padding = shard_rows(data, group, parts=parts, padded=padded)
    if dim != 0:
        local = local.transpose(0, dim)
    new = nn.Parameter(local.contiguous(), requires_grad=old.requires_grad)
    set_placement(new, placement_of(old).sharded(dim=dim, axis="tensor", offset=offset,
                                                 length=length, parts=parts,
                                                 padding=padding))
    memo[id(old)] = new
    return new


def map_first_input(fn: Callable[[Any], Any], args: tuple, kwargs: dict,
                    ) -> tuple[tuple, dict]:
    """Apply ``fn`` to a module call's hidden-state input (first positional argument, or
    the ``hidden_states`` / ``input`` keyword)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    for key in ("hidden_states", "input", "x"):
        if key in kwargs:
            return args, {**kwargs, key: fn(kwargs[key])}
    raise ValueError("cannot find the hidden-state input of a tensor-parallel module")


def shard_column(linear: nn.Module, group: AxisGroup, memo: dict[int, nn.Parameter], *,
                 parts: int = 1, padded: int | None = None, gather_output: bool = False,
                 enter: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 holders: tuple[nn.Module, ...] = ()) -> None:
    """``holders``: the modules whose per-output-feature parameters are split, when they
    are not ``linear`` itself (a LoRA layer: its base layer and its up projection B,
    :mod:`paraxis_tp.adapters`); the hooks go on ``linear``, whose forward sums them."""
    real_out = linear.out_features
    # The weight, the bias, and any parameter a subclass keeps per output feature (Dory's
    # head scales each logit): the module's own forward applies them to its local slice.
    for holder in holders or (linear,):
        for name, param in list(holder._parameters.items()):
            if param is not None and param.ndim >= 1 and param.shape[0] == real_out:
                holder._parameters[name] = sharded_parameter(param, group, memo,
                                                             parts=parts, padded=padded)
        holder.out_features = holder.weight.shape[0]
    linear.out_features = (holders or (linear,))[0].weight.shape[0]
    if enter is not None:
        linear.register_forward_pre_hook(
            lambda m, args, kwargs: map_first_input(enter, args, kwargs), with_kwargs=True)
    if gather_output:
        def gather(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            return all_gather(out, group, dim=-1, grad="slice")[..., :real_out]

        linear.register_forward_hook(gather)
    linear.paraxis_tensor = "column (gathered)" if gather_output else "column"


def shard_row(linear: nn.Module, group: AxisGroup, memo: dict[int, nn.Parameter], *,
              split_input: bool = False, sequence_parallel: bool = False,
              on_enter: Callable[[], None] | None = None, overlap: bool = False,
              holders: tuple[nn.Module, ...] = ()) -> None:
    """``holders``: the modules whose input features are split, when they are not
    ``linear`` itself (a LoRA layer: its base layer, whose bias is the one added after
    the sum, and its down projection A, :mod:`paraxis_tp.adapters`); the hooks go on
    ``linear``, whose forward adds up their partial sums before the one reduction."""
    for holder in holders or (linear,):
        holder.weight = sharded_parameter(holder.weight, group, memo, dim=1)
        holder.in_features = holder.weight.shape[1]
    base = (holders or (linear,))[0]
    linear.in_features = base.weight.shape[1]
    if overlap:  # its forward reduce-scatters, pipelined with the GEMM
        overlap_row(linear, group)

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if on_enter is not None:
            on_enter()
        # The bias is added once, after the sum: the module's forward runs without it.
        module._paraxis_bias = base._parameters.get("bias")
        if module._paraxis_bias is not None:
            base._parameters["bias"] = None
        if split_input:
            return map_first_input(lambda x: split(x, group, dim=-1), args, kwargs)
        return args, kwargs

    def post(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        bias = module._paraxis_bias
        if bias is not None:
            base._parameters["bias"] = bias
        if not overlap:
            out = scatter_tokens(out, group) if sequence_parallel else reduce_from(out, group)
        return out if bias is None else out + bias

    linear.register_forward_pre_hook(pre, with_kwargs=True)
    linear.register_forward_hook(post)
    linear.paraxis_tensor = "row"


def shard_embedding(emb: nn.Embedding, group: AxisGroup, memo: dict[int, nn.Parameter], *,
                    padded: int) -> None:
    rows = emb.num_embeddings
    emb.weight = sharded_parameter(emb.weight, group, memo, padded=padded)
    per = emb.weight.shape[0]
    start = group.rank * per
    end = min(start + per, rows)  # ids this rank owns
    emb.num_embeddings = per
    # The pad token's row gets no gradient, as in nn.Embedding; only its owner has it.
    pad = emb.padding_idx
    emb.padding_idx = pad - start if pad is not None and start <= pad < end else None

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def local(ids: torch.Tensor) -> torch.Tensor:
            module._paraxis_outside = (ids < start) | (ids >= end)
            return (ids - start).masked_fill(module._paraxis_outside, 0)

        return map_first_input(local, args, kwargs)

    def post(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(module._paraxis_outside.unsqueeze(-1), 0.0)
        return reduce_from(out, group)

    emb.register_forward_pre_hook(pre, with_kwargs=True)
    emb.register_forward_hook(post)
    emb.paraxis_tensor = f"vocab [{start}, {end})"
