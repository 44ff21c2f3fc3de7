"""Checkpoints through the bridge are paraxis's own format (index + safetensors, whole
tensors gathered from DeepSpeed's partitions, no pickle), so they move both ways
between an offload run and a run without DeepSpeed on another grid, and resuming
through the bridge is exact.

Every run trains the same model on the same batches: 3 steps, a checkpoint, a fixed
evaluation batch, 3 more steps. A loaded run must report the evaluation loss and the
next 3 losses of the run it continues: bit for bit through the bridge, at the shared
tolerance across the two arithmetics (DeepSpeed's CPU Adam against torch's AdamW).
"""

import json
from pathlib import Path

import pytest
import torch

import paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing.tolerance import assert_losses_close

CFG = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, GLOBAL_BATCH = 6, 8
TRAIN = {"steps": STEPS, "lr": 1e-2, "warmup_steps": 2, "grad_clip": 0.5,
         "seq_length": CFG.seq_length}
ZERO3 = {"data": 2, "zero": 3, "offload": {"optimizer": "cpu", "parameters": "cpu"}}
ZERO2 = {"data": 2, "zero": 2, "offload": {"optimizer": "cpu"}}


def batches():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, CFG.vocab_size, (STEPS + 1, GLOBAL_BATCH, CFG.seq_length),
                        generator=g)
    labels = ids.clone()
    labels[:, 0, :10] = -100
    return ids, labels


def run(layout, save_to=None, load_from=None):
    """Steps 1-3 (saving after them) and 4-6, or, loading, only 4-6. Returns the losses
    and the evaluation loss after step 3."""
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), train=TRAIN, **layout)
    index, count = engine.grid.sample_shard()
    part = slice(index * GLOBAL_BATCH // count, (index + 1) * GLOBAL_BATCH // count)
    ids, labels = batches()

    def batch(s):
        return {"input_ids": ids[s, part], "labels": labels[s, part]}

    losses = []
    if load_from is None:
        losses = [engine.train_step(batch(s))["loss"] for s in range(3)]
        if save_to is not None:
            engine.save(save_to)
    else:
        engine.load(load_from)
        assert engine.step == 3
    evaluated = engine.eval_step(batch(STEPS))
    losses += [engine.train_step(batch(s))["loss"] for s in range(3, STEPS)]
    engine.close()
    return losses, evaluated


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """An offload run (ZeRO-3, optimizer and parameters on the CPU) and a plain
    one-process run, each straight through, each saving after step 3."""
    root = tmp_path_factory.mktemp("ckpt")
    offload = worlds.run(2, run, ZERO3, str(root / "offload"))[0]
    plain = worlds.run(1, run, {}, str(root / "plain"))[0]
    return root, offload, plain


def test_checkpoint_is_paraxis_format(saved):
    root = saved[0]
    step = root / "offload" / (root / "offload" / "latest").read_text().strip()
    index = json.loads((step / "index.json").read_text())
    assert index["format"] == "paraxis-checkpoint"
    assert index["tensors"]["model/embed.tokens.weight"]["shape"] == [CFG.vocab_size,
                                                                      CFG.hidden_size]
    assert {"exp_avg", "exp_avg_sq", "step"} <= {k.rsplit("/", 1)[1]
                                                 for k in index["tensors"] if "optim/" in k}
    # Parameters spread over both data-parallel ranks' files, each written once.
    files = {s["file"] for t in index["tensors"].values() for s in t["shards"]}
    assert files == {"rank00000.safetensors", "rank00001.safetensors"}
    assert not list(Path(step).glob("*.pt")) and not list(Path(step).glob("*.pkl"))


def test_resume_through_the_bridge_is_exact(worlds, saved):
    root, (straight, evaluated), _ = saved
    losses, again = worlds.run(2, run, ZERO3, None, str(root / "offload"))[0]
    assert again == evaluated
    assert losses == straight[3:]


def test_offload_checkpoint_loads_without_deepspeed_on_another_grid(worlds, saved):
    root, (straight, evaluated), _ = saved
    losses, again = worlds.run(1, run, {}, None, str(root / "offload"))[0]
    assert_losses_close([again], [evaluated], "evaluation loss after loading")
    assert_losses_close(losses, straight[3:])


def test_plain_checkpoint_loads_into_an_offload_run(worlds, saved):
    root, _, (straight, evaluated) = saved
    losses, again = worlds.run(2, run, ZERO2, None, str(root / "plain"))[0]
    assert_losses_close([again], [evaluated], "evaluation loss after loading")
    assert_losses_close(losses, straight[3:])
