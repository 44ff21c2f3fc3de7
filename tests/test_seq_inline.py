"""Inline attention of older families routed through the context-parallel attention
function by the per-family adapters (issue 35, item 3; paraxis_seq.hf_inline.INLINE).

One process (a context group of one): every adapted family's tiny model (the coverage
matrix's) gives its own logits and every parameter's gradient, ring and Ulysses, fp32
at the shared step tolerance (several of these families compute their softmax in fp32
whatever the input, so float64 would only measure that). Two ranks: BLOOM (ALiBi, its
whole attention forward replaced), MegatronBERT (a BERT self-attention), RoFormer and
TrOCR (positions numbered from the shard unless the adapter gives the global ones) and
XLM (the row's non-pad count over the whole row; the matrix's random ids hold its pad
index) through the matrix's context=2 check. Families without an adapter are refused
with the reason; BigBird's switch to full attention is judged by the whole sequence.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from paraxis.runtime.collectives import CommStats
from paraxis.runtime.grid import AxisGroup
from paraxis.testing.tolerance import assert_gradients_close, assert_step_close
from paraxis_seq.hf_attention import interceptable, use_context_attention
from paraxis_seq.hf_inline import INLINE, install_inline

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ADAPTED = ["big_bird", "bloom", "falcon", "gpt_neo", "gpt_neox_japanese", "megatron-bert",
           "mpt", "openai-gpt", "rembert", "roformer", "trocr", "xglm", "xlm"]


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


def _unrouted(model):
    """Adapted classes whose instances, after a step, still run their own method (one
    rank cannot tell: its shard is the whole sequence). BigBird builds its full
    attention modules at its first call."""
    table = INLINE[type(model).__module__.rsplit(".", 1)[-1]].adapters
    return [name for name, m in model.named_modules()
            if type(m).__name__ in table and table[type(m).__name__][0] not in vars(m)]


@pytest.mark.parametrize("family", ADAPTED)
def test_adapted_family_matches_its_own_attention(family):
    model = _tiny(family)
    assert interceptable(model) is None
    ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(1))
    if hasattr(model.config, "pad_index"):  # XLM drops the tail of the row
        ids[1, 9] = model.config.pad_index
    # Copied before the reference runs: BigBird's first call switches it to full
    # attention, which the adapter must make itself.
    copies = {mode: copy.deepcopy(model) for mode in ("ring", "ulysses")}
    want, want_grads = _run(model, ids)
    for mode, cp in copies.items():
        use_context_attention(cp, _alone(), mode=mode)
        assert cp.config._attn_implementation == model.config._attn_implementation
        got, grads = _run(cp, ids)
        assert not _unrouted(cp), f"{family} {mode}: {_unrouted(cp)} kept their own method"
        assert_step_close(got, want, f"{family} {mode} logits")
        assert_gradients_close(grads, want_grads)


@pytest.mark.parametrize("family,reason", [
    ("cpmant", "relative-position bias"),
    ("reformer", "LSH"),
    ("rwkv", "recurrence"),
    ("xlnet", "two-stream relative attention"),
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


def test_trocr_sinusoidal_positions_are_refused():
    from transformers import TrOCRConfig, TrOCRForCausalLM

    with torch.device("meta"):
        model = TrOCRForCausalLM(TrOCRConfig(use_learned_position_embeddings=False,
                                             decoder_layers=1))
    assert "sinusoidal positions count the non-pad tokens" in interceptable(model)


def test_big_bird_judges_block_sparse_by_the_whole_sequence():
    # limit (5 + 2 x 1) x 2 = 14 tokens: a shard of 8 alone would switch to full
    # attention, but over two ranks the sequence is 16, block-sparse at one process.
    from transformers import BigBirdConfig, BigBirdForCausalLM

    config = BigBirdConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32, block_size=2,
                           num_random_blocks=1, is_decoder=True)
    model = BigBirdForCausalLM(config)
    attend = SimpleNamespace(group=SimpleNamespace(size=2))
    install_inline(model, attend)
    with pytest.raises(ValueError, match="sequence of 16 tokens, longer than 14"):
        model(input_ids=torch.ones(1, 8, dtype=torch.long), use_cache=False)
    assert model.bert.attention_type == "block_sparse"


@pytest.mark.parametrize("family", ["bloom", "megatron-bert", "roformer", "trocr", "xlm"])
def test_inline_family_context2_matches_one_process(worlds, family):
    from paraxis_coverage import available_checks, run_family
    from paraxis_hf.families import build_family, causal_lm_types

    checks = [c for c in available_checks() if c.name == "context=2"]
    row = run_family(build_family(family, causal_lm_types()[family]), checks, worlds)
    assert row.cells["context=2"].status == "pass", row.cells["context=2"].cell()
