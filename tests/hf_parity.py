"""One parity run for the cross-package tests: a debug-sized Hugging Face family trained
on random tokens under some degrees, against the same model in one process.

Per-step losses and gradient norms, an evaluation loss and the gathered final weights
must agree at the shared tolerance (paraxis.testing.tolerance). Functions here run on
the ranks of the ``worlds`` fixture (spawned workers import this module by name).
"""

from __future__ import annotations

import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import assert_same_weights, local_shards
from paraxis.testing.tolerance import assert_losses_close
from paraxis_hf import build_debug_model

LR, BATCH, SEQ = 1e-3, 8, 16
# One-process references already run in this test process, by their arguments: runs
# that differ only in degrees share one (the global batches are the same).
_REFERENCES: dict[tuple, tuple] = {}


def train(family, degrees, overrides, steps, options, seq=SEQ, batch=BATCH):
    """Train ``steps`` steps; returns per-step (loss, grad_norm), an eval loss and shards."""
    config = ParallelConfig.from_kwargs(**degrees, **options)
    model = build_debug_model(family, **overrides)
    vocab = model.config.vocab_size
    engine = paraxis.parallelize(model, config=config, train={
        "steps": steps, "lr": LR, "warmup_steps": 2, "seq_length": seq})
    index, count = engine.grid.sample_shard()
    part = slice(index * batch // count, (index + 1) * batch // count)
    g = torch.Generator().manual_seed(3)
    history = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[0, :9] = -100  # uneven token counts over the data ranks
        m = engine.train_step({"input_ids": ids[part], "labels": labels[part]})
        history.append((m["loss"], m["grad_norm"]))
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(4))
    eval_loss = engine.eval_step(ids[part])
    shards = local_shards(engine.model)
    engine.close()
    return history, eval_loss, shards


def compare(worlds, family, degrees, *, overrides=None, steps=8, seq=SEQ, batch=BATCH,
            **options):
    """Run ``degrees`` and one process on ``family`` (``batch`` sequences of ``seq``
    tokens per step); assert parity; return the runs."""
    overrides = overrides or {}
    single = {k: v for k, v in options.items() if k == "activation_checkpointing"}
    key = (family, repr(sorted(overrides.items())), steps, repr(sorted(single.items())),
           seq, batch)
    if key not in _REFERENCES:
        _REFERENCES[key] = worlds.run(1, train, family, {}, overrides, steps, single, seq,
                                      batch)[0]
    ref_history, ref_eval, ref_shards = _REFERENCES[key]
    world = ParallelConfig.from_kwargs(**degrees).world_size
    out = worlds.run(world, train, family, degrees, overrides, steps, options, seq, batch)
    for history, eval_loss, _ in out:
        assert_losses_close([h[0] for h in history], [h[0] for h in ref_history])
        assert_losses_close([h[1] for h in history], [h[1] for h in ref_history],
                            "gradient norms")
        assert_losses_close([eval_loss], [ref_eval], "evaluation loss")
    assert_same_weights([s for _, _, s in out], ref_shards, lr=LR, steps=steps)
    return out
