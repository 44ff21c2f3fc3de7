"""Capacity, validation and layout rules, without processes."""

import pytest
import torch
from torch import nn

from paraxis import ParallelConfig
from paraxis.config.errors import ConfigError
from paraxis.config.rules import validate
from paraxis.config.shape import ModelShape
from paraxis.engine.plugins import make_plugin_manager
from paraxis.runtime.grid import AxisGroup
from paraxis_moe import UnsupportedMoELayout, expert_capacity, keep_mask
from paraxis_moe import _plugin as moe_plugin
from paraxis_moe.config import moe_problems
from paraxis_moe.experts import check_experts
from paraxis_moe.stats import MoEStats


def test_capacity_formula():
    # Megatron-Core's get_capacity: ceil(T * k / E * factor), floored at min_capacity.
    assert expert_capacity(12, 2, 4, 1.0) == 6
    assert expert_capacity(12, 2, 4, 1.25) == 8
    assert expert_capacity(12, 2, 4, 0.1, min_capacity=4) == 4


def test_keep_mask_position_and_probs():
    # 5 tokens, top-2 over 3 experts; expert 0 is chosen by tokens 0, 1, 3, 4.
    index = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 1], [0, 2]])
    weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3], [0.9, 0.1], [0.6, 0.4]])
    position = keep_mask(index, weights, 3, capacity=2, policy="position")
    # Expert 0 keeps tokens 0 and 1 (first in order); expert 1 tokens 0, 2; expert 2: 1, 2.
    assert position.tolist() == [[True, True], [True, True], [True, True], [False, False],
                                 [False, False]]
    probs = keep_mask(index, weights, 3, capacity=2, policy="probs")
    # Expert 0: weights 0.6 (t0), 0.5 (t1), 0.9 (t3), 0.6 (t4) -> t3, then t0 (tie with
    # t4 goes to the earlier token). Expert 1: 0.4 t0, 0.7 t2, 0.1 t3 -> t2, t0.
    # Expert 2: 0.5 t1, 0.3 t2, 0.4 t4 -> t1, t4.
    assert probs.tolist() == [[True, True], [True, False], [True, False], [True, False],
                              [False, True]]
    # Deterministic: a rank's drops depend on its own tokens only.
    assert torch.equal(keep_mask(index, weights, 3, 2, "probs"), probs)
    assert keep_mask(index, weights, 3, capacity=10).all()


def _config(**kw):
    return ParallelConfig.from_kwargs(**kw)


def test_validation_rules_each_name_field_value_rule_fix():
    dense = ModelShape(64, 4, 2, 100)
    moe = ModelShape(64, 4, 2, 100, num_experts=6, experts_per_token=8)
    fields = {p.field: p for p in moe_problems(_config(expert=4, sequence_parallel=True,
                                                       tensor=2), moe, [])}
    # Sequence parallelism is no longer refused: each tensor rank routes its shard.
    assert set(fields) == {"model.num_experts", "model.num_experts_per_tok"}
    assert fields["model.num_experts"].value == 6 and "[1, 2, 3, 6]" in fields[
        "model.num_experts"].fix
    assert fields["model.num_experts_per_tok"].value == 8
    (dense_problem,) = moe_problems(_config(expert=2), dense, [])
    assert str(dense_problem).startswith("parallelism.expert = 2: the model has no experts")
    assert moe_problems(_config(expert=2), ModelShape(64, 4, 2, 100, num_experts=4,
                                                      experts_per_token=2), []) == []
    bad = moe_problems({"moe": {"drop_policy": "random"}, "parallelism": None}, None, [])
    assert [p.field for p in bad] == ["moe.drop_policy"]


def test_a_non_positive_capacity_factor_is_refused_when_the_config_is_built():
    for factor in (0, -1.0):
        with pytest.raises(ConfigError, match=r"moe\.capacity_factor"):
            _config(moe={"capacity_factor": factor})
    assert _config(moe={"capacity_factor": None}).moe.capacity_factor is None


def test_validate_reports_each_rule_once():
    pm = make_plugin_manager(load_entrypoints=False, plugins=(moe_plugin,))
    with pytest.raises(ConfigError) as err:
        validate(_config(expert=4), model=ModelShape(64, 4, 2, 100, num_experts=6),
                 plugin_manager=pm)
    assert [p.field for p in err.value.problems] == ["model.num_experts"]
    with pytest.raises(ConfigError) as err:
        validate(_config(expert=2), model=ModelShape(64, 4, 2, 100), plugin_manager=pm)
    assert [p.field for p in err.value.problems] == ["parallelism.expert"]


class ListExperts(nn.Module):
    """The pre-5.x layout: one module per expert."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_unknown_layout_is_refused_naming_the_module():
    with pytest.raises(UnsupportedMoELayout, match=r"model\.layers\.3\.mlp\.experts"):
        check_experts(ListExperts().experts, "model.layers.3.mlp.experts")
    fused = ListExperts()
    fused.has_gate, fused.num_experts = True, 2  # looks fused, but holds a ModuleList
    with pytest.raises(UnsupportedMoELayout, match=r"experts\.0\.weight"):
        check_experts(fused, "blk.experts")


def test_stats_summary_without_group():
    stats = MoEStats(4, ["l0"])
    layer = stats.layers["l0"]
    layer.add("assigned", torch.tensor([6, 2, 0, 0]))
    layer.add("dropped", torch.tensor([2, 0, 0, 0]))
    layer.add_router(torch.zeros(3, 4))  # uniform: entropy log 4
    m = stats.metrics(None)
    assert m["moe/tokens_assigned"] == 8 and m["moe/tokens_dropped"] == 2
    assert m["moe/dropped_fraction"] == 0.25 and m["moe/load_imbalance"] == 3.0
    assert m["moe/l0/assigned/0"] == 6
    assert m["moe/router_entropy"] == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert m["moe/l0/prob_mean/2"] == pytest.approx(0.25)
    assert stats.metrics(None)["moe/tokens_assigned"] == 0  # reset after reading


def test_group_of_one_runs_without_processes():
    pytest.importorskip("transformers")
    from moe_tiny_models import build

    from paraxis_moe import ExpertParallel

    model = build("mixtral")
    block = model.model.layers[0].mlp
    x = torch.randn(2, 5, 32)
    want = block(x)
    one = AxisGroup(("expert",), (0,), 0)
    ExpertParallel(model, ["model.layers.*.mlp"], one)
    assert type(block.experts).__name__ == "ExpertParallelMixtralExperts"
    torch.testing.assert_close(block(x), want)


def test_grouped_keep_mask_is_each_groups_own_mask():
    from paraxis.config.parallel import MoEConfig
    from paraxis_moe.capacity import grouped_keep_mask

    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, generator=g)
    moe = MoEConfig(capacity_factor=0.5, min_capacity=0, drop_policy="probs")
    cap = expert_capacity(6, 2, 4, 0.5)
    want = torch.cat([keep_mask(index[:6], weights[:6], 4, cap),
                      keep_mask(index[6:], weights[6:], 4, cap)])
    assert torch.equal(grouped_keep_mask(index, weights, 4, moe, groups=2), want)
    assert not torch.equal(grouped_keep_mask(index, weights, 4, moe, groups=1), want)
