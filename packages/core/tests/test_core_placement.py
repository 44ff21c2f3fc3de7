"""Placement records: set by core for replicated parameters, updated by sharding axes."""

import pytest
import torch
from torch import nn

from paraxis import Placement, placement_of
from paraxis.placement import record_replicated, set_placement


def test_core_records_every_parameter_as_replicated_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied: one record, first name
    record_replicated(model)
    names = [placement_of(p).name for p in model.parameters()]
    assert names == ["0.weight", "1.bias"]
    rec = placement_of(model[0].weight)
    assert rec.global_shape == (10, 4) and rec.dtype == torch.float32
    assert rec.replicated == ("data", "expert", "context", "tensor")
    assert rec.grad_sync_axes == ("data", "expert", "context")


def test_an_axis_updates_the_record_when_it_shards():
    full = Placement("w", (8, 4), torch.float32, replicated=("data", "expert", "tensor"))
    shard = full.sharded(dim=0, axis="tensor", offset=4, length=4)
    assert shard.local_shape == (4, 4) and shard.replicated == ("data", "expert")
    expert = shard.sharded(dim=1, axis="expert", offset=0, length=2)
    assert expert.grad_sync_axes == ("data",)
    param = nn.Parameter(torch.zeros(4, 2))
    set_placement(param, expert)
    assert placement_of(param) is expert
    with pytest.raises(ValueError, match="does not match"):
        set_placement(nn.Parameter(torch.zeros(8, 4)), shard)
    with pytest.raises(ValueError, match="already sharded"):
        shard.sharded(dim=0, axis="tensor", offset=0, length=2)


def test_missing_record_is_a_clear_error():
    with pytest.raises(LookupError, match="no placement record"):
        placement_of(nn.Parameter(torch.zeros(1)))
