"""Pipeline parallelism on a Hugging Face Llama, every schedule, against one process:
the first step's gradients parameter by parameter, then 20 steps, per-step losses and
gathered final weights at the shared tolerance (paraxis.testing.tolerance).
Compositions with data and tensor parallelism, up to 8 ranks."""

import pytest
import torch

import paraxis
from paraxis import ParallelConfig
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
STEPS, BATCH, SEQ = 20, 8, 16


def train(layers, degrees, schedule="1f1b", chunks=1, microbatches=4):
    config = ParallelConfig.from_kwargs(**degrees, microbatches=microbatches,
                                        pipeline_schedule=schedule, virtual_stages=chunks)
    engine = paraxis.parallelize(
        build_debug_model("llama", num_hidden_layers=layers, vocab_size=127), config=config,
        train={"steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ})
    losses, grads = train_on_random_tokens(engine, steps=STEPS, batch=BATCH, seq=SEQ,
                                           vocab=127, gradients=True)
    index, count = engine.grid.sample_shard()
    ids = torch.randint(0, 127, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, :9] = -100
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    eval_loss = engine.eval_step({"input_ids": ids[part], "labels": labels[part]})
    shards = local_shards(engine.model)
    engine.close()
    return losses, eval_loss, shards, grads


def compare(worlds, layers, degrees, schedule="1f1b", chunks=1):
    ref_losses, ref_eval, ref_shards, ref_grads = worlds.run(1, train, layers, {})[0]
    world = ParallelConfig.from_kwargs(**degrees).world_size
    out = worlds.run(world, train, layers, degrees, schedule, chunks)
    assert_same_gradients([g for *_, g in out], ref_grads)
    for losses, eval_loss, _, _ in out:
        assert_losses_close(losses, ref_losses)
        assert_losses_close([eval_loss], [ref_eval], "evaluation loss")
    # Every layer on exactly one stage.
    assert_same_weights([s for _, _, s, _ in out], ref_shards, lr=LR, steps=STEPS)


@pytest.mark.parametrize("pipeline", [2, 4])
@pytest.mark.parametrize(("schedule", "chunks"), [
    ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble_h1", 1)])
def test_pipeline_schedules_match_one_process(worlds, pipeline, schedule, chunks):
    compare(worlds, 8, {"pipeline": pipeline}, schedule=schedule, chunks=chunks)


@pytest.mark.parametrize("degrees", [
    {"pipeline": 2, "data": 2},
    {"pipeline": 2, "tensor": 2},
    {"pipeline": 2, "tensor": 2, "sequence_parallel": True},
    {"pipeline": 2, "tensor": 2, "sequence_parallel": True, "tensor_overlap": "on"},
    {"pipeline": 2, "tensor": 2, "data": 2},
], ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
def test_pipeline_composes(worlds, degrees):
    compare(worlds, 4, degrees)


def test_interleaved_chunks_with_tensor_and_sequence_parallel(worlds):
    # Each chunk is a stage of the model with the model's own module names, so the
    # tensor plan applies to each chunk (this combination used to be refused).
    compare(worlds, 4, {"pipeline": 2, "tensor": 2, "sequence_parallel": True},
            schedule="interleaved_1f1b", chunks=2)


def train_and_save(ckpt):
    config = ParallelConfig.from_kwargs(pipeline=2, microbatches=2)
    engine = paraxis.parallelize(build_debug_model("llama", num_hidden_layers=4),
                                 config=config, train={"steps": 3, "warmup_steps": 1,
                                                       "seq_length": SEQ})
    for _ in range(3):
        engine.train_step(torch.randint(0, 128, (4, SEQ)))
    engine.save(ckpt)
    shards = local_shards(engine.model)
    stage = engine.ctx.pipeline.stages
    engine.close()
    return shards, stage


def test_pipeline_checkpoint_holds_every_stage_and_loads_whole(worlds, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = worlds.run(2, train_and_save, ckpt)
    assert [stages for _, stages in out] == [(0,), (1,)]
    saved = assemble([s for s, _ in out])
    loaded = assemble(worlds.run(1, load_on_one_rank, ckpt,
                                 {"seed": 5, "num_hidden_layers": 4}))
    assert saved.keys() == loaded.keys()
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name
