"""A checkpoint carries DeepSeek-V3's ``e_score_correction_bias`` (a buffer the
auxiliary-loss-free update moves after every step, arXiv:2412.19437 section 2.1.2).

A tiny DeepSeek-V3 (2 layers, 4 experts in 2 groups, sigmoid router) with
``moe.bias_update_rate`` trains STEPS steps in one process; the same run saved after SAVE
steps (on one process, on expert=2, or on pipeline=2 where each stage writes its own
layer's bias) and resumed in a fresh engine on one process for the rest must have,
after every step, bit-identical biases, and the same per-step losses at the shared
tolerance. A resume that skips the buffers (the bug this guards against: the biases
restart from zero) is run too, and must differ: the comparison sees the bug."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

# The tiny MoE builders of paraxis-moe-ep's own tests (one definition); these tests need
# the data, pipeline and context axes too, so they run with every package installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "moe-ep" / "tests"))
from moe_tiny_models import build, plan_of

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.tolerance import assert_losses_close
from paraxis_moe.balance import BIAS_NAME

STEPS, SAVE, BATCH, SEQ, LR, RATE = 6, 3, 8, 16, 1e-3, 0.01
LAYERS = ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
# Saved on ..., resumed on one process; two microbatches everywhere, for the pipeline.
SAVED_ON = {"one": {}, "expert2": {"expert": 2}, "pipeline2": {"pipeline": 2}}


def run(degrees, stop, save=None, load=None, skip_buffers=False):
    """Train until step ``stop`` (batch i at engine.step i) after loading ``load``, then
    save to ``save``; returns per-step losses and biases (NaN for another stage's)."""
    import paraxis.checkpoint.read as read

    kept = read.load_buffers
    if skip_buffers:  # the planted bug: a resume that reads no buffer
        read.load_buffers = lambda reader, model: None
    try:
        return _run(degrees, stop, save, load)
    finally:
        read.load_buffers = kept  # the pool's processes run the next test


def _run(degrees, stop, save, load):
    model = build("deepseek_v3", layers=2, num_key_value_heads=4, seed=7 if load else 0)
    g = torch.Generator().manual_seed(3)
    batches = torch.randint(0, 64, (STEPS, BATCH, SEQ), generator=g)
    config = ParallelConfig.from_kwargs(**degrees, microbatches=2,
                                        moe={"bias_update_rate": RATE, "aux_loss_coef": 1e-2})
    plan = None if "pipeline" in degrees else plan_of(model)  # paraxis-hf's, with stages
    engine = paraxis.parallelize(model, config=config, plan=plan,
                                 train={"steps": STEPS, "lr": LR, "seq_length": SEQ})
    if load:
        engine.load(load)
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    losses, biases = [], []
    while engine.step < stop:
        losses.append(engine.train_step(batches[engine.step, part])["loss"])
        biases.append(torch.stack([_bias(engine.model, name) for name in LAYERS]).clone())
    if save:
        engine.save(save)
    engine.close()
    return losses, torch.stack(biases)


def _bias(model, name):
    try:
        return model.get_submodule(name).get_buffer(BIAS_NAME)
    except AttributeError:
        return torch.full((4,), float("nan"))


@pytest.mark.parametrize("saved_on", list(SAVED_ON))
def test_resume_continues_the_correction_bias(worlds, tmp_path, saved_on):
    ref_losses, ref_biases = worlds.run(1, run, {}, STEPS)[0]
    assert ref_biases[SAVE:].abs().amax((1, 2)).min() > 0  # the biases move
    degrees = SAVED_ON[saved_on]
    ckpt = str(tmp_path / "ckpt")
    size = ParallelConfig.from_kwargs(**degrees).world_size
    saved = worlds.run(size, run, degrees, SAVE, ckpt)
    for losses, _ in saved:
        assert_losses_close(losses, ref_losses[:SAVE], f"{saved_on}: before the save")
    losses, biases = worlds.run(1, run, {}, STEPS, None, ckpt)[0]
    assert torch.equal(biases, ref_biases[SAVE:]), f"{saved_on}: biases after the resume"
    assert_losses_close(losses, ref_losses[SAVE:], f"{saved_on}: losses after the resume")
    if saved_on == "one":  # the planted bug is seen
        _, restarted = worlds.run(1, run, {}, STEPS, None, ckpt, True)[0]
        assert not torch.equal(restarted, ref_biases[SAVE:])
        assert restarted[0].abs().max() <= RATE * 1.001  # one step from zero
