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
