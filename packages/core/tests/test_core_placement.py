"""Placement records: set by core for replicated parameters, updated by sharding axes."""

import pytest
import torch
from torch import nn

from paraxis import Placement, placement_of
from paraxis.parallel.placement import record_replicated, set_placement


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


# ---- nested shards: a data shard subdivides a tensor piece (ZeRO over TP) -------------


def _rows(t, offset, length, padding):
    """Rows [offset, offset + length) of t, then `padding` zero rows."""
    return torch.cat([t[offset:offset + length], t.new_zeros((padding, *t.shape[1:]))])


def _data_shard(rec, local, n, r, dim=0):
    """What ZeRO does: cut dim 0 of the local tensor into n padded chunks, keep chunk r."""
    rows = local.shape[dim]
    chunk = -(-rows // n)
    offset = min(r * chunk, rows)
    length = max(0, min(chunk, rows - offset))
    out = _rows(local, offset, length, chunk - length)
    return out, rec.sharded(dim=0, axis=("data", "context"), offset=offset, length=length,
                            padding=chunk - length)


def _check_layouts(full, layouts):
    from paraxis.testing.parity import assemble

    per_rank = [{"w": (local, rec)} for local, rec in layouts]
    for local, rec in layouts:
        assert tuple(local.shape) == rec.local_shape
    assert torch.equal(assemble(per_rank)["w"], full)  # placement moves bytes: exact


def test_data_shards_nest_in_padded_tensor_shards():
    full = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)  # vocabulary 10
    base = Placement("w", (10, 3), torch.float32,
                     replicated=("data", "expert", "context", "tensor"))
    layouts = []
    for t in range(4):  # tensor 4: 3 rows each, the last 1 real + 2 padding
        real = max(0, min(3, 10 - 3 * t))
        local = _rows(full, 3 * t, real, 3 - real)
        rec = base.sharded(dim=0, axis="tensor", offset=3 * t, length=real, padding=3 - real)
        for r in range(2):
            layouts.append(_data_shard(rec, local, 2, r))
    assert layouts[-1][1].replicated == ("expert",)
    assert layouts[-1][1].sharded_axes == ("tensor", "data", "context")
    assert layouts[-1][1].pieces() == []  # that rank holds padding rows only
    _check_layouts(full, layouts)


def test_data_shards_of_packed_blocks_and_of_another_dim():
    full = torch.randn(12, 6)  # gate and up, 6 rows each
    base = Placement("w", (12, 6), torch.float32, replicated=("data", "context", "tensor"))
    layouts = []
    for t in range(2):  # tensor 2: 3 rows of each block; data 4: 2 of those 6 rows each
        local = torch.cat([full[3 * t:3 * t + 3], full[6 + 3 * t:9 + 3 * t]])
        rec = base.sharded(dim=0, axis="tensor", offset=3 * t, length=3, parts=2)
        layouts += [_data_shard(rec, local, 4, r) for r in range(4)]
    pieces = layouts[1][1].pieces()  # data rank 1 holds the last row of gate, first of up
    assert [(p.suffix, p.region) for p in pieces] == [("#part0", ((2, 1), (0, 6))),
                                                      ("#part1", ((0, 1), (0, 6)))]
    _check_layouts(full, layouts)
    rowwise = []  # a row-parallel weight: tensor splits dim 1, data splits dim 0
    for t in range(2):
        rec = base.sharded(dim=1, axis="tensor", offset=3 * t, length=3)
        rowwise += [_data_shard(rec, full[:, 3 * t:3 * t + 3], 5, r) for r in range(5)]
    _check_layouts(full, rowwise)


def test_nested_shards_read_back_from_a_checkpoint_on_another_layout(tmp_path):
    from safetensors.torch import save_file

    from paraxis.checkpoint.format import pieces
    from paraxis.checkpoint.read import Reader

    full = torch.randn(10, 4)
    base = Placement("w", (10, 4), torch.float32, replicated=("data", "context", "tensor"))
    tensor = [(base.sharded(dim=0, axis="tensor", offset=5 * t, length=5),
               full[5 * t:5 * t + 5]) for t in range(2)]
    shards = []
    for rec, local in tensor:
        for r in range(3):  # data 3 over 5 rows: 2, 2, 1 + 1 padding
            out, nested = _data_shard(rec, local, 3, r)
            shards.append((f"rank{len(shards)}.safetensors", out, nested))
    index = {"tensors": {"model/w": {"shape": [10, 4], "dtype": "float32", "whole": False,
                                     "shards": []}}}
    for name, local, rec in shards:
        tensors = {}
        for suffix, view, _, region in pieces(local, rec):
            tensors[f"model/w{suffix}"] = view.contiguous()
            index["tensors"]["model/w"]["shards"].append(
                {"file": name, "key": f"model/w{suffix}", "offsets": region})
        save_file(tensors, str(tmp_path / name))
    reader = Reader(tmp_path, index)
    # another layout: data 4 over the whole tensor (plain ZeRO, no tensor parallel)
    for r in range(4):
        want, rec = _data_shard(base, full, 4, r)
        got = torch.zeros_like(want)
        for suffix, view, _, region in pieces(got, rec):
            view.copy_(reader.read(f"model/w{suffix}", region))
        assert torch.equal(got, want)
