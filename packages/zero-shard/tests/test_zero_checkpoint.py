"""ZeRO checkpoints store shards with their offsets in the shared index format, so they
load into another data degree, another stage, or one process, and back.

A ZeRO-3 run on data=2 saves after 3 of 6 steps; the checkpoint resumes under ZeRO-1 on
data=4 and in a single process, and both finish with the same losses and weights as the
uninterrupted run (other grids sum in another order: the shared tolerance). The ZeRO-1
run's own checkpoint then loads into ZeRO-3 on data=2 exactly."""

import torch
from zero_tiny import LR, TRAIN, build, train_steps

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import assemble, local_shards
from paraxis.testing.tolerance import assert_losses_close, assert_weights_close

STEPS, SAVE = 6, 3


def engine_for(options):
    return paraxis.parallelize(build(), config=ParallelConfig.from_kwargs(**options),
                               train={**TRAIN, "steps": STEPS})


def straight():
    engine = engine_for({"data": 2, "zero": 3})
    history = train_steps(engine, 0, STEPS)
    shards = local_shards(engine.model)
    engine.close()
    return history, shards


def save_at(ckpt):
    engine = engine_for({"data": 2, "zero": 3})
    train_steps(engine, 0, SAVE)
    engine.save(ckpt)
    engine.close()


def resume(ckpt, options, save_to=None):
    engine = engine_for(options)
    engine.load(ckpt)
    assert engine.step == SAVE
    history = train_steps(engine, SAVE, STEPS)
    if save_to:
        engine.save(save_to)
    shards = local_shards(engine.model)
    engine.close()
    return history, shards


def load_only(ckpt, options):
    engine = engine_for(options)
    engine.load(ckpt)
    shards = local_shards(engine.model)
    engine.close()
    return shards


def test_zero_checkpoint_resumes_on_other_degrees_stages_and_one_process(worlds, tmp_path):
    ckpt, again = str(tmp_path / "zero3"), str(tmp_path / "zero1")
    ref = worlds.run(2, straight)
    ref_losses = [h[0] for h in ref[0][0][SAVE:]]
    ref_weights = assemble([s for _, s in ref])
    worlds.run(2, save_at, ckpt)
    for world, options, save_to in [(4, {"data": 4, "zero": 1}, again), (1, {}, None)]:
        out = worlds.run(world, resume, ckpt, options, save_to)
        for history, _ in out:
            assert_losses_close([h[0] for h in history], ref_losses)
        weights = assemble([s for _, s in out])
        for name, w in ref_weights.items():
            assert_weights_close(weights[name], w, lr=LR, steps=STEPS, what=name)
        if save_to:
            saved = weights
    loaded = assemble(worlds.run(2, load_only, again, {"data": 2, "zero": 3}))
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[name], w) for name, w in saved.items())  # a copy
