"""Frozen parameters under ZeRO (DESIGN section 10, "Trainable vs frozen"; issue 34's
requirement of this package: a LoRA model's base weights are most of its bytes).

Core's tiny model with its embedding and first layer frozen (``requires_grad`` False),
data 2, two microbatches, 20 steps against the same frozen model in one process (losses,
gradient norms, an evaluation loss, the final weights: test_zero_parity's check; the
frozen ones must not move). Per rank, after a step:

* ZeRO-3 shards the frozen weights like the others (4 bytes an element / N) and gives
  them no gradient, no optimizer state and no place in a reduce-scatter; ZeRO-2 keeps
  them whole (4 bytes) and the same. The model state equals that count (vectors ZeRO
  keeps whole counted whole) within 0.1%, the reduce-scatter moves the trainable
  sharded parameters' bytes alone, the optimizer owns no frozen parameter, and the
  frozen weights end where they started.
"""

import math

import pytest
import torch
from test_zero_parity import check
from zero_tiny import STEPS, TRAIN, batches, build

import paraxis
from paraxis import ParallelConfig
from paraxis.parallel.placement import placement_of
from paraxis.testing.parity import assemble, local_shards

BATCH = 16


def frozen_model():
    model = build()
    for p in [*model.embed.parameters(), *model.layers[0].parameters()]:
        p.requires_grad_(False)
    return model


def run(options):
    engine = paraxis.parallelize(frozen_model(), config=ParallelConfig.from_kwargs(**options),
                                 train=TRAIN)
    ids, labels = batches()
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    history = []
    for step in range(STEPS):
        mark = engine.grid.comm.mark()
        m = engine.train_step({"input_ids": ids[step, part], "labels": labels[step, part]})
        history.append((m["loss"], m["grad_norm"]))
    scattered = sum(n for (_, op), n in engine.grid.comm.since(mark)["bytes"].items()
                    if op == "reduce_scatter")
    eval_loss = engine.eval_step({"input_ids": ids[0, part], "labels": labels[0, part]})
    state, rs = _expected(engine, options.get("zero", 0))
    owned = {placement_of(p).name for g in engine.optimizer.param_groups for p in g["params"]}
    frozen = {placement_of(p).name for p in engine.model.parameters() if not p.requires_grad}
    shards = local_shards(engine.model)
    engine.close()
    return history, eval_loss, shards, (m["model_state_bytes"], state), (scattered, rs), \
        owned, frozen


def _expected(engine, zero):
    """(model-state bytes, reduce-scatter bytes) a rank should see: 4 a weight element
    (over N where ZeRO-3 shards it), and for a trainable one 4 of gradient and 8 of Adam
    moments (over N where sharded); only trainable sharded ones reduce-scattered, ring
    bytes (N-1)/N of their fp32 size."""
    n, state, scattered = engine.grid.size("data"), 0.0, 0.0
    for p in engine.model.parameters():
        rec = placement_of(p)
        numel = math.prod(rec.global_shape)
        sharded = "data" in rec.sharded_axes or any(
            "data" in placement_of(s).sharded_axes for g in engine.optimizer.param_groups
            for s in g["params"] if placement_of(s).name == rec.name)
        share = numel / n if sharded else numel
        state += 4 * (share if zero == 3 else numel)
        if p.requires_grad:
            state += 4 * (share if zero >= 2 else numel) + 8 * share
            scattered += 4 * numel * (n - 1) / n if sharded else 0.0
    return state, scattered


@pytest.mark.parametrize("zero", [2, 3])
def test_frozen_parameters_are_placed_sharded_and_never_reduced(worlds, zero):
    ref = worlds.run(1, run, {})[0]
    out = worlds.run(2, run, {"data": 2, "zero": zero, "microbatches": 2})
    check([o[:3] for o in out], ref[:3])
    initial = {name: p.detach() for name, p in frozen_model().named_parameters()
               if not p.requires_grad}
    final = assemble([o[2] for o in out])
    assert all(torch.equal(final[name], w) for name, w in initial.items())  # not stepped
    for *_, (state, want), (scattered, rs), owned, frozen in out:
        print(f"zero {zero}: model state {state / want:.4f} of the count, reduce-scatter "
              f"{scattered / rs:.4f}")
        assert abs(state / want - 1) <= 1e-3, (state, want)
        assert abs(scattered / rs - 1) <= 1e-3, (scattered, rs)
        assert frozen and not frozen & owned
