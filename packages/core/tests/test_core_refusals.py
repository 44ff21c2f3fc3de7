"""Refuse, never mistrain: layouts that would train something else fail at parallelize
time with the reason, on every rank alike (no rank left waiting)."""

from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

import paraxis
from paraxis import ModelPlan, Phase, PlanError, Strategy
from paraxis.engine.plugins import make_plugin_manager
from paraxis.models.tiny import TINY_PLAN, TinyCalls, TinyConfig, TinyTransformer
from paraxis.parallel.anatomy import find_anatomy
from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.numerics import REDUCTION_RTOL
from paraxis.parallel.stages import StageParityError, check_stages

CFG = TinyConfig(vocab_size=32, hidden_size=16, num_layers=4, num_heads=2,
                 intermediate_size=32, seq_length=16)


class PositionsInForward(TinyTransformer):
    """Adds its position embedding to ``inputs_embeds`` inside the forward (as GPT-2
    does): a later stage would need the embedding it does not hold."""

    def hidden_states(self, input_ids=None, inputs_embeds=None, position_ids=None,
                      attention_mask=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed.tokens(input_ids)
        x = inputs_embeds + self.embed.positions[: inputs_embeds.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class ScalesInForward(TinyTransformer):
    """Scales ``inputs_embeds`` in the forward rather than in the embedding module (as
    some families once did): a stage fed hidden states would scale them again."""

    def hidden_states(self, input_ids=None, inputs_embeds=None, position_ids=None,
                      attention_mask=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, torch.arange(input_ids.shape[1]))
        x = inputs_embeds * 4.0
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def test_stages_that_do_not_reproduce_the_model_are_refused():
    torch.manual_seed(0)
    good = TinyTransformer(CFG)
    spec = find_anatomy(good, TINY_PLAN)
    assert (spec.layers, spec.embedding, spec.after, spec.head, spec.origin) == (
        "layers", "embed", ("norm",), "head", "plan")
    ranges = [(0, 2), (2, 4)]
    check_stages(good, spec, ranges, TinyCalls(), vocab=CFG.vocab_size, rtol=REDUCTION_RTOL)
    for kind, says in [(ScalesInForward, "do not reproduce the model's own logits"),
                       (PositionsInForward, "embed lives on another pipeline stage")]:
        try:
            check_stages(kind(CFG), spec, ranges, TinyCalls(), vocab=CFG.vocab_size,
                         rtol=REDUCTION_RTOL)
        except StageParityError as exc:  # a defect caught, not a declined feature
            assert says in str(exc) and kind.__name__ in str(exc), str(exc)
        else:
            raise AssertionError(f"{kind.__name__}'s stages were accepted")


class Miswired(Strategy):
    """A partition strategy that misunderstands the model: it doubles a weight, as a
    shard taken along the wrong dimension would change it."""

    axis = "tensor"
    phase = Phase.PARTITION

    def apply(self, model, ctx):
        with torch.no_grad():
            model.layers[0].mlp.down.weight.mul_(2)
        return model


class MiswiredPlugin:
    registered: ClassVar[list] = []

    @hookimpl
    def paraxis_register_strategies(self, register):
        register(Miswired)


def miswired_run():
    torch.manual_seed(0)
    pm = make_plugin_manager(load_entrypoints=False, plugins=(MiswiredPlugin(),))
    plan = ModelPlan("TinyTransformer", tensor={"layers.*.mlp.up": "colwise"})
    try:
        paraxis.parallelize(TinyTransformer(CFG), tensor=dist.get_world_size(), plan=plan,
                            plugin_manager=pm, train={"seq_length": CFG.seq_length})
    except PlanError as exc:
        return str(exc)
    return None


def test_the_parity_probe_refuses_a_layout_that_changes_the_loss(worlds):
    for message in worlds.run(2, miswired_run):
        assert message and "This layout would train something else" in message
        assert "with tensor 2" in message


class WrongBackward(Strategy):
    """A partition strategy whose forward is right and whose backward is not: it doubles
    one weight's gradient, as a partial gradient summed twice would. The loss alone
    cannot see it."""

    axis = "tensor"
    phase = Phase.PARTITION

    def apply(self, model, ctx):
        model.layers[0].mlp.down.weight.register_hook(lambda g: 2 * g)
        return model


def refused_run(strategy):
    """parallelize the tiny model over the tensor axis with ``strategy`` as the tensor
    strategy; the refusal's message, or None when it was accepted."""

    class Plugin:
        @hookimpl
        def paraxis_register_strategies(self, register):
            register(strategy)

    torch.manual_seed(0)
    pm = make_plugin_manager(load_entrypoints=False, plugins=(Plugin(),))
    plan = ModelPlan("TinyTransformer", tensor={"layers.*.mlp.up": "colwise"})
    try:
        paraxis.parallelize(TinyTransformer(CFG), tensor=dist.get_world_size(), plan=plan,
                            plugin_manager=pm, train={"seq_length": CFG.seq_length})
    except PlanError as exc:
        return str(exc)
    return None


def test_the_parity_probe_refuses_a_layout_with_the_right_loss_and_wrong_gradients(worlds):
    for message in worlds.run(2, refused_run, WrongBackward):
        assert message and "gradient of layers.0.mlp.down.weight" in message, message
        assert "on a probe batch" in message
        assert "This layout would train something else" in message


class Misshapen(Strategy):
    """A partition strategy after which the model's forward cannot run at all, as a
    tensor left whole beside split hidden states makes it."""

    axis = "tensor"
    phase = Phase.PARTITION

    def apply(self, model, ctx):
        model.layers[0].mlp.down.register_forward_hook(lambda m, args, out: out[..., :1, :-1])
        return model


def test_the_parity_probe_refuses_a_layout_whose_model_cannot_run(worlds):
    for message in worlds.run(2, refused_run, Misshapen):
        assert message and "cannot run the probe batch (RuntimeError" in message, message
        assert "with tensor 2" in message


def unchecked_run():
    torch.manual_seed(0)
    pm = make_plugin_manager(load_entrypoints=False, plugins=(MiswiredPlugin(),))
    plan = ModelPlan("TinyTransformer", tensor={"layers.*.mlp.up": "colwise"})
    engine = paraxis.parallelize(TinyTransformer(CFG), tensor=dist.get_world_size(),
                                 plan=plan, plugin_manager=pm, verify=False,
                                 train={"seq_length": CFG.seq_length})
    engine.close()
    return True


def test_the_probe_can_be_turned_off(worlds):
    assert all(worlds.run(2, unchecked_run))


def test_parallelize_refuses_options_beside_a_config():
    try:
        paraxis.parallelize(nn.Linear(2, 2), config=paraxis.ParallelConfig(), tensor=1,
                            sequence_parallel=True)
    except TypeError as exc:
        assert "both config= and options" in str(exc)
    else:
        raise AssertionError("options beside config= were silently dropped")


def die_mid_step():
    """Rank 2 dies while the others wait in an all-reduce of the data axis."""
    import os

    from paraxis.runtime.collectives import all_reduce_
    from paraxis.runtime.grid import Grid
    grid = Grid.build({"data": dist.get_world_size()})
    all_reduce_(torch.ones(4), grid.group("data"))  # everyone alive: fine
    if grid.rank == 2:
        os._exit(1)
    all_reduce_(torch.ones(4), grid.group("data"))  # raises CollectiveError
    return None


def test_a_dead_rank_is_named_by_the_others():
    from paraxis.testing import DistributedWorld, RankFailure

    world = DistributedWorld(3, timeout=60).start()
    try:
        world.run(die_mid_step)
    except RankFailure as exc:
        report = str(exc)
    else:
        raise AssertionError("the world survived a dead rank")
    assert "rank 2 died" in report
    for rank in (0, 1):  # both survivors said which collective and which rank
        assert f"all_reduce over data (ranks [0, 1, 2]) failed on rank {rank}" in report
    assert "unresponsive ranks: [2]" in report, report[-3000:]


def test_a_model_without_a_twin_is_refused_before_any_process_group():
    """Weights on the meta device (a model no rank holds whole) are probed through a
    shrunk twin; with no plugin to build one, the refusal says how to go on knowingly."""
    from paraxis import ConfigError
    from paraxis.parallel.strategy import MATERIALIZE_ATTR

    model = TinyTransformer(CFG)
    setattr(model, MATERIALIZE_ATTR, lambda m: None)
    pm = make_plugin_manager(load_entrypoints=False)
    try:
        paraxis.parallelize(model, plugin_manager=pm, train={"seq_length": CFG.seq_length})
    except ConfigError as exc:
        assert "needs a shrunk twin of it, and there is none" in str(exc)
        assert "pass verify=False" in str(exc)
    else:
        raise AssertionError("a model with no twin was probed")
    assert not dist.is_initialized()
