"""ZeRO-3 gathers the embedding and the head straight into their full buffers and
reduce-scatters their gradients from where autograd left them (issue 36, item 5): a
group holding one parameter split along dim 0 is its own rank-major buffer, so neither
direction allocates a second whole copy of the largest tensors a rank holds.

On data 2 (core's tiny model, untied and tied): the same steps with that path turned
off give bit-identical losses, gradient norms and shards, and only with it off are
whole-sized rank-major buffers allocated for those groups."""

import pytest
import torch
from zero_tiny import TRAIN, build, train_steps

import paraxis
from paraxis.testing.parity import local_shards
from paraxis_zero import sharded_unit


def steps(direct: bool, tie: bool):
    allocated: list[int] = []
    inner = sharded_unit._empty

    def recording(numel, like, dtype=None):
        allocated.append(numel)
        return inner(numel, like, dtype)

    sharded_unit._empty = recording
    own = sharded_unit._Flat.direct
    if not direct:
        sharded_unit._Flat.direct = property(lambda self: False)
    try:
        engine = paraxis.parallelize(build(tie), data=2, zero=3, train=TRAIN)
        sync = engine.ctx.extras["zero"]
        singles = {f.layout.group.size * f.layout.per_rank for u in sync.units
                   for f in u.flats if len(f.layout.params) == 1 and f.layout.prefix[0] == 1}
        history = train_steps(engine, 0, 3)
        shards = local_shards(engine.model)
        engine.close()
    finally:
        sharded_unit._empty = inner
        sharded_unit._Flat.direct = own
    return history, shards, sum(n in singles for n in allocated), len(singles)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_single_parameter_groups_gather_and_reduce_in_place(worlds, tie):
    direct = worlds.run(2, steps, True, tie)
    copied = worlds.run(2, steps, False, tie)
    for (h1, s1, whole1, singles), (h0, s0, whole0, _) in zip(direct, copied, strict=True):
        assert singles >= 1  # the embedding and head (or their tied weight)
        assert h1 == h0  # bit for bit: the path only skips copies
        assert s1.keys() == s0.keys()
        assert all(torch.equal(s1[k][0], s0[k][0]) for k in s1)
        print(f"whole-sized buffers allocated in 3 steps: {whole1} in place, {whole0} copied")
        assert whole1 == 0 < whole0
