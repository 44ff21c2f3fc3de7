"""Hooks, the plugin-manager factory and strategy ordering (DESIGN section 4)."""

import inspect
from typing import ClassVar

import pytest
from torch import nn

from paraxis import MissingAxisPackageError, ParallelConfig, Phase, Strategy, hookspecs
from paraxis.engine.apply import apply_strategies
from paraxis.engine.plugins import collect_strategies, make_plugin_manager
from paraxis.engine.resolve import required_axes, resolve_strategies
from paraxis.parallel.strategy import ApplyContext


def test_every_hookspec_is_documented():
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if name.startswith("paraxis_")]
    assert specs, "no hook specs found"
    for spec in specs:
        doc = inspect.getdoc(spec) or ""
        assert len(doc) > 80, f"hookspec {spec.__name__} needs a full docstring"
        assert "Called" in doc, f"hookspec {spec.__name__} must say who calls it"


def test_factory_gives_clean_managers():
    a = make_plugin_manager(load_entrypoints=False, builtins=False)
    b = make_plugin_manager(load_entrypoints=False, builtins=False)
    assert a is not b and a.get_plugins() == set()
    assert collect_strategies(a) == {}
    core_only = collect_strategies(make_plugin_manager(load_entrypoints=False))
    assert list(core_only) == ["activation_checkpointing"]


class Order:
    seen: ClassVar[list[str]] = []


def _strategy(axis_name, phase_value, place=0):
    class S(Strategy):
        axis = axis_name
        phase = phase_value
        order = place

        def apply(self, model, ctx):
            Order.seen.append(self.axis)
            return model

    S.__qualname__ = f"S_{axis_name}"
    return S


class FakePlugin:
    """Registers in the 'wrong' order; core must still apply by phase."""

    @hookspecs.hookimpl
    def paraxis_register_strategies(self, register):
        register(_strategy("data", Phase.DATA))
        register(_strategy("tensor", Phase.PARTITION))
        register(_strategy("pipeline", Phase.SPLIT))


def test_strategies_apply_in_phase_order_not_registration_order():
    pm = make_plugin_manager(load_entrypoints=False, builtins=False, plugins=(FakePlugin(),))
    cfg = ParallelConfig.from_kwargs(data=2, tensor=2, pipeline=2, microbatches=2)
    strategies = resolve_strategies(cfg, pm)
    assert [s.axis for s in strategies] == ["pipeline", "tensor", "data"]
    Order.seen = []
    apply_strategies(nn.Linear(2, 2), ApplyContext(grid=None, config=cfg), strategies)
    assert Order.seen == ["pipeline", "tensor", "data"]


def test_within_a_phase_the_declared_order_decides_and_must_be_stated():
    """Context, expert and tensor share the PARTITION phase: their order is each one's
    declared ``order``, not their names' (alphabetical order decided it before); two
    equal orders in one phase are refused rather than left to chance."""
    cfg = ParallelConfig.from_kwargs(tensor=2, expert=2, context=2)

    class Partition:
        @hookspecs.hookimpl
        def paraxis_register_strategies(self, register):
            register(_strategy("tensor", Phase.PARTITION, 1))
            register(_strategy("expert", Phase.PARTITION, 3))
            register(_strategy("context", Phase.PARTITION, 2))
            register(_strategy("data", Phase.DATA))  # expert x context hold distinct tokens

    pm = make_plugin_manager(load_entrypoints=False, builtins=False, plugins=(Partition(),))
    assert [s.axis for s in resolve_strategies(cfg, pm)] == [
        "tensor", "context", "expert", "data"]

    class Tied:
        @hookspecs.hookimpl
        def paraxis_register_strategies(self, register):
            register(_strategy("tensor", Phase.PARTITION, 1))
            register(_strategy("expert", Phase.PARTITION, 1))
            register(_strategy("context", Phase.PARTITION, 2))
            register(_strategy("data", Phase.DATA))

    pm = make_plugin_manager(load_entrypoints=False, builtins=False, plugins=(Tied(),))
    with pytest.raises(ValueError, match="both declare order 1 in phase PARTITION"):
        resolve_strategies(cfg, pm)


def test_the_installed_axes_declare_their_place():
    """The order docs/architecture.md states: context, expert, tensor."""
    installed = collect_strategies(make_plugin_manager())
    partition = sorted((cls for cls in installed.values() if cls.phase == Phase.PARTITION),
                       key=lambda cls: cls.order)
    assert [cls.axis for cls in partition if cls.axis in ("context", "expert", "tensor")] == [
        a for a in ("context", "expert", "tensor") if a in installed]


def test_missing_axis_names_the_pip_command():
    pm = make_plugin_manager(load_entrypoints=False)
    with pytest.raises(MissingAxisPackageError, match="pip install paraxis-tp-layers"):
        resolve_strategies(ParallelConfig.from_kwargs(tensor=2), pm)
    with pytest.raises(MissingAxisPackageError, match="pip install paraxis-zero-shard"):
        resolve_strategies(ParallelConfig.from_kwargs(data=2, zero=1), pm)
    with pytest.raises(MissingAxisPackageError, match="pip install paraxis-deepspeed"):
        resolve_strategies(ParallelConfig.from_kwargs(data=2, zero=2,
                                                      offload={"optimizer": "cpu"}), pm)


def test_duplicate_axis_registration_is_an_error():
    class Twice:
        @hookspecs.hookimpl
        def paraxis_register_strategies(self, register):
            register(_strategy("data", Phase.DATA))
            register(_strategy("data", Phase.DATA))

    pm = make_plugin_manager(load_entrypoints=False, plugins=(Twice(),))
    with pytest.raises(ValueError, match="two strategies for axis 'data'"):
        collect_strategies(pm)


def test_required_axes():
    assert required_axes(ParallelConfig()) == []
    assert required_axes(ParallelConfig.from_kwargs(data=2)) == ["data"]
    # Expert and context replicas average dense gradients too: that is the data strategy.
    assert sorted(required_axes(ParallelConfig.from_kwargs(expert=2))) == ["data", "expert"]
    assert required_axes(ParallelConfig.from_kwargs(data=2, zero=3)) == ["zero"]
    # Offload is the DeepSpeed bridge's, which owns ZeRO and data-parallel reduction.
    offload = ParallelConfig.from_kwargs(data=2, zero=3, offload={"parameters": "cpu"})
    assert required_axes(offload) == ["offload"]
    # A mixture-of-experts model trains with its router losses: the expert axis applies
    # at degree 1 too.
    assert required_axes(ParallelConfig(), has_experts=True) == ["expert"]
    assert sorted(required_axes(ParallelConfig.from_kwargs(expert=2), has_experts=True)) == [
        "data", "expert"]
