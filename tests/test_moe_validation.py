"""Every bad expert-parallel input is refused by ``parallelize`` with a clear error
before any process group exists (issue 11's list), each naming field, value and fix."""

import pytest
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("paraxis_moe")

import paraxis
from paraxis.config.errors import ConfigError
from paraxis_hf import build_debug_model


def refused(model, **kwargs):
    with pytest.raises(ConfigError) as err:
        paraxis.parallelize(model, train={"seq_length": 16}, **kwargs)
    assert not dist.is_initialized(), "refused after a process group was created"
    return str(err.value)


def test_expert_degree_on_a_dense_model():
    text = refused(build_debug_model("llama"), expert=2)
    assert "parallelism.expert = 2: the model has no experts. Fix: set expert: 1" in text


def test_experts_not_divisible_by_the_degree():
    text = refused(build_debug_model("mixtral"), expert=3)
    assert "model.num_experts = 4: must be divisible by the expert degree 3" in text
    assert "choose expert among [1, 2, 4]" in text


def test_top_k_above_the_expert_count():
    text = refused(build_debug_model("mixtral", num_experts_per_tok=5), expert=2)
    assert "model.num_experts_per_tok = 5: routes each token to more experts than the 4" \
        in text


@pytest.mark.parametrize("factor", [0, -0.5])
def test_capacity_factor_not_positive(factor):
    text = refused(build_debug_model("mixtral"), expert=2, moe={"capacity_factor": factor})
    assert f"moe.capacity_factor = {factor!r}" in text and "greater than 0" in text


def test_an_moe_layout_paraxis_does_not_know_names_the_module():
    model = build_debug_model("mixtral")
    # The pre-5.x layout: a list of expert modules instead of fused tensors.
    model.model.layers[1].mlp.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    # Refused where experts must be sharded; at expert=1 the block is kept whole (the
    # model's own forward: packages/moe-ep/tests/test_moe_kept_whole.py).
    text = refused(model, expert=2)
    assert "model.layers.1.mlp.experts (ModuleList)" in text
    assert "fused" in text


def test_a_shared_expert_the_tensor_degree_cannot_split_is_refused():
    # Qwen3-Next's tensor plan splits its shared expert's FFN (gate/up by columns, down by
    # rows); a width of 33 does not split over 2 ranks, which no model-shape rule sees.
    from paraxis_hf.debug import build_causal_lm

    model = build_causal_lm("qwen3_next", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=33, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, num_experts=4, num_experts_per_tok=2))
    for layout in ({"tensor": 2}, {"tensor": 2, "expert": 2, "sequence_parallel": True}):
        text = refused(model, **layout)
        assert "model.layers.0.mlp.shared_expert.gate_proj.out_features = 33: the tensor " \
               "plan splits it (colwise) over the tensor degree 2" in text, text
        assert "mlp.shared_expert.down_proj.in_features = 33" in text
        assert "choose tensor among [1, 3, 11, 33]" in text


def test_an_expert_tensor_degree_that_does_not_divide_the_expert_width_is_refused():
    model = build_debug_model("mixtral", intermediate_size=33)
    text = refused(model, tensor=2, expert_tensor=2)
    assert "expert FFN width 33 is not divisible by expert_tensor 2" in text, text

