"""Expert capacity: which routed (token, expert) pairs a rank keeps before dispatch.

Capacity is applied per expert on the tokens of one rank, before the all-to-all (as
Megatron-Core's ``drop_and_pad`` path and GShard's per-group capacity, arXiv:2006.16668),
so it depends only on that rank's routing: one process applying :func:`keep_mask` to
each rank's tokens separately drops exactly the same pairs.

Which pairs drop, exactly. Number a rank's pairs ``p = t * k + j`` (token ``t``, top-k
slot ``j``). For each expert, its pairs are ranked and the first ``capacity`` kept:

* ``position``: by ``p`` (earlier tokens first; a token picks an expert at most once);
* ``probs``: by routing weight, highest first, ties broken by lower ``p``.

A dropped pair contributes nothing to its token's output (its weight acts as zero, and
no gradient reaches that weight); the token still gets its other slots, and the
residual connection around the block carries it on.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["expert_capacity", "grouped_keep_mask", "keep_mask"]


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float,
                    min_capacity: int = 0) -> int:
    """Pairs each expert accepts from one rank: ``ceil(T * k / E * factor)``, at least
    ``min_capacity`` (Megatron-Core's ``get_capacity``)."""
    return max(int(min_capacity), math.ceil(num_tokens * top_k / num_experts * capacity_factor))


def keep_mask(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
              capacity: int, policy: str = "probs") -> torch.Tensor:
    """Boolean ``(T, k)``: True for the pairs kept under ``capacity`` (see the module
    docstring for the order)."""
    if policy not in ("probs", "position"):
        raise ValueError(f"drop_policy must be 'probs' or 'position', not {policy!r}")
    experts = top_k_index.reshape(-1)
    n = experts.numel()
    if policy == "probs":
        # Stable sorts keep the previous order among equals: weight descending, then
        # position, then (outer sort) expert.
        order = torch.sort(-top_k_weights.detach().reshape(-1).float(), stable=True).indices
    else:
        order = torch.arange(n, device=experts.device)
    by_expert, inner = torch.sort(experts[order], stable=True)
    order = order[inner]
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=experts.device) - starts[by_expert]
    keep = torch.zeros(n, dtype=torch.bool, device=experts.device)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(top_k_index)


def grouped_keep_mask(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                      moe: Any, groups: int = 1) -> torch.Tensor:
    """:func:`keep_mask` under ``moe``'s capacity (a :class:`paraxis.config.MoEConfig`)
    applied to each of ``groups`` equal runs of consecutive tokens separately: a rank
    routes one group (its own tokens); one process given ``groups = n`` drops exactly
    what ``n`` ranks holding those runs drop."""
    tokens, k = top_k_index.shape
    if tokens % groups:
        raise ValueError(f"{tokens} tokens do not split into {groups} capacity groups")
    size = tokens // groups
    cap = expert_capacity(size, k, num_experts, moe.capacity_factor, moe.min_capacity)
    return torch.cat([keep_mask(i, w, num_experts, cap, moe.drop_policy)
                      for i, w in zip(top_k_index.split(size), top_k_weights.split(size),
                                      strict=True)])
