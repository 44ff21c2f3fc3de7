"""Hugging Face models through paraxis.parallelize: data=2 against a world of one, per
family, with uneven -100 labels and 2 microbatches: losses and parameters at the shared
tolerance (paraxis.testing.tolerance; this test is where 1e-6 absolute on weights
failed on a fresh machine: Adam turns reduction-order noise into a fraction of lr)."""

import pytest
import torch
import torch.distributed as dist

import paraxis
from paraxis.testing.parity import train_on_random_tokens
from paraxis.testing.tolerance import assert_losses_close, assert_weights_close
from paraxis_hf import build_debug_model

STEPS, BATCH, SEQ, LR = 4, 4, 16, 1e-3


def run_family(family, microbatches):
    engine = paraxis.parallelize(build_debug_model(family), data=dist.get_world_size(),
                                 microbatches=microbatches,
                                 train={"steps": STEPS, "lr": LR, "warmup_steps": 1,
                                        "seq_length": SEQ})
    assert engine.plan.model_class == type(engine.model).__name__
    losses = train_on_random_tokens(engine, steps=STEPS, batch=BATCH, seq=SEQ, vocab=128)
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.close()
    return losses, params


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_hf_family_data_parallel_matches_one_process(worlds, family):
    (ref_losses, ref_params), = worlds.run(1, run_family, family, 1)
    for losses, params in worlds.run(2, run_family, family, 2):
        assert_losses_close(losses, ref_losses)
        for name, p in params.items():
            assert_weights_close(p, ref_params[name], lr=LR, steps=STEPS, what=name)
    initial = dict(build_debug_model(family).named_parameters())
    assert any(not torch.equal(p, initial[n]) for n, p in ref_params.items())  # it trained
