"""Host tensors' all-gather (one broadcast per rank) and consuming reduce-scatter (an
in-place all-reduce) against torch's own gloo ops on the same data: the same bits, the
same byte counts, and neither op reaching for the whole-sized temporaries of gloo's."""

import pytest
import torch
import torch.distributed as dist

from paraxis.runtime import collectives
from paraxis.runtime.collectives import all_gather_into, reduce_scatter_into
from paraxis.runtime.grid import Grid

# What core's collectives call for torch's flat all-gather and reduce-scatter.
NATIVE = ("_gather_flat", "_scatter_flat")


def _data(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def check_host(monkeypatch_native):
    grid = Grid.build({"data": dist.get_world_size()})
    group, n, r = grid.group("data"), grid.world_size, grid.rank
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        per = 1000 + 3  # odd: no alignment assumed
        part = _data(per, dtype, 100 + r)
        native = torch.empty(n * per, dtype=dtype)
        dist.all_gather_into_tensor(native, part, group=group.pg)
        flat = _data(n * per, dtype, 200 + r)
        want = torch.empty(per, dtype=dtype)
        dist.reduce_scatter_tensor(want, flat.clone(), group=group.pg)
        kept = flat.clone()
        mine = torch.empty(per, dtype=dtype)
        reduce_scatter_into(mine, kept, group)  # not consumed: torch's op, input intact
        out[f"kept {dtype}"] = torch.equal(kept, flat) and torch.equal(mine, want)

        monkeypatch_native(True)  # from here core calling torch's flat ops raises
        mark = grid.comm.mark()
        got = torch.empty(n * per, dtype=dtype)
        all_gather_into(got, part, group)
        pending = all_gather_into(torch.empty_like(got), part, group, async_op=True)
        later = pending.wait() if pending is not None else None
        scattered = torch.empty(per, dtype=dtype)
        reduce_scatter_into(scattered, flat.clone(), group, consume=True)
        async_out = torch.empty(per, dtype=dtype)
        reduce_scatter_into(async_out, flat.clone(), group, consume=True,
                            async_op=True).wait()
        counted = grid.comm.since(mark)["bytes"]
        monkeypatch_native(False)
        size = n * per * flat.element_size()
        out[f"gather {dtype}"] = torch.equal(got, native) and later is None
        out[f"scatter {dtype}"] = torch.equal(scattered, want) and \
            torch.equal(async_out, want)
        out[f"bytes {dtype}"] = counted == {
            ("data", "all_gather"): 2 * (n - 1) / n * size,
            ("data", "reduce_scatter"): 2 * (n - 1) / n * size}
    # bf16 on the wire from fp32 (the send copy is consumed, the caller's input is not)
    flat = _data(n * 64, torch.float32, 300 + r)
    wire = torch.empty(64, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(wire, flat.to(torch.bfloat16), group=group.pg)
    got = torch.empty(64)
    kept = flat.clone()
    reduce_scatter_into(got, kept, group, wire_dtype=torch.bfloat16)
    out["wire"] = torch.equal(got, wire.float()) and torch.equal(kept, flat)
    grid.destroy()
    return out


def _run():
    real = {name: getattr(collectives, name) for name in NATIVE}

    def forbid(on):
        for name, fn in real.items():
            setattr(collectives, name, _refuse(name) if on else fn)

    try:
        return check_host(forbid)
    finally:
        forbid(False)


def _refuse(name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the host path called torch's {name}")
    return refuse


@pytest.mark.parametrize("n", [2, 3, 4])
def test_host_collectives_match_torchs_gloo_ops_without_their_copies(worlds, n):
    for rank, out in enumerate(worlds.run(n, _run)):
        bad = [k for k, ok in out.items() if not ok]
        assert not bad, (rank, bad)
