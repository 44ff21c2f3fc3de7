"""Exact parameter counts by module on the meta device, and reading --model."""

import json

import pytest
from torch import nn

from paraxis import make_plugin_manager
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.parallel.hookspecs import hookimpl
from paraxis.planner.model import (
    ModelSource,
    build_on_meta,
    count_model,
    load_model_source,
)
from paraxis.planner.units import PlanInputError


def tiny_counts(**cfg):
    source = ModelSource("tiny", cfg, "test", {})
    model = build_on_meta(source, make_plugin_manager(load_entrypoints=False))
    assert all(p.is_meta for p in model.parameters())  # shapes only, no storage
    return count_model(model, "tiny")


def test_tiny_counted_exactly_by_module():
    c = tiny_counts(vocab_size=100, hidden_size=32, num_layers=3, num_heads=4,
                    intermediate_size=48, seq_length=16)
    h, v, f, s = 32, 100, 48, 16
    assert c.embedding == v * h + s * h  # token embedding + learned positions
    assert [layer.matrices for layer in c.layers] == [3 * h * h + h * h + 2 * h * f] * 3
    assert [layer.vectors for layer in c.layers] == [2 * h] * 3  # two RMSNorms
    assert (c.final, c.head, c.tied) == (h, v * h, False)
    assert c.total == sum(p.numel() for p in TinyTransformer(TinyConfig(
        vocab_size=100, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
        seq_length=16)).parameters())
    assert (c.num_layers, c.hidden_size, c.num_heads, c.head_dim, c.max_seq) == (
        3, 32, 4, 8, 16)


class _Toy(nn.Module):
    """A model with a tied head and expert parameters, built by a fake plugin."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.config = type("C", (), {"hidden_size": hidden, "num_attention_heads": 2,
                                     "num_hidden_layers": 2, "vocab_size": vocab,
                                     "num_local_experts": 4, "num_experts_per_tok": 2})()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "attn": nn.Linear(hidden, hidden),
            "experts": nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(4)),
            "gate": nn.Linear(hidden, 4, bias=False)}) for _ in range(2))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head


class _ToyPlugin:
    @hookimpl
    def paraxis_build_model(self, family, config):
        return _Toy(**config) if family == "toy" else None


def test_build_goes_through_the_hook_and_counts_experts_and_tied_head_once():
    pm = make_plugin_manager(load_entrypoints=False, plugins=(_ToyPlugin(),))
    model = build_on_meta(ModelSource("toy", {"vocab": 50, "hidden": 8}, "t", {}), pm)
    c = count_model(model, "toy")
    assert c.tied and c.head == 0 and c.embedding == 50 * 8
    assert c.layers[0].experts == 4 * 64 and c.layers[0].matrices == 64 + 32
    assert c.layers[0].vectors == 8 and c.final == 16
    assert (c.num_experts, c.top_k, c.moe_layers) == (4, 2, 2)
    assert c.active_non_embedding == c.non_embedding - 2 * 4 * 64 // 2
    with pytest.raises(PlanInputError, match=r"model_type 'nope'.*not known.*paraxis-hf"):
        build_on_meta(ModelSource("nope", {}, "cfg.json", {}), pm)
    with pytest.raises(PlanInputError, match="could not build model_type 'toy'") as err:
        build_on_meta(ModelSource("toy", {"vocab": 5}, "cfg.json", {}), pm)
    assert "\n" not in str(err.value)


def test_load_model_source_from_dir_json_and_run_yaml(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "transformers_version": "4.0"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_dir = load_model_source(tmp_path)
    assert from_dir.family == "llama" and from_dir.config == {"hidden_size": 64}
    assert load_model_source(tmp_path / "config.json").config == from_dir.config
    run = tmp_path / "run.yaml"
    run.write_text("model: {family: tiny, config: {hidden_size: 32}}\n"
                   "train: {seq_length: 16, global_batch: 8}\n")
    src = load_model_source(run)
    assert (src.family, src.config, src.defaults["seq_length"]) == ("tiny",
                                                                    {"hidden_size": 32}, 16)


@pytest.mark.parametrize(("content", "message"), [
    ('{"hidden_size": 4}', "has no model_type"),
    ("{not json", "does not parse"),
    ("[1, 2]", "must hold a mapping"),
])
def test_load_model_source_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(PlanInputError, match=message) as err:
        load_model_source(path)
    assert "\n" not in str(err.value)
    with pytest.raises(PlanInputError, match="no such file"):
        load_model_source(tmp_path / "missing")
