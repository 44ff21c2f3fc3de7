"""Evaluation during ``paraxis train`` (``train.eval_every``, ``data.eval``): the held-out
rows never reach training, and the eval loss is the same on one process and on data 2 x
pipeline 2 (at the shared tolerance: the runs' weights differ by reduction order)."""

import json
import math
import random

import pytest
import torch

from paraxis.config.errors import ConfigError
from paraxis.config.run import RunConfig
from paraxis.parallel.numerics import REDUCTION_RTOL
from paraxis.testing import run_distributed
from paraxis.testing.tolerance import assert_losses_close
from paraxis.train.data import ByteTokenizer, pack, split_held_out
from paraxis.train.loop import train


def run_config(degrees=None, **data):
    return RunConfig.from_dict({
        "parallelism": degrees or {},
        "schedule": {"microbatches": 2},
        "model": {"family": "tiny", "config": {"hidden_size": 32, "num_layers": 2,
                                               "num_heads": 4, "intermediate_size": 64}},
        "train": {"steps": 6, "global_batch": 8, "seq_length": 32, "lr": 5e-3,
                  "warmup_steps": 2, "log_every": 100, "eval_every": 3, "eval_batches": 2},
        "data": {"max_bytes": 60_000, "eval": {"fraction": 0.1}, **data},
        "logging": {"progress": False, "wandb": False},
    })


def eval_losses(degrees):
    history = []
    summary = train(run_config(degrees), history)
    evals = [(int(m["step"]), m["eval_loss"], m["eval_ppl"]) for m in history
             if "eval_loss" in m]
    return evals, summary["eval_loss"]


def test_eval_loss_is_the_same_on_one_process_and_on_data2_pipeline2():
    (one, last), = run_distributed(eval_losses, 1, {})
    assert [step for step, _, _ in one] == [3, 6]
    assert last == one[-1][1]
    for _, loss, ppl in one:
        assert math.isclose(ppl, math.exp(loss))
    for evals, _ in run_distributed(eval_losses, 4, {"data": 2, "pipeline": 2}):
        assert [step for step, _, _ in evals] == [3, 6]
        assert_losses_close([loss for _, loss, _ in evals], [loss for _, loss, _ in one],
                            "eval losses")


def test_held_out_rows_are_cut_before_training_sees_them():
    cfg = run_config().data
    rows = pack(cfg, 32, ByteTokenizer())
    train_rows, held = split_held_out(cfg, 32, ByteTokenizer())
    assert len(held) == round(0.1 * len(rows)) and len(train_rows) + len(held) == len(rows)
    assert torch.equal(torch.cat([train_rows, held]), rows)  # the last rows, in order


def test_eval_needs_held_out_data_and_only_one_kind():
    problems = run_config(eval={"fraction": 0.0}).check_run()
    assert any(p.field == "train.eval_every" for p in problems), problems
    problems = run_config(eval={"fraction": 0.1, "source": "x.txt"}).check_run()
    assert any(p.field == "data.eval" for p in problems), problems
    with pytest.raises(ConfigError):
        RunConfig.from_dict({"data": {"eval": {"fraction": 1.5}}})


def masked_losses(masking, degrees, source):
    cfg = run_config(degrees, document_masking=masking, source=source)
    history = []
    train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_every": 0})}),
          history)
    return [m["loss"] for m in history]


def test_document_masking_reaches_the_model_and_holds_on_data2_pipeline2(tmp_path):
    """Packed rows of short documents with per-document positions (restarting after each
    separator): the losses differ from attending across documents (the mask is applied),
    and data 2 x pipeline 2 equals one process with it."""
    rng = random.Random(0)
    words = ["def", "return", "import", "class", "self", "print", "for", "in", "x", "y"]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(
        json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(2, 8)))}) + "\n"
        for _ in range(1500)))
    (masked,) = run_distributed(masked_losses, 1, True, {}, str(source))
    (across,) = run_distributed(masked_losses, 1, False, {}, str(source))
    apart = max(abs(m - a) / a for m, a in zip(masked, across, strict=True))
    assert apart > 100 * REDUCTION_RTOL, (masked, across)  # far beyond reduction noise
    for losses in run_distributed(masked_losses, 4, True, {"data": 2, "pipeline": 2},
                                  str(source)):
        assert_losses_close(losses, masked)


def test_document_positions_restart_after_each_separator():
    from paraxis.train.data import document_positions

    rows = torch.tensor([[5, 0, 7, 8, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    assert document_positions(rows, 0).tolist() == [[0, 1, 0, 1, 2, 0, 0],
                                                    [0, 1, 2, 3, 4, 5, 6]]


def source_losses(source):
    cfg = run_config({}, source=source, eval={"fraction": 0.0})
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_every": 0})})
    history = []
    train(cfg, history)
    return [m["loss"] for m in history]


def test_prepared_shards_train_like_the_source_they_came_from(tmp_path):
    """paraxis data prepare (two tokenizing processes), then data.source: DIR: the same
    losses, bit for bit, as training on the JSONL itself."""
    import subprocess
    import sys

    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * (i % 7 + 1)}) + "\n"
                              for i in range(3000)))
    out = subprocess.run([sys.executable, "-m", "paraxis", "data", "prepare", str(source),
                          "--out", str(tmp_path / "shards"), "--workers", "2", "--quiet",
                          "--max-bytes", "60000"],  # run_config's data.max_bytes
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and " documents, " in out.stdout, out.stderr
    (raw,) = run_distributed(source_losses, 1, str(source))
    (shards,) = run_distributed(source_losses, 1, str(tmp_path / "shards"))
    assert shards == raw
