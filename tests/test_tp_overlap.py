"""Tensor-parallel overlap (``parallelism.tensor_overlap``: sequence parallel's
all-gathers and reduce-scatters cut into ring steps interleaved with the GEMMs) against
one process and against the same layout without it: the first step's gradients
parameter by parameter, per-step losses, final weights (paraxis.testing.tolerance), on
Llama tensor 2 + SP and data 2 x tensor 2 + SP; the ring ops must have carried the
traffic (no plain all-gather or reduce-scatter left on the tensor axis in the blocks)."""

import pytest

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import (
    assert_same_gradients,
    assert_same_weights,
    local_shards,
    train_on_random_tokens,
)
from paraxis.testing.tolerance import assert_losses_close
from paraxis_hf import build_debug_model
from paraxis_tp.rules import check_tensor

LR = 1e-3
STEPS, BATCH, SEQ = 8, 4, 16


def train(degrees, overrides):
    engine = paraxis.parallelize(
        build_debug_model("llama", **overrides), config=ParallelConfig.from_kwargs(**degrees),
        train={"steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ})
    losses, grads = train_on_random_tokens(engine, steps=STEPS, batch=BATCH, seq=SEQ,
                                           vocab=engine.model.config.vocab_size,
                                           gradients=True)
    ops = {op: n for (axes, op), n in engine.grid.comm.since()["bytes"].items()
           if axes == "tensor"}
    shards = local_shards(engine.model)
    engine.close()
    return losses, shards, grads, ops


def compare(worlds, degrees, overrides):
    ref_losses, ref_shards, ref_grads, _ = worlds.run(1, train, {}, overrides)[0]
    world = ParallelConfig.from_kwargs(**degrees).world_size
    out = worlds.run(world, train, degrees, overrides)
    assert_same_gradients([g for _, _, g, _ in out], ref_grads)
    for losses, *_ in out:
        assert_losses_close(losses, ref_losses)
    assert_same_weights([s for _, s, _, _ in out], ref_shards, lr=LR, steps=STEPS)
    return out


@pytest.mark.parametrize("degrees", [
    {"tensor": 2},
    {"data": 2, "tensor": 2},
], ids=["tensor2", "data2xtensor2"])
def test_overlap_matches_one_process(worlds, degrees):
    degrees = {**degrees, "sequence_parallel": True, "tensor_overlap": "on"}
    out = compare(worlds, degrees, {"vocab_size": 127})
    for *_, ops in out:
        # every q/k/v, gate/up entry and o/down exit (and the lm head's entry) went round
        # the ring; what is left plain is the embedding's all-reduce, the first split's
        # backward gather, the vocab-parallel loss and the partial-gradient sums
        assert ops.get("all_gather_ring", 0) > 0 and ops.get("reduce_scatter_ring", 0) > 0
        assert "reduce_scatter" not in ops, ops


@pytest.mark.parametrize(("options", "reason"), [
    ({"tensor": 2}, "without sequence_parallel"),
    ({"tensor": 2, "pipeline": 2, "sequence_parallel": True,
      "pipeline_schedule": "zero_bubble_h1", "microbatches": 2}, "zero_bubble_h1"),
    ({"tensor": 2, "pipeline": 2, "sequence_parallel": True, "pipeline_schedule": "zbv",
      "virtual_stages": 2, "microbatches": 2}, "zbv splits the backward"),
])
def test_overlap_on_is_refused_where_it_cannot_apply(options, reason):
    problems = check_tensor(ParallelConfig.from_kwargs(**options, tensor_overlap="on"), None)
    assert [p.field for p in problems] == ["parallelism.tensor_overlap"]
    assert reason in str(problems[0])
    assert not check_tensor(ParallelConfig.from_kwargs(**options), None)  # auto
