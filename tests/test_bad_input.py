"""Bad input ends a run in one line naming the file or field and the fix: exit 1, no
traceback, and (where nothing but a rank can meet it) every rank agreeing on that line
(issue 38, item 5).

Each case before any rank starts calls the CLI in this process
(:func:`paraxis.cli.main.main`) with the launcher replaced by a stub that fails the test
if it is reached. The byte flipped in one rank's checkpoint file is met by that rank
alone: it runs ``paraxis train`` on 2 ranks, and the agreement itself is checked on 2
ranks of the shared test world. One small checkpoint (tiny model, one step, 2 ranks)
serves every case that needs one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paraxis.checkpoint.files import CheckpointError, read_index
from paraxis.cli.main import main

MODEL = {"family": "tiny", "config": {"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                      "intermediate_size": 64}}
TRAIN = {"steps": 1, "global_batch": 2, "seq_length": 16, "warmup_steps": 0}
DATA = {"source": "stdlib", "tokenizer": "bytes", "max_bytes": 20_000}


def write_config(path: Path, **sections) -> Path:
    body = {"model": MODEL, "train": TRAIN, "data": DATA,
            "logging": {"progress": False, "wandb": False}, **sections}
    path.write_text(json.dumps(body))  # JSON is YAML
    return path


def cli(capsys, monkeypatch, *argv) -> tuple[int, str]:
    """``paraxis *argv`` in this process; the launcher must never be reached."""
    import paraxis.train.launcher as launcher

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started for bad input")

    monkeypatch.setattr(launcher, "run_workers", no_ranks)
    monkeypatch.delenv("RANK", raising=False)
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *says: str) -> None:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert "Traceback" not in err
    for text in says:
        assert text in lines[0], (text, lines[0])


def save_two_ranks(directory: str) -> None:
    from paraxis.config.run import RunConfig
    from paraxis.train.loop import train

    train(RunConfig.from_dict({"parallelism": {"data": 2}, "model": MODEL,
                               "train": {**TRAIN, "checkpoint_dir": directory},
                               "data": DATA, "logging": {"progress": False,
                                                         "wandb": False}}))


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory):
    """A checkpoint of the tiny model, one step on data 2 (rank00000/rank00001 files)."""
    where = tmp_path_factory.mktemp("saved") / "ckpt"
    worlds.run(2, save_two_ranks, str(where))
    return where


@pytest.fixture
def ckpt(saved, tmp_path):
    """A copy of the saved checkpoint this test may damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def test_an_empty_pretrained_directory_is_refused_by_validate_and_train(
        tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    (tmp_path / "emptydir").mkdir()
    config = write_config(tmp_path / "run.yaml",
                          model={"pretrained": str(tmp_path / "emptydir")})
    for verb in ("validate", "train"):
        code, err = cli(capsys, monkeypatch, verb, "--config", config)
        assert_one_line(code, err, "model.pretrained", "holds no config.json", "Fix:")


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys, monkeypatch):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  steps: 3\n  global_batch: [16\n")
    code, err = cli(capsys, monkeypatch, "train", "--config", config)
    assert_one_line(code, err, f"{config}:3", "global_batch: [16", "is not valid YAML")


def test_data_prepare_with_a_missing_tokenizer_directory_never_asks_the_hub(
        tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")

    def hub(*args, **kwargs):
        raise AssertionError("the tokenizer was looked up through transformers")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub)
    code, err = cli(capsys, monkeypatch, "data", "prepare", "stdlib", "--out",
                    tmp_path / "out", "--tokenizer", tmp_path / "missing", "--quiet")
    assert_one_line(code, err, "--tokenizer", "is not a directory", "never downloads")
    assert not (tmp_path / "out").exists()


def test_a_misspelled_key_gets_the_nearest_valid_name(tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path / "run.yaml", train={**TRAIN, "setps": 3})
    code, err = cli(capsys, monkeypatch, "validate", "--config", config)
    assert_one_line(code, err, "train.setps = 3", "write train.steps")
    code, err = cli(capsys, monkeypatch, "train", "--config", config, "trian.steps=2")
    assert "trian = {'steps': 2}" in err and "write train" in err, err


def test_a_checkpoint_of_another_model_is_caught_before_any_rank_starts(
        ckpt, tmp_path, capsys, monkeypatch):
    wider = {**MODEL, "config": {**MODEL["config"], "hidden_size": 64}}
    config = write_config(tmp_path / "run.yaml", model=wider,
                          train={**TRAIN, "steps": 2, "checkpoint_dir": str(ckpt)})
    for verb in ("validate", "train"):
        code, err = cli(capsys, monkeypatch, verb, "--config", config)
        assert_one_line(code, err, "train.checkpoint_dir", "was saved from another model",
                        "[256, 32], the model's is [256, 64]")


def test_an_index_naming_a_file_outside_its_directory_is_refused(
        ckpt, tmp_path, capsys, monkeypatch):
    step = ckpt / (ckpt / "latest").read_text().strip()
    index = json.loads((step / "index.json").read_text())
    for entry in index["tensors"].values():
        for shard in entry["shards"]:
            if shard["file"] == "rank00000.safetensors":
                shard["file"] = "../rank00000.safetensors"
    (step / "index.json").write_text(json.dumps(index))
    shutil.copy(step / "rank00000.safetensors", ckpt)  # readable, were it not refused
    with pytest.raises(CheckpointError, match=r"names the file '\.\./rank00000"):
        read_index(step)
    config = write_config(tmp_path / "run.yaml",
                          train={**TRAIN, "steps": 2, "checkpoint_dir": str(ckpt)})
    code, err = cli(capsys, monkeypatch, "validate", "--config", config)
    assert_one_line(code, err, "'../rank00000.safetensors'", "outside its directory")


def flip(path: Path, at: int = -50) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def load_into_tiny(directory: str) -> tuple[str, str, list[int] | None]:
    import paraxis
    from paraxis.models.tiny import TinyConfig, TinyTransformer

    cfg = TinyConfig(vocab_size=256, seq_length=16, **{
        "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64})
    engine = paraxis.parallelize(TinyTransformer(cfg), data=2,
                                 train={"seq_length": 16, "global_batch": 2})
    try:
        engine.load(directory)
    except Exception as exc:
        return type(exc).__name__, str(exc), getattr(exc, "ranks", None)
    finally:
        engine.close()
    return "loaded", "", None


def test_one_ranks_damaged_file_is_agreed_on_by_every_rank(worlds, ckpt):
    step = ckpt / (ckpt / "latest").read_text().strip()
    flip(step / "rank00000.safetensors")
    (mine, message, ranks), (other, same, also) = worlds.run(2, load_into_tiny, str(ckpt))
    assert (mine, other) == ("CheckpointError", "AgreedError"), (mine, other)
    assert message == same and "rank00000.safetensors is corrupted" in message
    assert ranks == also == [0]


def test_a_damaged_rank_file_ends_the_run_in_one_line(ckpt, tmp_path):
    step = ckpt / (ckpt / "latest").read_text().strip()
    flip(step / "rank00000.safetensors")
    config = write_config(tmp_path / "run.yaml", parallelism={"data": 2},
                          train={**TRAIN, "steps": 2, "checkpoint_dir": str(ckpt)})
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "paraxis", "train", "--config", str(config)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "CollectiveError" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    (line,) = lines
    assert "rank00000.safetensors is corrupted" in line and line.endswith("(rank 0)"), line
