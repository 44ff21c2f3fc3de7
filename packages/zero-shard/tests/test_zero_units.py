"""What ZeRO does between and within steps, on two real ranks: stage 3's units hold
their shards between uses, prefetch as many units as ``zero_prefetch`` says both ways
and reduce every unit from backward hooks; stage 2 reduce-scatters every bucket from
hooks; each rank's optimizer holds only its shards."""

import pytest
import torch
from zero_tiny import CFG, TRAIN, build, train_steps

import paraxis
from paraxis.parallel.placement import placement_of


def stage3_run(prefetch=1):
    engine = paraxis.parallelize(build(), data=2, zero=3, zero_prefetch=prefetch,
                                 train=TRAIN)
    sync = engine.ctx.extras["zero"]
    names = [u.name for u in sync.units]
    seen = {}
    layer0, layer1 = engine.model.layers
    unit = {u.name: u for u in sync.units}

    def during_forward(module, args):
        seen["forward, while layer0 runs"] = (unit["layer1"].state, unit["head"].state)

    def after_forward(module, args, out):
        def in_backward(_):
            seen["backward, while layer1 runs"] = (unit["layer0"].state,
                                                   unit["embedding"].state)
        torch.autograd.graph.register_multi_grad_hook([out], in_backward, mode="any")

    layer0.register_forward_pre_hook(during_forward)
    layer1.register_forward_hook(after_forward)
    launched = []
    finish = sync.finish
    sync.finish = lambda: (launched.append(sync._next), finish())[1]
    mark = engine.grid.comm.mark()
    train_steps(engine, 0, 2)
    moved = {op: n for (axes, op), n in engine.grid.comm.since(mark)["bytes"].items()
             if axes == "dataxexpertxcontext"}
    shapes = [(tuple(p.shape), placement_of(p).local_shape) for u in sync.units
              for p in u.params]
    freed = [full.untyped_storage().nbytes() for u in sync.units for f in u.flats
             for full in f.fulls.values()]
    owned = sum(p.numel() for p in engine.optimizer.owned)
    total = sum(torch.Size(placement_of(p).global_shape).numel()
                for p in engine.model.parameters())
    engine.close()
    return names, seen, launched, moved, shapes, freed, owned, total


AHEAD = {0: ("sharded", "sharded"), 1: ("gathering", "sharded"),
         2: ("gathering", "gathering")}  # the next unit, the one after it


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stage3_units_shards_prefetch_and_hooks(worlds, prefetch):
    names, seen, launched, moved, shapes, freed, owned, total = worlds.run(
        2, stage3_run, prefetch)[0]
    assert names == ["embedding", "layer0", "layer1", "head"]
    assert seen == {"forward, while layer0 runs": AHEAD[prefetch],
                    "backward, while layer1 runs": AHEAD[prefetch]}
    assert launched == [4, 4]  # every unit's reduce-scatter started from a hook
    # each unit gathered for forward and again for backward, reduced once
    assert moved["all_gather"] == 2 * moved["reduce_scatter"] > 0
    assert all(shape == local for shape, local in shapes)  # shards between steps
    assert all(n == 0 for n in freed)  # no full buffer stays allocated
    assert owned < 0.55 * total  # this rank's optimizer holds half (plus the norms)


def stage2_run():
    engine = paraxis.parallelize(build(), data=2, zero=2, bucket_mb=0.01, microbatches=2,
                                 train=TRAIN)
    sync = engine.ctx.extras["zero"]
    launched = []
    finish = sync.finish
    sync.finish = lambda: (launched.append(sync._next), finish())[1]
    train_steps(engine, 0, 2)
    grads = [p.grad is None for p in engine.model.parameters() if p.ndim > 1]
    n = len(sync.buckets)
    engine.close()
    return launched, n, grads


def test_stage2_reduces_every_bucket_from_hooks_and_frees_whole_gradients(worlds):
    launched, n, grads = worlds.run(2, stage2_run)[0]
    assert n > 3 and launched == [n, n]
    assert all(grads)  # the model's whole gradients were freed in the hooks
    assert CFG.hidden_size == 32


def stage3_sends(prefetch):
    """Per backward unit, the units holding send buffers once its reduce-scatter is
    launched; per rank-major copy, the gradients of its group not yet copied."""
    from paraxis_zero.layout import ShardLayout

    engine = paraxis.parallelize(build(), data=2, zero=3, zero_prefetch=prefetch,
                                 train=TRAIN)
    sync = engine.ctx.extras["zero"]
    alive, waiting = [], []
    ready, copy = sync._launch_ready, ShardLayout.to_rank_major

    def launched():
        ready()
        alive.append(sum(any(f.send is not None for f in u.flats) for u in sync.units))

    def copying(layout, buffer, i, src):
        waiting.append(sum(p.grad is not None for p in layout.params))
        copy(layout, buffer, i, src)

    sync._launch_ready, ShardLayout.to_rank_major = launched, copying
    try:
        train_steps(engine, 0, 1)
    finally:
        ShardLayout.to_rank_major = copy
    engine.close()
    return alive, waiting


@pytest.mark.parametrize("prefetch", [0, 1])
def test_stage3_bounds_send_buffers_and_frees_each_gradient_once_copied(worlds, prefetch):
    alive, waiting = worlds.run(2, stage3_sends, prefetch)[0]
    # reduce-scatters in flight: the newest and ``prefetch`` before it
    assert max(alive) == prefetch + 1 and alive[:prefetch + 1] == list(range(1, prefetch + 2))
    # a layer's gradients (4 matrices) leave one by one as they are copied rank-major
    assert waiting.count(4) == 2 and waiting[waiting.index(4):][:4] == [4, 3, 2, 1], waiting
