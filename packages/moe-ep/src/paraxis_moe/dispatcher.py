"""Token dispatch by all-to-all: Megatron-Core's ``MoEAlltoAllTokenDispatcher``, one
class per dispatch method (this is the only one so far).

Each rank owns a contiguous range of ``E / ep`` experts, so sorting a rank's (token,
expert) pairs by expert also groups them by owning rank:

1. permute: sort the kept pairs by expert (stable: token order within an expert);
2. exchange counts: an all-to-all of the per-expert counts tells every rank how many
   rows it receives from each rank and for which of its experts, hence the splits;
3. dispatch: ``all_to_all_uneven`` the rows to their owners;
4. (the caller runs its local experts on them);
5. combine: ``all_to_all_uneven`` the results back, unpermute to (token, slot), weight
   by the routing weights on the sender (Megatron's ``unpermute`` with probs) and sum
   over the top-k slots.

Both exchanges are core's differentiable op, so backward runs the mirrored exchanges and
the routing weights get their gradient where they were computed. The seconds of each
exchange are a :class:`~paraxis.runtime.clock.Span` of the dispatcher's clock (on CUDA
without ``parallelism.stream_timing``, the launch: :mod:`paraxis_moe.stats`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paraxis.runtime.clock import Span, Stopwatch
from paraxis.runtime.differentiable import all_to_all_uneven
from paraxis.runtime.grid import AxisGroup
from paraxis_moe.stats import BackwardTimer

__all__ = ["AllToAllDispatcher", "Dispatched"]


@dataclass
class Dispatched:
    """What one dispatch produced and what the combine needs."""

    tokens: torch.Tensor         # (R, h) rows this rank's experts compute, grouped by source
    local_ids: torch.Tensor      # (R,) local expert id of each row
    pairs: torch.Tensor          # flat (token * k + slot) index of each sent row, in send order
    send: tuple[int, ...]        # rows sent to each rank
    recv: tuple[int, ...]        # rows received from each rank
    sent_per_expert: torch.Tensor  # (E,) rows this rank sent to each expert
    recv_counts: torch.Tensor    # (ep, E/ep) rows received from each rank for each local expert
    row_bytes: int
    rank: int                    # this rank's index in the expert group
    exchange: Span | None = None  # the forward count and token exchanges (blocking)

    @property
    def bytes_out(self) -> int:
        """Forward bytes of dispatch plus combine sent to other ranks (core's convention)."""
        me = self.rank
        return (sum(self.send) - self.send[me] + sum(self.recv) - self.recv[me]) * self.row_bytes

    def bytes_per_expert(self) -> torch.Tensor:
        """(E,) forward bytes attributable to each expert: rows sent to it when it is
        remote, rows returned from it to other ranks when it is local. Sums to
        :attr:`bytes_out`."""
        local = self.recv_counts.shape[1]
        first = self.rank * local
        out = self.sent_per_expert.to(torch.float64)
        out[first:first + local] = (self.recv_counts.sum(0) - self.recv_counts[self.rank]).double()
        return out * self.row_bytes


class AllToAllDispatcher:
    """Dispatch to and combine from the experts' owners over one expert group."""

    def __init__(self, group: AxisGroup, num_experts: int, clock: Stopwatch | None = None):
        if num_experts % group.size:
            raise ValueError(f"{num_experts} experts do not split over {group.size} expert ranks")
        self.group, self.clock = group, clock or Stopwatch()
        self.num_experts = num_experts
        self.num_local = num_experts // group.size

    def dispatch(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 keep: torch.Tensor | None, timer: BackwardTimer | None = None) -> Dispatched:
        """Rows of ``hidden`` (T, h) for every kept pair of ``top_k_index`` (T, k), moved
        to the rank that owns the pair's expert. ``timer`` marks the exchange and what
        follows it, for backward seconds."""
        k = top_k_index.shape[-1]
        pairs, sent_per_expert = self.permute(top_k_index, keep)
        # 2. counts: rank j gets our counts for its experts, we get theirs for ours.
        n, local = self.group.size, self.num_local
        start = self.clock.mark()
        recv_counts = all_to_all_uneven(sent_per_expert, self.group, [local] * n, [local] * n)
        recv_counts = recv_counts.view(n, local)
        send = tuple(sent_per_expert.view(n, local).sum(1).tolist())
        recv = tuple(recv_counts.sum(1).tolist())
        # 3. dispatch.
        rows = hidden[pairs // k]
        if timer is not None:
            rows = timer.point(rows, "dispatch")
        tokens = all_to_all_uneven(rows, self.group, send, recv)
        exchange = self.clock.since(start)
        if timer is not None:
            tokens = timer.point(tokens, "compute")
        return Dispatched(tokens, local_ids(recv_counts), pairs, send, recv,
                          sent_per_expert, recv_counts,
                          hidden.shape[-1] * hidden.element_size(), self.group.rank, exchange)

    def permute(self, top_k_index: torch.Tensor, keep: torch.Tensor | None,
                tokens: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 for the tokens ``tokens`` of ``top_k_index`` (T, k): the flat (token * k
        + slot) index of each kept pair, sorted by expert (stable: token order within an
        expert), and the (E,) pairs per expert."""
        k = top_k_index.shape[-1]
        first = tokens.start or 0
        experts = top_k_index[tokens].reshape(-1)
        pairs = torch.arange(experts.numel(), device=experts.device)
        if keep is not None:
            pairs = pairs[keep[tokens].reshape(-1)]
        by_expert, order = torch.sort(experts[pairs], stable=True)
        return pairs[order] + first * k, torch.bincount(by_expert, minlength=self.num_experts)

    def combine(self, expert_out: torch.Tensor, d: Dispatched, top_k_weights: torch.Tensor,
                keep: torch.Tensor | None, timer: BackwardTimer | None = None,
                ) -> tuple[torch.Tensor, Span]:
        """Each token's weighted sum over its slots; returns it and the exchange's span."""
        if timer is not None:
            expert_out = timer.point(expert_out, "combine")
        start = self.clock.mark()
        # Expert outputs go back as computed: bf16 where autocast ran the experts, fp32
        # where they ran outside it (grouped matmuls), as one process would keep them.
        back = all_to_all_uneven(expert_out, self.group, d.recv, d.send, narrow=False)
        exchange = self.clock.since(start)
        if timer is not None:
            back = timer.point(back, None)
        return unpermute(back, d.pairs, top_k_weights, keep), exchange

    def local_range(self) -> tuple[int, int]:
        """[first, last) global ids of this rank's experts."""
        first = self.group.rank * self.num_local
        return first, first + self.num_local


def local_ids(recv_counts: torch.Tensor) -> torch.Tensor:
    """The local expert id of each received row, from the ``(ranks, local)`` counts of
    rows received (rows arrive by sender, then by expert)."""
    ranks, local = recv_counts.shape
    ids = torch.arange(local, device=recv_counts.device).repeat(ranks)
    return ids.repeat_interleave(recv_counts.reshape(-1))


def unpermute(back: torch.Tensor, pairs: torch.Tensor, top_k_weights: torch.Tensor,
              keep: torch.Tensor | None) -> torch.Tensor:
    """Each token's weighted sum over its slots, from the expert outputs ``back`` of the
    kept pairs ``pairs`` (flat token * k + slot indices into ``top_k_weights`` (T, k))."""
    num_tokens, k = top_k_weights.shape
    slots = back.new_zeros((num_tokens * k, back.shape[-1])).index_copy(0, pairs, back)
    weights = top_k_weights if keep is None else top_k_weights.masked_fill(~keep, 0.0)
    # As transformers' grouped_mm experts: weight in the promoted dtype, sum the slots,
    # then cast (the sum of two slots is the same in either order).
    return (slots.view(num_tokens, k, back.shape[-1]) * weights.unsqueeze(-1)).sum(1)
