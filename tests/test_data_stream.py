"""data.streaming and data.balance_tokens through ``paraxis train`` on real process
groups (gloo, a tiny model): the stream's global batches do not depend on the layout, a
checkpoint resumes them exactly on the same and on another layout, and a token-balanced
run equals an unbalanced one (the loss is normalized by the global token count)."""

import json
import random

import pytest

from paraxis.config.run import RunConfig
from paraxis.testing.tolerance import assert_losses_close
from paraxis.train.loop import train

WORDS = ["def", "return", "import", "class", "self", "print", "for", "in", "x", "y"]


def run_config(degrees, data, **train_kw):
    return RunConfig.from_dict({
        "parallelism": degrees,
        "model": {"family": "tiny", "config": {"hidden_size": 32, "num_layers": 2,
                                               "num_heads": 4, "intermediate_size": 64}},
        "train": {"steps": 6, "global_batch": 8, "seq_length": 32, "lr": 5e-3,
                  "warmup_steps": 2, "log_every": 100, **train_kw},
        "data": data,
        "logging": {"progress": False, "wandb": False},
    })


def _corpus(path, files=3, docs=300, longest=8):
    rng = random.Random(0)
    path.mkdir()
    for k in range(files):
        (path / f"part{k}.jsonl").write_text("".join(
            json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(2, longest)))})
            + "\n" for _ in range(docs)))
    return path


def losses(degrees, data, train_kw):
    history = []
    train(run_config(degrees, data, **train_kw), history)
    return [m["loss"] for m in history]


def test_a_stream_trains_the_same_batches_on_any_layout_and_resumes_exactly(tmp_path, worlds):
    """Two stream shards: data 2 (a shard a rank) equals one process reading both; a
    run stopped after 3 steps resumes on data 2 and on one process at the losses of the
    unbroken run (exact batches; the weights' reduction order differs, hence the shared
    tolerance)."""
    data = {"source": str(_corpus(tmp_path / "c")), "streaming": True, "stream_shards": 2}
    (one,) = worlds.run(1, losses, {}, data, {})
    for run in worlds.run(2, losses, {"data": 2}, data, {}):
        assert_losses_close(run, one, "data 2 against one process")
    for degrees, world in (({"data": 2}, 2), ({}, 1)):
        ckpt = str(tmp_path / f"ckpt{world}")
        first = worlds.run(2, losses, {"data": 2}, data,
                                {"checkpoint_dir": ckpt, "exit_after_steps": 3})
        assert_losses_close(first[0], one[:3])
        for rest in worlds.run(world, losses, degrees, data, {"checkpoint_dir": ckpt}):
            assert_losses_close(rest, one[3:], f"resumed on {degrees or 'one process'}")


def test_a_token_balanced_run_equals_an_unbalanced_one_on_data2(tmp_path, worlds):
    """Unpacked rows of long-tailed lengths; balancing moves rows between the ranks of
    each global batch (and cuts each rank's padding to its longest row), never the
    loss."""
    source = _corpus(tmp_path / "c", files=1, docs=400, longest=12)
    data = {"source": str(source), "packing": False}
    plain = worlds.run(2, losses, {"data": 2}, data, {})
    fair = worlds.run(2, losses, {"data": 2}, {**data, "balance_tokens": True}, {})
    assert_losses_close(fair[0], plain[0], "balanced against unbalanced")
    assert plain[0] == plain[1] and fair[0] == fair[1]


def mixtral_losses(degrees, data):
    from paraxis_hf import DEBUG_CONFIGS

    cfg = run_config(degrees, data)
    model = {"family": "mixtral", "config": {**DEBUG_CONFIGS["mixtral"], "vocab_size": 256}}
    history = []
    train(cfg.model_copy(update={"model": cfg.model.model_copy(update=model)}), history)
    return [m["loss"] for m in history]


def test_expert_ranks_split_the_stream_too(tmp_path, worlds):
    """Samples split over data x expert: on expert 2 each rank reads its own shard, and
    the run equals one process reading both (Mixtral, 4 experts, top-2)."""
    pytest.importorskip("paraxis_moe")
    pytest.importorskip("paraxis_hf")
    data = {"source": str(_corpus(tmp_path / "c")), "streaming": True, "stream_shards": 2}
    (one,) = worlds.run(1, mixtral_losses, {}, data)
    for run in worlds.run(2, mixtral_losses, {"expert": 2}, data):
        assert_losses_close(run, one, "expert 2 against one process")
