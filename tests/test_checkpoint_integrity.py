"""A checkpoint is checked before it is trusted, and a save killed at any point leaves
the previous one loadable.

Every damaged checkpoint gives a CheckpointError naming the file and the problem, never
a traceback from inside safetensors; nothing is unpickled.
"""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import paraxis
from paraxis.checkpoint.files import CheckpointError
from paraxis.checkpoint.format import resolve
from paraxis.models.tiny import TinyConfig, TinyTransformer

CFG = TinyConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                 intermediate_size=32, seq_length=16)


def engine_of(cfg=CFG):
    torch.manual_seed(0)
    return paraxis.parallelize(TinyTransformer(cfg), train={"seq_length": cfg.seq_length})


def save_steps(ckpt, steps):
    engine = engine_of()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        engine.train_step(torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), generator=g))
        engine.save(ckpt)
    engine.close()


def load(ckpt, cfg=CFG):
    engine = engine_of(cfg)
    try:
        engine.load(ckpt)
        return engine.step
    except CheckpointError as exc:
        return str(exc)
    finally:
        engine.close()


@pytest.fixture
def saved(worlds, tmp_path):
    ckpt = tmp_path / "ckpt"
    worlds.run(1, save_steps, str(ckpt), 2)
    return ckpt, resolve(ckpt)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "says"), [
    (lambda d: (d / "rank00000.safetensors").write_bytes(
        (d / "rank00000.safetensors").read_bytes()[:-100]), "is truncated"),
    (lambda d: _flip(d / "rank00000.safetensors", -50), "is corrupted: its SHA-256"),
    (lambda d: (d / "rank00000.safetensors").unlink(), "is missing"),
    (lambda d: (d / "index.json").write_text("{not json"), "index.json is corrupted"),
    (lambda d: (d / "index.json").write_text(json.dumps(
        {**json.loads((d / "index.json").read_text()), "format_version": 99})),
     "newer than this paraxis reads"),
], ids=["truncated", "bit-flip", "missing-file", "bad-index", "newer-format"])
def test_a_damaged_checkpoint_is_named_not_loaded(worlds, saved, damage, says):
    ckpt, step_dir = saved
    damage(step_dir)
    (message,) = worlds.run(1, load, str(ckpt))
    assert isinstance(message, str) and says in message, message
    assert "safetensors_rust" not in message


def test_a_checkpoint_from_another_model_is_refused(worlds, saved):
    ckpt, _ = saved
    other = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                       intermediate_size=32, seq_length=16)
    (message,) = worlds.run(1, load, str(ckpt), other)
    assert "was saved from another model" in message and "[64, 16]" in message


SAVER = """
import sys, torch, paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer
cfg = TinyConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                 intermediate_size=32, seq_length=16)
torch.manual_seed(0)
engine = paraxis.parallelize(TinyTransformer(cfg), train={"seq_length": 16})
print("ready", flush=True)
for _ in range(10_000):
    engine.train_step(torch.randint(0, 64, (2, 16)))
    engine.save(sys.argv[1])
"""


def test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint(worlds, tmp_path):
    ckpt = tmp_path / "ckpt"
    rng = random.Random(0)
    for _trial in range(6):  # kill the saving process at random points of many saves
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(ckpt)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if (ckpt / "latest").exists():
            step = worlds.run(1, load, str(ckpt))[0]
            assert isinstance(step, int), step  # latest names a whole, valid checkpoint
    assert (ckpt / "latest").exists()


def test_inspect_shows_the_grid_and_verifies(saved):
    ckpt, step_dir = saved
    out = subprocess.run([sys.executable, "-m", "paraxis", "checkpoint", "inspect",
                          str(ckpt), "--verify"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "step 2, format 4" in out.stdout and "model/embed.tokens.weight" in out.stdout
    assert "verified: every file has its recorded size and SHA-256" in out.stdout
    _flip(step_dir / "rank00000.safetensors", -50)
    bad = subprocess.run([sys.executable, "-m", "paraxis", "checkpoint", "inspect",
                          str(ckpt), "--verify"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "is corrupted" in bad.stderr
