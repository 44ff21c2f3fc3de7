"""Gradient synchronization details: each gradient over the group its placement names,
broadcast within replicas only, unused parameters, and bucket layout."""

import copy

import torch
import torch.distributed as dist
from torch import nn

from paraxis import Grid, ParallelConfig
from paraxis.parallel.placement import Placement, record_replicated, set_placement
from paraxis_dp import DataParallel


class DenseAndExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 4, bias=False)  # this rank's slice of a (8, 4) stack
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.expert(torch.tanh(self.dense(x))).square().mean()


def expert_placement_rank():
    """data=2 x expert=2: dense grads average over 4 ranks; expert grads sum over their 2
    replicas and are divided by the 4 ranks holding distinct tokens."""
    config = ParallelConfig.from_kwargs(data=2, expert=2)
    grid = Grid.build(config)
    e = grid.coords["expert"]
    torch.manual_seed(0)
    model = DenseAndExpert()
    with torch.no_grad():
        model.expert.weight.fill_(0.1 * (e + 1))  # experts differ, replicas agree
        if grid.coords["data"] == 1:
            model.expert.weight.add_(5.0)  # ...until the broadcast repairs it
    # What an expert axis would record: dim 0 of the (8, 4) stack split over `expert`.
    full = Placement("expert.weight", (8, 4), torch.float32,
                     replicated=("data", "expert", "context", "tensor"))
    set_placement(model.expert.weight, full.sharded(dim=0, axis="expert", offset=4 * e,
                                                    length=4))
    record_replicated(model)  # the rest, as core does before any axis applies
    sync = DataParallel(model, grid=grid, bucket_mb=config.parallelism.bucket_mb)
    assert torch.all(model.expert.weight == 0.1 * (e + 1)), "broadcast crossed experts"

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(grid.rank))
    local = copy.deepcopy(model)
    local(x).backward()  # this rank's own gradients, never synchronized
    model(x).backward()
    waited = sync.finish()
    assert waited >= 0.0

    def gathered(t):
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t.contiguous())
        return out

    dense_all = gathered(local.dense.weight.grad)
    expert_all = gathered(local.expert.weight.grad)
    peers = grid.group("data").ranks  # same expert coordinate
    torch.testing.assert_close(model.dense.weight.grad, sum(dense_all) / 4)
    # Expert gradients are summed over their replicas (same expert coordinate) and
    # divided, like every gradient, by the 4 ranks holding distinct tokens: the engine
    # scales each rank's loss by that count, and an expert's gradient already sums the
    # tokens of every expert rank (the all-to-all), so this is the one-process mean.
    torch.testing.assert_close(model.expert.weight.grad,
                               sum(expert_all[r] for r in peers) / 4)
    # A parameter no rank used reduces as zeros, so every rank still steps identically.
    assert torch.count_nonzero(model.unused.weight.grad) == 0
    grid.destroy()
    return [str(b.group.axes) for b in sync.buckets]


def test_each_gradient_reduced_over_its_placement_group(worlds):
    buckets = worlds.run(4, expert_placement_rank)[0]
    assert sorted(set(buckets)) == ["('data', 'context')", "('data', 'expert', 'context')"]


def bucket_layout_rank():
    grid = Grid.build({"data": 2})
    model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4)))  # 256 KiB each
    record_replicated(model)
    sync = DataParallel(model, grid=grid, bucket_mb=0.5)
    order = [[id(p) for p in b.params] for b in sync.buckets]
    expected = [[id(model[3].weight), id(model[2].weight)],
                [id(model[1].weight), id(model[0].weight)]]
    model(torch.ones(1, 256)).sum().backward()
    sync.finish()
    views_ok = all(p.grad.data_ptr() == v.data_ptr()
                   for b in sync.buckets for p, v in zip(b.params, b.views, strict=True))
    sync.remove_hooks()
    grid.destroy()
    return order == expected, views_ok, repr(sync)


def test_buckets_fill_in_reverse_registration_order_and_grads_are_views(worlds):
    order_ok, views_ok, text = worlds.run(2, bucket_layout_rank)[0]
    assert order_ok, "buckets must be filled from the last registered parameter"
    assert views_ok, "param.grad must live in the flat bucket (no copy on reduce)"
    assert text == ("DataParallel(buckets=[0.50MiB/dataxexpertxcontext, "
                    "0.50MiB/dataxexpertxcontext])")
