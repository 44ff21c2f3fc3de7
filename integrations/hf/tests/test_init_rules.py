"""The init recorder (:mod:`paraxis_hf.init_rules`), without processes (issue 32).

Every init function transformers routes through ``transformers.initialization`` is
recorded on the meta device, ``trunc_normal_`` included (torch returns before any Tensor
method on meta), with fan-based ones computed from the global shape; one without a rule
is refused by its name. A tie takes its source's own init, as eager does (init untied,
then tie). A copy from a small real tensor is kept whole, drawn from the run's seed; one
from a meta tensor or of a large one is refused. A module whose parameters sit in its
children is not rebuilt from the config, and any failure to build deferred falls back to
the whole build with one warning naming the family."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.init import trunc_normal_ as bound_trunc_normal  # escapes transformers' guard

from paraxis.testing.samples import SampleAllowance
from paraxis_hf.invariant_init import Copy, Draw, Fill, InitRule, piece_values

pytest.importorskip("transformers")

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
MAMBA = {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 128, "state_size": 4}


def rules_with(init_weights, monkeypatch, family="llama", config=LLAMA):
    """The rules recorded for ``family`` whose ``_init_weights`` is ``init_weights``."""
    from transformers import AutoConfig

    from paraxis_hf.init_rules import record_init_rules
    from paraxis_hf.materialize import meta_model

    model = meta_model(AutoConfig.for_model(family, **config), untied=True)
    for cls in type(model).__mro__:
        if "_init_weights" in cls.__dict__ and cls.__name__.endswith("PreTrainedModel"):
            monkeypatch.setattr(cls, "_init_weights", lambda self, m: init_weights(m))
    return record_init_rules(model, seed=0)


def test_every_init_function_is_recorded_on_meta_from_the_global_shape(monkeypatch):
    from transformers import initialization as init

    def fills(module, norm=lambda w: init.constant_(w, 3.0)):
        if isinstance(module, torch.nn.Linear):
            init.trunc_normal_(module.weight, std=0.1, a=-0.2, b=0.2)
        elif isinstance(module, torch.nn.Embedding):
            init.kaiming_normal_(module.weight, mode="fan_out")  # Embedding: fan_out = 128
        elif getattr(module, "weight", None) is not None:
            norm(module.weight)

    rules = rules_with(fills, monkeypatch)
    assert rules["model.layers.1.mlp.down_proj.weight"].base == Draw("trunc_normal", 0.0,
                                                                      0.1, -0.2, 0.2)
    assert rules["model.embed_tokens.weight"].base == Draw("normal", 0.0,
                                                           math.sqrt(2) / math.sqrt(128))
    assert rules["model.norm.weight"].base == Fill(3.0)
    with pytest.raises(ValueError, match=r"xavier_uniform_ through a reshaped view.*norm"):
        rules_with(lambda m: fills(m, lambda w: torch.nn.init.xavier_uniform_(
            w.data.view(4, 8))), monkeypatch)


def test_a_trunc_normal_that_escapes_transformers_is_recorded(monkeypatch):
    """torch's ``trunc_normal_`` bound by name bypasses ``guard_torch_init_functions`` and
    returns at once on meta; its ``_no_grad_trunc_normal_`` is still seen."""
    def fills(module):
        for param in module.parameters(recurse=False):
            bound_trunc_normal(param, mean=0.5, std=0.25, a=0.0, b=1.0)

    rules = rules_with(fills, monkeypatch)
    assert {r.base for r in rules.values()} == {Draw("trunc_normal", 0.5, 0.25, 0.0, 1.0)}


@pytest.mark.parametrize("name", ["orthogonal_", "sparse_", "eye_", "dirac_"])
def test_an_init_function_without_a_rule_is_refused_by_name(monkeypatch, name):
    from transformers import initialization as init

    extra = {"sparse_": {"sparsity": 0.5}}.get(name, {})
    with pytest.raises(ValueError, match=rf"torch\.nn\.init\.{name} \(paraxis has no .*"
                                         r"q_proj\.weight"):
        rules_with(lambda m: getattr(init, name)(m.weight, **extra)
                   if isinstance(m, torch.nn.Linear) else None, monkeypatch)


def test_a_tie_takes_its_source_s_own_init_as_eager_does(monkeypatch):
    """Eager runs ``initialize_weights`` on the untied model, then ties: the embedding's
    init wins over the head's, which is initialized later (issue 32: Youtu)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import initialization as init

    def fills(module):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            init.normal_(module.weight, std=0.5 if isinstance(module, torch.nn.Linear) else 0.1)
        elif getattr(module, "weight", None) is not None:
            init.ones_(module.weight)

    tied = {**LLAMA, "tie_word_embeddings": True}
    rules = rules_with(fills, monkeypatch, config=tied)
    assert "lm_head.weight" not in rules
    assert rules["model.embed_tokens.weight"].base == Draw("normal", 0.0, 0.1)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **tied))
    embed = eager.model.embed_tokens.weight
    assert eager.lm_head.weight is embed
    assert abs(embed.std().item() - 0.1) <= SampleAllowance.of(embed.numel()).std(0.1)


def test_small_copies_are_kept_whole_from_the_run_s_seed():
    """Mamba's ``A_log`` (an arange asked for on the meta device) and ``dt_proj.bias``
    (``torch.rand``): the same values on every rank of a run, another run's seed
    another draw; any block of a copy is that block of the whole."""
    from transformers import AutoConfig

    from paraxis_hf.init_rules import record_init_rules
    from paraxis_hf.materialize import meta_model

    config = AutoConfig.for_model("mamba", **MAMBA)
    first, again, other = (record_init_rules(meta_model(config, untied=True), seed=s)
                           for s in (1, 1, 2))
    a_log = first["backbone.layers.0.mixer.A_log"].base
    assert isinstance(a_log, Copy)
    assert torch.equal(a_log.values, torch.log(torch.arange(1.0, 5.0)).expand(64, 4))
    name = "backbone.layers.1.mixer.dt_proj.bias"
    assert torch.equal(first[name].base.values, again[name].base.values)
    assert not torch.equal(first[name].base.values, other[name].base.values)
    rule = InitRule(Copy(torch.arange(12.0).reshape(4, 3)), rows=((1, 2, -1.0),))
    block = piece_values(rule, seed=0, name="x", global_shape=(4, 3),
                         where=(slice(1, 3), slice(1, 3)), dtype=torch.float32)
    assert torch.equal(block, torch.tensor([[-1.0, -1.0], [7.0, 8.0]]))
    assert rule.base.values[1, 1] == 4.0  # the rule's own values untouched


def test_copies_a_rank_cannot_keep_whole_are_refused(monkeypatch):
    from paraxis_hf import init_rules

    def from_a_parameter(module):
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(module.weight.t().contiguous().t() * 2)

    with pytest.raises(ValueError, match=r"copy_ from a meta tensor.*q_proj\.weight"):
        rules_with(from_a_parameter, monkeypatch)
    monkeypatch.setattr(init_rules, "COPY_LIMIT", 100)
    with pytest.raises(ValueError, match=r"copy_ of 4096 elements \(over the 100"):
        rules_with(lambda m: m.weight.copy_(torch.ones(m.weight.shape))
                   if isinstance(m, torch.nn.Embedding) else None, monkeypatch)


def test_a_rescaled_draw_keeps_its_scale(monkeypatch):
    """``copy_(p, p / c)`` after a draw (Nemotron-H's ``out_proj``), ``p.mul_(c)``; any
    other in-place op is refused."""
    from transformers import initialization as init

    def fills(module):
        if isinstance(module, torch.nn.Linear):
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
            init.copy_(module.weight, module.weight / 4)
        elif isinstance(module, torch.nn.Embedding):
            init.normal_(module.weight, std=0.5)
            module.weight.data.mul_(-0.5)
        elif getattr(module, "weight", None) is not None:
            init.ones_(module.weight)

    rules = rules_with(fills, monkeypatch)
    bound = 1 / math.sqrt(32) / 4  # kaiming_uniform_(a=sqrt(5)): 1 / sqrt(fan_in)
    down = rules["model.layers.0.mlp.down_proj.weight"].base  # fan_in 64
    assert down.kind == "uniform" and math.isclose(down.b, 1 / math.sqrt(64) / 4)
    assert math.isclose(rules["model.layers.0.mlp.up_proj.weight"].base.b, bound)
    assert rules["model.embed_tokens.weight"].base == Draw("normal", 0.0, 0.25)
    assert rules["model.norm.weight"].base == Fill(1.0)
    with pytest.raises(ValueError, match=r"add_ \(an in-place op paraxis cannot .*norm"):
        rules_with(lambda m: m.weight.add_(1.0) if hasattr(m, "variance_epsilon")
                   else fills(m), monkeypatch)


def test_modules_with_parameters_in_children_keep_their_buffers():
    """GPT-Neo's and XGLM's modules hold buffers beside children with parameters: the
    model is built deferred (no constructor called with the config alone) and its
    buffers are the eager model's."""
    from paraxis_hf.build import build_causal_lm

    configs = {"gpt_neo": {"hidden_size": 32, "num_layers": 2, "num_heads": 4,
                           "vocab_size": 128, "max_position_embeddings": 64,
                           "attention_types": [[["global", "local"], 1]], "window_size": 8},
               "xglm": {"d_model": 32, "num_layers": 2, "attention_heads": 4,
                        "ffn_dim": 64, "vocab_size": 128, "max_position_embeddings": 64}}
    for family, config in configs.items():
        deferred = build_causal_lm(family, config, deferred=True, seed=0)
        assert all(p.is_meta for p in deferred.parameters())
        whole = dict(build_causal_lm(family, config).named_buffers())
        for name, buffer in deferred.named_buffers():
            assert torch.equal(buffer, whole[name]), (family, name)


def test_any_failure_to_build_deferred_falls_back_with_one_warning(monkeypatch):
    from paraxis.config.run import ModelSection
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.train.build import build_model
    from paraxis_hf import build

    def broken(family, config, *, deferred=False, **kwargs):
        if deferred:
            raise TypeError("SomeModule.__init__() missing 1 required argument")
        return whole(family, config)

    whole = build.build_causal_lm
    monkeypatch.setattr(build, "build_causal_lm", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(ModelSection(family="llama", config=LLAMA),
                            make_plugin_manager(), deferred=True)
    ours = [str(w.message) for w in caught if "built whole" in str(w.message)]
    assert len(ours) == 1 and "'llama'" in ours[0] and "TypeError: SomeModule" in ours[0]
    assert not any(p.is_meta for p in model.parameters())
