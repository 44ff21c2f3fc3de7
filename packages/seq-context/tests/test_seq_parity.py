"""Ring attention and Ulysses on 2 and 4 gloo ranks against unsharded attention on one
rank (float64): outputs and q/k/v gradients, and the bytes each put on the wire
against the analytic volumes."""

import pytest
import torch
import torch.distributed as dist
from seq_reference import full_and_grads, qkv

from paraxis.runtime.grid import Grid
from paraxis_seq.ring import ring_attention
from paraxis_seq.ulysses import kv_replication, ulysses_attention
from paraxis_seq.zigzag import shard

# (name, causal, query heads, kv heads, window)
RING_CASES = [
    ("causal-gqa", True, 4, 2, None),
    ("causal-mha", True, 4, 4, None),
    ("full-gqa", False, 4, 1, None),
    ("window-gqa", True, 4, 2, 5),
]
ULYSSES_CASES = [
    ("causal-gqa", True, 4, 2, None),     # kv heads divide over 2, not over 4 (repeat)
    ("causal-mqa", True, 4, 1, None),     # one kv head: repeated C times
    ("full-mha", False, 8, 8, None),
    ("window-gqa", True, 8, 2, 5),
]


def _run(attn, layout, case, dtype=torch.float64, **extra):
    """One case on this rank: max errors against the reference and the p2p/all-to-all
    bytes of forward and backward."""
    name, causal, h, hk, window = case
    grid = Grid.build({"context": dist.get_world_size()})
    group = grid.group("context")
    n, r = group.size, group.rank
    q, k, v = qkv(b=2, s=8 * n, h=h, hk=hk, d=8, seed=len(name), dtype=dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64)
    want = full_and_grads(q, k, v, dout, causal=causal, window=window)
    cut = dict(size=n, rank=r, layout=layout)
    ql, kl, vl = (shard(t, **cut).requires_grad_(True) for t in (q, k, v))
    mark = grid.comm.mark()
    out = attn(ql, kl, vl, group=group, causal=causal, window=window, layout=layout, **extra)
    fwd = grid.comm.since(mark)["bytes"]
    mark = grid.comm.mark()
    out.backward(shard(dout, **cut).to(dtype))
    bwd = grid.comm.since(mark)["bytes"]
    got = (out, ql.grad, kl.grad, vl.grad)
    errors = [float((g.detach().double() - shard(w, **cut)).abs().max())
              for g, w in zip(got, want, strict=True)]
    grid.destroy()
    local = {"q": ql.numel(), "kv": kl.numel(), "size": dtype.itemsize}
    return {"errors": errors, "fwd": fwd, "bwd": bwd, "local": local}


def check_ring(layout, dtype):
    return {case[0]: _run(ring_attention, layout, case, dtype) for case in RING_CASES}


def check_ulysses(layout):
    return {case[0]: _run(ulysses_attention, layout, case) for case in ULYSSES_CASES}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [2, 4])
def test_ring_matches_full_attention(worlds, n, layout):
    for rank, results in enumerate(worlds.run(n, check_ring, layout, torch.float64)):
        for name, res in results.items():
            assert max(res["errors"]) < 1e-12, (rank, name, res["errors"])
            # Forward: (C-1) hops of this rank's K and V = (C-1)/C of the layer's K/V.
            kv_bytes = 2 * res["local"]["kv"] * res["local"]["size"]
            assert res["fwd"] == {("context", "p2p"): (n - 1) * kv_bytes}, name
            # Backward: K/V again, plus the travelling dK/dV (float64 here, same size).
            assert res["bwd"] == {("context", "p2p"): 2 * (n - 1) * kv_bytes}, name


def test_ring_float32_computes_in_fp32(worlds):
    for results in worlds.run(2, check_ring, "zigzag", torch.float32):
        for name, res in results.items():
            assert max(res["errors"]) < 2e-5, (name, res["errors"])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [2, 4])
def test_ulysses_matches_full_attention(worlds, n, layout):
    for rank, results in enumerate(worlds.run(n, check_ulysses, layout)):
        for (name, _, h, hk, _), res in zip(ULYSSES_CASES, results.values(), strict=True):
            assert max(res["errors"]) < 1e-12, (rank, name, res["errors"])
            # Four all-to-alls each way, each sending (C-1)/C of a local tensor:
            # q and out have h heads, k and v hk x the replication.
            heads = 2 * h + 2 * hk * kv_replication(h, hk, n)
            per_head = res["local"]["q"] // h * res["local"]["size"]
            volume = (n - 1) / n * heads * per_head
            assert res["fwd"] == {("context", "all_to_all"): pytest.approx(volume)}, name
            assert res["bwd"] == {("context", "all_to_all"): pytest.approx(volume)}, name


def test_ulysses_kv_replication():
    assert [kv_replication(8, hk, 4) for hk in (8, 4, 2, 1)] == [1, 1, 2, 4]
    assert kv_replication(12, 4, 6) == 3
    with pytest.raises(ValueError, match="do not divide over 4"):
        kv_replication(6, 2, 4)
    for heads in range(1, 25):  # the repeat always leaves each rank whole GQA groups
        for hk in (d for d in range(1, heads + 1) if heads % d == 0):
            for size in (c for c in range(1, heads + 1) if heads % c == 0):
                rep = kv_replication(heads, hk, size)
                assert (hk * rep) % size == 0 and (heads // hk) % rep == 0
