"""Checkpoints: the format on disk, exact resume in new processes, another grid."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

import paraxis
from paraxis.config.run import RunConfig
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing import run_distributed
from paraxis.train.loop import train


def run_config(steps, ckpt=None, data=2, exit_after=None, **train_kw):
    return RunConfig.from_dict({
        "parallelism": {"data": data},
        "schedule": {"microbatches": 2},
        "model": {"family": "tiny", "config": {"hidden_size": 32, "num_layers": 2,
                                               "num_heads": 4, "intermediate_size": 64}},
        "train": {"steps": steps, "global_batch": 8, "seq_length": 32, "lr": 5e-3,
                  "warmup_steps": 3, "log_every": 100, "checkpoint_dir": ckpt,
                  "exit_after_steps": exit_after, **train_kw},
        "data": {"max_bytes": 60_000},
        "logging": {"progress": False, "wandb": False},
    })


def train_losses(steps, ckpt, exit_after=None):
    history = []
    train(run_config(steps, ckpt, exit_after=exit_after), history)
    return [m["loss"] for m in history]


def test_resume_in_new_processes_repeats_the_same_losses(tmp_path):
    straight = run_distributed(train_losses, 2, 20, None)[0]
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(train_losses, 2, 20, ckpt, 10)[0]  # saves at step 10, exits
    second = run_distributed(train_losses, 2, 20, ckpt)[0]  # new processes, resumes
    assert len(first) == 10 and len(second) == 10
    assert first + second == straight  # bit for bit, not approximately


def lr_run(steps, ckpt, exit_after=None, reschedule=False):
    """Each step's learning rate and what the run printed."""
    import contextlib
    import io

    history, out = [], io.StringIO()
    with contextlib.redirect_stdout(out):
        train(run_config(steps, ckpt, data=1, exit_after=exit_after, reschedule=reschedule),
              history)
    return [m["lr"] for m in history], out.getvalue()


def schedule_said(out):
    """What the resume line (issue 38) says of the lr schedule: its last part."""
    return [ln[ln.index("lr schedule"):] for ln in out.splitlines()
            if ln.startswith("resumed from")]


def cosine_lrs(total, first, last):
    """The schedule a run of ``total`` steps would have, steps ``first`` to ``last``."""
    from paraxis.engine.optim import WarmupCosine

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=5e-3)
    schedule = WarmupCosine(sgd, warmup=3, total=total)
    lrs = []
    for step in range(last):
        if step >= first:
            lrs.append(schedule.lr)
        schedule.step()
    return lrs


def test_a_resume_with_more_steps_keeps_the_schedule_unless_told_and_says_so(tmp_path,
                                                                              worlds):
    """Issue 32: extending train.steps on resume re-spread the cosine and the learning
    rate jumped back up, silently. Now the checkpoint's horizon is kept (the rate goes on
    down the 12-step cosine, then stays at its floor), or, with train.reschedule, the run
    follows the 20-step schedule from step 6 on; one line says which."""
    import shutil

    ckpt = tmp_path / "ckpt"
    first, _ = worlds.run(1, lr_run, 12, str(ckpt), 6)[0]  # saved at step 6 of 12
    assert first == cosine_lrs(12, 0, 6)
    shutil.copytree(ckpt, tmp_path / "again", ignore=shutil.ignore_patterns(".paraxis.lock"))
    kept, said = worlds.run(1, lr_run, 20, str(ckpt))[0]
    assert kept == cosine_lrs(12, 6, 12) + [5e-3 * 0.1] * 8
    assert kept[0] < first[-1]  # no jump: the rate goes on down
    lines = schedule_said(said)
    assert lines == ["lr schedule: kept the checkpoint's horizon (warmup 3, cosine to step "
                     f"12) though train.steps is 20: lr {kept[0]:.2e} at step 6; "
                     "train.reschedule: true re-spreads it over 20"], said
    spread, said = worlds.run(1, lr_run, 20, str(tmp_path / "again"), None, True)[0]
    assert spread == cosine_lrs(20, 6, 20) and spread[0] > first[-1]
    assert schedule_said(said) == [
        "lr schedule re-spread from step 6 over train.steps = 20 (the checkpoint's ran to "
        f"12; train.reschedule: true): lr {kept[0]:.2e} -> {spread[0]:.2e}"], said


def test_checkpoint_directory_format(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_distributed(train_losses, 2, 3, str(ckpt))
    assert (ckpt / "latest").read_text().strip() == "step-00000003"
    step_dir = ckpt / "step-00000003"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "index.json", "rank00000.safetensors", "rank00001.safetensors"]
    # The atomic write left nothing else behind (no .tmp-, .old- or .part files); the
    # run's metrics.jsonl lives beside its checkpoints (issue 38).
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "metrics.jsonl",
                                                      "step-00000003"]
    index = json.loads((step_dir / "index.json").read_text())
    assert index["format_version"] == 4 and index["step"] == 3
    assert set(index["files"]) == {"rank00000.safetensors", "rank00001.safetensors"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in index["files"].values())
    assert index["grid"]["degrees"]["data"] == 2 and len(index["grid"]["coords"]) == 2
    assert index["data"] == {"position": 24, "seed": 0}
    assert index["parallel_config"]["parallelism"]["data"] == 2
    assert index["model_config"]["hidden_size"] == 32
    assert {"torch", "paraxis", "python"} <= set(index["versions"])
    assert index["scheduler"]["step_count"] == 3
    emb = index["tensors"]["model/embed.tokens.weight"]
    assert emb["shape"] == [256, 32] and emb["dtype"] == "float32"
    # Replicated tensors are written once, by the first replica.
    assert [s["file"] for s in emb["shards"]] == ["rank00000.safetensors"]
    assert {"optim/embed.tokens.weight/exp_avg", "optim/embed.tokens.weight/exp_avg_sq",
            "optim/embed.tokens.weight/step", "rng/rank1/torch"} <= set(index["tensors"])
    with safe_open(str(step_dir / "rank00001.safetensors"), "pt") as f:
        assert list(f.keys()) == ["rng/rank1/torch"]


def load_on_one_rank(ckpt):
    torch.manual_seed(123)  # different weights, to be overwritten
    cfg = TinyConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4,
                     intermediate_size=64, seq_length=32)
    engine = paraxis.parallelize(TinyTransformer(cfg), train={"seq_length": 32})
    engine.load(ckpt)
    out = (engine.step, engine.data_state, {n: p.detach().clone()
                                            for n, p in engine.model.named_parameters()})
    engine.close()
    return out



def test_a_checkpoint_from_two_ranks_loads_on_one(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_losses, 2, 4, ckpt)
    step, data, params = run_distributed(load_on_one_rank, 1, ckpt)[0]
    assert step == 4 and data["position"] == 32
    step_dir = Path(ckpt) / "step-00000004"
    with safe_open(str(step_dir / "rank00000.safetensors"), "pt") as f:
        for name, p in params.items():
            assert torch.equal(p, f.get_tensor(f"model/{name}")), name
