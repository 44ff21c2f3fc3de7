"""Cross-field validation before any process group: every problem, all at once."""

import json
import subprocess
import sys

import pytest

from paraxis import ConfigError, ModelShape, ParallelConfig, make_plugin_manager, validate
from paraxis.hookspecs import hookimpl
from paraxis.validation import check

LLAMA = ModelShape(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   num_layers=2, vocab_size=250, intermediate_size=96, seq_length=30)


def fields(problems):
    return sorted(p.field for p in problems)


def test_valid_config_has_no_problems():
    assert check(ParallelConfig.from_kwargs(data=2, tensor=2), world_size=4, model=LLAMA) == []


def test_world_size_must_match_product():
    (p,) = check(ParallelConfig.from_kwargs(data=2, tensor=2), world_size=6)
    assert p.field == "world_size" and p.value == 6 and "= 4" in p.rule


def test_all_model_problems_reported_together():
    cfg = ParallelConfig.from_kwargs(tensor=8, pipeline=4, context=4, microbatches=2)
    shape = ModelShape(hidden_size=60, num_attention_heads=4, num_key_value_heads=3,
                       num_layers=2, vocab_size=5, intermediate_size=100, seq_length=30)
    problems = check(cfg, world_size=64, model=shape)
    assert fields(problems) == [
        "model.hidden_size", "model.intermediate_size", "model.num_attention_heads",
        "model.num_key_value_heads", "model.seq_length", "model.vocab_size",
        "parallelism.pipeline", "schedule.microbatches", "world_size",
    ]
    for p in problems:
        assert p.rule and p.fix, p
    assert "choose tensor among [1, 2, 4]" in str(ConfigError(problems))


def test_kv_heads_must_split_over_the_tensor_degree():
    shape = ModelShape(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                       num_layers=2, vocab_size=100)
    assert check(ParallelConfig.from_kwargs(tensor=2), model=shape) == []
    (p,) = check(ParallelConfig.from_kwargs(tensor=4), model=shape)
    assert p.field == "model.num_key_value_heads" and "never replicated" in p.rule
    assert "choose tensor among [1, 2]" in str(p)


def test_unsupported_combinations():
    assert fields(check(ParallelConfig.from_kwargs(sequence_parallel=True))) == [
        "parallelism.sequence_parallel"]
    assert fields(check(ParallelConfig.from_kwargs(zero=2, pipeline=2, microbatches=2))) == [
        "parallelism.zero"]
    moe = check(ParallelConfig.from_kwargs(expert=2), model=LLAMA)
    assert fields(moe) == ["parallelism.expert"]
    experts = ModelShape(64, 4, 2, 100, num_experts=6)
    assert fields(check(ParallelConfig.from_kwargs(expert=4), model=experts)) == [
        "model.num_experts"]


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
    for text in ("world_size", "model.num_attention_heads", "Fix:"):
        assert text in bad.stderr

    # Core alone (no axis package needed): one rank.
    cfg.write_text("parallelism: {data: 1}\n")
    good = _cli("--config", str(cfg), "--model", str(model), "--world-size", "1")
    assert good.returncode == 0, good.stderr
    assert "valid. world size 1" in good.stdout and "strategies: none" in good.stdout
