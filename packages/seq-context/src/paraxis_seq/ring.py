"""Ring attention over the ``context`` group (Liu, Zaharia & Abbeel, arXiv:2310.01889).

Each rank keeps its queries; key/value blocks travel around the ring, one hop per step,
and each rank folds the block it holds into its output through the log-sum-exp
(:func:`paraxis_seq.blockwise.merge`). The next block's transfer is posted before the
local block's attention and waited after it, so communication hides behind compute
when a block's attention takes longer than its transfer.

With zigzag sharding (:mod:`paraxis_seq.zigzag`) the causal work is the same on every
rank and every step (zhuzilin/ring-flash-attention's ``zigzag_ring_flash_attn``;
Brandon et al., arXiv:2311.09431): which rows and columns of a block have work is
planned from true positions by :func:`paraxis_seq.blockwise.plan_block`.

Backward is a ring too, written out in :class:`_RingAttention` (no autograd through
the loop, no gathered K/V): K/V circulate again, and with each block travels the sum
of the dK/dV contributions of the ranks it visited; after ``C-1`` hops that sum comes
home to the block's owner, who adds its own part. Per layer and rank the ring sends
(C-1)/C of the layer's K/V forward, and as much K/V plus (C-1)/C of dK/dV backward.
dK/dV travel in the compute dtype (fp32 for bf16 inputs): C partial sums in bf16 would
lose precision.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from paraxis.runtime.differentiable import autocast_dtype
from paraxis_seq.blockwise import (
    Block,
    alibi_bias,
    block_backward,
    block_forward,
    compute_dtype,
    merge,
    merge_sinks,
    plan_blocks,
    sink_grad,
    with_documents,
)
from paraxis_seq.variant import Variant
from paraxis_seq.zigzag import check_layout, positions

__all__ = ["DROPOUT_REFUSED", "ring_attention", "step_plan"]

DROPOUT_REFUSED = (
    "attention dropout is not supported by context-parallel attention: backward recomputes "
    "each block's probabilities from (q, k, lse), so a dropout mask would have to be "
    "regenerated bit for bit per (query block, key block), on whichever rank holds the "
    "pair at that ring step; that needs a counter-based RNG keyed by global positions "
    "(flash-attention's Philox offsets), which this kernel does not have. Train with "
    "attention dropout 0 (Llama, Mistral, Qwen do)")


@functools.lru_cache(maxsize=4096)
def step_blocks(seq_len: int, size: int, rank: int, src: int, layout: str,
                variant: Variant) -> tuple[Block, ...]:
    """The blocks of work of ``rank``'s queries against ``src``'s keys
    (:func:`paraxis_seq.blockwise.plan_blocks`; cached: the same for every layer and
    step)."""
    return plan_blocks(positions(seq_len, size, rank, layout),
                       positions(seq_len, size, src, layout), variant)


def step_plan(seq_len: int, size: int, rank: int, src: int, layout: str, causal: bool,
              window: int | None) -> Block | None:
    """The one block of a causal or windowed step (None: no work); a step that splits
    into several blocks raises (use :func:`step_blocks`)."""
    blocks = step_blocks(seq_len, size, rank, src, layout, Variant(causal, window))
    if len(blocks) > 1:
        raise ValueError(f"rank {rank}'s step against rank {src} splits into "
                         f"{len(blocks)} blocks; use step_blocks")
    return blocks[0] if blocks else None


class _Ring:
    """Point-to-point exchange with the ring neighbours of one context group: sends go to
    the next member, receives come from the previous one. Bytes sent and seconds
    blocked go to the group's CommStats under ``"p2p"``."""

    def __init__(self, group: Any):
        self.group = group
        n, i = group.size, group.rank
        self.next, self.prev = group.ranks[(i + 1) % n], group.ranks[(i - 1) % n]

    def _count(self, nbytes: float, seconds: float, calls: int) -> None:
        stats = getattr(self.group, "stats", None)
        if stats is not None:
            stats.add(self.group.axes, "p2p", nbytes, seconds, calls)

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor]) -> tuple:
        """Post every send and receive now. Both sides post in the same order (the
        receiver's receives match the sender's sends one for one; NCCL has no tags).
        The handle keeps the sent tensors alive until :meth:`wait`."""
        pg = self.group.pg
        ops = [dist.P2POp(dist.irecv, t, self.prev, group=pg) for t in recv]
        ops += [dist.P2POp(dist.isend, t, self.next, group=pg) for t in send]
        works = dist.batch_isend_irecv(ops) if ops else []
        self._count(float(sum(t.numel() * t.element_size() for t in send)), 0.0, len(send))
        return works, recv, send

    def wait(self, handle: tuple) -> list[torch.Tensor]:
        works, recv, _ = handle
        begin = time.perf_counter()
        for work in works:
            work.wait()
        self._count(0.0, time.perf_counter() - begin, 0)
        return list(recv)


def _pack(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    # One message per hop: K and V (or dK and dV) flattened into one buffer.
    return torch.cat([a.reshape(-1), b.reshape(-1)]).to(dtype or a.dtype).contiguous()


def _unpack(buf: torch.Tensor, ka: torch.Size, vb: torch.Size) -> tuple[torch.Tensor, ...]:
    n = math.prod(ka)
    return buf[:n].view(ka), buf[n:].view(vb)


def _travelling(kv: torch.Tensor, docs: torch.Tensor | None) -> list[torch.Tensor]:
    """What goes round the ring with a key block: K/V packed, and its document ids."""
    return [kv] if docs is None else [kv, docs]


def _bias(alibi: torch.Tensor | None, spec: tuple, seq_len: int, group: Any, src: int,
          blk: Block, dtype: torch.dtype) -> torch.Tensor | None:
    """ALiBi's bias for one block, from the true positions of its rows and columns."""
    if alibi is None:
        return None
    layout, n = spec[2], group.size
    return alibi_bias(alibi.to(dtype), positions(seq_len, n, group.rank, layout)[blk.rows],
                      positions(seq_len, n, src, layout)[blk.cols])


def _mask(blk: Block, docs: torch.Tensor | None, held: list[torch.Tensor],
          selected: torch.Tensor | None, spec: tuple, seq_len: int, group: Any, src: int,
          device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """The block's mask (:func:`paraxis_seq.blockwise.with_documents`), and with
    ``selected`` (DSA's chosen keys of this rank's queries, ``(b, s/C, seq_len)`` over
    global key positions) only the keys it selects among them."""
    mask, tri = with_documents(blk, docs, held[1] if docs is not None else None)
    if selected is not None:
        keys = positions(seq_len, group.size, src, spec[2])[blk.cols].to(selected.device)
        chosen = selected[:, blk.rows].index_select(2, keys)[:, None]
        mask, tri = chosen if mask is None else mask.to(chosen.device) & chosen, False
    return (None if mask is None else mask.to(device)), tri


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None,
             extra: tuple, group: Any, spec: tuple, wire: torch.dtype | None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    variant, scale, layout = spec
    sinks, alibi, selected = extra
    n, rank, cd = group.size, group.rank, compute_dtype(q.dtype)
    b, s, h, _ = q.shape
    qc = q.to(cd)
    out = torch.zeros((b, s, h, v.shape[-1]), dtype=cd, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=cd, device=q.device)
    ring, held = _Ring(group), _travelling(_pack(k, v, wire), docs)
    for step in range(n):
        # Post the next block's transfer first: it flies while this block computes.
        handle = (ring.start(held, [torch.empty_like(t) for t in held])
                  if step < n - 1 else None)
        kb, vb, src = *_unpack(held[0], k.shape, v.shape), (rank - step) % n
        for blk in step_blocks(s * n, n, rank, src, layout, variant):
            mask, tri = _mask(blk, docs, held, selected, spec, s * n, group, src, q.device)
            o, lse_b = block_forward(qc[:, blk.rows], kb[:, blk.cols].to(cd),
                                     vb[:, blk.cols].to(cd), scale=scale, mask=mask,
                                     causal=tri, softcap=variant.softcap,
                                     bias=_bias(alibi, spec, s * n, group, src, blk, cd))
            out[:, blk.rows], lse[:, :, blk.rows] = merge(out[:, blk.rows],
                                                          lse[:, :, blk.rows], o, lse_b)
        if handle is not None:
            held = ring.wait(handle)
    if sinks is not None:  # one more logit per head, entering once (after every block)
        out, lse = merge_sinks(out, lse, sinks)
    return out, lse


def _block_grads(blocks: tuple[Block, ...], held: list[torch.Tensor], k: torch.Tensor,
                 v: torch.Tensor, saved: tuple, dq: torch.Tensor, softcap: float | None,
                 docs: torch.Tensor | None, bias: Any, masks: Any) -> torch.Tensor:
    """This rank's dK/dV (packed, compute dtype) for the key block it holds; adds into
    dq. ``bias(blk)``: the block's ALiBi bias, or None; ``masks(blk, held)``: its mask
    (:func:`_mask`)."""
    qc, do, out, lse, delta, scale = saved
    dk = torch.zeros(k.shape, dtype=qc.dtype, device=qc.device)
    dv = torch.zeros(v.shape, dtype=qc.dtype, device=qc.device)
    kb, vb = _unpack(held[0], k.shape, v.shape)
    for blk in blocks:
        r, c = blk.rows, blk.cols
        mask, tri = masks(blk, held=held)
        dq_b, dk_b, dv_b = block_backward(
            do[:, r], qc[:, r], kb[:, c].to(qc.dtype), vb[:, c].to(qc.dtype), lse[:, :, r],
            delta[:, :, r], scale=scale, mask=mask, causal=tri, out=out[:, r],
            softcap=softcap, bias=bias(blk))
        dq[:, r] += dq_b
        dk[:, c] += dk_b
        dv[:, c] += dv_b
    return _pack(dk, dv)


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, docs: torch.Tensor | None,
              extra: tuple, group: Any, spec: tuple, wire: torch.dtype | None,
              ) -> tuple[torch.Tensor, ...]:
    variant, scale, layout = spec
    (alibi, selected), n, rank, cd = extra, group.size, group.rank, compute_dtype(q.dtype)
    qc, do = q.to(cd), dout.to(cd)
    delta = (do * out).sum(-1).transpose(1, 2)  # rowsum(dO ∘ O), (b, h, s)
    saved, dq = (qc, do, out, lse, delta, scale), torch.zeros_like(qc)
    ring, held = _Ring(group), _travelling(_pack(k, v, wire), docs)
    grad_size = k.numel() + v.numel()
    own, sends = None, []
    for step in range(n):
        # Receives from the previous rank, in the order it sent: the dK/dV sum for the
        # block we are about to get (it sent that at the end of its last step), then
        # the next K/V (and its document ids; sent at the start of this step).
        more, incoming = step < n - 1, step >= 2
        recv = [torch.empty(grad_size, dtype=cd, device=q.device)] if incoming else []
        recv += [torch.empty_like(t) for t in held] if more else []
        handle = ring.start(held if more else [], recv)
        src, seq_len = (rank - step) % n, q.shape[1] * n
        blocks = step_blocks(seq_len, n, rank, src, layout, variant)
        masks = functools.partial(_mask, docs=docs, selected=selected, spec=spec,
                                  seq_len=seq_len, group=group, src=src, device=q.device)
        grad = _block_grads(blocks, held, k, v, saved, dq, variant.softcap, docs, functools.partial(
            _bias, alibi, spec, seq_len, group, src, dtype=cd), masks)
        got = ring.wait(handle)
        if step == 0:
            own = grad  # our own block's part: it stays here
        else:
            # The block's travelling sum moves on; after step n-1 the next rank is home.
            sends.append(ring.start([got.pop(0) + grad if incoming else grad], []))
        if more:
            held = got
    if n > 1:
        own = own + ring.wait(ring.start([], [torch.empty(grad_size, dtype=cd,
                                                          device=q.device)]))[0]
    for handle in sends:
        ring.wait(handle)
    dk, dv = _unpack(own, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), delta


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None, alibi: torch.Tensor | None,
                docs: torch.Tensor | None, selected: torch.Tensor | None, group: Any,
                spec: tuple) -> torch.Tensor:
        # K/V travel in the autocast dtype under bf16/fp16, both ways (the forward's
        # block matmuls would cast them to it; the backward must see the same values).
        wire = autocast_dtype(q.device.type)
        out, lse = _forward(q, k, v, docs, (sinks, alibi, selected), group, spec, wire)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.docs, ctx.extra = docs, (alibi, selected)
        ctx.group, ctx.spec, ctx.wire = group, spec, wire
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        *grads, delta = _backward(dout, q, k, v, out, lse, ctx.docs, ctx.extra, ctx.group,
                                  ctx.spec, ctx.wire)
        # The sinks' gradient comes from this rank's rows alone; the context ranks' parts
        # are summed with every other parameter's (the data strategy's reduction).
        dsinks = None if sinks is None else sink_grad(lse, delta, sinks).to(sinks.dtype)
        return (*grads, dsinks, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any,
                   causal: bool = True, scale: float | None = None,
                   window: int | None = None, layout: str = "zigzag",
                   dropout: float = 0.0, documents: torch.Tensor | None = None,
                   chunk: int | None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                   selected: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, sharded over ``group``.

    ``q`` is ``(b, s/C, h, d)``, ``k`` and ``v`` ``(b, s/C, h_kv, d)`` with ``h_kv``
    dividing ``h`` (GQA: query head i uses kv head ``i // (h / h_kv)``); every rank holds
    its shard of the sequence in ``layout`` (:mod:`paraxis_seq.zigzag`). ``window``: a
    causal sliding window of that many keys (transformers' ``sliding_window``);
    ``chunk``: chunked attention; ``softcap``: logit soft-capping; ``sinks`` ``(h,)``:
    one learned logit per head in every row's normalizer (differentiable); ``alibi``
    ``(h,)``: ALiBi's slopes (a bias from true positions, fixed);
    :mod:`paraxis_seq.variant` defines each. ``documents`` ``(b, s/C)``: this shard's
    document ids (pads -1). ``selected`` ``(b, s/C, s)``: the keys (global positions) each
    of this rank's queries may attend at most (DeepSeek's sparse attention,
    :mod:`paraxis_seq.indexed`). Returns ``(b, s/C, h, d_v)`` in q's dtype. Collective over
    ``group``.
    """
    if dropout:
        raise ValueError(DROPOUT_REFUSED + f" (dropout={dropout})")
    if q.dim() != 4 or k.shape[:-1] != v.shape[:-1] or k.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q (b, s, h, d) and k, v (b, s, h_kv, d) with the same b "
                         f"and s; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} "
                         "kv heads")
    for name, per_head in (("sinks", sinks), ("alibi", alibi)):
        if per_head is not None and per_head.shape != (q.shape[2],):
            raise ValueError(f"{name} must hold one value per query head, ({q.shape[2]},); "
                             f"got {tuple(per_head.shape)}")
    variant = Variant(bool(causal), window, chunk, softcap)
    check_layout(q.shape[1] * group.size, group.size, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    docs = None if documents is None else documents.to(q.device).long().contiguous()
    alibi = None if alibi is None else alibi.detach()
    if selected is not None and tuple(selected.shape) != (q.shape[0], q.shape[1],
                                                          q.shape[1] * group.size):
        raise ValueError("selected must be (b, s/C, s): one row of keys per query of this "
                         f"rank; got {tuple(selected.shape)} for q {tuple(q.shape)}")
    return _RingAttention.apply(q, k, v, sinks, alibi, docs, selected, group,
                                (variant, scale, layout))
