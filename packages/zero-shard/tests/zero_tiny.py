"""Shared by this package's tests: core's tiny model trained through the engine on
random tokens, run on the ranks of the ``worlds`` fixture (spawned workers import this
module by name)."""

from __future__ import annotations

import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing.parity import local_shards

CFG = TinyConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, BATCH, LR = 20, 16, 3e-3
TRAIN = {"steps": STEPS, "lr": LR, "warmup_steps": 3, "grad_clip": 0.5,
         "seq_length": CFG.seq_length}


def build(tie: bool = False, cfg: TinyConfig = CFG) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    if tie:  # a word embedding tied to the head: one parameter, two units
        model.head.weight = model.embed.tokens.weight
    return model


def batches(steps: int = STEPS, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of every step; the first 9 labels of each step's sample 0
    are ignored, so the ranks hold uneven token counts."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab_size, (steps, batch, CFG.seq_length), generator=g)
    labels = ids.clone()
    labels[:, 0, :9] = -100
    return ids, labels


def train_steps(engine, first: int, last: int) -> list[tuple[float, float]]:
    """Steps ``[first, last)`` of :func:`batches`, this rank's sample shard of each;
    returns (loss, gradient norm) per step."""
    ids, labels = batches()
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    out = []
    for step in range(first, last):
        m = engine.train_step({"input_ids": ids[step, part], "labels": labels[step, part]})
        out.append((m["loss"], m["grad_norm"]))
    return out


def run(options: dict, tie: bool = False, train: dict | None = None):
    """Train STEPS steps; per-step (loss, grad norm), an evaluation loss, the shards."""
    engine = paraxis.parallelize(build(tie), config=ParallelConfig.from_kwargs(**options),
                                 train={**TRAIN, **(train or {})})
    history = train_steps(engine, 0, STEPS)
    ids, labels = batches(1)
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    eval_loss = engine.eval_step({"input_ids": ids[0, part], "labels": labels[0, part]})
    shards = local_shards(engine.model)
    engine.close()
    return history, eval_loss, shards
