"""ZeRO stages 1, 2 and 3 on Hugging Face families (llama, qwen2 with q/k/v biases,
mistral), against one process: data=2 and data=4, accumulation over 2 and 4
microbatches, 20 steps with clipping and uneven -100 labels; the first step's gradients
(gathered from ZeRO's shards, parameter by parameter), per-step losses and gradient
norms, an evaluation loss and the gathered final weights at the shared tolerance
(paraxis.testing.tolerance). Then the compositions: ZeRO-3 x tensor 2 (with and without
sequence parallelism: the partial norms stay whole), ZeRO-3 over context replicas,
ZeRO-1 x pipeline 2 x data 2 (a tied embedding stays whole for the pipeline's tied
sum)."""

from __future__ import annotations

import pytest
import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import (
    assert_same_gradients,
    assert_same_weights,
    local_gradients,
    local_shards,
)
from paraxis.testing.tolerance import assert_losses_close
from paraxis_hf import build_debug_model

LR, STEPS, BATCH, SEQ = 1e-3, 20, 16, 16
_references: dict[tuple, tuple] = {}


def train(family, options, overrides):
    model = build_debug_model(family, **overrides)
    vocab = model.config.vocab_size
    engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**options), train={
        "steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ, "grad_clip": 0.5})
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    g = torch.Generator().manual_seed(3)
    history, grads = [], None
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :9] = -100
        share = {"input_ids": ids[part], "labels": labels[part]}
        grads = grads if grads is not None else local_gradients(engine, share)
        m = engine.train_step(share)
        history.append((m["loss"], m["grad_norm"]))
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    eval_loss = engine.eval_step(ids[part])
    shards = local_shards(engine.model)
    engine.close()
    return history, eval_loss, shards, grads


def compare(worlds, family, options, overrides=None):
    overrides = overrides or {}
    key = (family, tuple(sorted(overrides.items())))
    if key not in _references:
        _references[key] = worlds.run(1, train, family, {}, overrides)[0]
    ref_history, ref_eval, ref_shards, ref_grads = _references[key]
    world = ParallelConfig.from_kwargs(**options).world_size
    out = worlds.run(world, train, family, options, overrides)
    assert_same_gradients([g for *_, g in out], ref_grads)
    for history, eval_loss, *_ in out:
        assert_losses_close([h[0] for h in history], [h[0] for h in ref_history])
        assert_losses_close([h[1] for h in history], [h[1] for h in ref_history],
                            "gradient norms")
        assert_losses_close([eval_loss], [ref_eval], "evaluation loss")
    assert_same_weights([s for _, _, s, _ in out], ref_shards, lr=LR, steps=STEPS)


# Every stage with data 2 (2 microbatches) and data 4 (4 microbatches), each family twice
# (a Latin square rather than all 18 products: a stage's arithmetic does not depend on
# the family, and every family's layers still meet two stages and both degrees).
ROTATION = [("llama", 1, 2, 2), ("qwen2", 2, 2, 2), ("mistral", 3, 2, 2),
            ("qwen2", 1, 4, 4), ("mistral", 2, 4, 4), ("llama", 3, 4, 4)]


@pytest.mark.parametrize(("family", "zero", "data", "microbatches"), ROTATION)
def test_zero_on_hf_families_matches_one_process(worlds, family, zero, data, microbatches):
    compare(worlds, family, {"data": data, "zero": zero, "microbatches": microbatches})


@pytest.mark.parametrize(("family", "options", "overrides"), [
    ("llama", {"data": 2, "tensor": 2, "zero": 3}, {"vocab_size": 127}),  # padded vocab
    ("qwen2", {"data": 2, "tensor": 2, "zero": 3, "sequence_parallel": True,
               "microbatches": 2}, {}),
])
def test_zero3_with_tensor_parallel(worlds, family, options, overrides):
    compare(worlds, family, options, overrides)


def test_zero3_over_context_replicas(worlds):
    """data=1: the context ranks are the replicas ZeRO shards over."""
    compare(worlds, "llama", {"context": 2, "zero": 3})


def test_zero1_with_pipeline_and_a_tied_embedding(worlds):
    compare(worlds, "llama", {"data": 2, "pipeline": 2, "zero": 1, "microbatches": 2},
            {"tie_word_embeddings": True})
