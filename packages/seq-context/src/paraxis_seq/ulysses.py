"""DeepSpeed-Ulysses over the ``context`` group (Jacobs et al., arXiv:2309.14509).

An all-to-all turns sequence-sharded q, k, v ``(b, s/C, H, d)`` into head-sharded
``(b, s, H/C, d)``; any attention kernel then runs on the whole sequence for H/C heads,
and a second all-to-all brings the output back to sequence shards. Per layer and rank
forward moves four tensors of (C-1)/C x N·h/C elements (q, k, v, out, N tokens, h
hidden; k and v are smaller under GQA), backward as much again: about 4·N·h/C either
way, independent of C on the wire per link, which is Ulysses' argument.

Two facts the exchange must respect:

* **KV heads.** Rank r gets query heads ``[rH/C, (r+1)H/C)``; they use kv heads
  ``h // (H/H_kv)``. When ``H_kv`` is a multiple of C the kv heads split the same way.
  When it is not (``H_kv < C`` is common: 8 kv heads, 16 ranks) each kv head is
  repeated ``rep = C / gcd(H_kv, C)`` times before the exchange, so that the ``H_kv·rep``
  heads split over C ranks and each rank receives exactly the kv heads its query heads
  use (this always works once C divides H; see :func:`kv_replication`). The repeat
  costs ``rep`` times the k/v bytes; its backward sums the copies' gradients. Query
  heads that do not divide over C are refused: use ring attention then.
* **Sequence order.** The all-to-all stacks what arrives in rank order, so with zigzag
  shards the gathered sequence is permuted (rank 0's chunks 0 and 2C-1 first). A causal
  kernel needs true order: the permutation is undone before attention and re-applied
  after (:func:`paraxis_seq.zigzag.shard_order`). The ``context`` strategy shards
  contiguously in Ulysses mode (each rank attends over the whole sequence for its
  heads, so zigzag buys no balance), which needs no permutation at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from paraxis.runtime.collectives import CommStats, gather_along
from paraxis.runtime.differentiable import all_to_all
from paraxis.runtime.grid import AxisGroup
from paraxis_seq.ring import DROPOUT_REFUSED, ring_attention
from paraxis_seq.variant import Variant, visible
from paraxis_seq.zigzag import check_layout, shard_order

__all__ = ["kv_replication", "local_attention", "sdpa_attention", "ulysses_attention"]

Attention = Callable[..., torch.Tensor]


def kv_replication(heads: int, kv_heads: int, size: int) -> int:
    """How many times each kv head is repeated so that heads split over ``size`` ranks
    with each rank holding the kv heads of its query heads (1: no repeat)."""
    if heads % size:
        raise ValueError(f"Ulysses splits heads over the context group: {heads} query "
                         f"heads do not divide over {size} ranks; use ring attention "
                         "(mode='ring') or a context degree that divides the heads")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    # rep = C / gcd(H_kv, C) divides H / H_kv whenever C divides H (C/gcd is coprime
    # to H_kv/gcd and divides H_kv/gcd x H/H_kv), so every rank's query heads find
    # their kv heads among the ones it receives.
    rep = size // math.gcd(kv_heads, size)
    return rep


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   scale: float | None, window: int | None = None,
                   documents: torch.Tensor | None = None, chunk: int | None = None,
                   ) -> torch.Tensor:
    """PyTorch SDPA on ``(b, s, h, d)`` tensors in true sequence order, GQA allowed:
    Ulysses' default kernel (flash on GPU, math on CPU). ``documents`` ``(b, s)``: a
    query attends only keys of its own document, never a pad (-1); a pad's own row
    sees itself, so its (ignored) output stays finite."""
    mask = None
    if window is not None or documents is not None or chunk is not None:
        pos = torch.arange(q.shape[1], device=q.device)
        mask = visible(pos, pos, causal=causal, window=window, chunk=chunk)
        if mask is None:
            mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device)
        if documents is not None:
            same = (documents[:, :, None] == documents[:, None, :]) & (documents[:, None] >= 0)
            mask = (mask & same) | torch.eye(q.shape[1], dtype=torch.bool, device=q.device)
            mask = mask[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=causal and mask is None, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    scale: float | None, window: int | None = None,
                    documents: torch.Tensor | None = None, chunk: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    alibi: torch.Tensor | None = None,
                    selected: torch.Tensor | None = None) -> torch.Tensor:
    """The ring's blockwise kernel on one rank, over the whole gathered sequence: Ulysses'
    kernel for what SDPA cannot compute (soft-capping, sinks, ALiBi, DSA's selected
    keys), with the same
    arithmetic as the ring's (:mod:`paraxis_seq.blockwise`), so both modes agree by
    construction."""
    alone = AxisGroup(("context",), (0,), 0, None, CommStats())
    return ring_attention(q, k, v, group=alone, causal=causal, scale=scale, window=window,
                          layout="contiguous", documents=documents, chunk=chunk,
                          softcap=softcap, sinks=sinks, alibi=alibi, selected=selected)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any,
                      causal: bool = True, scale: float | None = None,
                      window: int | None = None, layout: str = "zigzag",
                      attention: Attention | None = None, dropout: float = 0.0,
                      documents: torch.Tensor | None = None, chunk: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None,
                      alibi: torch.Tensor | None = None,
                      selected: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of sequence-sharded ``q (b, s/C, H, d)``, ``k, v (b, s/C, H_kv, d)``
    through head-sharded full-sequence attention; returns ``(b, s/C, H, d_v)``.

    ``attention(q, k, v, causal=, scale=, window=)`` runs on ``(b, s, H/C, d)`` tensors
    in true order (default :func:`sdpa_attention`, or :func:`local_attention` under
    soft-capping, sinks or ALiBi; with ``documents``, this shard's per-token document ids, the
    kernel also gets ``documents=`` for the gathered sequence, and ``chunk=``,
    ``softcap=``, ``sinks=`` and ``alibi=`` (this rank's heads' values) when set;
    ``selected`` ``(b, s, s)``, every query's allowed keys in true order (DSA,
    :mod:`paraxis_seq.indexed`), goes to the kernel as it is). Collective over ``group``.
    """
    if dropout:
        raise ValueError(DROPOUT_REFUSED + f" (dropout={dropout})")
    Variant(bool(causal), window, chunk, softcap)  # refuses what no kernel here computes
    n = group.size
    seq_len = q.shape[1] * n
    check_layout(seq_len, n, layout)
    rep = kv_replication(q.shape[2], k.shape[2], n)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    qh, kh, vh = (all_to_all(t, group, scatter_dim=2, gather_dim=1) for t in (q, k, v))
    order = None
    if layout == "zigzag" and n > 1:
        order = shard_order(seq_len, n, layout).to(q.device)
        back = order.argsort()
        qh, kh, vh = (t.index_select(1, back) for t in (qh, kh, vh))
    extra: dict[str, Any] = {}
    if documents is not None:  # every rank's ids, once: the gathered sequence's
        docs = gather_along(documents.to(q.device).long().contiguous(), 1, group)
        extra["documents"] = docs if order is None else docs.index_select(1, back)
    if chunk is not None:
        extra["chunk"] = chunk
    if softcap is not None:
        extra["softcap"] = softcap
    if selected is not None:
        extra["selected"] = selected
    heads = q.shape[2] // n  # rank r holds query heads [r H/C, (r+1) H/C) now
    for name, per_head in (("sinks", sinks), ("alibi", alibi)):
        if per_head is not None:
            extra[name] = per_head[group.rank * heads:(group.rank + 1) * heads]
    blockwise = any(x is not None for x in (softcap, sinks, alibi, selected))
    kernel = attention or (local_attention if blockwise else sdpa_attention)
    out = kernel(qh, kh, vh, causal=causal, scale=scale, window=window, **extra)
    if order is not None:
        out = out.index_select(1, order)
    return all_to_all(out, group, scatter_dim=1, gather_dim=2)
