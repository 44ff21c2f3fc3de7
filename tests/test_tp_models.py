"""Tensor (and sequence) parallelism on Hugging Face models from their own plans, against
one process: the first step's gradients parameter by parameter, then 20 steps, per-step
losses and gathered final weights at the shared tolerance (paraxis.testing.tolerance).
Plus data x tensor on 4 ranks, GPT-2's clear refusal, and a tensor=2 checkpoint that
loads on one rank."""

import pytest
import torch
import torch.distributed as dist

import paraxis
from paraxis import ParallelConfig, PlanError
from paraxis.testing.parity import (
    assemble,
    assert_same_gradients,
    assert_same_weights,
    local_shards,
    train_on_random_tokens,
)
from paraxis.testing.tolerance import assert_losses_close
from paraxis_hf import build_debug_model
from paraxis_hf.debug import load_on_one_rank

LR = 1e-3
STEPS, BATCH, SEQ = 20, 4, 16


def train(family, degrees, overrides, ckpt=None):
    config = ParallelConfig.from_kwargs(**degrees)
    engine = paraxis.parallelize(
        build_debug_model(family, **overrides), config=config,
        train={"steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ})
    losses, grads = train_on_random_tokens(engine, steps=STEPS, batch=BATCH, seq=SEQ,
                                           vocab=engine.model.config.vocab_size,
                                           gradients=True)
    if ckpt:
        engine.save(ckpt)
    shards = local_shards(engine.model)
    sent = engine.grid.comm.bytes_by_axis().get("tensor", 0.0)
    engine.close()
    return losses, shards, sent, grads


def compare(worlds, family, degrees, overrides=None):
    overrides = overrides or {}
    ref_losses, ref_shards, _, ref_grads = worlds.run(1, train, family, {}, overrides)[0]
    world = ParallelConfig.from_kwargs(**degrees).world_size
    out = worlds.run(world, train, family, degrees, overrides)
    assert_same_gradients([g for *_, g in out], ref_grads)
    for losses, *_ in out:
        assert_losses_close(losses, ref_losses)
    assert_same_weights([s for _, s, _, _ in out], ref_shards, lr=LR, steps=STEPS)
    return out


@pytest.mark.parametrize(("family", "degrees", "overrides"), [
    ("llama", {"tensor": 2}, {"vocab_size": 127}),  # padded vocabulary
    ("llama", {"tensor": 2, "sequence_parallel": True}, {}),
    ("qwen2", {"tensor": 2}, {}),  # q/k/v biases
    ("mistral", {"tensor": 2, "sequence_parallel": True}, {"vocab_size": 127}),
    ("phi3", {"tensor": 2}, {}),  # fused qkv / gate_up: colwise_gather_output
])
def test_tensor_parallel_matches_one_process(worlds, family, degrees, overrides):
    out = compare(worlds, family, degrees, overrides)
    assert all(sent > 0 for _, _, sent, _ in out)


def test_data_by_tensor_on_four_ranks(worlds):
    compare(worlds, "llama", {"data": 2, "tensor": 2}, {"vocab_size": 127})


def wrap_gpt2():
    try:
        paraxis.parallelize(build_debug_model("gpt2"), tensor=dist.get_world_size())
    except PlanError as exc:
        return str(exc)
    return None


def test_gpt2_is_refused_with_a_clear_error(worlds):
    for message in worlds.run(2, wrap_gpt2):
        assert message and "GPT2LMHeadModel has no tensor-parallel plan" in message


def test_tensor_parallel_checkpoint_restores_on_one_rank(worlds, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = worlds.run(2, train, "llama", {"tensor": 2}, {"vocab_size": 127}, ckpt)
    saved = assemble([s for _, s, _, _ in out])
    loaded = assemble(worlds.run(1, load_on_one_rank, ckpt, {"seed": 9, "vocab_size": 127}))
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name  # padding neither saved nor loaded
