"""Tensor-parallel layers on plain tensors (Megatron-LM, arXiv:1909.08053, section 3).

* :class:`ColumnParallelLinear`: ``Y = X A`` with ``A``'s output features split; each rank
  computes its slice of ``Y``. Optionally gathers ``Y`` (``gather_output``).
* :class:`RowParallelLinear`: ``A``'s input features split; each rank multiplies its
  slice of ``X`` and the partial results are summed (all-reduce, or reduce-scatter along
  the sequence under sequence parallelism). The bias is added once, after the sum.
* :class:`VocabParallelEmbedding`: the vocabulary split by token range; a rank looks up
  the tokens it owns, zeros the rest, and the partial embeddings are summed.

Each is built from the dense module (``from_dense``), copying this rank's slice, and
replaces the parameter's placement record in the same step. A module that "enters the
region" itself (``enter`` set) applies the entry op to its input: Megatron's f without
sequence parallelism, an all-gather along the sequence with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paraxis.grid import AxisGroup
from paraxis.placement import placement_of, set_placement
from paraxis_tp.functional import (
    CommStats,
    reduce_from_region,
    reduce_scatter_seq,
    split_last,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "shard_rows"]


def shard_rows(t: torch.Tensor, group: AxisGroup, *, parts: int = 1,
               padded: int | None = None) -> tuple[torch.Tensor, int, int, int]:
    """This rank's rows of ``t`` (dim 0): (tensor, offset, real length, padding).

    ``parts > 1``: dim 0 is ``parts`` equal blocks (e.g. gate and up) and each block is
    split. ``padded``: dim 0 is first padded with zero rows to that size (a vocabulary
    padded to a multiple of the tensor degree); padding never counts as real rows.
    """
    rows = t.shape[0]
    if parts > 1:
        blocks = t.chunk(parts, dim=0)
        pieces = [shard_rows(b, group)[0] for b in blocks]
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


def _adopt(new: nn.Parameter, old: nn.Parameter, *, offset: int, length: int, parts: int = 1,
           padding: int = 0, dim: int = 0) -> nn.Parameter:
    """Give ``new`` the placement of ``old`` split along ``dim`` over the tensor axis."""
    record = placement_of(old).sharded(dim=dim, axis="tensor", offset=offset, length=length,
                                       parts=parts, padding=padding)
    set_placement(new, record)
    return new


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: AxisGroup, *,
                 gather_output: bool = False, enter: Callable | None = None,
                 stats: CommStats | None = None, real_out: int | None = None):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.gather_output, self.enter, self.stats = gather_output, enter, stats
        self.out_features, self.in_features = weight.shape
        self.real_out = real_out  # a gathered output loses its padding columns

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: AxisGroup, *, parts: int = 1,
                   padded: int | None = None, memo: dict[int, nn.Parameter] | None = None,
                   **kwargs) -> ColumnParallelLinear:
        memo = {} if memo is None else memo
        weight = memo.get(id(linear.weight))
        if weight is None:
            local, off, n, pad = shard_rows(linear.weight.data, group, parts=parts,
                                            padded=padded)
            weight = _adopt(nn.Parameter(local), linear.weight, offset=off, length=n,
                            parts=parts, padding=pad)
            memo[id(linear.weight)] = weight
        bias = None
        if linear.bias is not None:
            local, off, n, pad = shard_rows(linear.bias.data, group, parts=parts, padded=padded)
            bias = _adopt(nn.Parameter(local), linear.bias, offset=off, length=n, parts=parts,
                          padding=pad)
        return cls(weight, bias, group, real_out=linear.out_features, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter is not None:
            x = self.enter(x)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            from paraxis_tp.functional import gather_last

            y = gather_last(y, self.group, self.stats)[..., : self.real_out]
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out_local={self.out_features}, "
                f"tensor={self.group.size}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: AxisGroup, *,
                 split_input: bool = False, sequence_parallel: bool = False,
                 stats: CommStats | None = None, on_enter: Callable | None = None):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.split_input, self.sequence_parallel = split_input, sequence_parallel
        self.stats, self.on_enter = stats, on_enter
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: AxisGroup, **kwargs) -> RowParallelLinear:
        local, off, n, _ = shard_rows(linear.weight.data.t(), group)
        weight = _adopt(nn.Parameter(local.t().contiguous()), linear.weight, offset=off,
                        length=n, dim=1)
        bias = None
        if linear.bias is not None:  # added after the sum: replicated, not split
            bias = nn.Parameter(linear.bias.data.clone())
            set_placement(bias, placement_of(linear.bias))
        return cls(weight, bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_enter is not None:
            self.on_enter()
        if self.split_input:
            x = split_last(x, self.group, self.stats)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_seq(y, self.group, self.stats)
        else:
            y = reduce_from_region(y, self.group, self.stats)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_local={self.in_features}, out={self.out_features}, "
                f"tensor={self.group.size}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, start: int, real: int, group: AxisGroup,
                 stats: CommStats | None = None, padding_idx: int | None = None):
        super().__init__()
        self.weight, self.group, self.stats = weight, group, stats
        self.start, self.end = start, start + real  # token ids this rank owns
        self.num_embeddings, self.embedding_dim = weight.shape
        # The pad token's row gets no gradient, as in nn.Embedding; only its owner has it.
        owns_pad = padding_idx is not None and start <= padding_idx < start + real
        self.local_padding_idx = padding_idx - start if owns_pad else None

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: AxisGroup, *, padded: int | None = None,
                   memo: dict[int, nn.Parameter] | None = None,
                   stats: CommStats | None = None) -> VocabParallelEmbedding:
        memo = {} if memo is None else memo
        local, off, n, pad = shard_rows(emb.weight.data, group, padded=padded)
        weight = memo.get(id(emb.weight))
        if weight is None:
            weight = _adopt(nn.Parameter(local), emb.weight, offset=off, length=n, padding=pad)
            memo[id(emb.weight)] = weight
        return cls(weight, off, n, group, stats, padding_idx=emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(out, self.group, self.stats)

    def extra_repr(self) -> str:
        return f"tokens=[{self.start}, {self.end}), dim={self.embedding_dim}"
