"""The grid: layout arithmetic without processes, then real groups on 1, 2, 4, 8 ranks
for every factorization of the world over the five axes."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from paraxis import AXES, Grid, GridLayout
from paraxis.runtime.grid import DENSE_REPLICA_AXES, EXPERT_REPLICA_AXES, standard_groups


def factorizations(n):
    """Every assignment of degrees to the five axes whose product is n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for combo in itertools.product(divisors, repeat=len(AXES)):
        if math.prod(combo) == n:
            yield dict(zip(AXES, combo, strict=True))


def test_factorization_counts():
    # Ordered factorizations of 2**k into 5 factors: C(k + 4, 4).
    assert [len(list(factorizations(n))) for n in (1, 2, 4, 8)] == [1, 5, 15, 35]


@pytest.mark.parametrize("degrees", list(factorizations(8)), ids=str)
def test_layout_round_trip_and_partition(degrees):
    layout = GridLayout(degrees)
    for r in range(layout.size):
        assert layout.rank(**layout.coords(r)) == r
    for axes in [(a,) for a in AXES] + [DENSE_REPLICA_AXES, EXPERT_REPLICA_AXES]:
        groups = layout.group_ranks(axes)
        assert sorted(r for g in groups for r in g) == list(range(8))  # a partition
        size = math.prod(degrees[a] for a in axes)
        assert all(len(g) == size for g in groups)
        for g in groups:  # members agree on every coordinate outside `axes`
            outside = {tuple(layout.coords(r)[a] for a in AXES if a not in axes) for r in g}
            assert len(outside) == 1


def test_tensor_is_innermost_and_pipeline_outermost():
    layout = GridLayout({"pipeline": 2, "data": 2, "tensor": 2})
    assert layout.group_ranks("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == {"pipeline": 1, "data": 0, "expert": 0, "context": 0,
                                "tensor": 1}


def test_unknown_axis_rejected():
    with pytest.raises(KeyError, match="unknown grid axes"):
        GridLayout({"date": 2})
    with pytest.raises(KeyError, match="unknown grid axes"):
        GridLayout({"data": 2}).group_ranks("tensr")


def check_all_factorizations():
    """On every rank: build each grid, check coordinates and that every group's process
    group really connects exactly its members."""
    world, rank = dist.get_world_size(), dist.get_rank()
    checked = 0
    for degrees in factorizations(world):
        grid = Grid.build(degrees)
        layout = GridLayout(degrees)
        assert grid.coords == layout.coords(rank)
        for axes in standard_groups(layout.table):
            g = grid.group(axes)
            assert list(g.ranks) == layout.group_of(rank, axes)
            assert g.ranks[g.rank] == rank
            if g.size > 1:
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=g.pg)
                assert t.item() == sum(g.ranks), (degrees, axes, g.ranks)
        desc = grid.describe()
        assert desc["coords"] == grid.coords and desc["world_size"] == world
        grid.destroy()
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_grid_groups_on_real_ranks(worlds, world_size):
    counts = worlds.run(world_size, check_all_factorizations)
    assert counts == [len(list(factorizations(world_size)))] * world_size


def build_with_wrong_world():
    Grid.build({"data": dist.get_world_size() + 1})


def test_grid_rejects_wrong_world_size(worlds):
    from paraxis.testing import RankFailure

    with pytest.raises(RankFailure, match="world_size = 2: must equal"):
        worlds.run(2, build_with_wrong_world)
