"""The DeepSpeed bridge composes with paraxis tensor parallelism (sequence parallelism is
refused, see paraxis_deepspeed.rules): tensor=2 x data=2, ZeRO-2 with the optimizer on
the CPU, against paraxis's own run of the same layout without offload (plain data
parallel: ZeRO-2 changes where state lives, not the arithmetic) and against the one-
process run, on the same model and batches.

DeepSpeed learns the grid through its mpu interface (data-parallel group = paraxis's
dense replica group, model-parallel group = the tensor group); tensor-sharded
parameters carry ``tensor_model_parallel`` so its gradient norm counts each element
once; gradients a placement marks partial (``replicated_with_grad_allreduce``) are
summed in a gradient hook before DeepSpeed reduces them. Shared tolerance."""

import pytest
import torch

import paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing.parity import assemble
from paraxis.testing.tolerance import assert_losses_close, assert_weights_close

pytest.importorskip("paraxis_deepspeed")
pytest.importorskip("paraxis_tp")

CFG = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, GLOBAL_BATCH = 10, 8
TRAIN = {"steps": STEPS, "lr": 1e-2, "warmup_steps": 2, "grad_clip": 0.5,
         "seq_length": CFG.seq_length}


def run(layout):
    from paraxis_deepspeed.bridge import full_weights

    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), train=TRAIN, **layout)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, CFG.seq_length), generator=g)
    index, count = engine.grid.sample_shard()
    part = slice(index * GLOBAL_BATCH // count, (index + 1) * GLOBAL_BATCH // count)
    metrics = [engine.train_step(ids[s, part]) for s in range(STEPS)]
    weights = full_weights(engine.model, engine.optimizer)
    shards = {p.name: (weights[p.name], p) for p in
              (paraxis.placement_of(q) for q in engine.model.parameters())}
    keep = engine.grid.coords["data"] == 0
    engine.close()
    return metrics, shards if keep else None


def test_offload_with_tensor_parallel_matches_paraxis(worlds):
    plain = {"tensor": 2, "data": 2, "microbatches": 2}
    references = [worlds.run(4, run, plain), [worlds.run(1, run, {})[0]]]
    out = worlds.run(4, run, {**plain, "zero": 2, "offload": {"optimizer": "cpu"}})
    for reference in references:
        ref_metrics = reference[0][0]
        for metrics, _ in out:
            assert_losses_close([m["loss"] for m in metrics],
                                [m["loss"] for m in ref_metrics])
            assert_losses_close([m["grad_norm"] for m in metrics],
                                [m["grad_norm"] for m in ref_metrics], "gradient norms")
        full = assemble([s for _, s in out if s is not None])
        ref = assemble([s for _, s in reference if s is not None])
        for name, w in ref.items():
            assert_weights_close(full[name], w, lr=TRAIN["lr"], steps=STEPS, what=name)
