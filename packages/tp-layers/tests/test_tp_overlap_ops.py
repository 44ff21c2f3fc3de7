"""The overlapped entry and exit (paraxis_tp.overlap) against dense twins on 2 and 3 gloo
ranks: outputs, input gradients, weight and bias gradients (one step's tolerance). Three
ranks exercise the ring's order (which block a rank holds at each hop, which partial it
computes first), which two ranks cannot tell apart."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paraxis import Grid
from paraxis.testing.tolerance import assert_step_close as close
from paraxis_tp.overlap import OverlappedEntry, _LinearScatter


def own(t, g, dim):
    return t.chunk(g.size, dim=dim)[g.rank]


def local_linear(dense, g, dim):
    """This rank's column (dim 0) or row (dim 1) shard of ``dense``, as a plain Linear."""
    w = own(dense.weight.detach(), g, dim).clone()
    m = nn.Linear(w.shape[1], w.shape[0], bias=dense.bias is not None)
    m.weight = nn.Parameter(w)
    if dense.bias is not None:
        m.bias = nn.Parameter(own(dense.bias.detach(), g, 0).clone())
    return m


def entry_rank():
    g = Grid.build({"tensor": dist.get_world_size()}).group("tensor")
    torch.manual_seed(0)
    n, seq = g.size, 2 * g.size
    q, k = nn.Linear(8, 6 * n), nn.Linear(8, 3 * n, bias=False)
    x = torch.randn(2, seq, 8)
    wq, wk, c = torch.randn(2, seq, 6 * n), torch.randn(2, seq, 3 * n), torch.randn(2, seq, 8)
    xd = x.clone().requires_grad_()
    # every rank uses the gathered input once more (grad_full), so the sum counts it n times
    ((q(xd) * wq).sum() + (k(xd) * wk).sum() + n * (xd * c).sum()).backward()
    ql, kl = local_linear(q, g, 0), local_linear(k, g, 0)
    entry = OverlappedEntry(g)
    entry.add(ql)
    entry.add(kl)
    xl = own(x, g, -2).clone().requires_grad_()
    full = entry(xl)
    yq, yk = ql(full), kl(full)
    entry.clear()
    assert entry.consumers == [ql, kl]  # both took their outputs: both stay fused
    ((yq * own(wq, g, -1)).sum() + (yk * own(wk, g, -1)).sum() + (full * c).sum()).backward()
    close(full, x, "gathered input")
    close(yq, own(q(x), g, -1), "q output")
    close(yk, own(k(x), g, -1), "k output")
    close(xl.grad, own(xd.grad, g, -2), "input gradient")
    close(ql.weight.grad, own(q.weight.grad, g, 0), "q weight gradient")
    close(ql.bias.grad, own(q.bias.grad, g, 0), "q bias gradient")
    close(kl.weight.grad, own(k.weight.grad, g, 0), "k weight gradient")


def exit_rank():
    g = Grid.build({"tensor": dist.get_world_size()}).group("tensor")
    torch.manual_seed(1)
    n, seq = g.size, 2 * g.size
    o = nn.Linear(4 * n, 8, bias=False)
    x, w = torch.randn(2, seq, 4 * n), torch.randn(2, seq, 8)
    xd = x.clone().requires_grad_()
    (o(xd) * w).sum().backward()
    weight = nn.Parameter(own(o.weight.detach(), g, 1).clone())
    xl = own(x, g, -1).clone().requires_grad_()
    out = _LinearScatter.apply(xl, weight, g)
    (out * own(w, g, -2)).sum().backward()
    close(out, own(o(x), g, -2), "reduce-scattered output")
    close(xl.grad, own(xd.grad, g, -1), "input gradient")
    close(weight.grad, own(o.weight.grad, g, 1), "weight gradient")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("fn", [entry_rank, exit_rank], ids=["entry", "exit"])
def test_overlapped_ops_match_dense(worlds, fn, ranks):
    worlds.run(ranks, fn)
