"""``checkpoint.async: true``: the step waits for a host snapshot only; the files are
written by a background thread and published exactly like a synchronous save (same
directory contents, checksums in the index), and a resume from them repeats the
uninterrupted run bit for bit."""

from __future__ import annotations

import json

import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.config.parallel import CheckpointConfig
from paraxis.models.tiny import TinyConfig, TinyTransformer

CFG = TinyConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, BATCH = 6, 8


def run(ckpt, first, last, saves=()):
    torch.manual_seed(0)
    config = ParallelConfig.from_dict({"parallelism": {"data": 2},
                                       "checkpoint": {"async": True}})
    engine = paraxis.parallelize(TinyTransformer(CFG), config=config, train={
        "steps": STEPS, "lr": 3e-3, "warmup_steps": 2, "seq_length": 16})
    if first:
        engine.load(ckpt)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (STEPS, BATCH, 16), generator=g)
    part = slice(engine.grid.rank * BATCH // 2, (engine.grid.rank + 1) * BATCH // 2)
    losses = []
    for step in range(first, last):
        losses.append(engine.train_step(ids[step, part])["loss"])
        if engine.step in saves:
            engine.data_state = {"position": engine.step * BATCH, "seed": 0}
            engine.save(ckpt)  # returns after the snapshot
    engine.close()  # waits for the last write
    return losses


def test_async_field_spelling():
    assert CheckpointConfig.model_validate({"async": True}).async_save
    assert not CheckpointConfig().async_save


def test_async_saves_publish_and_resume_bit_for_bit(worlds, tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = worlds.run(2, run, str(ckpt / "unused"), 0, STEPS)[0]
    first = worlds.run(2, run, str(ckpt), 0, 3, (1, 2, 3))[0]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "latest", "step-00000001", "step-00000002", "step-00000003"]
    step = ckpt / "step-00000003"
    assert sorted(p.name for p in step.iterdir()) == [
        "index.json", "rank00000.safetensors", "rank00001.safetensors"]
    index = json.loads((step / "index.json").read_text())
    assert all(len(f["sha256"]) == 64 for f in index["files"].values())
    assert index["data"] == {"position": 24, "seed": 0}
    second = worlds.run(2, run, str(ckpt), 3, STEPS)[0]
    assert first + second == straight
