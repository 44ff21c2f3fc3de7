"""Expert tensor parallelism's uneven row exchanges on real gloo ranks (uneven counts,
one rank with none at 3): ``gather_rows`` and ``scatter_sum_rows`` forward and backward
against the same arithmetic on every rank's tensors, the bytes they count, and the
memory they allocate: one buffer of the gathered rows, never ``n`` copies of a rank's
own rows.

Planted, once each, as they were: ``gather_rows`` as an all-to-all of ``x.repeat(n)``
fails the forward check (rank 0 allocated 640 B against the 256 B gathered at 2 ranks,
1,152 B against 384 B at 3: ``n`` copies of its 3 or 4 rows besides the output), and
``scatter_sum_rows`` as an all-to-all whose backward reshapes the expanded gradient
fails its backward check (the same 640 B and 1,152 B: ``n`` contiguous copies)."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

WIDTH = 8
COUNTS = {2: [3, 1], 3: [4, 0, 2]}


class Allocations(TorchDispatchMode):
    """The bytes of every new storage an op returns while active (views and in-place
    results share an input's storage and are not counted)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() and \
                    t.untyped_storage().data_ptr() not in held:
                self.made.append((str(func), t.untyped_storage().nbytes()))
        return out

    @property
    def total(self) -> int:
        return sum(n for _, n in self.made)


def _rows(rank: int, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(count, WIDTH, generator=g, dtype=torch.float64)


def check_rows(counts):
    from paraxis.runtime.grid import Grid
    from paraxis_moe.expert_tensor import gather_rows, scatter_sum_rows

    grid = Grid.build({"tensor": dist.get_world_size()})
    group, n, r = grid.group("tensor"), grid.world_size, grid.rank
    total, row = sum(counts), WIDTH * 8
    out = {}
    # gather_rows: every rank's rows in rank order; backward sums each rank's gradient
    # rows and returns this rank's.
    x = _rows(r, counts[r], 0).requires_grad_(True)
    upstream = [_rows(k, total, 100) for k in range(n)]
    mark = grid.comm.mark()
    with Allocations() as forward:
        y = gather_rows(x, group, counts)
    out["gather"] = torch.equal(y, torch.cat([_rows(k, c, 0) for k, c in enumerate(counts)]))
    with Allocations() as backward:
        y.backward(upstream[r])
    mine = slice(sum(counts[:r]), sum(counts[:r + 1]))
    out["gather_grad"] = torch.allclose(x.grad, sum(u[mine] for u in upstream))
    out["gather_bytes"] = grid.comm.since(mark)["bytes"]
    out["gather_alloc"] = (forward.total, backward.total)
    # scatter_sum_rows: this rank's rows of the sum; backward gathers.
    full = _rows(r, total, 200).requires_grad_(True)
    mark = grid.comm.mark()
    z = scatter_sum_rows(full, group, counts)
    out["scatter"] = torch.allclose(z, sum(_rows(k, total, 200)[mine] for k in range(n)))
    grad = _rows(r, counts[r], 300)
    with Allocations() as scatter_back:
        z.backward(grad)
    out["scatter_grad"] = torch.equal(
        full.grad, torch.cat([_rows(k, c, 300) for k, c in enumerate(counts)]))
    out["scatter_bytes"] = grid.comm.since(mark)["bytes"]
    out["scatter_back_alloc"] = scatter_back.total
    out["gathered_bytes"], out["row"] = total * row, row
    grid.destroy()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_row_exchanges_match_and_allocate_no_copy_per_rank(worlds, n):
    counts = COUNTS[n]
    total = sum(counts)
    for r, out in enumerate(worlds.run(n, check_rows, counts)):
        assert out["gather"] and out["gather_grad"], r
        assert out["scatter"] and out["scatter_grad"], r
        row = out["row"]
        # The forward allocates the gathered rows and nothing else (the old all-to-all of
        # x.repeat(n) allocated n copies of x besides); so does scatter_sum_rows'
        # backward (the old one made n contiguous copies of the gradient rows).
        forward, backward = out["gather_alloc"]
        print(f"n={n} rank {r}: gathered {out['gathered_bytes']} B; gather_rows allocated "
              f"{forward} B forward, {backward} B backward; scatter_sum_rows' backward "
              f"{out['scatter_back_alloc']} B")
        assert forward == out["gathered_bytes"], (r, forward)
        assert out["scatter_back_alloc"] == out["gathered_bytes"], r
        # The gather's backward: the n partials of this rank's rows and their sum.
        assert backward <= (n + 1) * counts[r] * row, (r, backward)
        # Bytes sent to other ranks: this rank's rows to each of them (an even gather's
        # (n-1)/n of the whole), and every other rank's slice of the partials.
        sent = {("tensor", "all_gather"): (n - 1) * counts[r] * row,
                ("tensor", "reduce_scatter"): (total - counts[r]) * row}
        assert out["gather_bytes"] == {k: v for k, v in sent.items() if v}  # 0: not kept
        assert out["scatter_bytes"] == out["gather_bytes"]
