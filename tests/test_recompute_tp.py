"""Activation checkpointing on a tensor- and sequence-parallel Llama with attention
dropout: recomputation must replay the per-rank dropout stream, so training with and
without it is identical."""

import pytest
import torch
import torch.distributed as dist

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import local_shards
from paraxis_hf import build_debug_model

STEPS, BATCH, SEQ = 4, 2, 16


def run(mode, dropout, overlap="off"):
    config = ParallelConfig.from_kwargs(tensor=dist.get_world_size(), sequence_parallel=True,
                                        activation_checkpointing=mode, tensor_overlap=overlap)
    engine = paraxis.parallelize(build_debug_model("llama", attention_dropout=dropout),
                                 config=config, train={"steps": STEPS, "lr": 1e-3,
                                                       "warmup_steps": 1, "seq_length": SEQ})
    calls = []
    engine.model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda *a: calls.append(1))
    g = torch.Generator().manual_seed(0)
    losses = [engine.train_step(torch.randint(0, 128, (BATCH, SEQ), generator=g))["loss"]
              for _ in range(STEPS)]
    shards = local_shards(engine.model)
    engine.close()
    return losses, shards, len(calls)


@pytest.mark.parametrize(("mode", "overlap"), [("full", "off"), ("selective", "off"),
                                             ("full", "on")])
def test_recomputation_replays_tensor_parallel_dropout(worlds, mode, overlap):
    # overlap on: the fused entry (paraxis_tp.overlap) runs again in the recomputation
    base = worlds.run(2, run, "none", 0.2, overlap)
    again = worlds.run(2, run, mode, 0.2, overlap)
    for (b_losses, b_shards, b_calls), (a_losses, a_shards, a_calls) in zip(base, again,
                                                                          strict=True):
        assert b_calls == STEPS and a_calls == 2 * STEPS  # attention ran again in backward
        assert a_losses == b_losses
        for name, (tensor, _) in b_shards.items():
            assert torch.equal(a_shards[name][0], tensor), name


def test_dropout_is_really_on(worlds):
    on = worlds.run(2, run, "none", 0.2)[0][0]
    off = worlds.run(2, run, "none", 0.0)[0][0]
    assert on != off
