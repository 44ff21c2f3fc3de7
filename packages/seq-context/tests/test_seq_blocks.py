"""Sharding layouts, the block plan and the per-block arithmetic, without processes:
the zigzag rule derived from positions, a blockwise (merged) forward and the manual
backward against PyTorch SDPA and autograd in float64."""

import pytest
import torch
from seq_reference import full_and_grads, qkv, reference

from paraxis.runtime.collectives import CommStats
from paraxis.runtime.grid import AxisGroup
from paraxis.testing.tolerance import FP64_RTOL
from paraxis_seq.blockwise import block_backward, block_forward, merge, plan_block, visible
from paraxis_seq.ring import ring_attention, step_plan
from paraxis_seq.ulysses import ulysses_attention
from paraxis_seq.zigzag import positions, shard, shard_order, unshard


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_roundtrip_and_positions(layout, size):
    x = torch.arange(3 * 16).view(3, 16)
    parts = [shard(x, size=size, rank=r, layout=layout) for r in range(size)]
    assert torch.equal(unshard(parts, layout=layout), x)
    for r, part in enumerate(parts):
        assert torch.equal(part[0], positions(16, size, r, layout))  # ids = positions
    assert sorted(shard_order(16, size, layout).tolist()) == list(range(16))
    if layout == "zigzag" and size == 2:  # chunks of 4: rank 0 holds 0 and 3
        assert positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_shard_refuses_uneven():
    with pytest.raises(ValueError, match="8 equal chunks"):
        positions(12, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="layout must be"):
        positions(8, 2, 0, "striped")


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_zigzag_causal_rule(size):
    """The plan from positions is the zigzag case split: own block a triangle, a block
    from before all queries x first half of keys, from after second half of queries x
    all keys, no masks off the diagonal, equal area on every rank and step."""
    s, c = 4 * size * 2, 4
    half = 2 * c // 2
    for rank in range(size):
        for src in range(size):
            blk = step_plan(s * 1, size, rank, src, "zigzag", True, None)
            if src == rank:
                assert blk.mask is not None and torch.equal(blk.mask, torch.ones(
                    2 * c, 2 * c, dtype=torch.bool).tril())
                assert blk.causal  # the fused kernel's is_causal
            elif src < rank:
                assert (blk.rows, blk.cols, blk.mask) == (slice(0, 2 * c), slice(0, half), None)
            else:
                assert (blk.rows, blk.cols, blk.mask) == (slice(half, 2 * c), slice(0, 2 * c),
                                                          None)
            if src != rank:
                assert blk.area == 2 * c * c


def test_contiguous_causal_plan_is_unbalanced():
    size, s = 4, 32
    work = [sum(b.area for src in range(size)
                if (b := step_plan(s, size, r, src, "contiguous", True, None)))
            for r in range(size)]
    assert work == [64, 128, 192, 256]  # rank r computes r + 1 blocks (one triangular)
    assert step_plan(s, size, 0, 3, "contiguous", True, None) is None


def test_plan_window_and_noncausal():
    q, k = torch.arange(8, 16), torch.arange(0, 8)
    assert plan_block(q, k, causal=False).mask is None
    blk = plan_block(q, k, causal=True, window=4)  # query 8 sees 5..8, 11 sees 8..11
    assert (blk.rows, blk.cols) == (slice(0, 3), slice(5, 8))
    assert plan_block(q, k, causal=True, window=1) is None


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5)])
def test_blockwise_forward_merges_to_reference(causal, window):
    """Split the keys into 4 blocks, attend each with its plan and merge by LSE."""
    q, k, v = qkv()
    want = reference(q, k, v, causal=causal, window=window)
    b, s, h, d = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((b, h, s), float("-inf"), dtype=q.dtype)
    qpos = torch.arange(s)
    for cols in torch.arange(s).chunk(4):
        blk = plan_block(qpos, cols, causal=causal, window=window)
        if blk is None:
            continue
        kb, vb = k[:, cols][:, blk.cols], v[:, cols][:, blk.cols]
        o, lb = block_forward(q[:, blk.rows], kb, vb, scale=d ** -0.5, mask=blk.mask)
        out[:, blk.rows], lse[:, :, blk.rows] = merge(out[:, blk.rows], lse[:, :, blk.rows],
                                                      o, lb)
    torch.testing.assert_close(out, want, rtol=FP64_RTOL, atol=FP64_RTOL)


def test_merge_keeps_empty_rows_empty():
    out, lse = torch.zeros(1, 2, 1, 3), torch.full((1, 1, 2), float("-inf"))
    o2, l2 = merge(out, lse, torch.zeros(1, 2, 1, 3), torch.full((1, 1, 2), float("-inf")))
    assert torch.equal(o2, out) and torch.isneginf(l2).all()


@pytest.mark.parametrize("causal", [False, True])
def test_block_backward_matches_autograd(causal):
    q, k, v = (t.requires_grad_(True) for t in qkv(seed=1))
    scale = 0.3
    out = reference(q, k, v, causal=causal, scale=scale)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), dout)
    mask = visible(torch.arange(16), torch.arange(16), causal=causal, window=None)
    with torch.no_grad():
        o, lse = block_forward(q, k, v, scale=scale, mask=mask)
        delta = (dout * o).sum(-1).transpose(1, 2)
        got = block_backward(dout, q, k, v, lse, delta, scale=scale, mask=mask)
    torch.testing.assert_close(o, out.detach(), rtol=FP64_RTOL, atol=FP64_RTOL)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=FP64_RTOL, atol=FP64_RTOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_fused_cpu_block_matches_autograd(causal, dtype, tol):
    """The fused CPU flash kernel (no mask, or the causal triangle), forward and its
    backward given the final out/lse, GQA, against SDPA and autograd."""
    q, k, v = (t.requires_grad_(True) for t in qkv(seed=4))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    want = full_and_grads(q, k, v, dout, causal=causal, scale=0.3)
    mask = torch.ones(16, 16, dtype=torch.bool).tril() if causal else None
    q, k, v, dout = (t.detach().to(dtype) for t in (q, k, v, dout))
    out, lse = block_forward(q, k, v, scale=0.3, mask=mask, causal=causal)
    delta = (dout * out).sum(-1).transpose(1, 2)
    grads = block_backward(dout, q, k, v, lse, delta, scale=0.3, mask=mask, causal=causal,
                           out=out)
    for g, w in zip((out, *grads), want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)


def _alone():
    """A context group of one rank: the ring and Ulysses run without processes."""
    return AxisGroup(("context",), (0,), 0, None, CommStats())


@pytest.mark.parametrize("attn", [ring_attention, ulysses_attention])
def test_one_rank_is_full_attention(attn):
    q, k, v = (t.requires_grad_(True) for t in qkv(seed=2))
    dout = torch.randn_like(q)
    out = attn(q, k, v, group=_alone(), causal=True, window=6)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for g, w in zip(got, full_and_grads(q, k, v, dout, causal=True, window=6), strict=True):
        torch.testing.assert_close(g, w, rtol=FP64_RTOL, atol=FP64_RTOL)


@pytest.mark.parametrize("attn", [ring_attention, ulysses_attention])
def test_refusals_say_why(attn):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout is not supported.*Philox"):
        attn(q, k, v, group=_alone(), dropout=0.1)
    with pytest.raises(ValueError, match="needs causal=True"):
        attn(q, k, v, group=_alone(), causal=False, window=4)
