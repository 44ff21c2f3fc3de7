"""The strategy against the intended ApplyContext contract (aux_losses, step_hooks,
plan.experts), with stand-ins for what core will provide and a group of one rank:
no engine and no processes."""

from types import SimpleNamespace

import pytest
import torch

from paraxis import ParallelConfig
from paraxis.grid import AxisGroup
from paraxis.plan import ModelPlan
from paraxis.plugins import collect_strategies, make_plugin_manager
from paraxis.strategy import Phase
from paraxis_moe import ExpertParallelStrategy
from paraxis_moe import _plugin as moe_plugin
from paraxis_moe.router import AUX_LOSS


class StandInAuxLosses:
    """The interface of core's paraxis.batch.AuxLosses that the strategy uses."""

    def __init__(self):
        self.names, self.added = [], []

    def declare(self, name):
        self.names.append(name)

    def add(self, name, part):
        assert name in self.names
        self.added.append((name, part))


class OneRankGrid:
    def group(self, axes):
        return AxisGroup(tuple([axes] if isinstance(axes, str) else axes), (0,), 0)


def test_registered_for_the_expert_axis_in_partition_phase():
    pm = make_plugin_manager(load_entrypoints=False, builtins=False, plugins=(moe_plugin,))
    assert collect_strategies(pm)["expert"] is ExpertParallelStrategy
    assert ExpertParallelStrategy.phase == Phase.PARTITION


def test_apply_declares_losses_adds_parts_and_reports_metrics():
    pytest.importorskip("transformers")
    from moe_tiny_models import build

    model = build("mixtral", layers=2)
    plan = ModelPlan("MixtralForCausalLM", experts=("model.layers.0.mlp", "model.layers.1.mlp"))
    ctx = SimpleNamespace(grid=OneRankGrid(), config=ParallelConfig.from_kwargs(), plan=plan,
                          aux_losses=StandInAuxLosses(), step_hooks=[], extras={})
    assert ExpertParallelStrategy().apply(model, ctx) is model
    assert ctx.aux_losses.names == [AUX_LOSS]
    ids = torch.randint(0, 64, (2, 5))
    out = model(input_ids=ids, output_router_logits=True)
    assert [n for n, _ in ctx.aux_losses.added] == [AUX_LOSS]
    part = ctx.aux_losses.added[0][1]
    torch.testing.assert_close(part, model.config.router_aux_loss_coef * out.aux_loss)
    with torch.no_grad():  # evaluation: no part is handed over, the counts still are
        model(input_ids=ids)
    assert len(ctx.aux_losses.added) == 1
    # Routing outside the model's forward (e.g. a recomputation) is not counted.
    model.model.layers[0].mlp(torch.randn(1, 3, 32))
    metrics = ctx.step_hooks[0]()
    assert metrics["moe/tokens_assigned"] == 2 * 2 * (2 * 5) * 2
    assert metrics["moe/model.layers.1.mlp/router_entropy"] > 0


def test_apply_refuses_without_the_core_contract():
    ctx = SimpleNamespace(grid=OneRankGrid(), config=ParallelConfig.from_kwargs(), plan=None,
                          extras={})
    with pytest.raises(RuntimeError, match="aux_losses"):
        ExpertParallelStrategy().apply(torch.nn.Linear(2, 2), ctx)
