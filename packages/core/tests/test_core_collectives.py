"""Core collectives on real gloo ranks: each differentiable op's forward and backward
against the same arithmetic done on the gathered tensors, and the byte counts."""

import pytest
import torch
import torch.distributed as dist

from paraxis.runtime import differentiable as C
from paraxis.runtime.grid import Grid


def _grid():
    return Grid.build({"data": dist.get_world_size()})


def _inputs(shape, seed):
    """Every rank's input (the same list on every rank) and this rank's own."""
    g = torch.Generator().manual_seed(seed)
    every = [torch.randn(shape, generator=g, dtype=torch.float64)
             for _ in range(dist.get_world_size())]
    return every, every[dist.get_rank()].clone().requires_grad_(True)


def check_ops():
    grid = _grid()
    group, n, r = grid.group("data"), grid.world_size, grid.rank
    every, x = _inputs((4, 6, 3), 0)
    upstream = [torch.randn(4 * n, 6, 3, generator=torch.Generator().manual_seed(10 + i),
                            dtype=torch.float64) for i in range(n)]
    results = {}

    # all_gather along dim 0, gradient: own slice (consumers replicated).
    y = C.all_gather(x, group, dim=0)
    assert torch.equal(y, torch.cat(every, 0))
    y.backward(upstream[0])  # the same upstream everywhere
    assert torch.equal(x.grad, upstream[0].chunk(n, 0)[r])
    x.grad = None
    # all_gather, gradient: sum of every rank's slice (consumers differ per rank).
    y = C.all_gather(x, group, dim=0, grad="sum")
    y.backward(upstream[r])
    torch.testing.assert_close(x.grad, sum(u.chunk(n, 0)[r] for u in upstream))
    x.grad = None
    # reduce_scatter along dim 1 (6 splits over 2; over 4 use dim 0 scaled below).
    big = torch.cat([e for e in every], 0)  # (4n, 6, 3) same on all ranks
    z = C.reduce_scatter(big * (r + 1), group, dim=0)
    torch.testing.assert_close(z, big.chunk(n, 0)[r] * sum(range(1, n + 1)))
    # split and its all-gather backward.
    s = C.split(x, group, dim=0)
    assert torch.equal(s, x.detach().chunk(n, 0)[r])
    s.backward(torch.ones_like(s) * (r + 1))
    expect = torch.cat([torch.ones_like(s) * (k + 1) for k in range(n)], 0)
    assert torch.equal(x.grad, expect)
    x.grad = None
    # copy_to / reduce_from: Megatron's f and g.
    f = C.copy_to(x, group)
    f.backward(torch.full_like(x, float(r)))
    assert torch.equal(x.grad, torch.full_like(x, float(sum(range(n)))))
    x.grad = None
    g = C.reduce_from(x, group)
    torch.testing.assert_close(g, sum(every))
    g.backward(torch.ones_like(g))
    assert torch.equal(x.grad, torch.ones_like(x))
    x.grad = None
    # all_reduce: a true sum both ways.
    a = C.all_reduce(x, group)
    a.backward(torch.full_like(x, float(r + 1)))
    assert torch.equal(x.grad, torch.full_like(x, float(sum(range(1, n + 1)))))
    x.grad = None
    # all_to_all: scatter heads (dim 2 of (b, s, h*n)), gather sequence (dim 1).
    q = torch.arange(2 * 3 * 2 * n, dtype=torch.float64).view(2, 3, 2 * n) + 100 * r
    q.requires_grad_(True)
    out = C.all_to_all(q, group, scatter_dim=2, gather_dim=1)
    full = [torch.arange(2 * 3 * 2 * n, dtype=torch.float64).view(2, 3, 2 * n) + 100 * k
            for k in range(n)]
    assert torch.equal(out, torch.cat([f[..., 2 * r:2 * r + 2] for f in full], 1))
    back = C.all_to_all(out, group, scatter_dim=1, gather_dim=2)
    assert torch.equal(back, q.detach())  # the reverse exchange restores the input
    back.sum().backward()
    assert torch.equal(q.grad, torch.ones_like(q))
    # all_to_all_uneven: rank r sends k + r + 1 rows to rank k.
    send = [k + r + 1 for k in range(n)]
    recv = [r + k + 1 for k in range(n)]
    rows = torch.arange(sum(send), dtype=torch.float64).unsqueeze(1) + 1000 * r
    rows.requires_grad_(True)
    got = C.all_to_all_uneven(rows, group, send, recv)
    assert got.shape == (sum(recv), 1)
    (got * (r + 1)).sum().backward()
    # each row came back to its owner weighted by the rank that received it
    weights = torch.cat([torch.full((s, 1), float(k + 1)) for k, s in enumerate(send)])
    assert torch.equal(rows.grad, weights.double())
    results["bytes"] = dict(grid.comm.bytes)
    results["seconds"] = grid.comm.total_seconds()
    grid.destroy()
    return results


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_forward_backward_and_counts(worlds, n):
    out = worlds.run(n, check_ops)
    counts = out[0]["bytes"]
    # all_reduce of a (4, 6, 3) float64 tensor: 2 (n-1)/n x 576 bytes, per call.
    per_call = 2 * (n - 1) / n * 4 * 6 * 3 * 8
    calls = (counts[("data", "all_reduce")] / per_call)
    assert calls == pytest.approx(round(calls)) and calls >= 3
    assert {("data", "all_gather"), ("data", "reduce_scatter"),
            ("data", "all_to_all")} <= set(counts)
    assert all(o["seconds"] >= 0 for o in out)



def check_async_exchange():
    """``exchange_rows(..., async_op=True)`` against the blocking one: the same rows, the
    bytes counted once (at launch, none at ``wait()``), a strided input sent as well."""
    from paraxis.runtime.collectives import exchange_rows

    grid = _grid()
    group, n, r = grid.group("data"), grid.world_size, grid.rank
    send = [k + r + 1 for k in range(n)]
    recv = [r + k + 1 for k in range(n)]
    rows = torch.arange(sum(send) * 3, dtype=torch.float64).view(-1, 3) + 1000 * r
    mark = grid.comm.mark()
    expect = exchange_rows(rows, group, send, recv)
    sync_bytes = grid.comm.since(mark)["bytes"]
    mark = grid.comm.mark()
    pending = exchange_rows(rows, group, send, recv, async_op=True)
    launched = grid.comm.since(mark)["bytes"]
    got = pending.wait()
    waited = grid.comm.since(mark)["bytes"]
    again = pending.wait()  # neither blocks nor counts again
    # Not contiguous: the exchange sends a copy, held by the handle until wait().
    strided = exchange_rows(rows[:, :2], group, send, recv, async_op=True)
    out = {"equal": torch.equal(got, expect) and again is got,
           "strided": torch.equal(strided.wait(), expect[:, :2]),
           "shape": tuple(got.shape), "sync": sync_bytes, "launched": launched,
           "waited": waited, "after": grid.comm.since(mark)["bytes"]}
    grid.destroy()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_async_exchange_matches_the_blocking_one_and_counts_bytes_once(worlds, n):
    for r, out in enumerate(worlds.run(n, check_async_exchange)):
        assert out["equal"] and out["strided"]
        assert out["shape"] == (sum(r + k + 1 for k in range(n)), 3)
        # Bytes sent to other ranks: sum(send) - send[r] rows of 3 float64.
        nbytes = (sum(k + r + 1 for k in range(n)) - (2 * r + 1)) * 3 * 8
        assert out["sync"] == {("data", "all_to_all"): nbytes}
        assert out["launched"] == out["waited"] == out["sync"]
        assert out["after"] == {("data", "all_to_all"): nbytes * 5 / 3}  # + 2 of 3 columns
