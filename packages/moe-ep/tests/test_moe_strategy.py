"""The strategy against core's ApplyContext contract (aux_losses with its carry,
step_hooks, skip_verify, the anatomy's expert blocks, Strategy.check_model), on a group of one rank:
no engine and no processes."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paraxis import ParallelConfig
from paraxis.config.axes import BUILTIN_AXES
from paraxis.engine.plugins import collect_strategies, make_plugin_manager
from paraxis.parallel.anatomy import find_anatomy
from paraxis.parallel.aux_losses import AuxLosses
from paraxis.parallel.model_plan import ModelPlan
from paraxis.parallel.strategy import Phase
from paraxis.runtime.comm_stats import CommStats
from paraxis.runtime.grid import AxisGroup
from paraxis_moe import ExpertParallelStrategy
from paraxis_moe import _plugin as moe_plugin
from paraxis_moe.router import AUX_LOSS, Z_LOSS

PLAN = ModelPlan("MixtralForCausalLM", experts=("model.layers.*.mlp",))


class OneRankGrid:
    comm = CommStats()
    axes = BUILTIN_AXES

    def group(self, axes):
        return AxisGroup(tuple([axes] if isinstance(axes, str) else axes), (0,), 0)


def _ctx(model, plan=PLAN, **moe):
    return SimpleNamespace(grid=OneRankGrid(), config=ParallelConfig.from_kwargs(moe=moe),
                           plan=plan, anatomy=find_anatomy(model, plan),
                           aux_losses=AuxLosses(), step_hooks=[], extras={}, pipeline=None,
                           skip_verify=None)


def test_registered_for_the_expert_axis_in_partition_phase():
    pm = make_plugin_manager(load_entrypoints=False, builtins=False, plugins=(moe_plugin,))
    assert collect_strategies(pm)["expert"] is ExpertParallelStrategy
    assert ExpertParallelStrategy.phase == Phase.PARTITION


def test_apply_declares_losses_carries_parts_and_reports_metrics():
    pytest.importorskip("transformers")
    from moe_tiny_models import build

    model = build("mixtral", layers=2)
    ctx = _ctx(model, z_loss_coef=1e-3)
    assert ExpertParallelStrategy().apply(model, ctx) is model
    assert ctx.aux_losses.names == [AUX_LOSS, Z_LOSS]
    assert ctx.aux_losses.carry_size == 4 + 1  # the router counts and the row count
    assert ctx.skip_verify is None  # dropless: the parity probe applies
    ids = torch.randint(0, 64, (2, 5))
    out = model(input_ids=ids, output_router_logits=True)
    objective = ctx.aux_losses.objective(torch.zeros(()), 1.0)
    torch.testing.assert_close(ctx.aux_losses.totals[AUX_LOSS],
                               float(model.config.router_aux_loss_coef * out.aux_loss.detach()))
    lse = torch.logsumexp(torch.cat(out.router_logits), -1)
    torch.testing.assert_close(objective, model.config.router_aux_loss_coef * out.aux_loss
                               + 1e-3 * lse.square().mean())
    with torch.no_grad():  # evaluation: nothing carried, nothing counted
        model(input_ids=ids)
    assert ctx.aux_losses.pop_carried().resolvers == []
    # Routing outside the model's forward (e.g. a recomputation) is not counted.
    model.model.layers[0].mlp(torch.randn(1, 3, 32))
    metrics = ctx.step_hooks[0]()
    assert metrics["moe/tokens_assigned"] == 2 * (2 * 5) * 2
    assert metrics["moe/model.layers.1.mlp/router_entropy"] > 0
    last = ctx.extras["expert"].last_step
    assert list(last) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert last["model.layers.0.mlp"]["assigned"].sum() == 2 * 5 * 2


def test_a_capacity_factor_skips_the_parity_probe_with_the_reason():
    pytest.importorskip("transformers")
    from moe_tiny_models import build

    model = build("mixtral")
    ctx = _ctx(model, capacity_factor=1.25)
    ExpertParallelStrategy().apply(model, ctx)
    assert "capacity_factor=1.25" in ctx.skip_verify


class ListExperts(nn.Module):
    """The pre-5.x layout: one module per expert."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_check_model_names_an_unknown_layout():
    model = nn.Module()
    model.layers = nn.ModuleList([ListExperts()])
    plan = ModelPlan("M", experts=("layers.*",))
    problems = ExpertParallelStrategy.check_model(
        model, ParallelConfig.from_kwargs(expert=2), plan, find_anatomy(model, plan))
    assert [p.field for p in problems] == ["model"]
    assert "layers.0.experts" in problems[0].rule and "ModuleList" in problems[0].rule


def test_apply_refuses_without_a_plan():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="plan naming the MoE blocks"):
        ExpertParallelStrategy().apply(model, _ctx(model, plan=None))
