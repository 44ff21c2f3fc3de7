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
