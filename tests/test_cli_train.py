"""End to end: ``paraxis train`` launches itself under torchrun, trains the default
config on 2 ranks, checkpoints, resumes, and logs to W&B offline."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGGED = [b"loss", b"tokens_per_s", b"step_time_s", b"exposed_comm_s", b"grad_norm",
          b"straggler_spread_s"]


def paraxis(*args, cwd):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(cwd),
           "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "paraxis", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)


def test_cli_trains_the_default_config_and_logs_to_wandb_offline(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = paraxis("train", "--config", str(ROOT / "examples/default.yaml"),
                  "train.steps=30", "train.warmup_steps=5", "train.log_every=1",
                  f"train.checkpoint_dir={ckpt}", "train.checkpoint_every=10",
                  "logging.progress=false", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 30, out.stdout
    assert losses[-1] < losses[0] - 1.5, losses  # byte-level loss falls from ~5.5
    assert "paraxis run summary" in out.stdout and "tokens_per_s" in out.stdout
    # exposed communication per group, named as a user thinks of it (issue 38): data 2 x
    # tensor 2 has tensor groups, replica groups (data x expert x context) and the world
    assert "comm/tensor_exposed_s" in out.stdout, out.stdout[-3000:]
    assert "comm/replicas_exposed_s" in out.stdout, out.stdout[-3000:]
    assert "pipelinexdata" not in out.stdout and "dataxexpert" not in out.stdout
    assert (ckpt / "latest").read_text().strip() == "step-00000030"
    assert (ckpt / "step-00000010" / "index.json").exists()

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "exactly one rank (the logging rank) opens a W&B run"
    (record,) = runs[0].glob("run-*.wandb")
    data = record.read_bytes()
    for key in LOGGED:
        assert key in data, f"W&B run does not name metric {key!r}"
    assert b"degrees" in data  # the grid description went into the run config

    again = paraxis("train", "--config", str(ROOT / "examples/default.yaml"),
                    "train.steps=40", "train.warmup_steps=5", "train.log_every=10",
                    f"train.checkpoint_dir={ckpt}", "logging.progress=false", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.findall(r"step\s+(\d+)/40", again.stdout) == ["40"]  # resumed at 30
    # ...into the same W&B run: its id is kept beside the checkpoints.
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1, runs


def test_cli_rejects_a_bad_config_before_starting_processes(tmp_path):
    out = paraxis("train", "--config", str(ROOT / "examples/default.yaml"),
                  "parallelism.tensor=3", "parallelism.expert=2", "train.global_batch=7",
                  "data.source=/nonexistent/corpus.txt", cwd=tmp_path)
    assert out.returncode == 1
    for text in ("train.global_batch = 7", "model.num_attention_heads = 4",
                 "model.num_key_value_heads = 2",
                 "parallelism.expert = 2: the model has no experts",  # paraxis-moe-ep's rule
                 "data.source = '/nonexistent/corpus.txt': does not exist"):
        assert text in out.stderr or text in out.stdout, (text, out.stderr)
    assert "torch.distributed.run" not in out.stderr


def test_cli_refuses_a_layout_that_does_not_fit_the_device_memory(tmp_path):
    out = paraxis("train", "--config", str(ROOT / "examples/default.yaml"),
                  "--device-memory", "2MB", cwd=tmp_path)
    assert out.returncode == 1
    assert "refused: the plan says pipeline stage 0 needs" in out.stderr, out.stderr
    assert "more than 2.00 MB" in out.stderr, out.stderr  # the cap, then the largest term
    assert "the largest term is" in out.stderr, out.stderr
    assert "torch.distributed" not in out.stderr and not (tmp_path / "runs").exists()
