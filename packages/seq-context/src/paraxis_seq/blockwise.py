"""Attention on one (query block, key block) pair, its backward, and the merge of
partial results: the arithmetic that ring attention repeats once per ring step.

Tensors are ``(batch, seq, heads, head_dim)`` (flash-attention's layout); the
log-sum-exp is ``(batch, heads, seq)``. Everything runs in a compute dtype of at least
fp32 (float64 stays float64, for tests): partial softmax results from different
blocks meet through their log-sum-exp, and adding those in bf16 would lose the very
bits the merge is for (Milakov & Gimelshein, arXiv:1805.02867, the online softmax;
flash-attention 2, Dao, arXiv:2307.08691, for the backward below).

Two kernels. On CPU, a block without a mask or with the causal triangle runs PyTorch's
fused flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, which returns
the log-sum-exp the public SDPA hides, and its backward, which takes the *final* output
and log-sum-exp as flash-attention 2's does); elsewhere (other masks such as sliding
windows, other devices) a manual kernel materializes the block's scores. On GPU the
manual kernel runs unchanged; flash-attention's ``_flash_attn_forward`` (which returns
``softmax_lse``) can replace it there without touching the ring.

Which part of a key block a query block may see is a plan computed from true global
positions (:func:`plan_block`, :func:`plan_blocks`) under the layer's
:class:`~paraxis_seq.variant.Variant` (causal, a sliding window, chunked attention), and
skipped entirely when nothing is visible, so the zigzag rule of ring attention falls out
of the positions instead of being special-cased. Soft-capping acts on each block's
scores (forward and backward, manual kernel); sinks enter once, after the last block
(:func:`merge_sinks`, :func:`sink_grad`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from paraxis_seq.variant import Variant, visible

__all__ = [
    "Block",
    "alibi_bias",
    "block_backward",
    "block_forward",
    "compute_dtype",
    "merge",
    "merge_sinks",
    "plan_block",
    "plan_blocks",
    "sink_grad",
    "visible",
    "with_documents",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; fp32, bf16 and fp16 compute (and merge) in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Block:
    """The rectangle of a (queries, keys) pair that has work: rows ``rows`` of the local
    queries attend columns ``cols`` of the key block, under ``mask`` (None: all)."""

    rows: slice
    cols: slice
    mask: torch.Tensor | None
    # The mask is the square lower triangle (a fused kernel's is_causal=True).
    causal: bool = False

    @property
    def area(self) -> int:
        return (self.rows.stop - self.rows.start) * (self.cols.stop - self.cols.start)

    @property
    def cost(self) -> int:
        """Score elements a kernel computes: the rectangle, or the triangle a causal
        kernel computes of it."""
        n = self.rows.stop - self.rows.start
        return n * (n + 1) // 2 if self.causal else self.area

    def shifted(self, rows: int, cols: int) -> Block:
        return replace(self, rows=slice(self.rows.start + rows, self.rows.stop + rows),
                       cols=slice(self.cols.start + cols, self.cols.stop + cols))


def plan_block(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool = True,
               window: int | None = None, variant: Variant | None = None) -> Block | None:
    """The work of local queries at ``q_pos`` against keys at ``k_pos``, as one bounding
    rectangle; None if none. ``variant`` (else ``causal`` and ``window``) says what is
    visible.

    For zigzag shards under a causal mask (rank ``r`` holds chunks ``r`` and
    ``2C-1-r``) this gives exactly the rule of zigzag ring attention:
    keys from rank ``r`` itself: the lower triangle; from a rank ``s < r``: every local
    query, the first half of the keys (chunk ``s``; chunk ``2C-1-s`` lies after both of
    ours), no mask; from a rank ``s > r``: the second half of the queries (chunk
    ``2C-1-r`` comes after both of s's chunks, chunk ``r`` before both), every key, no
    mask. Every off-diagonal step then costs every rank the same half block.
    """
    variant = variant or Variant(causal=causal, window=window)
    mask = variant.visible(q_pos, k_pos)
    if mask is None:
        return Block(slice(0, len(q_pos)), slice(0, len(k_pos)), None)
    rows = mask.any(1).nonzero().flatten()
    if rows.numel() == 0:
        return None
    cols = mask.any(0).nonzero().flatten()
    r0, r1 = int(rows[0]), int(rows[-1]) + 1
    c0, c1 = int(cols[0]), int(cols[-1]) + 1
    sub = mask[r0:r1, c0:c1]
    if bool(sub.all()):
        return Block(slice(r0, r1), slice(c0, c1), None)
    tri = sub.shape[0] == sub.shape[1] and torch.equal(
        sub, torch.ones_like(sub).tril())
    return Block(slice(r0, r1), slice(c0, c1), sub.clone(), causal=tri)


def _runs(pos: torch.Tensor, tile: int | None) -> list[slice]:
    """The maximal runs of consecutive positions (a zigzag shard: two chunks), cut again
    where a position is a multiple of ``tile``."""
    cut = (pos[1:] - pos[:-1]) != 1
    if tile is not None:
        cut |= pos[1:] % tile == 0
    starts = [0, *(int(b) + 1 for b in cut.nonzero().flatten())]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], len(pos)], strict=True)]


def plan_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, variant: Variant,
                ) -> tuple[Block, ...]:
    """The work of queries at ``q_pos`` against keys at ``k_pos``: one bounding block,
    or, when that computes more scores (:attr:`Block.cost`), one block per pair of
    tiles: the layout's runs of consecutive positions (a zigzag shard's two chunks), cut
    at the multiples of the attention chunk (chunked attention) or of the window.

    A window or chunk sees a band near the diagonal: of a zigzag pair's four chunk
    pairs often only the two on the diagonal have work, and their bounding rectangle
    would be the whole block, half of it masked; chunks smaller than a shard's run leave
    a block-diagonal of triangles, which tiles at the chunk boundaries compute exactly.
    Causal attention alone gives the same cost either way and keeps the one block
    (:func:`plan_block`'s zigzag rule)."""
    whole = plan_block(q_pos, k_pos, variant=variant)
    if whole is None:
        return ()
    tile = variant.chunk or variant.window
    parts = [blk.shifted(qs.start, ks.start)
             for qs in _runs(q_pos, tile) for ks in _runs(k_pos, tile)
             if (blk := plan_block(q_pos[qs], k_pos[ks], variant=variant)) is not None]
    if len(parts) > 1 and sum(b.cost for b in parts) < whole.cost:
        return tuple(parts)
    return (whole,)


def with_documents(blk: Block, q_docs: torch.Tensor | None, k_docs: torch.Tensor | None,
                   ) -> tuple[torch.Tensor | None, bool]:
    """The block's mask with document ids applied, ``(mask, causal)`` for
    :func:`block_forward`: a query sees a key of its own document, never a pad (id -1);
    ``(b, 1, rows, cols)`` when there are documents (per sample), the block's own
    positional mask otherwise."""
    if q_docs is None or k_docs is None:
        return blk.mask, blk.causal
    qd, kd = q_docs[:, blk.rows], k_docs[:, blk.cols]
    mask = (qd[:, :, None] == kd[:, None, :]) & (kd[:, None, :] >= 0)
    if blk.mask is not None:
        mask = mask & blk.mask.to(mask.device)
    return mask[:, None], False


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # Query head h uses kv head h // groups, as transformers' repeat_kv.
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _fold_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # Adjoint of _repeat_kv: sum the gradients of the copies of each kv head.
    if groups == 1:
        return x
    b, s, h, d = x.shape
    return x.view(b, s, h // groups, groups, d).sum(3)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None,
            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (b, h, sq, sk), soft-capped when ``softcap`` is set (Gemma 2's
    ``softcap·tanh(s/softcap)``), plus ``bias`` (ALiBi's, broadcast), and the cap's
    derivative ``1 - tanh²`` (None without)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    dcap = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores, dcap = capped * softcap, 1 - capped * capped
    return (scores if bias is None else scores + bias), dcap


def _probs(scores: torch.Tensor, mask: torch.Tensor | None, lse: torch.Tensor | None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax probabilities (b, h, sq, sk) and the log-sum-exp (b, h, sq); a row that
    sees nothing has lse -inf and probabilities 0."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - finite.unsqueeze(-1)), lse


def _fused(q: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           softcap: float | None, bias: torch.Tensor | None) -> bool:
    """Whether PyTorch's fused CPU flash kernel computes this block (it needs one head
    size for q, k and v, so MLA's smaller value heads take the manual kernel, and has no
    soft-capping and no bias)."""
    return (q.device.type == "cpu" and (mask is None or causal) and softcap is None
            and bias is None and q.shape[-1] == v.shape[-1]
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _heads_first(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2) for t in ts]  # (b, s, h, d) -> (b, h, s, d), a view


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  mask: torch.Tensor | None = None, causal: bool = False,
                  softcap: float | None = None, bias: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale) v for one block: ``(out, lse)``, out ``(b, sq, h, dv)``.

    ``causal``: ``mask`` is the square lower triangle (the fused kernel's is_causal).
    ``softcap``: the scores are soft-capped before the softmax (and the log-sum-exp);
    ``bias`` (broadcast to (b, h, sq, sk)) is added after the cap (ALiBi).
    ``k`` and ``v`` may have fewer heads than ``q`` (GQA); they are repeated here."""
    groups = q.shape[2] // k.shape[2]
    kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if _fused(q, v, mask, causal, softcap, bias):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_heads_first(q, kr, vr), 0.0, mask is not None, scale=scale)
        return out.transpose(1, 2), lse
    p, lse = _probs(_scores(q, kr, scale, softcap, bias)[0], mask, None)
    return torch.einsum("bhqk,bkhd->bqhd", p, vr), lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, *, scale: float,
                   mask: torch.Tensor | None = None, causal: bool = False,
                   out: torch.Tensor | None = None, softcap: float | None = None,
                   bias: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* ``lse`` of the rows and
    ``delta = rowsum(dout ∘ out)`` (b, h, sq) of the final output (flash-attention 2,
    algorithm 2): P = exp(S - lse), dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - delta),
    dQ = dS K · scale, dK = dSᵀ Q · scale; under soft-capping dS is multiplied by the
    cap's derivative 1 - tanh²(s/softcap) first. Returns ``(dq, dk, dv)``; dk and dv
    have k's (fewer, under GQA) heads. With the final ``out`` of the rows (b, sq, h, dv)
    the fused CPU kernel does the same (it forms delta from ``out`` itself)."""
    groups = q.shape[2] // k.shape[2]
    kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if out is not None and _fused(q, v, mask, causal, softcap, bias):
        dq, dk, dv = (g.transpose(1, 2) for g in
                      torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                          *_heads_first(dout, q, kr, vr, out), lse.contiguous(), 0.0,
                          mask is not None, scale=scale))
        return dq, _fold_kv(dk, groups), _fold_kv(dv, groups)
    scores, dcap = _scores(q, kr, scale, softcap, bias)
    p, _ = _probs(scores, mask, lse)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vr)
    ds = p * (dp - delta.unsqueeze(-1))
    if dcap is not None:
        ds = ds * dcap
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    return dq, _fold_kv(dk, groups), _fold_kv(dv, groups)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax results over disjoint keys:
    lse = log(e^lse + e^lse_b), out = out·e^(lse_old - lse) + out_b·e^(lse_b - lse).
    Rows where both are empty (-inf) stay empty with output 0."""
    new = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    old_w = torch.exp(lse - finite).transpose(1, 2).unsqueeze(-1)
    new_w = torch.exp(block_lse - finite).transpose(1, 2).unsqueeze(-1)
    return out * old_w + block_out * new_w, new


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold attention sinks (``(h,)``, one logit per head, gpt-oss' ``s_aux``) into the
    final result of every key block: a key whose value is zero, so
    lse' = log(e^lse + e^sink), out' = out · e^(lse - lse'). It enters once per row,
    after the last block; the backward of every block then takes (out', lse') as the
    final result, exactly as for one more key (:func:`block_backward`)."""
    sink = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    new = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - new).transpose(1, 2).unsqueeze(-1), new


def sink_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient from the rows' final ``lse`` and ``delta = rowsum(dO ∘ O)``
    (b, h, s): the sink's probability is p = e^(sink - lse), its value zero, so
    dS_sink = p · (0 - delta), summed over the rows (and the batch) of each head."""
    p = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p * delta).sum((0, 2))


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
               ) -> torch.Tensor:
    """ALiBi's bias (Press et al., arXiv:2108.12409) for queries at ``q_pos`` and keys at
    ``k_pos``: ``slope_h · (k - q)``, (1, h, sq, sk). BLOOM adds ``slope_h · k`` alone,
    which differs by a constant per row (the softmax does not see it); the difference
    from true positions makes it the same on every rank."""
    diff = (k_pos[None, :] - q_pos[:, None]).to(slopes.device, slopes.dtype)
    return slopes.view(1, -1, 1, 1) * diff
