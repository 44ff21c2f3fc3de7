"""Context parallelism on the attention variants (issue 35, item 1), through
``parallelize`` against one process: 20 steps at sequence 64, fp32; the first step's
per-parameter gradients, per-step losses and gradient norms, an evaluation loss and the
final weights (tests/hf_parity.py ``compare``). Ring and Ulysses on 2 and 4 context
ranks on Gemma 2 (logit soft-capping, with sliding windows), gpt-oss (sinks, with
sliding windows; experts) and Llama 4 (chunked attention; a NoPE layer whose
temperature tuning reads positions, from 16 tokens on here); packed documents on gpt-oss.

Windows (10) and chunks (12) fall inside the zigzag chunks (16 tokens at context 2, 8 at
4), not on their edges. The debug models' scores are about 0.1 (initializer 0.02), so
Gemma 2's shipped cap (50) would change nothing: it is 0.05 here, which caps them hard.
"""

import re

import pytest
import torch.distributed as dist
from hf_parity import compare
from test_document_masks import SEQ as SEQ_DOCS
from test_document_masks import VOCAB, layout_run, one_process, packed_and_padded

import paraxis
from paraxis.config.errors import ConfigError
from paraxis.testing.parity import assert_same_gradients
from paraxis.testing.tolerance import assert_losses_close
from paraxis_hf import build_debug_model

STEPS, SEQ, BATCH = 20, 64, 4
FAMILIES = {
    "gemma2": {"max_position_embeddings": SEQ, "sliding_window": 10,
               "attn_logit_softcapping": 0.05},
    "gpt_oss": {"max_position_embeddings": SEQ, "sliding_window": 10},
    "llama4_text": {"max_position_embeddings": SEQ, "attention_chunk_size": 12,
                    "floor_scale": 16},
}
LAYOUTS = [
    pytest.param({"context": 2}, {}, id="ring2"),
    pytest.param({"context": 2}, {"context_mode": "ulysses"}, id="ulysses2"),
    pytest.param({"context": 4}, {}, id="ring4"),
    pytest.param({"context": 4}, {"context_mode": "ulysses"}, id="ulysses4"),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("degrees", "options"), LAYOUTS)
def test_variant_matches_one_process(worlds, family, degrees, options):
    compare(worlds, family, degrees, overrides=FAMILIES[family], steps=STEPS, seq=SEQ,
            batch=BATCH, **options)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_packed_documents_with_soft_capping_and_windows(worlds, mode):
    """Packed rows (documents of 5, 7 and 4 tokens...) on Gemma 2 under context 2 give the
    loss of the same documents one per right-padded row in one process, and the packed
    rows' per-parameter gradients (tests/test_document_masks.py's rows). gpt-oss is not
    used here: its own one-process forward does not honour packed positions (paraxis
    measures and refuses that: logits 2.8e-01 off), so it takes padding below."""
    _, padded, _, ref_grads = worlds.run(1, one_process, "gemma2")[0]
    out = worlds.run(2, layout_run, "gemma2", {"context": 2, "context_mode": mode})
    for loss, _ in out:
        assert_losses_close([loss], [padded], "packed rows against padded rows")
    assert_same_gradients([g for _, g in out], ref_grads)


def padded_loss(degrees):
    _, padded = packed_and_padded()
    engine = paraxis.parallelize(build_debug_model("gpt_oss", vocab_size=VOCAB), **degrees,
                                 train={"seq_length": SEQ_DOCS})
    loss = engine.eval_step(padded)
    engine.close()
    return loss


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_padding_with_sinks(worlds, mode):
    """Right-padded rows on gpt-oss: a pad is no key of any row, and each real row's sink
    enters its normalizer once, as in one process."""
    (want,) = worlds.run(1, padded_loss, {})
    for loss in worlds.run(2, padded_loss, {"context": 2, "context_mode": mode}):
        assert_losses_close([loss], [want], "padded rows under context parallelism")


@pytest.mark.parametrize("family", ["gemma2", "llama4_text"])
def test_a_sequence_the_mode_cannot_cut_is_refused_before_any_group(family):
    """Ring cuts 2 x context chunks, Ulysses context: 30 tokens fit neither at context 4
    (nor ring at 2), and parallelize says so before a process group exists."""
    model = build_debug_model(family, **FAMILIES[family])
    for mode, rule in (("ring", "2 x context = 8"), ("ulysses", "divide over context = 4")):
        with pytest.raises(ConfigError, match=re.escape(rule)) as err:
            paraxis.parallelize(model, context=4, context_mode=mode, train={"seq_length": 30})
        assert "model.seq_length = 30" in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_sinks_split_with_the_heads_under_tensor_parallel(worlds, mode):
    """Context 2 x tensor 2 on gpt-oss: each tensor rank's attention gets its heads'
    sinks (the tensor plan splits them with the heads), and Ulysses splits them again."""
    compare(worlds, "gpt_oss", {"context": 2, "tensor": 2}, overrides=FAMILIES["gpt_oss"],
            steps=STEPS, seq=SEQ, batch=BATCH, context_mode=mode)
