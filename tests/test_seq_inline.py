"""Inline attention of older families routed through the context-parallel attention
function by the per-family adapters (issue 35, item 3; paraxis_seq.hf_inline.INLINE).

One process (a context group of one): every adapted family's tiny model (the coverage
matrix's) gives its own logits and every parameter's gradient, ring and Ulysses, fp32
at the shared step tolerance (several of these families compute their softmax in fp32
whatever the input, so float64 would only measure that). Two ranks: BLOOM (ALiBi, its
whole attention forward replaced) and MegatronBERT (a BERT self-attention) through the
matrix's context=2 check. Families without an adapter are refused with the reason.
"""

import copy

import pytest
import torch

from paraxis.runtime.collectives import CommStats
from paraxis.runtime.grid import AxisGroup
from paraxis.testing.tolerance import assert_gradients_close, assert_step_close
from paraxis_seq.hf_attention import interceptable, use_context_attention
from paraxis_seq.hf_inline import INLINE

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ADAPTED = ["bloom", "falcon", "gpt_neo", "gpt_neox_japanese", "megatron-bert", "mpt",
           "openai-gpt", "rembert", "xglm"]


def _tiny(family):
    from paraxis_hf.families import build_family, build_model, causal_lm_types

    return build_model(family, build_family(family, causal_lm_types()[family]).overrides)


def _alone():
    return AxisGroup(("context",), (0,), 0, None, CommStats())


def _run(model, ids):
    model.zero_grad()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    (logits.float() ** 2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("family", ADAPTED)
def test_adapted_family_matches_its_own_attention(family):
    model = _tiny(family)
    assert interceptable(model) is None
    ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(1))
    want, want_grads = _run(model, ids)
    for mode in ("ring", "ulysses"):
        cp = copy.deepcopy(model)
        use_context_attention(cp, _alone(), mode=mode)
        assert cp.config._attn_implementation == model.config._attn_implementation
        got, grads = _run(cp, ids)
        assert_step_close(got, want, f"{family} {mode} logits")
        assert_gradients_close(grads, want_grads)


@pytest.mark.parametrize("family,reason", [
    ("cpmant", "relative-position bias"),
    ("reformer", "LSH"),
    ("rwkv", "recurrence"),
    ("xlnet", "two-stream relative attention"),
    ("roformer", "rotary positions from the length"),
    ("trocr", "learned positions count from the input"),
    ("big_bird", "block-sparse attention"),
    ("xlm", "count of non-pad tokens"),
])
def test_inline_without_an_adapter_is_refused_with_the_reason(family, reason):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, is_decoder=True))
    got = interceptable(model)
    assert got is not None and "computes attention inline" in got and reason in got, got


def test_falcon_alibi_is_refused_and_the_table_names_each_family():
    from transformers import FalconConfig, FalconForCausalLM

    with torch.device("meta"):
        model = FalconForCausalLM(FalconConfig(alibi=True, num_hidden_layers=1))
    assert "bfloat16" in interceptable(model)
    assert all(f.adapters or f.refused or f.refuse for f in INLINE.values())


@pytest.mark.parametrize("family", ["bloom", "megatron-bert"])
def test_inline_family_context2_matches_one_process(worlds, family):
    from paraxis_coverage import available_checks, run_family
    from paraxis_hf.families import build_family, causal_lm_types

    checks = [c for c in available_checks() if c.name == "context=2"]
    row = run_family(build_family(family, causal_lm_types()[family]), checks, worlds)
    assert row.cells["context=2"].status == "pass", row.cells["context=2"].cell()
