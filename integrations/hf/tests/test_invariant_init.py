"""Layout-invariant initial values and the init rules read from a family's
``_init_weights``, without processes: any block of a tensor, drawn alone, equals the
same block of the tensor drawn whole (tiles cut small so that blocks straddle them);
the rules are the family's (GPT-2's scaled residual projections, zero biases, unit
norms, a padding row); buffers are the whole model's; what cannot be replayed piece by
piece is refused by name (OpenAI-GPT's Conv1D weights, drawn by their constructor
alone), and the trainer then builds that family whole. The recorder itself is tested in
test_init_rules.py, every family against eager in test_init_every_family.py."""

from __future__ import annotations

import random

import pytest
import torch

from paraxis_hf import invariant_init
from paraxis_hf.invariant_init import Draw, Fill, InitRule, piece_values

pytest.importorskip("transformers")

MAMBA = {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 128, "state_size": 4}
OPENAI_GPT = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64}


def whole(rule, shape, seed=1, name="w"):
    return piece_values(rule, seed=seed, name=name, global_shape=shape,
                        where=tuple(slice(0, n) for n in shape), dtype=torch.float32)


@pytest.mark.parametrize("shape", [(50, 30), (4, 17, 9), (100,), ()])
@pytest.mark.parametrize("kind", ["normal", "uniform", "trunc_normal"])
def test_any_block_equals_the_same_block_of_the_whole(monkeypatch, shape, kind):
    monkeypatch.setattr(invariant_init, "BLOCK", 64)  # blocks straddle many tiles
    rule = InitRule(Draw(kind, 0.0, 0.5), rows=((3, 5, 7.0),) if shape else ())
    full = whole(rule, shape)
    rng = random.Random(0)
    for _ in range(40):
        where = []
        for n in shape:
            a = rng.randrange(n)
            where.append(slice(a, rng.randrange(a + 1, n + 1)))
        block = piece_values(rule, seed=1, name="w", global_shape=shape,
                             where=tuple(where), dtype=torch.float32)
        assert torch.equal(block, full[tuple(where)]), where
    if len(shape) == 2:
        assert (full[3:5] == 7.0).all() and (full[5:] != 7.0).all()


def test_values_depend_on_seed_and_name_and_follow_the_rule():
    rule = InitRule(Draw("normal", 0.0, 0.02))
    a = whole(rule, (256, 256))
    assert torch.equal(a, whole(rule, (256, 256)))
    assert not torch.equal(a, whole(rule, (256, 256), seed=2))
    assert not torch.equal(a, whole(rule, (256, 256), name="v"))
    assert abs(a.std().item() - 0.02) < 5e-4 and abs(a.mean().item()) < 5e-4
    assert torch.equal(whole(InitRule(Fill(1.0)), (5,)), torch.ones(5))
    bf16 = piece_values(rule, seed=1, name="w", global_shape=(256, 256),
                        where=(slice(0, 256), slice(0, 256)), dtype=torch.bfloat16)
    assert torch.equal(bf16, a.to(torch.bfloat16))


def rules_of(family, **overrides):
    from paraxis.parallel.strategy import MATERIALIZE_ATTR
    from paraxis_hf import DEBUG_CONFIGS, build_causal_lm

    model = build_causal_lm(family, {**DEBUG_CONFIGS[family], **overrides}, deferred=True,
                            seed=0)
    assert all(p.is_meta for p in model.parameters())
    return model, getattr(model, MATERIALIZE_ATTR).rules


def test_each_family_keeps_its_own_rule():
    _, gpt2 = rules_of("gpt2")  # n_layer 2: c_proj at 0.02 / sqrt(4)
    assert gpt2["transformer.h.1.attn.c_proj.weight"].base == Draw("normal", 0.0, 0.01)
    assert gpt2["transformer.h.1.mlp.c_proj.weight"].base == Draw("normal", 0.0, 0.01)
    assert gpt2["transformer.h.1.mlp.c_fc.weight"].base == Draw("normal", 0.0, 0.02)
    assert gpt2["transformer.h.0.attn.c_attn.bias"].base == Fill(0.0)
    assert gpt2["transformer.ln_f.weight"].base == Fill(1.0)
    assert "lm_head.weight" not in gpt2  # tied: one parameter, one rule
    _, llama = rules_of("llama", initializer_range=0.05, pad_token_id=3)
    assert llama["model.layers.0.mlp.down_proj.weight"].base == Draw("normal", 0.0, 0.05)
    assert llama["model.norm.weight"].base == Fill(1.0)
    assert llama["model.embed_tokens.weight"].rows == ((3, 4, 0.0),)  # the padding row
    _, qwen2 = rules_of("qwen2")
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].base == Fill(0.0)
    model, mixtral = rules_of("mixtral")
    assert mixtral["model.layers.0.mlp.experts.gate_up_proj"].base == Draw("normal", 0.0,
                                                                           0.02)
    assert not any("_is_hf_initialized" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_buffers_are_computed_as_the_whole_model_computes_them(family):
    """Rotary frequencies, Gemma's embedding scale: real, and the whole model's."""
    from paraxis_hf import DEBUG_CONFIGS, build_causal_lm

    model, _ = rules_of(family)
    whole = dict(build_causal_lm(family, DEBUG_CONFIGS[family]).named_buffers())
    buffers = dict(model.named_buffers())
    assert buffers.keys() == whole.keys() and buffers
    for name, buffer in buffers.items():
        assert not buffer.is_meta and torch.equal(buffer, whole[name]), name


def test_the_trainer_builds_families_deferred_and_tiny_whole():
    from paraxis.config.run import ModelSection
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.parallel.strategy import deferred
    from paraxis.train.build import build_model
    from paraxis_hf import DEBUG_CONFIGS

    pm = make_plugin_manager()
    llama = ModelSection(family="llama", config=DEBUG_CONFIGS["llama"])
    assert deferred(build_model(llama, pm, deferred=True))
    assert not deferred(build_model(llama, pm))
    assert deferred(build_model(ModelSection(family="mamba", config=MAMBA), pm,
                                deferred=True))  # A_log copied from an arange, kept whole
    with pytest.warns(UserWarning, match="'openai-gpt' is built whole.*constructor's"):
        gpt = build_model(ModelSection(family="openai-gpt", config=OPENAI_GPT), pm,
                          deferred=True)  # Conv1D weights drawn by their constructor only
    assert not deferred(gpt) and not any(p.is_meta for p in gpt.parameters())


def test_fills_through_data_and_torch_init_are_read_with_the_global_shape():
    """Older families write ``module.weight.data.normal_(...)``; ``xavier_uniform_``
    computes its bound from the fans, which the meta tensor has whole."""
    import math

    from paraxis_hf.init_rules import record_init_rules

    model, _ = rules_of("llama")

    def init(module):
        if isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(0.0, 0.1)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.xavier_uniform_(module.weight)
        elif getattr(module, "weight", None) is not None:
            module.weight.data.fill_(2.0)

    for owner in (model, model.model):
        owner._init_weights = init
    rules = record_init_rules(model)
    assert rules["model.layers.1.self_attn.q_proj.weight"].base == Draw("normal", 0.0, 0.1)
    bound = math.sqrt(6 / (128 + 32))  # vocabulary 128, hidden 32
    embed = rules["model.embed_tokens.weight"].base
    assert embed.kind == "uniform" and math.isclose(embed.b, bound) and embed.a == -embed.b
    assert rules["model.norm.weight"].base == Fill(2.0)
