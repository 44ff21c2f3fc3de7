"""How a sequence is cut over the ``context`` ranks: zigzag or contiguous.

Under a causal mask a contiguous cut is unbalanced: rank ``C-1`` holds the last tokens,
which attend to everything before them, rank 0 the first, which attend to almost
nothing. Zigzag sharding cuts the sequence into ``2C`` chunks and gives rank ``r``
chunks ``r`` and ``2C-1-r`` (one early, one late), so every rank does the same causal
work (Brandon et al., "Striped Attention", arXiv:2311.09431, for the balance argument;
the two-chunk layout is zhuzilin/ring-flash-attention's ``zigzag_ring_flash_attn`` and
Megatron-Core's context parallelism).

Positions are 0-based token indices of the whole sequence. A rank's shard keeps its
tokens in increasing position order (first chunk, then second), so a causal mask
inside one shard is the ordinary lower triangle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "LAYOUTS",
    "check_layout",
    "in_true_order",
    "positions",
    "shard",
    "shard_order",
    "unshard",
]

LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def check_layout(seq_len: int, size: int, layout: str) -> None:
    """Raise ValueError unless ``seq_len`` tokens split over ``size`` ranks as ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    parts = 2 * size if layout == "zigzag" else size
    if seq_len % parts:
        raise ValueError(f"a sequence of {seq_len} tokens does not split into {parts} equal "
                         f"chunks ({layout} over {size} context ranks); pad or pick a "
                         f"length divisible by {parts}")


def positions(seq_len: int, size: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Global positions (1-D, int64, increasing) of the tokens that ``rank`` holds."""
    check_layout(seq_len, size, layout)
    if not 0 <= rank < size:
        raise IndexError(f"rank {rank} outside a context group of {size}")
    if layout == "contiguous":
        n = seq_len // size
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * size)
    late = 2 * size - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange(late * c, (late + 1) * c)])


def shard_order(seq_len: int, size: int, layout: str = "zigzag") -> torch.Tensor:
    """Every rank's positions concatenated in rank order: what an all-gather (or the
    sequence all-to-all of Ulysses) delivers. ``gathered[:, j]`` is position
    ``shard_order[j]``; ``gathered.index_select(1, shard_order.argsort())`` restores
    the true order."""
    return torch.cat([positions(seq_len, size, r, layout) for r in range(size)])


def shard(x: torch.Tensor, *, size: int, rank: int, layout: str = "zigzag",
          dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the sequence of a ``(b, s, ...)`` tensor).

    Works for hidden states, token ids, targets and position ids alike: shard the
    position ids ``arange(s)`` the same way and rotary embeddings see global positions.
    """
    seq_len = x.shape[dim]
    check_layout(seq_len, size, layout)
    if layout == "contiguous":
        return x.chunk(size, dim=dim)[rank].contiguous()
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def unshard(parts: Sequence[torch.Tensor], *, layout: str = "zigzag",
            dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: every rank's part, in rank order, back to the sequence."""
    return in_true_order(torch.cat(list(parts), dim=dim), len(parts), layout=layout, dim=dim)


def in_true_order(gathered: torch.Tensor, size: int, *, layout: str = "zigzag",
                  dim: int = 1) -> torch.Tensor:
    """``size`` ranks' parts concatenated in rank order along ``dim`` (what an
    all-gather delivers), back to the sequence's true order."""
    if layout == "contiguous" or size == 1:
        check_layout(gathered.shape[dim], size, layout)
        return gathered
    order = shard_order(gathered.shape[dim], size, layout).to(gathered.device)
    return gathered.index_select(dim, order.argsort())
