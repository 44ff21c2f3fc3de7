"""Shared by the seq-context tests: unsharded reference attention and random inputs."""

import torch
import torch.nn.functional as F

from paraxis_seq.blockwise import visible


def reference(q, k, v, *, causal, scale=None, window=None):
    """Unsharded attention by PyTorch SDPA, (b, s, h, d) in and out, GQA by repeat."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    mask = visible(torch.arange(q.shape[1]), torch.arange(k.shape[1]), causal=causal,
                   window=window)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def qkv(b=2, s=16, h=4, hk=2, d=8, seed=0, dtype=torch.float64):
    """q (b, s, h, d), k and v (b, s, hk, d), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g, dtype=torch.float64).to(dtype)
            for n in (h, hk, hk)]


def full_and_grads(q, k, v, dout, **kw):
    """Reference output and (dq, dk, dv) in float64."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out = reference(q, k, v, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def eager(q, k, v, *, causal=True, scale=None, window=None, chunk=None, softcap=None,
          sinks=None, documents=None, alibi=None):
    """Unsharded attention written as transformers' eager kernels compute it (gemma2's
    soft-capping, gpt-oss' sinks as one more column of the softmax, BLOOM's ALiBi as
    slope x key position), masks from
    :func:`paraxis_seq.variant.visible` and document ids (pads -1), in one pass: the
    reference of another order for the blockwise kernels. A row that sees no key gives
    0 (what the ring gives, and what a sink-only row gives)."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(q.shape[1])
    if alibi is not None:  # BLOOM's form: slope times the key's position alone
        s = s + alibi.view(1, -1, 1, 1) * pos.to(s.dtype)
    mask = visible(pos, pos, causal=causal, window=window, chunk=chunk)
    mask = torch.ones(len(pos), len(pos), dtype=torch.bool) if mask is None else mask
    mask = mask.expand(q.shape[0], 1, -1, -1)
    if documents is not None:
        same = (documents[:, :, None] == documents[:, None, :]) & (documents[:, None] >= 0)
        mask = mask & same[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        col = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1).to(s.dtype)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s.masked_fill(~mask.any(-1, keepdim=True), 0.0), -1)
        p = p * mask.any(-1, keepdim=True)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def documents_of(lengths, b=2):
    """Per-token document ids (b, sum(lengths)): documents of ``lengths`` in a row, a
    length given as negative is that many pads (-1)."""
    ids, doc = [], 0
    for n in lengths:
        ids += [-1] * -n if n < 0 else [doc] * n
        doc += n > 0
    return torch.tensor(ids).expand(b, -1).contiguous()
