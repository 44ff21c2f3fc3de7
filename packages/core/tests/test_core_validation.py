"""Cross-field validation before any process group: every problem, all at once."""

import json
import subprocess
import sys

import pytest

from paraxis import ConfigError, ModelShape, ParallelConfig, make_plugin_manager, validate
from paraxis.config.rules import check
from paraxis.parallel.hookspecs import hookimpl

LLAMA = ModelShape(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   num_layers=2, vocab_size=250, intermediate_size=96, seq_length=30)


def fields(problems):
    return sorted(p.field for p in problems)


def test_core_checks_only_grid_wide_rules():
    # Each axis checks what it splits in its own package (paraxis_validate_config).
    assert check(ParallelConfig.from_kwargs(data=2, tensor=8), world_size=16, model=LLAMA) == []


def test_world_size_must_match_product():
    (p,) = check(ParallelConfig.from_kwargs(data=2, tensor=2), world_size=6)
    assert p.field == "world_size" and p.value == 6 and "= 4" in p.rule


def test_validate_raises_with_every_problem_and_plugins_add_rules():
    class Plugin:
        @hookimpl
        def paraxis_validate_config(self, config, model, problems):
            from paraxis import Problem
            problems.append(Problem("plugin.rule", 1, "plugin says no", "obey"))

    pm = make_plugin_manager(load_entrypoints=False, plugins=(Plugin(),))
    with pytest.raises(ConfigError) as err:
        validate(ParallelConfig.from_kwargs(data=2), world_size=3, plugin_manager=pm)
    assert fields(err.value.problems) == ["plugin.rule", "world_size"]
    assert "2 configuration problem(s)" in str(err.value)


def test_model_shape_from_hf_config_dict():
    shape = ModelShape.from_hf_config({"n_embd": 32, "n_head": 4, "n_layer": 2,
                                       "vocab_size": 50, "n_positions": 64})
    assert (shape.hidden_size, shape.num_attention_heads, shape.num_layers) == (32, 4, 2)
    assert shape.kv_heads == 4 and shape.seq_length == 64


def test_every_spelling_of_the_expert_count_is_read():
    """Aria spells it moe_num_experts (no attribute_map): read as 0, its expert=2 cell
    was refused for "no experts" while its tensor cells replicated 3 blocks' experts."""
    base = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 50}
    for spelling in ("num_local_experts", "num_experts", "n_routed_experts",
                     "moe_num_experts"):
        assert ModelShape.from_hf_config({**base, spelling: 8}).num_experts == 8, spelling


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "paraxis", "validate", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_validate_reports_and_exits_nonzero(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("parallelism: {data: 2, tensor: 8}\nschedule: {microbatches: 1}\n")
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                 "num_hidden_layers": 2, "vocab_size": 100}))
    bad = _cli("--config", str(cfg), "--model", str(model), "--world-size", "4")
    assert bad.returncode == 1
    for text in ("world_size", "Fix:"):
        assert text in bad.stderr

    # Core alone (no axis package needed): one rank.
    cfg.write_text("parallelism: {data: 1}\n")
    good = _cli("--config", str(cfg), "--model", str(model), "--world-size", "1")
    assert good.returncode == 0, good.stderr
    assert "valid. world size 1" in good.stdout and "strategies: none" in good.stdout


def test_cli_validate_takes_a_model_directory(tmp_path):
    """A Hugging Face model is a directory: accepted, and anything else is explained,
    never a raw OS error (it used to print '[Errno 21] Is a directory')."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("parallelism: {data: 1}\n")
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "vocab_size": 100}))
    good = _cli("--config", str(cfg), "--model", str(model_dir), "--world-size", "1")
    assert good.returncode == 0, good.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, says in [(empty, "is a directory without config.json"),
                       (tmp_path / "nowhere", "does not exist"),
                       (cfg, "has no hidden_size")]:
        out = _cli("--config", str(cfg), "--model", str(path))
        assert out.returncode == 1 and says in out.stderr, out.stderr
        assert "Errno" not in out.stderr and "Traceback" not in out.stderr
        assert "model directory" in out.stderr
